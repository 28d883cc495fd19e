"""Softmax vs linear (eq. 19) and Performer (FAVOR+) attention vs sequence length: op, layer and model level.

    python bench/bench_linear_attention.py                                   # every level, N = 512 … 32768 (long)
    python bench/bench_linear_attention.py --level layer --max-n 2048 --reps 2 --out /tmp/la   # smoke run
    python bench/bench_linear_attention.py --level model                     # 4-layer forward memory only
    python bench/bench_linear_attention.py --softmax-max-n 8192 --no-memory   # skip the slowest parts

Batch 1, float32, on the CPU; base width (768 = 12 heads × 64, intermediate 3072). Three levels (--level):

op     the attention operation alone, q, k, v → (B, N, H, 64). q, k, v are strided (B, H, N, 64) views into one
       fused (B, N, 3, H, 64) projection, as the model passes them:
         softmax-onednn[-causal]  our oneDNN softmax attention (the model's CPU inference path; no backward)
         softmax-sdpa[-causal]    F.scaled_dot_product_attention, output transposed to (B, N, H, 64)
         linear[-causal]          eq. 19: φ = elu+1 of q, k; R_iφ(q_i), R_jφ(k_j) by a complex multiply over the
                                  64 feature dims (numerator only); `linear_attention` (chunk 64 when causal)
         performer[-causal]       FAVOR+: 256 orthogonal random features of q, k (RoPE before the feature map);
                                  `linear_attention` with the keys' log scales
       q and k count as already rotated for softmax and performer (the model rotates them before attention);
       eq. 19 rotates the features, so that rotation is inside the linear op. The angles and the random
       projection (a buffer) are built once, outside the timing.
layer  one encoder layer, `RoFormerRopeLayer` (qkv, rotary, attention, o_proj, norm, MLP, norm) with
       attention_type softmax (the model's default "sdpa": our oneDNN kernel at inference where faster on this
       CPU, SDPA otherwise and in training), linear, performer; bidirectional and causal (`is_decoder=True`,
       no cache). Built as a 1-layer `RoFormerRopeModel`; the layer's inputs (hidden states, rotary cos/sin,
       masks) are captured from the model's own forward at each N, then `model.layers[0]` is timed alone.
       Next to them, in the same interleaved rounds, the best fp32 GEMM rate of this CPU: `F.linear` and
       `torch.ops.mkldnn._linear_pointwise` on (min(N, 4096), 768) × (768, 3072), the faster one counts.
       GEMM floor = the layer's linear-layer FLOPs / that rate: 2·N·(4·C² + 2·C·I) (qkv 3C², o_proj C², MLP
       2CI multiply-adds per token), ×3 for forward + backward. layer / floor says how far a layer is from
       "as fast as its linear layers allow" (1.0 = nothing but GEMMs at the best rate).
model  peak memory of the 4-layer base-width `RoFormerRopeModel` (vocab 20000) forward under `torch.no_grad`
       at 8k, 16k, 32k tokens, softmax (sdpa), linear, performer; bidirectional.

Method: forward under `torch.no_grad` (modules in eval); training step = forward + backward with a fixed random
cotangent, input and parameters requiring grad (modules in train mode, dropout 0; gradients set to None
before each step). Times are medians of interleaved runs (common.interleaved: every candidate once per round,
so a load change hits all alike), after one warm-up; default glibc malloc. Softmax runs only up to
--softmax-max-n (quadratic). Random init (std 0.02) gives small attention scores, so our softmax kernel takes
its fast no-max-subtraction path: if anything, softmax is favoured.

Peak memory: each (level, N) runs in a fresh child process with glibc's mmap threshold fixed at 64 KiB, so
every large buffer is its own mapping and RSS follows live memory. Per candidate: one warm-up call at the same
N (lazy kernels, calibration, oneDNN primitives), then peak RSS (VmHWM after resetting it through
/proc/self/clear_refs) minus RSS just before the call: the op's / layer's / forward's temporaries, outputs
and (training) saved activations and gradients; weights and inputs are excluded. The model level also
reports the whole process's peak RSS (weights, torch runtime included).

Reported: time and memory per N, time(2N)/time(N), softmax/linear speedups at 16k, causal/bidirectional, layer
time / GEMM floor, memory(2N)/memory(N), and the crossover N where each linear form gets faster than the
fastest softmax of the same masking (bidirectional vs bidirectional, causal vs causal). Results go to
bench/results/<cpu-tag>/linear_attention/ (README.md, results.json, *.png) unless --out; levels not run keep
their previous results from results.json. Never a test: timings depend on the machine and its load.
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
from common import cpu_flags, cpu_model, cpu_tag, interleaved, machine, markdown_table

HEADS, HEAD_DIM, NB_FEATURES = 12, 64, 256
HIDDEN, INTERMEDIATE = HEADS * HEAD_DIM, 3072
MODEL_LAYERS, MODEL_VOCAB = 4, 20000
LEVELS = ("op", "layer", "model")
CANDIDATES = [
    "softmax-onednn",
    "softmax-onednn-causal",
    "softmax-sdpa",
    "softmax-sdpa-causal",
    "linear",
    "linear-causal",
    "performer",
    "performer-causal",
]
LAYER_CANDIDATES = ["softmax", "softmax-causal", "linear", "linear-causal", "performer", "performer-causal"]
MODEL_CANDIDATES = ["softmax", "linear", "performer"]
GEMM_CANDIDATES = ["gemm-F.linear", "gemm-onednn"]
GEMM_MAX_ROWS = 4096  # the rate is flat from here on; more rows only cost time
GOALS = {"scaling": 2.2, "speedup_16k": 10.0, "causal_over_bidirectional": 2.0, "model_16k_gib": 2.0}
HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2**20
GIB = 2**30


def is_softmax(name: str) -> bool:
    return name.startswith("softmax")


def is_causal(name: str) -> bool:
    return name.endswith("-causal")


def softmax_references(name: str, names: list[str]) -> list[str]:
    """The softmax candidates a linear form is compared with: same masking (bidirectional or causal)."""
    return [s for s in names if is_softmax(s) and is_causal(s) == is_causal(name)]


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


# ----------------------------------------------------------------------------------------------------
# Op level: the attention operation alone
# ----------------------------------------------------------------------------------------------------


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
        causal = is_causal(name)
        if name.startswith("softmax-onednn"):
            return self.onednn(q, k, v, is_causal=causal)
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


def op_available(name: str, length: int, args, onednn, backward: bool) -> bool:
    if is_softmax(name) and length > args.softmax_max_n:
        return False
    if name.startswith("softmax-onednn") and (onednn is None or backward):
        return False
    return name in args.candidates


def op_check(ops: Ops, names: list[str]) -> None:
    """Nothing is timed on wrong outputs: softmax kernels agree, linear equals eq. 19 from an N×N matrix."""
    length = 512
    _, q, k, v = make_inputs(length)
    with torch.no_grad():
        outs = {name: ops(name, q, k, v) for name in names}
        for suffix in ("", "-causal"):
            a, b = outs.get("softmax-onednn" + suffix), outs.get("softmax-sdpa" + suffix)
            if a is not None and b is not None:
                diff = (a - b).abs().max().item()
                assert diff < 1e-4, f"oneDNN vs SDPA{suffix} differ by {diff:.2g}"
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


def op_time(length: int, args, onednn, backward: bool) -> dict[str, list[float]]:
    ops = Ops(length, onednn)
    names = [n for n in CANDIDATES if op_available(n, length, args, onednn, backward)]
    qkv, q, k, v = make_inputs(length, requires_grad=backward)
    cotangent = torch.randn(1, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))

    def forward(name):
        with torch.no_grad():
            return ops(name, q, k, v)

    def train_step(name):
        qkv.grad = None
        ops(name, q, k, v).backward(cotangent)

    run = train_step if backward else forward
    timing = interleaved({name: partial(run, name) for name in names}, reps=reps_for(length, args), warmup=1)
    return timing.times


def op_peak_child(length: int, names: list[str], backward: bool) -> dict[str, int]:
    """Runs in a child: peak RSS increase of one call per candidate."""
    onednn, _ = load_onednn_attention()
    ops = Ops(length, onednn)
    result = {}
    cotangent = torch.randn(1, length, HEADS, HEAD_DIM)
    for name in names:
        qkv, q, k, v = make_inputs(length, requires_grad=backward)
        call = partial(_op_call, ops, name, q, k, v, cotangent if backward else None)
        call()  # lazily initialised kernels and their workspaces are not the op's memory
        qkv.grad = None
        result[name] = peak_increase(call)
        del qkv, q, k, v
    return result


def _op_call(ops: Ops, name: str, q, k, v, cotangent):
    if cotangent is not None:
        ops(name, q, k, v).backward(cotangent)
        return None
    with torch.no_grad():
        return ops(name, q, k, v)


# ----------------------------------------------------------------------------------------------------
# Layer level: one RoFormerRopeLayer, and the GEMM rate it is measured against
# ----------------------------------------------------------------------------------------------------


def roformer():
    """The payload's modeling module (imported on first use: the op level runs without it)."""
    return importlib.import_module("modeling_roformer_rope.modeling_roformer_rope")


def model_config(name: str, layers: int = 1):
    """Base width; attention_type and is_decoder from the candidate name ("linear-causal" ...); no dropout."""
    return roformer().RoFormerRopeConfig(
        vocab_size=MODEL_VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_type=name.removesuffix("-causal"),
        is_decoder=is_causal(name),
        use_cache=False,
    )


def build_model(name: str, layers: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = roformer().RoFormerRopeModel(model_config(name, layers), add_pooling_layer=False)
    model.set_attn_implementation("sdpa")  # the default; for softmax: our kernel where faster, else SDPA
    return model.eval()


class _Captured(Exception):
    pass


def layer_inputs(model, length: int, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """(hidden_states (1, N, C), kwargs) exactly as the model hands them to its first layer at this length:
    embeddings, rotary cos/sin and masks come from the model's own forward, stopped before the layer runs."""
    store = {}

    def hook(module, args, kwargs):
        store["args"], store["kwargs"] = args, kwargs
        raise _Captured

    input_ids = torch.randint(1, MODEL_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    handle = model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()  # the in-place inference paths step aside for hooked modules: none stays
    (hidden_states,) = store["args"]
    return hidden_states, store["kwargs"]


class LayerRunner:
    """One candidate's layer at one N: `forward()` (no grad) and `train_step()` (forward + backward)."""

    def __init__(self, model, length: int):
        self.layer = model.layers[0]
        self.hidden_states, self.kwargs = layer_inputs(model, length)
        self.train_input = self.hidden_states.detach().clone().requires_grad_(True)
        self.cotangent = torch.randn(self.hidden_states.shape, generator=torch.Generator().manual_seed(1))

    def forward(self) -> torch.Tensor:
        self.layer.eval()
        with torch.no_grad():
            return self.layer(self.hidden_states, **self.kwargs)

    def train_step(self) -> None:
        self.layer.train()
        self.layer.zero_grad(set_to_none=True)
        self.train_input.grad = None
        self.layer(self.train_input, **self.kwargs).backward(self.cotangent)

    def run(self, backward: bool):
        return self.train_step() if backward else self.forward()


def layer_check(models: dict) -> None:
    """Nothing is timed on wrong outputs: the layer called alone gives the 1-layer model's output, is finite,
    and causal layers are causal (changing the second half of the input leaves the first half's output)."""
    length, half = 512, 256
    for name, model in models.items():
        runner = LayerRunner(model, length)
        with torch.no_grad():
            expected = model(
                input_ids=torch.randint(1, MODEL_VOCAB, (1, length), generator=torch.Generator().manual_seed(0)),
                use_cache=False,
            ).last_hidden_state
            out = runner.forward()
            diff = (out - expected).abs().max().item()
            assert diff < 1e-5 and torch.isfinite(out).all(), (
                f"{name}: layer alone differs from the model by {diff:.2g}"
            )
            perturbed = runner.hidden_states.clone()
            perturbed[:, half:] = torch.randn(perturbed[:, half:].shape, generator=torch.Generator().manual_seed(2))
            moved = (runner.layer(perturbed, **runner.kwargs)[:, :half] - out[:, :half]).abs().max().item()
        if is_causal(name):
            assert moved < 1e-5, f"{name}: later tokens change earlier outputs by {moved:.2g}"
        else:
            assert moved > 1e-3, f"{name}: bidirectional layer ignores later tokens"
        runner.train_step()
        grad = runner.train_input.grad
        assert grad is not None and torch.isfinite(grad).all(), f"{name}: no finite input gradient"


def layer_gemm_flops(length: int, backward: bool) -> float:
    """FLOPs of one layer's linear layers: 2·N·(4C² + 2CI) forward (qkv 3C², o_proj C², MLP 2CI), ×3 with backward."""
    forward = 2.0 * length * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE)
    return 3 * forward if backward else forward


def gemm_candidates(length: int) -> tuple[dict, float]:
    """Representative GEMM (min(N, 4096), 768) × (768, 3072) + bias on `F.linear` and on oneDNN; its FLOPs."""
    generator = torch.Generator().manual_seed(3)
    rows = min(length, GEMM_MAX_ROWS)
    x = torch.randn(rows, HIDDEN, generator=generator)
    w = torch.randn(INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN**-0.5
    b = torch.randn(INTERMEDIATE, generator=generator)

    @torch.no_grad()
    def torch_linear():
        return F.linear(x, w, b)

    candidates = {"gemm-F.linear": torch_linear}
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if torch.backends.mkldnn.is_available():
            torch.testing.assert_close(op(x[:8], w, b, "none", [], ""), F.linear(x[:8], w, b), rtol=1e-4, atol=1e-4)
            candidates["gemm-onednn"] = torch.no_grad()(partial(op, x, w, b, "none", [], ""))
    except (AttributeError, RuntimeError, AssertionError):
        pass
    return candidates, 2.0 * rows * HIDDEN * INTERMEDIATE


def layer_available(name: str, length: int, args) -> bool:
    return name in args.layer_candidates and not (is_softmax(name) and length > args.softmax_max_n)


def layer_time(models: dict, length: int, args, backward: bool) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved rounds of every candidate layer plus the two GEMMs → (times, GEMM rates in FLOP/s)."""
    names = [n for n in LAYER_CANDIDATES if n in models and layer_available(n, length, args)]
    runners = {name: LayerRunner(models[name], length) for name in names}
    gemms, gemm_flops = gemm_candidates(length)
    candidates = {name: partial(runners[name].run, backward) for name in names} | gemms
    timing = interleaved(candidates, reps=reps_for(length, args), warmup=1)
    rates = {g: gemm_flops / median(timing.times[g]) for g in gemms}
    return timing.times, rates


def layer_peak_child(length: int, names: list[str], backward: bool) -> dict[str, int]:
    """Runs in a child: peak RSS increase of one layer call (forward, or training step) per candidate."""
    result = {}
    for name in names:
        runner = LayerRunner(build_model(name), length)
        runner.run(backward)  # warm-up: calibration, oneDNN primitives, lazily allocated .grad
        runner.layer.zero_grad(set_to_none=True)
        runner.train_input.grad = None
        result[name] = peak_increase(partial(runner.run, backward))
        del runner
    return result


# ----------------------------------------------------------------------------------------------------
# Model level: peak memory of the 4-layer forward
# ----------------------------------------------------------------------------------------------------


def model_peak_child(length: int, name: str) -> dict[str, float]:
    """Runs in a child: the 4-layer model's forward at N tokens: peak RSS increase, whole-process peak, time."""
    model = build_model(name, layers=MODEL_LAYERS)
    input_ids = torch.randint(1, MODEL_VOCAB, (1, length), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=False).last_hidden_state

    out = forward()  # warm-up at the same length: lazily initialised kernels and calibration are not the forward's
    assert torch.isfinite(out).all(), f"{name}: non-finite output at N={length}"
    del out
    start = time.perf_counter()
    increase = peak_increase(forward)
    seconds = time.perf_counter() - start
    return {"forward_bytes": increase, "peak_bytes": _status_kib("VmHWM") * 1024, "seconds": seconds}


# ----------------------------------------------------------------------------------------------------
# Memory measurement machinery (children)
# ----------------------------------------------------------------------------------------------------


def peak_increase(call) -> int:
    """Peak RSS during `call()` minus RSS just before it, in bytes (the call's own allocations)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux ≥ 4.0)
    before = _status_kib("VmRSS")
    out = call()
    peak = _status_kib("VmHWM")
    del out
    return (peak - before) * 1024


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_child(payload: dict) -> dict:
    level = payload["level"]
    if level == "op":
        return op_peak_child(payload["length"], payload["names"], payload["backward"])
    if level == "layer":
        return layer_peak_child(payload["length"], payload["names"], payload["backward"])
    return model_peak_child(payload["length"], payload["name"])


def measure_in_child(payload: dict, threads: int | None) -> dict:
    """A fresh process per measurement: no earlier allocation or freed-but-kept heap hides the peak."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(payload)]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:]
        print(f"memory child failed ({payload}): {tail}", file=sys.stderr)
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def reps_for(length: int, args) -> int:
    return args.reps if length <= 4096 else max(2, args.reps // 2)


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = cpu_model()
    flags = cpu_flags()
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))
    return f"{model} ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}; {isa})"


def crossover(times: dict[str, dict[int, float]], name: str, references: list[str]) -> str:
    """Smallest N of the grid from which `name` beats the fastest of `references` at every measured larger N."""
    softmax = [times[s] for s in references if times.get(s)]
    lengths = sorted(n for n in times[name] if any(n in t for t in softmax))
    if not lengths:
        return "no common N"
    best = {n: min(t[n] for t in softmax if n in t) for n in lengths}
    wins = [times[name][n] < best[n] for n in lengths]
    if not wins[-1]:
        return f"not reached up to {lengths[-1]}"
    i = len(wins) - 1
    while i > 0 and wins[i - 1]:
        i -= 1
    if i == 0:
        return f"≤ {lengths[0]}"
    lo, hi = lengths[i - 1], lengths[i]  # log-log interpolation of the time ratio between the grid points
    r_lo, r_hi = (math.log(times[name][n] / best[n]) for n in (lo, hi))
    estimate = math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * r_lo / (r_lo - r_hi))
    return f"{lo}–{hi} (≈ {estimate:.0f})"


def medians(per_candidate: dict) -> dict[str, dict[int, float]]:
    return {c: {int(n): median(ts) for n, ts in per.items()} for c, per in per_candidate.items()}


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 1 else f"{1000 * seconds:.1f}"


def time_tables(data: dict, names: list[str], lengths: list[int], label: str) -> list[str]:
    rows = [[str(n)] + [ms(data[c][n]) if n in data[c] else "–" for c in names] for n in lengths]
    lines = [f"#### Time, {label} (ms, median)", "", markdown_table(["N"] + names, rows), ""]
    ratio_rows = []
    for a, b in zip(lengths, lengths[1:]):
        if b == 2 * a:
            cells = [f"{data[c][b] / data[c][a]:.2f}" if a in data[c] and b in data[c] else "–" for c in names]
            ratio_rows.append([f"{a}→{b}"] + cells)
    if ratio_rows:
        lines += [f"time(2N)/time(N), {label} (goal for linear ≤ {GOALS['scaling']} from 2k up):", ""]
        lines += [markdown_table(["N"] + names, ratio_rows), ""]
    return lines


def scaling_summary(data: dict, names: list[str], lengths: list[int], label: str) -> list[str]:
    summary = []
    for c in names:
        if is_softmax(c):
            continue
        worst = [data[c][2 * n] / data[c][n] for n in lengths if n >= 2048 and 2 * n in data[c] and n in data[c]]
        if worst:
            mark = "✅" if max(worst) <= GOALS["scaling"] else "❌"
            summary.append(f"{label}, {c}: worst time(2N)/time(N) from 2k up {max(worst):.2f} {mark}")
    for c in ("linear", "performer"):
        common_n = [n for n in lengths if n in data.get(c, {}) and n in data.get(c + "-causal", {})]
        if common_n:
            ratios = ", ".join(f"{n}: {data[c + '-causal'][n] / data[c][n]:.2f}" for n in common_n)
            long_n = [n for n in common_n if n >= 2048]
            worst = max(data[c + "-causal"][n] / data[c][n] for n in long_n) if long_n else None
            mark = "" if worst is None else (" ✅" if worst <= GOALS["causal_over_bidirectional"] else " ❌")
            summary.append(f"{label}, {c}-causal / {c}: {ratios}{mark}")
    return summary


def crossover_lines(data: dict, names: list[str], label: str) -> list[str]:
    lines = []
    for c in names:
        refs = softmax_references(c, names)
        if not is_softmax(c) and refs:
            lines.append(f"{label}, {c} vs {' / '.join(refs)}: crossover N {crossover(data, c, refs)}")
    return lines


def memory_table(data: dict, names: list[str], lengths: list[int], title: str) -> list[str]:
    names = [c for c in names if any(c in per for per in data.values())]
    if not names:
        return []
    rows = [
        [str(n)] + [f"{data[str(n)][c] / MIB:.1f}" if c in data.get(str(n), {}) else "–" for c in names]
        for n in lengths
    ]
    return [f"#### {title}", "", markdown_table(["N"] + names, rows), ""] + memory_ratios(data, names, lengths)


def memory_ratios(data: dict, names: list[str], lengths: list[int]) -> list[str]:
    """memory(2N)/memory(N) per candidate; data: {str(N): {name: bytes}}."""
    ratio_rows = []
    for a, b in zip(lengths, lengths[1:]):
        if b == 2 * a:
            cells = []
            for c in names:
                ma, mb = data.get(str(a), {}).get(c), data.get(str(b), {}).get(c)
                cells.append(f"{mb / ma:.2f}" if ma and mb else "–")
            ratio_rows.append([f"{a}→{b}"] + cells)
    if not ratio_rows:
        return []
    return ["memory(2N)/memory(N) (2.0 = ∝ N):", "", markdown_table(["N"] + names, ratio_rows), ""]


def level_header(block: dict) -> list[str]:
    m = block["machine"]
    return [
        f"CPU: {block['cpu']}",
        "",
        " | ".join(f"{k}: {v}" for k, v in m.items()) + f" | load average at end: {block.get('load_end', '?')}",
        "",
    ]


def report_op(block: dict) -> tuple[list[str], list[str]]:
    lengths = block["lengths"]
    lines = [
        "## Op level: the attention operation alone (q, k, v → output)",
        "",
        *level_header(block),
        f"12 heads × 64, batch 1, float32. softmax-onednn: {block['onednn']}.",
        "",
    ]
    summary = []
    for mode, label in (("forward", "forward (no grad)"), ("train", "forward + backward")):
        data = medians(block[mode])
        names = [c for c in CANDIDATES if data.get(c)]
        if not names:
            continue
        lines += time_tables(data, names, lengths, f"op, {label}")
        summary += scaling_summary(data, names, lengths, f"op {label}")
        summary += crossover_lines(data, names, f"op {label}")
        for c in ("linear", "linear-causal", "performer", "performer-causal"):
            for soft in softmax_references(c, names):
                if 16384 in data.get(soft, {}) and 16384 in data.get(c, {}):
                    speedup = data[soft][16384] / data[c][16384]
                    mark = "✅" if speedup >= GOALS["speedup_16k"] else "❌"
                    summary.append(f"op {label}, N = 16384: {soft} / {c} = {speedup:.1f}× {mark}")
    for mode, label in (("memory_forward", "forward"), ("memory_train", "forward + backward")):
        lines += memory_table(
            block.get(mode) or {}, CANDIDATES, lengths, f"Peak memory of the op, {label} (MiB above the inputs)"
        )
    lines += ["![op time](op_time.png)", "", "![op memory](op_memory.png)", ""]
    return lines, summary


def report_layer(block: dict) -> tuple[list[str], list[str]]:
    lengths = block["lengths"]
    lines = [
        "## Layer level: one base-width encoder layer (768 wide, 12 heads, intermediate 3072)",
        "",
        *level_header(block),
        "`model.layers[0]` of a 1-layer `RoFormerRopeModel` (attn_implementation sdpa), inputs captured from the "
        "model's forward. Floor = the layer's linear-layer FLOPs (2·N·(4C² + 2CI), ×3 for forward + backward) at the "
        "best GEMM rate of the same rounds (`F.linear` or oneDNN `_linear_pointwise` on (min(N, 4096), 768) × "
        "(768, 3072)).",
        "",
    ]
    summary = []
    for mode, label in (("forward", "forward (no grad)"), ("train", "training step (forward + backward)")):
        data = medians(block[mode])
        names = [c for c in LAYER_CANDIDATES if data.get(c)]
        if not names:
            continue
        lines += time_tables(data, names, lengths, f"layer, {label}")
        rates = {int(n): r for n, r in block["gemm_rates_" + mode].items()}
        rows = []
        for n in lengths:
            if n not in rates:
                continue
            best = max(rates[n].values())
            floor = layer_gemm_flops(n, mode == "train") / best
            rate_cells = [f"{rates[n].get(g, float('nan')) / 1e9:.0f}" for g in GEMM_CANDIDATES]
            ratio_cells = [f"{data[c][n] / floor:.2f}" if n in data[c] else "–" for c in names]
            rows.append([str(n), *rate_cells, ms(floor), *ratio_cells])
        headers = ["N", *(f"{g} GFLOP/s" for g in GEMM_CANDIDATES), "floor ms", *(f"{c} / floor" for c in names)]
        lines += [f"#### Layer time / GEMM floor, {label}", "", markdown_table(headers, rows), ""]
        summary += scaling_summary(data, names, lengths, f"layer {label}")
        summary += crossover_lines(data, names, f"layer {label}")
        linear_n = [n for n in rates if n in data.get("linear", {})]
        if linear_n:  # at 16k, or the longest N measured
            n = 16384 if 16384 in linear_n else max(linear_n)
            best = max(rates[n].values())
            floor = layer_gemm_flops(n, mode == "train") / best
            cells = ", ".join(f"{c} {data[c][n] / floor:.2f}" for c in names if n in data[c])
            summary.append(f"layer {label}, time / GEMM floor at N = {n} (best GEMM {best / 1e9:.0f} GFLOP/s): {cells}")
    for mode, label in (("memory_forward", "forward"), ("memory_train", "training step")):
        lines += memory_table(
            block.get(mode) or {},
            LAYER_CANDIDATES,
            lengths,
            f"Peak memory of the layer, {label} (MiB above weights and input)",
        )
    if block.get("dispatch"):
        choices = "; ".join(f"{d['class']} → {d['choice']}" for d in block["dispatch"])
        lines += [f"Dispatch choices made by the library in this run: {choices}", ""]
    lines += ["![layer time](layer_time.png)", "", "![layer memory](layer_memory.png)", ""]
    return lines, summary


def report_model(block: dict) -> tuple[list[str], list[str]]:
    lengths = block["lengths"]
    lines = [
        f"## Model level: {MODEL_LAYERS}-layer base-width model, forward memory",
        "",
        *level_header(block),
        f"`RoFormerRopeModel` ({MODEL_LAYERS} layers, 768 wide, vocab {MODEL_VOCAB}), `torch.no_grad`, bidirectional, "
        "one fresh process per (type, N), warmed up at the same N. forward + MiB = peak RSS − RSS just before the "
        "forward (activations and temporaries; weights excluded); process peak = VmHWM of the whole process; time = "
        "that single forward (not a median).",
        "",
    ]
    data = block["memory"]
    names = [c for c in MODEL_CANDIDATES if any(c in per for per in data.values())]
    rows = []
    for n in lengths:
        row = [str(n)]
        for c in names:
            r = data.get(str(n), {}).get(c)
            row += (
                [f"{r['forward_bytes'] / MIB:.0f}", f"{r['peak_bytes'] / MIB:.0f}", f"{r['seconds']:.1f}"]
                if r
                else ["–"] * 3
            )
        rows.append(row)
    headers = ["N"] + [f"{c} {h}" for c in names for h in ("forward +MiB", "process peak MiB", "s")]
    lines += [markdown_table(headers, rows), ""]
    increments = {str(n): {c: r["forward_bytes"] for c, r in per.items()} for n, per in data.items()}
    lines += memory_ratios(increments, names, lengths)
    summary = []
    for c in names:
        r = data.get("16384", {}).get(c)
        if r:
            mark = "✅" if r["forward_bytes"] < GOALS["model_16k_gib"] * GIB else "❌"
            summary.append(
                f"model, {c}, N = 16384: forward +{r['forward_bytes'] / GIB:.2f} GiB {mark} "
                f"(process peak {r['peak_bytes'] / GIB:.2f} GiB; goal < {GOALS['model_16k_gib']:g} GiB)"
            )
    lines += ["![model memory](model_memory.png)", ""]
    return lines, summary


def report(results: dict) -> str:
    lines = [
        "# Softmax vs linear (eq. 19) vs Performer (FAVOR+): op, layer, model",
        "",
        "Measured by `bench/bench_linear_attention.py` (method in its docstring). Batch 1, float32, CPU. Each level "
        "lists the machine and load it ran under; timings on a loaded machine are provisional.",
        "",
    ]
    summary = []
    body = []
    for level, fn in (("op", report_op), ("layer", report_layer), ("model", report_model)):
        if results.get(level):
            part, s = fn(results[level])
            body += part
            summary += s
    crossovers = [s for s in summary if ": crossover N " in s]
    lines += ["## Crossover: smallest N from which linear attention is faster than softmax", ""]
    lines += [f"- {s}" for s in crossovers] + [""]
    lines += ["## Summary", ""] + [f"- {s}" for s in summary if s not in crossovers] + [""]
    return "\n".join(lines + body)


def _loglog(ax, title: str, ylabel: str) -> None:
    ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)

    for level, names in (("op", CANDIDATES), ("layer", LAYER_CANDIDATES)):
        block = results.get(level)
        if not block:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, mode, title in zip(axes, ("forward", "train"), ("forward (no grad)", "forward + backward")):
            for c in names:
                per = block[mode].get(c)
                if per:
                    ns = sorted(int(n) for n in per)
                    style = "s--" if is_causal(c) else "o-"
                    ax.plot(ns, [1000 * median(per[str(n)]) for n in ns], style, label=c)
            rates = block.get("gemm_rates_" + mode)
            if rates:
                ns = sorted(int(n) for n in rates)
                floor = [1000 * layer_gemm_flops(n, mode == "train") / max(rates[str(n)].values()) for n in ns]
                ax.plot(ns, floor, "k:", label="GEMM floor")
            _loglog(ax, f"{level}, {title}", "ms")
        save(fig, f"{level}_time.png")
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for mode, tag in (("memory_forward", "fwd"), ("memory_train", "fwd+bwd")):
            data = block.get(mode) or {}
            for c in names:
                ns = sorted(int(n) for n in data if c in data[n])
                if ns:
                    style = ("o" if mode == "memory_forward" else "s") + ("--" if is_causal(c) else "-")
                    ax.plot(ns, [data[str(n)][c] / MIB for n in ns], style, label=f"{c} ({tag})")
        _loglog(ax, f"peak memory of the {level}", "MiB")
        save(fig, f"{level}_memory.png")
    block = results.get("model")
    if block:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        data = block["memory"]
        for i, c in enumerate(MODEL_CANDIDATES):
            ns = sorted(int(n) for n in data if c in data[n])
            if ns:
                forward = [data[str(n)][c]["forward_bytes"] / MIB for n in ns]
                ax.plot(ns, forward, "o-", color=f"C{i}", label=f"{c} forward +MiB")
                peak = [data[str(n)][c]["peak_bytes"] / MIB for n in ns]
                ax.plot(ns, peak, "s:", color=f"C{i}", label=f"{c} process peak")
        ax.axhline(GOALS["model_16k_gib"] * 1024, color="k", lw=0.8, ls="--", label="2 GiB (goal at 16k)")
        _loglog(ax, f"{MODEL_LAYERS}-layer model forward, peak memory", "MiB")
        save(fig, "model_memory.png")


# ----------------------------------------------------------------------------------------------------
# Levels
# ----------------------------------------------------------------------------------------------------


def extend_block(old: dict, new: dict) -> dict:
    """`--extend`: the new lengths' results added to a level's previous ones (per-length dicts merged, the
    lengths unioned; the run's own arguments and load kept per run under "extended_by")."""
    merged = dict(old)
    for key, value in new.items():
        if key == "lengths":
            merged[key] = sorted(set(old.get(key, [])) | set(value))
        elif isinstance(value, dict) and isinstance(old.get(key), dict):
            merged[key] = extend_block(old[key], value)
        elif key in ("args", "load_end"):
            merged.setdefault("extended_by", []).append({key: value})
        elif key in ("cpu", "machine", "dispatch"):
            continue  # the first run's description stays
        else:
            merged[key] = value
    return merged


def level_block(lengths: list[int], args) -> dict:
    return {"cpu": cpu_line(), "machine": machine(), "lengths": lengths, "args": public_args(args)}


def public_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("child", "out")}


def load_end() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_op(lengths: list[int], args) -> dict:
    onednn, onednn_name = load_onednn_attention()
    print(f"softmax-onednn: {onednn_name if onednn else 'unavailable (' + onednn_name + ')'}", flush=True)
    op_check(
        Ops(512, onednn), [n for n in CANDIDATES if op_available(n, 512, args, onednn, False) or n.startswith("linear")]
    )
    block = level_block(lengths, args)
    block |= {"onednn": onednn_name if onednn else f"unavailable ({onednn_name})"}
    block |= {"forward": {}, "train": {}, "memory_forward": {}, "memory_train": {}}
    for length in lengths:
        for backward in modes(args):
            mode = "train" if backward else "forward"
            start = time.perf_counter()
            times = op_time(length, args, onednn, backward)
            for name, ts in times.items():
                block[mode].setdefault(name, {})[str(length)] = ts
            cells = ", ".join(f"{name} {1000 * median(ts):.1f}" for name, ts in times.items())
            print(f"op N={length} {mode}: {cells} ms ({time.perf_counter() - start:.0f} s)", flush=True)
            if not args.no_memory:
                names = [n for n in CANDIDATES if op_available(n, length, args, onednn, backward)]
                payload = {"level": "op", "length": length, "names": names, "backward": backward}
                peaks = measure_in_child(payload, args.threads)
                block["memory_" + mode][str(length)] = peaks
                print(f"op N={length} {mode} peak MiB: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in peaks.items()))
    block["load_end"] = load_end()
    return block


def run_layer(lengths: list[int], args) -> dict:
    models = {name: build_model(name) for name in LAYER_CANDIDATES if name in args.layer_candidates}
    layer_check(models)
    block = level_block(lengths, args)
    block |= {"forward": {}, "train": {}, "memory_forward": {}, "memory_train": {}}
    block |= {"gemm_rates_forward": {}, "gemm_rates_train": {}}
    for length in lengths:
        for backward in modes(args):
            mode = "train" if backward else "forward"
            start = time.perf_counter()
            times, rates = layer_time(models, length, args, backward)
            block["gemm_rates_" + mode][str(length)] = rates
            for name, ts in times.items():
                if name not in GEMM_CANDIDATES:
                    block[mode].setdefault(name, {})[str(length)] = ts
            floor = layer_gemm_flops(length, backward) / max(rates.values())
            cells = ", ".join(f"{n} {ms(median(ts))}" for n, ts in times.items() if n not in GEMM_CANDIDATES)
            gemm = ", ".join(f"{g} {r / 1e9:.0f}" for g, r in rates.items())
            print(
                f"layer N={length} {mode}: {cells} ms; floor {ms(floor)} ms (GFLOP/s {gemm}) "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            if not args.no_memory:
                names = [n for n in LAYER_CANDIDATES if n in models and layer_available(n, length, args)]
                payload = {"level": "layer", "length": length, "names": names, "backward": backward}
                peaks = measure_in_child(payload, args.threads)
                block["memory_" + mode][str(length)] = peaks
                print(f"layer N={length} {mode} peak MiB: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in peaks.items()))
    try:
        calibration = importlib.import_module("modeling_roformer_rope.calibration_roformer_rope")
        block["dispatch"] = calibration.decisions()
    except Exception:  # noqa: BLE001 - informational only
        block["dispatch"] = []
    block["load_end"] = load_end()
    return block


def run_model(lengths: list[int], args) -> dict:
    block = level_block(lengths, args) | {"memory": {}}
    for length in lengths:
        for name in MODEL_CANDIDATES:
            if name not in args.model_candidates or (is_softmax(name) and length > args.softmax_max_n):
                continue
            r = measure_in_child({"level": "model", "length": length, "name": name}, args.threads)
            if r:
                block["memory"].setdefault(str(length), {})[name] = r
                print(
                    f"model N={length} {name}: forward +{r['forward_bytes'] / MIB:.0f} MiB, process peak "
                    f"{r['peak_bytes'] / MIB:.0f} MiB, {r['seconds']:.1f} s",
                    flush=True,
                )
    block["load_end"] = load_end()
    return block


def modes(args) -> list[bool]:
    return [False] if args.no_backward else [False, True]


def parse_list(value: str, allowed: list[str], parser, flag: str) -> list[str]:
    names = [c.strip() for c in value.split(",") if c.strip()]
    unknown = set(names) - set(allowed)
    if unknown:
        parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {allowed}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="all", choices=[*LEVELS, "all"], help="which benchmark(s) to run")
    parser.add_argument("--min-n", type=int, default=512)
    parser.add_argument(
        "--max-n", type=int, default=32768, help="longest N at every level (powers of two from --min-n)"
    )
    parser.add_argument("--softmax-max-n", type=int, default=16384, help="softmax only up to this N (every level)")
    parser.add_argument("--model-n", default="8192,16384,32768", help="model-level lengths (capped by --max-n)")
    parser.add_argument("--reps", type=int, default=5, help="rounds per N (halved, min 2, above 4096)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="op-level candidates")
    parser.add_argument("--layer-candidates", default=",".join(LAYER_CANDIDATES))
    parser.add_argument("--model-candidates", default=",".join(MODEL_CANDIDATES))
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-memory", action="store_true", help="op and layer levels: skip the memory children")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--extend", action="store_true",
                        help="add this run's lengths to the level's previous results instead of replacing them")
    parser.add_argument("--out", default=os.path.join(HERE, "results", cpu_tag(), "linear_attention"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    args.candidates = parse_list(args.candidates, CANDIDATES, parser, "--candidates")
    args.layer_candidates = parse_list(args.layer_candidates, LAYER_CANDIDATES, parser, "--layer-candidates")
    args.model_candidates = parse_list(args.model_candidates, MODEL_CANDIDATES, parser, "--model-candidates")
    levels = list(LEVELS) if args.level == "all" else [args.level]
    lengths = [n for n in (args.min_n * 2**i for i in range(20)) if n <= args.max_n]
    model_lengths = [n for n in (int(x) for x in args.model_n.split(",") if x.strip()) if n <= args.max_n]
    model_lengths = model_lengths or [args.max_n]
    print(f"CPU: {cpu_line()}; results to {args.out}", flush=True)

    path = os.path.join(args.out, "results.json")
    results = {}
    if os.path.exists(path):  # levels not run now keep their previous results
        with open(path) as f:
            previous = json.load(f)
        results = {level: previous[level] for level in LEVELS if isinstance(previous.get(level), dict)}
    runners = {
        "op": partial(run_op, lengths),
        "layer": partial(run_layer, lengths),
        "model": partial(run_model, model_lengths),
    }
    os.makedirs(args.out, exist_ok=True)
    for level in levels:
        block = runners[level](args)
        if args.extend and isinstance(results.get(level), dict):
            block = extend_block(results[level], block)
        results[level] = block
        with open(path, "w") as f:  # after every level: a later failure keeps what was measured
            json.dump(results, f, indent=1)
    markdown = report(results)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(markdown)
    plot(results, args.out)
    print()
    print(markdown)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
