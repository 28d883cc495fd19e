"""`torch.compile` on and off: ours and the built-in, eager vs compiled (inductor), fp32 forward.

    python bench/bench_compile.py --layers 4 --reps 5

Each model is compiled with `torch.compile(model, dynamic=False)` (default inductor mode); the first
call's wall time is reported as compile time. Compiled outputs are checked against eager (atol 1e-4)
and against the built-in. Shapes are fixed, so each new shape recompiles (counted in its first call).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from functools import partial

import torch
from common import (
    Section,
    bar_plot,
    check_parity,
    fmt_ms,
    interleaved,
    isa_limits,
    make_pair,
    random_batch,
    settle_note,
    shape_name,
)

SHAPES = [(1, 128), (4, 512)]


def separate_inductor_cache() -> None:
    """Under an ISA limit (`ATEN_CPU_CAPABILITY=avx2` ...) compile into a cache of that limit's own. Inductor's
    on-disk cache key does not include the limit: with torch 2.13 on a Zen 5 EPYC, kernels cached by an unlimited
    run and served under `ATEN_CPU_CAPABILITY=avx2` gave NaN for the built-in and ours alike (a fresh cache
    directory gave the right outputs)."""
    try:  # inductor writes its default into the environment the first time anything asks for the cache dir
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = default_cache_dir()  # per user: /tmp/torchinductor_<user>
    except ImportError:
        default = os.path.join(tempfile.gettempdir(), "torchinductor")
    limits = isa_limits()
    if limits and os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default):
        name = re.sub(r"[^a-z0-9_-]+", "_", "-".join(f"{k}-{v}" for k, v in sorted(limits.items())).lower())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{name}"
        print(f"ISA limits {limits}: inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}", flush=True)


def run(layers: int, reps: int, shapes=SHAPES) -> list[Section]:
    separate_inductor_cache()
    builtin, ours = make_pair(layers, 8192)
    compiled = {"builtin": torch.compile(builtin, dynamic=False), "ours": torch.compile(ours, dynamic=False)}
    results = []
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        compile_s = {}
        with torch.no_grad():
            for name, model in compiled.items():
                start = time.perf_counter()
                model(**inputs)
                compile_s[name] = time.perf_counter() - start
            diff = max(
                check_parity(builtin, ours, inputs),
                check_parity(builtin, compiled["ours"], inputs),
                check_parity(builtin, compiled["builtin"], inputs),
            )
            timing = interleaved(
                {
                    "builtin": partial(builtin, **inputs),
                    "builtin_compiled": partial(compiled["builtin"], **inputs),
                    "ours": partial(ours, **inputs),
                    "ours_compiled": partial(compiled["ours"], **inputs),
                },
                reps=reps,
                warmup=0,  # every candidate ran in the parity checks
            )
        r = dict(
            batch=batch,
            length=length,
            max_abs_diff=diff,
            compile_s=compile_s,
            times=timing.times,
            **{f"{name}_s": timing.median(name) for name in timing.times},
            ours_compiled_vs_builtin=timing.ratio("builtin", "ours_compiled"),
            ours_compiled_vs_ours=timing.ratio("ours", "ours_compiled"),
            builtin_compiled_vs_builtin=timing.ratio("builtin", "builtin_compiled"),
            settle_rounds=timing.settle_rounds,
        )
        results.append(r)
        print(
            f"compile {shape_name(batch, length)}: ours {fmt_ms(r['ours_s'])} → {fmt_ms(r['ours_compiled_s'])} ms, "
            f"built-in {fmt_ms(r['builtin_s'])} → {fmt_ms(r['builtin_compiled_s'])} ms",
            flush=True,
        )
    rows = [
        [
            shape_name(r["batch"], r["length"]),
            fmt_ms(r["builtin_s"]),
            fmt_ms(r["builtin_compiled_s"]),
            fmt_ms(r["ours_s"]),
            fmt_ms(r["ours_compiled_s"]),
            f"{r['ours_compiled_vs_ours']:.2f}×",
            f"{r['ours_compiled_vs_builtin']:.2f}×",
            f"{r['compile_s']['builtin']:.0f} / {r['compile_s']['ours']:.0f}",
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in results
    ]
    labels = [shape_name(r["batch"], r["length"]) for r in results]

    def plot(path: str) -> None:
        bar_plot(
            path,
            f"torch.compile on/off, fp32 forward, {layers} layers (ms, log scale)",
            labels,
            {
                name: [1000 * r[f"{key}_s"] for r in results]
                for name, key in (
                    ("built-in eager", "builtin"),
                    ("built-in compiled", "builtin_compiled"),
                    ("ours eager", "ours"),
                    ("ours compiled", "ours_compiled"),
                )
            },
            "ms",
            log=True,
        )

    method = (
        f"Encoder forward, fp32, `torch.no_grad`, {layers} layers; `torch.compile(model, dynamic=False)` (inductor, "
        f"default mode). Median of {reps} interleaved runs after compilation; compile time = first call per shape "
        "(seconds, built-in / ours). max |Δ| is the worst of eager-ours, compiled-ours and compiled-built-in vs the "
        "eager built-in."
        + settle_note({shape_name(r["batch"], r["length"]): r["settle_rounds"] for r in results})
    )
    headers = [
        "B×T",
        "built-in ms",
        "built-in compiled ms",
        "ours ms",
        "ours compiled ms",
        "compiled vs ours eager",
        "ours compiled vs built-in",
        "compile s (built-in / ours)",
        "max abs diff",
    ]
    return [Section("compile", "torch.compile on and off", method, headers, rows, plot, {"rows": results})]


def main() -> None:
    from common import standalone_main

    standalone_main(run, __doc__)


if __name__ == "__main__":
    main()
