"""How much of a long forward is the kernel paging memory in? glibc's default malloc vs a fixed threshold.

    python bench/page_faults.py [--layers 4] [--shape 1x4096] [--reps 4]

Every large activation (the QKV projection, the MLP's intermediate, attention score blocks) is a fresh
allocation. glibc serves requests above its mmap threshold with new mappings and returns them to the OS
when freed, so the next forward faults the same pages in again (zeroed by the kernel). Runs our encoder's
forward in two child processes, default malloc and `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`
fixed high (memory stays in the process), and prints the median time and minor page faults per forward.
The setting is process-wide, so the library never changes it: it is a deployment choice (so is jemalloc).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from common import make_pair, random_batch

TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def measure(layers: int, batch: int, length: int, reps: int) -> None:
    _, ours = make_pair(layers, max(8192, length))
    inputs = random_batch(batch, length)
    times, faults = [], []
    with torch.no_grad():
        ours(**inputs)  # warm-up
        for _ in range(reps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            ours(**inputs)
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(f"{1000 * statistics.median(times):.0f} ms, {statistics.median(faults):.0f} minor faults", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", default="1x4096")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch, length = (int(x) for x in args.shape.split("x"))
    if args.child:
        return measure(args.layers, batch, length, args.reps)
    argv = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--shape", args.shape]
    print(f"our encoder, {args.layers} layers, {args.shape}, median of {args.reps} forwards per process")
    for label, env in (("glibc default", {}), (" ".join(f"{k}={v}" for k, v in TUNED.items()), TUNED)):
        print(f"{label}: ", end="", flush=True)
        subprocess.run(argv + ["--reps", str(args.reps)], env={**os.environ, **env}, check=True)


if __name__ == "__main__":
    main()
