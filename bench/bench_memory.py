"""Peak memory of one fp32 forward (inference) at long lengths: ours vs the built-in, fresh process each.

    python bench/bench_memory.py --layers 4

Method: every (model, length) runs in its own fresh Python subprocess (`--child`), so no allocator cache or
earlier peak leaks between measurements. The child builds the encoder (random weights: memory does not
depend on their values), runs one short forward to load lazily initialised kernels, then resets the
kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`, Linux ≥ 4.0) and records VmRSS; after one
`torch.no_grad` forward at 1×T it reads VmHWM (the peak RSS). Reported: peak RSS of the whole process and
the forward's increment (peak − RSS before the forward = activations, attention scores, workspaces).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import Section, bar_plot, builtin_config, shape_name

LENGTHS = [4096, 8192]
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(which: str, layers: int, length: int) -> dict:
    import torch
    import transformers

    import modeling_roformer_rope as rr
    from roformer_rope.conversion.from_transformers import convert_config

    config = builtin_config(layers, max(length, 512))
    if which == "builtin":
        model = transformers.RoFormerModel(config).eval()
    else:
        model = rr.RoFormerRopeModel(convert_config(config)).eval()
        model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(input_ids=torch.ones(1, 16, dtype=torch.long), attention_mask=torch.ones(1, 16, dtype=torch.long))
        input_ids = torch.randint(1, config.vocab_size, (1, length))
        attention_mask = torch.ones(1, length, dtype=torch.long)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        model(input_ids=input_ids, attention_mask=attention_mask)
        peak = _status_kib("VmHWM")
    return {"rss_before_bytes": before * 1024, "peak_bytes": peak * 1024, "forward_bytes": (peak - before) * 1024}


def measure(which: str, layers: int, length: int) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(here, "bench_memory.py"),
            "--child",
            which,
            "--layers",
            str(layers),
            "--length",
            str(length),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(layers: int, lengths=LENGTHS) -> list[Section]:
    results = []
    for length in lengths:
        row = {"length": length}
        for which in ("builtin", "ours"):
            row[which] = measure(which, layers, length)
        results.append(row)
        print(
            f"memory 1×{length}: built-in +{row['builtin']['forward_bytes'] / MIB:.0f} MiB, "
            f"ours +{row['ours']['forward_bytes'] / MIB:.0f} MiB",
            flush=True,
        )
    rows = []
    for r in results:
        b, o = r["builtin"], r["ours"]
        rows.append(
            [
                shape_name(1, r["length"]),
                f"{b['peak_bytes'] / MIB:.0f}",
                f"{o['peak_bytes'] / MIB:.0f}",
                f"{b['forward_bytes'] / MIB:.0f}",
                f"{o['forward_bytes'] / MIB:.0f}",
                f"{b['forward_bytes'] / max(o['forward_bytes'], 1):.1f}×",
            ]
        )
    labels = [shape_name(1, r["length"]) for r in results]

    def plot(path: str) -> None:
        bar_plot(
            path,
            f"Forward peak memory increment, fp32, {layers} layers (MiB, log scale)",
            labels,
            {
                "built-in (eager)": [r["builtin"]["forward_bytes"] / MIB for r in results],
                "ours (SDPA)": [r["ours"]["forward_bytes"] / MIB for r in results],
            },
            "MiB",
            log=True,
        )

    method = (
        f"Encoder forward, fp32, `torch.no_grad`, batch 1, {layers} layers of base width; one fresh subprocess per "
        "model and length. Peak RSS = VmHWM after the forward (reset with `/proc/self/clear_refs` just before it); "
        "forward increment = peak RSS − RSS just before the forward (activations and attention scores; weights "
        "excluded)."
    )
    headers = [
        "B×T",
        "built-in peak RSS MiB",
        "ours peak RSS MiB",
        "built-in forward +MiB",
        "ours forward +MiB",
        "built-in / ours (increment)",
    ]
    return [Section("memory", "Peak memory (fp32 forward)", method, headers, rows, plot, {"rows": results})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--length", type=int, help="(with --child) the one length to measure")
    parser.add_argument("--child", choices=["builtin", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.length)))
        return
    for section in run(args.layers, [args.length] if args.length else LENGTHS):
        print(section.markdown())


if __name__ == "__main__":
    main()
