"""How much do page faults decide the comparison? Built-in vs ours under glibc's default malloc and a tuned one.

    python bench/page_faults.py [--layers 4] [--shapes 4x512,1x4096] [--dtypes float32,bfloat16] [--reps 5]

Every large activation (QKV projection, MLP intermediate, the built-in's (B, H, T, T) attention weights, oneDNN's
per-call weight layout buffers) is a fresh allocation. glibc serves large requests with new mappings or trims
its heap when they are freed, so the next forward faults the same pages in again (zeroed by the kernel). Each
cell runs in a fresh child process: default malloc, then `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_` fixed
high (freed memory stays in the process), with the built-in and ours interleaved in the same rounds (same
weights, `torch.no_grad`), and prints the median time and minor page faults per forward.

The setting is process-wide, so the model code never changes it: it is a deployment choice (so is jemalloc or
tcmalloc via LD_PRELOAD). The built-in allocates far more per forward, so it gains far more from it: ratios
against the built-in under the default allocator (what `run_all.py` measures) are larger than under a tuned one.
`--out FILE` also writes the table as markdown with the CPU header.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from common import machine, make_pair, markdown_table, random_batch

TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def measure(layers: int, dtype: str, batch: int, length: int, reps: int) -> dict:
    """Child process: median ms and minor faults per forward of each model, interleaved."""
    builtin, ours = (m.to(getattr(torch, dtype)) for m in make_pair(layers, max(8192, length)))
    inputs = random_batch(batch, length)
    models = {"builtin": builtin, "ours": ours}
    times: dict[str, list[float]] = {name: [] for name in models}
    faults: dict[str, list[int]] = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():  # warm-up: calibration, first-call allocations
            model(**inputs)
        for _ in range(reps):
            for name, model in models.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                model(**inputs)
                times[name].append(time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {
        name: {"ms": 1e3 * statistics.median(times[name]), "faults": statistics.median(faults[name])} for name in models
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shapes", default="4x512,1x4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="also write the table (markdown) here")
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        batch, length = (int(x) for x in args.child[1].split("x"))
        print(json.dumps(measure(args.layers, args.child[0], batch, length, args.reps)))
        return
    allocators = {"glibc default": {}, "tuned (" + ", ".join(f"{k}={v}" for k, v in TUNED.items()) + ")": TUNED}
    rows = []
    for dtype in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            for label, env in allocators.items():
                argv = [sys.executable, __file__, "--layers", str(args.layers), "--reps", str(args.reps)]
                out = subprocess.run(
                    argv + ["--child", dtype, shape],
                    env={**os.environ, **env},
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                cell = json.loads(out.strip().splitlines()[-1])
                ratio = cell["builtin"]["ms"] / cell["ours"]["ms"]
                rows.append(
                    [dtype, shape.replace("x", "×"), label]
                    + [f"{cell[m]['ms']:.0f} ({cell[m]['faults']:.0f})" for m in ("builtin", "ours")]
                    + [f"{ratio:.2f}×"]
                )
                print(" | ".join(rows[-1]), flush=True)
    headers = ["dtype", "B×T", "allocator", "built-in ms (faults)", "ours ms (faults)", "built-in / ours"]
    table = markdown_table(headers, rows)
    info = machine()
    header = (
        f"CPU: {info['CPU']}, {info['CPU family/model']}, torch threads {info['torch threads']}, "
        f"{info['date (UTC)']} UTC, roformer_rope {info['roformer_rope']}"
    )
    options = f"--layers {args.layers} --shapes {args.shapes} --dtypes {args.dtypes} --reps {args.reps}"
    title = f"# Page faults: built-in vs ours under two allocators ({args.layers} layers)"
    text = "\n\n".join([title, f"`python bench/page_faults.py {options}`", header, table])
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
