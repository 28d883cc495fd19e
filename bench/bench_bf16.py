"""bf16 forward on CPU: ours bf16 vs the built-in bf16 (same dtype), and vs both fp32 (same weights, `.to`).

    python bench/bench_bf16.py --layers 4 --reps 5

bf16 GEMMs use AVX512-BF16 (`avx512_bf16` in /proc/cpuinfo) through oneDNN where present, AMX where
present; without AMX a bf16 GEMM is not faster than fp32 on many CPUs, which is what this measures.
fp32 outputs are checked equal (atol 1e-4) first; the bf16 error vs fp32 is reported, not asserted
beyond a sanity bound (bf16 has 8 mantissa bits).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from bench_floor import floor_numbers, linear_gemms
from common import (
    Section,
    bar_plot,
    check_parity,
    cpu_flags,
    fmt_ms,
    goal_cell,
    interleaved,
    make_pair,
    random_batch,
    shape_name,
)

SHAPES = [(4, 512), (1, 4096)]
# issue 14: ours bf16 vs the built-in bf16, and ours bf16 / its own bf16 GEMM floor (on a CPU with AMX)
GOALS = {(4, 512): 1.5, (1, 4096): 2.5}
FLOOR_GOAL = 2.0


def run(layers: int, reps: int, shapes=SHAPES) -> list[Section]:
    builtin, ours = make_pair(layers, 8192)
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    builtin_bf16 = copy.deepcopy(builtin).to(torch.bfloat16)
    results = []
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        check_parity(builtin, ours, inputs)
        with torch.no_grad():
            reference = ours(**inputs).last_hidden_state
            low = ours_bf16(**inputs).last_hidden_state.float()
            bf16_diff = (reference - low).abs().max().item()
            bf16_rel = ((reference - low).norm() / reference.norm()).item()
            if not bf16_rel < 0.05:
                raise AssertionError(f"bf16 output too far from fp32: relative error {bf16_rel:.3g}")
            timing = interleaved(
                {
                    "builtin": partial(builtin, **inputs),
                    "ours": partial(ours, **inputs),
                    "ours_bf16": partial(ours_bf16, **inputs),
                    "builtin_bf16": partial(builtin_bf16, **inputs),
                    "gemm_bf16": linear_gemms(ours_bf16, batch, length),
                },
                reps=reps,
                warmup=1,  # the built-in bf16 model has not run yet
            )
        results.append(
            dict(
                batch=batch,
                length=length,
                bf16_max_abs_diff=bf16_diff,
                bf16_rel_err=bf16_rel,
                builtin_s=timing.median("builtin"),
                ours_s=timing.median("ours"),
                bf16_s=timing.median("ours_bf16"),
                builtin_bf16_s=timing.median("builtin_bf16"),
                bf16_vs_builtin_bf16=timing.ratio("builtin_bf16", "ours_bf16"),
                bf16_vs_fp32=timing.ratio("ours", "ours_bf16"),
                bf16_vs_builtin=timing.ratio("builtin", "ours_bf16"),
                times=timing.times,
            )
            | {f"bf16_{k}": v for k, v in floor_numbers(ours_bf16, batch, length, timing.median("gemm_bf16")).items()}
        )
        results[-1]["bf16_vs_floor"] = results[-1]["bf16_s"] / results[-1]["bf16_floor_s"]
        print(
            f"bf16 {shape_name(batch, length)}: ours bf16 {fmt_ms(results[-1]['bf16_s'])} ms, built-in bf16 "
            f"{fmt_ms(results[-1]['builtin_bf16_s'])} ms, ours fp32 {fmt_ms(results[-1]['ours_s'])} ms",
            flush=True,
        )
    amx = "amx_bf16" in cpu_flags()
    rows = [
        [
            shape_name(r["batch"], r["length"]),
            fmt_ms(r["builtin_s"]),
            fmt_ms(r["ours_s"]),
            fmt_ms(r["builtin_bf16_s"]),
            fmt_ms(r["bf16_s"]),
            f"{r['bf16_vs_builtin_bf16']:.2f}× {goal_cell(r['bf16_vs_builtin_bf16'], GOALS.get((r['batch'], r['length'])))}",
            f"{r['bf16_gflops']:.0f}",
            fmt_ms(r["bf16_floor_s"]),
            f"{r['bf16_vs_floor']:.2f}× {goal_cell(r['bf16_vs_floor'], FLOOR_GOAL if amx else None, False)}",
            f"{r['bf16_vs_fp32']:.2f}×",
            f"{r['bf16_vs_builtin']:.2f}×",
            f"{r['bf16_rel_err']:.1e}",
        ]
        for r in results
    ]
    labels = [shape_name(r["batch"], r["length"]) for r in results]

    def plot(path: str) -> None:
        bar_plot(
            path,
            f"bf16 vs fp32 forward, {layers} layers (ms, log scale)",
            labels,
            {
                "built-in fp32": [1000 * r["builtin_s"] for r in results],
                "ours fp32": [1000 * r["ours_s"] for r in results],
                "built-in bf16": [1000 * r["builtin_bf16_s"] for r in results],
                "ours bf16": [1000 * r["bf16_s"] for r in results],
            },
            "ms",
            log=True,
        )

    isa = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()) or "neither avx512_bf16 nor AMX"
    method = (
        f"Encoder forward, `torch.no_grad`, {layers} layers; ours cast to bf16 with `.to(torch.bfloat16)` (weights "
        f"and activations; rotary angles still formed in fp32). CPU: {isa}. Median of {reps} interleaved runs. "
        "Speed-ups > 1 mean bf16 is faster; rel. error = ‖bf16 − fp32‖ / ‖fp32‖ of `last_hidden_state`. bf16 floor: "
        "our bf16 model's own linear GEMMs timed alone in the same rounds + attention FLOPs at that GEMM rate "
        "(see the fp32 floor); the ≤ 2× floor goal applies on AMX CPUs."
    )
    headers = [
        "B×T",
        "built-in fp32 ms",
        "ours fp32 ms",
        "built-in bf16 ms",
        "ours bf16 ms",
        "ours bf16 vs built-in bf16",
        "bf16 GEMM GFLOP/s",
        "bf16 floor ms",
        "ours bf16 / bf16 floor",
        "bf16 vs ours fp32",
        "ours bf16 vs built-in fp32",
        "bf16 rel. error",
    ]
    return [Section("bf16", "bf16 forward (CPU)", method, headers, rows, plot, {"rows": results})]


def main() -> None:
    from common import standalone_main

    standalone_main(run, __doc__)


if __name__ == "__main__":
    main()
