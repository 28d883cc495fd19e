"""The attention op alone vs sequence length: softmax (oneDNN, SDPA) vs linear (eq. 19) and Performer (FAVOR+).

    python bench/bench_linear_attention.py                                   # N = 512 … 32768, long (softmax is N²)
    python bench/bench_linear_attention.py --max-n 2048 --reps 2 --out /tmp/la   # smoke run, ~1 min
    python bench/bench_linear_attention.py --softmax-max-n 8192 --no-memory   # skip the slowest parts

One layer's attention at base width (12 heads × 64), batch 1, float32, on the CPU. q, k, v are strided
(B, H, N, 64) views into one fused (B, N, 3, H, 64) projection, as the model passes them; the op is
everything from q, k, v to the (B, N, H, 64) output:

    softmax-onednn         our oneDNN softmax attention (the model's CPU inference path; no backward)
    softmax-sdpa[-causal]  F.scaled_dot_product_attention, output transposed to (B, N, H, 64)
    linear[-causal]        eq. 19: φ = elu+1 of q, k; R_iφ(q_i), R_jφ(k_j) by a complex multiply over the 64
                           feature dims (numerator only); `linear_attention` (chunk 64 when causal)
    performer[-causal]     FAVOR+: 256 orthogonal random features of q, k (RoPE before the feature map);
                           `linear_attention` with the keys' log scales

q and k count as already rotated for softmax and performer (the model rotates them before attention);
eq. 19 rotates the features, so that rotation is inside the linear op. The angles (like the model's
cos/sin) and the random projection (a buffer) are built once, outside the timing.

Method: forward under `torch.no_grad`; forward+backward with q, k, v requiring grad and a fixed random
cotangent. Times are medians of interleaved runs (common.interleaved: every candidate once per round, so
a load change hits all alike), default glibc malloc (large temporaries are fresh mappings and page-fault
in, as in real use). Softmax runs only up to --softmax-max-n (quadratic). Peak memory: each N in a fresh
child process with glibc's mmap threshold fixed at 64 KiB, so every large buffer is its own mapping and
RSS follows live memory; per candidate, peak RSS (VmHWM after resetting it) minus RSS before the call,
i.e. the op's temporaries, output and (backward) gradients.

Reported: time and memory per N, time(2N)/time(N), softmax/linear speedups at 16k, causal/bidirectional,
and the crossover N where each linear form gets faster than the fastest softmax. Results go to
bench/results/linear_attention/ (README.md, results.json, time.png, memory.png) unless --out.
Never a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from common import cpu_flags, cpu_model, interleaved, machine, markdown_table

HEADS, HEAD_DIM, NB_FEATURES = 12, 64, 256
CANDIDATES = [
    "softmax-onednn",
    "softmax-sdpa",
    "softmax-sdpa-causal",
    "linear",
    "linear-causal",
    "performer",
    "performer-causal",
]
SOFTMAX = [c for c in CANDIDATES if c.startswith("softmax")]
LINEAR = [c for c in CANDIDATES if not c.startswith("softmax")]
GOALS = {"scaling": 2.2, "speedup_16k": 10.0, "causal_over_bidirectional": 2.0}
HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2**20


# ----------------------------------------------------------------------------------------------------
# Kernels (imported defensively: the payload's module names move during refactors)
# ----------------------------------------------------------------------------------------------------


def load_linear_attention():
    try:
        return importlib.import_module("modeling_roformer_rope.linear_attention_roformer_rope")
    except Exception:  # the package's __init__ may be mid-refactor: the kernel file stands alone
        path = os.path.join(HERE, "..", "modeling_roformer_rope", "linear_attention_roformer_rope.py")
        spec = importlib.util.spec_from_file_location("linear_attention_roformer_rope", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def load_onednn_attention():
    """(function, module name) of our fastest CPU softmax attention, or (None, why not)."""
    errors = []
    for name in (
        "modeling_roformer_rope.onednn_attention_roformer_rope",
        "modeling_roformer_rope.attention_roformer_rope",
        "modeling_roformer_rope.onednn_roformer_rope",
    ):
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any import failure means "not available here"
            errors.append(f"{name}: {type(error).__name__}")
            continue
        fn = getattr(module, "onednn_attention", None)
        if fn is not None and getattr(module, "_LINEAR_POINTWISE", True) is not None:
            return fn, name
    return None, "; ".join(errors) or "no onednn_attention found"


la = load_linear_attention()


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """R_m x over the last dim (interleaved pairs as complex numbers, paper eq. 34): x (B, H, N, F) float32."""
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs).flatten(-2)


class Ops:
    """The candidates as callables (q, k, v) → (B, N, H, 64), for one length N."""

    def __init__(self, length: int, onednn):
        theta = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        angles = torch.arange(length, dtype=torch.float32)[:, None] * theta  # (N, F/2)
        self.freqs = torch.polar(torch.ones_like(angles), angles)  # (N, F/2) complex: built once per forward
        generator = torch.Generator().manual_seed(0)
        self.projection = la.gaussian_orthogonal_random_matrix(NB_FEATURES, HEAD_DIM, generator=generator)
        self.onednn = onednn

    def __call__(self, name: str, q, k, v):
        causal = name.endswith("-causal")
        if name == "softmax-onednn":
            return self.onednn(q, k, v)
        if name.startswith("softmax-sdpa"):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
        if name.startswith("linear"):
            qf, kf = la.elu_feature_map(q), la.elu_feature_map(k)  # (B, H, N, 64) φ = elu + 1
            qr, kr = rotate(qf, self.freqs), rotate(kf, self.freqs)  # eq. 19: rotation in the numerator
            return la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, causal=causal)
        qf, _ = la.favor_plus_features(q, self.projection)  # (B, H, N, 256)
        kf, k_log = la.favor_plus_features(k, self.projection)
        return la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=causal)


def make_inputs(length: int, requires_grad: bool = False, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, length, 3, HEADS, HEAD_DIM, generator=generator).requires_grad_(requires_grad)
    q, k, v = qkv.transpose(1, 3).unbind(2)  # 3 × (B, H, N, 64) strided views
    return qkv, q, k, v


def available(name: str, length: int, args, onednn, backward: bool) -> bool:
    if name.startswith("softmax") and length > args.softmax_max_n:
        return False
    if name == "softmax-onednn" and (onednn is None or backward):
        return False
    return name in args.candidates


def check(ops: Ops, names: list[str]) -> None:
    """Nothing is timed on wrong outputs: softmax kernels agree, linear equals eq. 19 from an N×N matrix."""
    length = 512
    _, q, k, v = make_inputs(length)
    with torch.no_grad():
        outs = {name: ops(name, q, k, v) for name in names}
        if "softmax-onednn" in outs and "softmax-sdpa" in outs:
            diff = (outs["softmax-onednn"] - outs["softmax-sdpa"]).abs().max().item()
            assert diff < 1e-4, f"oneDNN vs SDPA differ by {diff:.2g}"
        qf, kf = la.elu_feature_map(q).double(), la.elu_feature_map(k).double()
        weights_num = rotate(qf.float(), ops.freqs).double() @ rotate(kf.float(), ops.freqs).double().mT
        weights_den = qf @ kf.mT  # (B, H, N, N)
        for causal in (False, True):
            mask = torch.ones(length, length, dtype=torch.bool).tril() if causal else True
            expected = ((weights_num * mask) @ v.double()) / (weights_den * mask).sum(-1, keepdim=True)
            name = "linear-causal" if causal else "linear"
            diff = (outs[name].double() - expected.transpose(1, 2)).abs().max().item()
            assert diff < 1e-4, f"{name} differs from the naive eq. 19 by {diff:.2g}"
        for name, out in outs.items():
            assert out.shape == (1, length, HEADS, HEAD_DIM) and torch.isfinite(out).all(), name


# ----------------------------------------------------------------------------------------------------
# Timing (this process) and memory (child processes)
# ----------------------------------------------------------------------------------------------------


def time_length(length: int, args, onednn, backward: bool) -> dict[str, list[float]]:
    ops = Ops(length, onednn)
    names = [n for n in CANDIDATES if available(n, length, args, onednn, backward)]
    qkv, q, k, v = make_inputs(length, requires_grad=backward)
    cotangent = torch.randn(1, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))

    def forward(name):
        with torch.no_grad():
            return ops(name, q, k, v)

    def train_step(name):
        qkv.grad = None
        ops(name, q, k, v).backward(cotangent)

    run = train_step if backward else forward
    reps = args.reps if length <= 4096 else max(2, args.reps // 2)
    timing = interleaved({name: partial(run, name) for name in names}, reps=reps, warmup=1)
    return timing.times


def peak_child(length: int, names: list[str], backward: bool) -> dict[str, int]:
    """Runs in a child with MALLOC_MMAP_THRESHOLD_=65536: peak RSS increase of one call per candidate."""
    onednn, _ = load_onednn_attention()
    ops = Ops(length, onednn)
    result = {}
    cotangent = torch.randn(1, length, HEADS, HEAD_DIM)
    for name in names:
        qkv, q, k, v = make_inputs(length, requires_grad=backward)
        call = partial(_call, ops, name, q, k, v, cotangent if backward else None)
        call()  # lazily initialised kernels and their workspaces are not the op's memory
        qkv.grad = None
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux ≥ 4.0)
        before = _status_kib("VmRSS")
        out = call()
        result[name] = (_status_kib("VmHWM") - before) * 1024
        del out, qkv, q, k, v
    return result


def _call(ops: Ops, name: str, q, k, v, cotangent):
    if cotangent is not None:
        ops(name, q, k, v).backward(cotangent)
        return None
    with torch.no_grad():
        return ops(name, q, k, v)


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(length: int, names: list[str], backward: bool) -> dict[str, int]:
    if not names:
        return {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([length, names, backward])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0:
        print(f"memory child failed at N={length}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = cpu_model()
    flags = cpu_flags()
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))
    return f"{model} ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}; {isa})"


def crossover(times: dict[str, dict[int, float]], name: str) -> str:
    """Smallest N of the grid from which `name` beats the fastest softmax at every measured larger N."""
    softmax = [times[s] for s in SOFTMAX if s in times]
    lengths = sorted(n for n in times[name] if any(n in t for t in softmax))
    best = {n: min(t[n] for t in softmax if n in t) for n in lengths}
    wins = [times[name][n] < best[n] for n in lengths]
    if not lengths or not wins[-1]:
        return "not reached"
    i = len(wins) - 1
    while i > 0 and wins[i - 1]:
        i -= 1
    if i == 0:
        return f"≤ {lengths[0]}"
    lo, hi = lengths[i - 1], lengths[i]  # log-log interpolation of the time ratio between the grid points
    r_lo, r_hi = (math.log(times[name][n] / best[n]) for n in (lo, hi))
    estimate = math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * r_lo / (r_lo - r_hi))
    return f"{lo}–{hi} (≈ {estimate:.0f})"


def report(results: dict) -> str:
    lengths = results["lengths"]
    lines = [
        "# Attention op alone: softmax vs linear (eq. 19) and Performer (FAVOR+)",
        "",
        f"CPU: {results['cpu']}",
        "",
        " | ".join(f"{k}: {v}" for k, v in results["machine"].items()),
        "",
        f"12 heads × 64, batch 1, float32. softmax-onednn: {results['onednn']}. Method: bench/bench_linear_attention.py.",
        "",
    ]
    summary = []
    for mode, label in (("forward", "forward (no grad)"), ("train", "forward + backward")):
        data = {c: {int(n): median(ts) for n, ts in per.items()} for c, per in results[mode].items()}
        names = [c for c in CANDIDATES if data.get(c)]
        if not names:
            continue
        rows = [[str(n)] + [f"{1000 * data[c][n]:.1f}" if n in data[c] else "–" for c in names] for n in lengths]
        lines += [f"## Time, {label} (ms, median)", "", markdown_table(["N"] + names, rows), ""]
        ratio_rows = []
        for a, b in zip(lengths, lengths[1:]):
            if b != 2 * a:
                continue
            cells = [f"{data[c][b] / data[c][a]:.2f}" if a in data[c] and b in data[c] else "–" for c in names]
            ratio_rows.append([f"{a}→{b}"] + cells)
        if ratio_rows:
            lines += [f"time(2N)/time(N), {label} (goal for linear ≤ {GOALS['scaling']} from 2k up):", ""]
            lines += [markdown_table(["N"] + names, ratio_rows), ""]
        for c in LINEAR:
            if c not in data:
                continue
            worst = [data[c][2 * n] / data[c][n] for n in lengths if n >= 2048 and 2 * n in data[c] and n in data[c]]
            if worst:
                mark = "✅" if max(worst) <= GOALS["scaling"] else "❌"
                summary.append(f"{label}, {c}: worst time(2N)/time(N) from 2k up {max(worst):.2f} {mark}")
            summary.append(f"{label}, {c}: crossover vs fastest softmax at N = {crossover(data, c)}")
        for soft in ("softmax-onednn", "softmax-sdpa"):
            for c in ("linear", "linear-causal", "performer", "performer-causal"):
                if 16384 in data.get(soft, {}) and 16384 in data.get(c, {}):
                    speedup = data[soft][16384] / data[c][16384]
                    mark = "✅" if speedup >= GOALS["speedup_16k"] else "❌"
                    summary.append(f"{label}, N = 16384: {soft} / {c} = {speedup:.1f}× {mark}")
        for c in ("linear", "performer"):
            common_n = [n for n in lengths if n in data.get(c, {}) and n in data.get(c + "-causal", {})]
            if common_n:
                ratios = ", ".join(f"{n}: {data[c + '-causal'][n] / data[c][n]:.2f}" for n in common_n)
                worst = (
                    max(data[c + "-causal"][n] / data[c][n] for n in common_n if n >= 2048)
                    if max(common_n) >= 2048
                    else None
                )
                mark = "" if worst is None else (" ✅" if worst <= GOALS["causal_over_bidirectional"] else " ❌")
                summary.append(f"{label}, {c}-causal / {c}: {ratios}{mark}")
    for mode, label in (("memory_forward", "forward"), ("memory_train", "forward + backward")):
        data = results.get(mode) or {}
        names = [c for c in CANDIDATES if any(c in per for per in data.values())]
        if names:
            rows = [
                [str(n)] + [f"{data[str(n)][c] / MIB:.1f}" if c in data.get(str(n), {}) else "–" for c in names]
                for n in lengths
            ]
            lines += [
                f"## Peak memory of the op, {label} (MiB above the inputs)",
                "",
                markdown_table(["N"] + names, rows),
                "",
            ]
    lines += ["## Summary", ""] + [f"- {s}" for s in summary] + [""]
    return "\n".join(lines)


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode, title in zip(axes, ("forward", "train"), ("forward (no grad)", "forward + backward")):
        for c in CANDIDATES:
            per = results[mode].get(c)
            if per:
                ns = sorted(int(n) for n in per)
                ax.plot(ns, [1000 * median(per[str(n)]) for n in ns], "o-", label=c)
        ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="ms", title=f"attention op, {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "time.png"), dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode, style in (("memory_forward", "o-"), ("memory_train", "s--")):
        data = results.get(mode) or {}
        for c in CANDIDATES:
            ns = sorted(int(n) for n in data if c in data[n])
            if ns:
                label = f"{c} ({'fwd' if mode == 'memory_forward' else 'fwd+bwd'})"
                ax.plot(ns, [data[str(n)][c] / MIB for n in ns], style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="MiB", title="peak memory of the op")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-n", type=int, default=512)
    parser.add_argument("--max-n", type=int, default=32768, help="longest N (powers of two from --min-n)")
    parser.add_argument("--softmax-max-n", type=int, default=16384, help="softmax only up to this N")
    parser.add_argument("--reps", type=int, default=5, help="rounds per N (halved, min 2, above 4096)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "linear_attention"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        length, names, backward = json.loads(args.child)
        print(json.dumps(peak_child(length, names, backward)))
        return
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    unknown = set(args.candidates) - set(CANDIDATES)
    if unknown:
        parser.error(f"unknown candidates {sorted(unknown)}; choose from {CANDIDATES}")
    lengths = [n for n in (args.min_n * 2**i for i in range(20)) if n <= args.max_n]
    onednn, onednn_name = load_onednn_attention()
    cpu = cpu_line()
    print(f"CPU: {cpu}")
    print(f"softmax-onednn: {onednn_name if onednn else 'unavailable (' + onednn_name + ')'}", flush=True)
    check(Ops(512, onednn), [n for n in CANDIDATES if available(n, 512, args, onednn, False) or n.startswith("linear")])
    results = {
        "cpu": cpu,
        "machine": machine(),
        "onednn": onednn_name if onednn else f"unavailable ({onednn_name})",
        "lengths": lengths,
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "forward": {},
        "train": {},
        "memory_forward": {},
        "memory_train": {},
    }
    modes = [False] if args.no_backward else [False, True]
    for length in lengths:
        for backward in modes:
            mode = "train" if backward else "forward"
            start = time.perf_counter()
            times = time_length(length, args, onednn, backward)
            for name, ts in times.items():
                results[mode].setdefault(name, {})[str(length)] = ts
            cells = ", ".join(f"{name} {1000 * median(ts):.1f}" for name, ts in times.items())
            print(f"N={length} {mode}: {cells} ms ({time.perf_counter() - start:.0f} s)", flush=True)
            if not args.no_memory:
                names = [n for n in CANDIDATES if available(n, length, args, onednn, backward)]
                peaks = measure_memory(length, names, backward)
                results["memory_train" if backward else "memory_forward"][str(length)] = peaks
                print(f"N={length} {mode} peak MiB: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in peaks.items()))
    os.makedirs(args.out, exist_ok=True)
    markdown = report(results)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    print()
    print(markdown)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
