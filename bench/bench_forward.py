"""Forward (inference) latency, fp32: our encoder vs the built-in `transformers.RoFormerModel`, same weights.

    python bench/bench_forward.py --layers 4 --reps 5

Per shape: both outputs are checked equal (atol 1e-4; this run is also the warm-up), then the built-in,
ours (SDPA) and our linear GEMMs alone (the floor, see bench_floor.py) run interleaved; medians reported.
Inputs carry an all-ones attention mask, as a tokenizer returns for an unpadded batch.
"""

from __future__ import annotations

from functools import partial

import torch
from bench_floor import floor_numbers, floor_section, linear_gemms
from common import (
    Section,
    bar_plot,
    check_parity,
    fmt_ms,
    goal_cell,
    interleaved,
    make_pair,
    random_batch,
    settle_note,
    shape_name,
)

SHAPES = [(1, 128), (8, 128), (4, 512), (1, 1536), (1, 4096)]
GOALS = {shape: 1.0 for shape in SHAPES}  # issue 14: no cell below the built-in, on every CPU
FLOOR_SHAPES = ((4, 512), (1, 4096))  # where the summary reports forward / own GEMM floor


def run(layers: int, reps: int, shapes=SHAPES) -> list[Section]:
    builtin, ours = make_pair(layers, max(8192, max(t for _, t in shapes)))
    padded_diff = check_parity(builtin, ours, random_batch(2, 64, pad=True))
    results = []
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        diff = check_parity(builtin, ours, inputs)  # the warm-up run of both
        with torch.no_grad():
            timing = interleaved(
                {
                    "builtin": partial(builtin, **inputs),
                    "ours": partial(ours, **inputs),
                    "gemm": linear_gemms(ours, batch, length),
                },
                reps=reps,
                warmup=0,
            )
        row = dict(
            batch=batch,
            length=length,
            max_abs_diff=diff,
            builtin_s=timing.median("builtin"),
            ours_s=timing.median("ours"),
            speedup=timing.ratio("builtin", "ours"),
            times=timing.times,
            settle_rounds=timing.settle_rounds,
        )
        results.append(row | floor_numbers(ours, batch, length, timing.median("gemm")))
        print(
            f"forward {shape_name(batch, length)}: built-in {fmt_ms(row['builtin_s'])} ms, "
            f"ours {fmt_ms(row['ours_s'])} ms, {row['speedup']:.2f}×",
            flush=True,
        )
    return [forward_section(results, layers, reps, padded_diff), floor_section(results)]


def forward_section(results: list[dict], layers: int, reps: int, padded_diff: float) -> Section:
    rows = []
    for r in results:
        goal = GOALS.get((r["batch"], r["length"]))
        rows.append(
            [
                shape_name(r["batch"], r["length"]),
                fmt_ms(r["builtin_s"]),
                fmt_ms(r["ours_s"]),
                f"{r['speedup']:.2f}×",
                goal_cell(r["speedup"], goal),
                f"{r['max_abs_diff']:.1e}",
            ]
        )
    labels = [shape_name(r["batch"], r["length"]) for r in results]

    def plot(path: str) -> None:
        bar_plot(
            path,
            f"Forward latency, fp32, {layers} layers × 768 (ms, log scale)",
            labels,
            {
                "built-in (eager)": [1000 * r["builtin_s"] for r in results],
                "ours (SDPA)": [1000 * r["ours_s"] for r in results],
            },
            "ms",
            log=True,
        )

    method = (
        f"Encoder forward (`RoFormerModel` vs `RoFormerRopeModel`, SDPA), fp32, `torch.no_grad`, {layers} layers of "
        f"base width; median of {reps} interleaved runs after a warm-up that is also the parity check "
        f"(max |Δ| of `last_hidden_state`; a padded 2×64 batch also checked: {padded_diff:.1e}). "
        "Speed-up = median over rounds of built-in/ours."
        + settle_note({shape_name(r["batch"], r["length"]): r["settle_rounds"] for r in results})
    )
    headers = ["B×T", "built-in ms", "ours ms", "speed-up", "goal", "max abs diff"]
    return Section("forward", "Forward latency (fp32)", method, headers, rows, plot, {"rows": results})


def main() -> None:
    from common import standalone_main

    standalone_main(run, __doc__)


if __name__ == "__main__":
    main()
