"""The GEMM floor: the time of a model's linear layers alone, plus attention FLOPs at the measured GEMM rate.

    python bench/bench_floor.py --layers 4            # 4×512 and 1×4096, prints the table

floor(B, T) = t_linear + attention_FLOPs / (linear_FLOPs / t_linear)

`t_linear` runs exactly the forward's nn.Linear GEMMs (same weights, same M×K×N, output allocated as in
the model) on random inputs, interleaved with the model forward it is the floor of. A forward can only
beat the floor by skipping work; the ratio forward / floor says how much time goes to everything that
is not a GEMM (attention softmax, rotary, norms, masks, copies, Python).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from common import Section, attention_flops, fmt_ms, goal_cell, make_pair, random_batch, shape_name

FLOOR_GOAL = 1.15  # issue 14: fp32 forward ≤ 1.15× its own GEMM floor at 4×512 and 1×4096


def encoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Linear layers applied to every token (the pooler sees only [CLS] and is left out)."""
    return [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "pooler" not in name]


def linear_gemms(model: torch.nn.Module, batch: int, length: int) -> Callable[[], None]:
    """A callable running the model's per-token GEMMs once, in forward order, on random activations (in the
    model's dtype: a bf16 model's floor is its bf16 GEMMs)."""
    linears = encoder_linears(model)
    tokens = batch * length
    dtype = linears[0].weight.dtype
    inputs = {m.in_features: torch.randn(tokens, m.in_features, dtype=dtype) for m in linears}

    @torch.no_grad()
    def run() -> None:
        for m in linears:
            m(inputs[m.in_features])  # the module's own forward: oneDNN for RoFormerRopeLinear, BLAS for nn.Linear

    return run


def floor_numbers(model: torch.nn.Module, batch: int, length: int, t_linear: float) -> dict[str, float]:
    flops = sum(2.0 * batch * length * m.in_features * m.out_features for m in encoder_linears(model))
    rate = flops / t_linear
    t_attention = attention_flops(model.config, batch, length) / rate
    return {"gemm_s": t_linear, "gflops": rate / 1e9, "attention_s": t_attention, "floor_s": t_linear + t_attention}


def floor_section(results: list[dict]) -> Section:
    """results: dicts with batch, length, ours_s, builtin_s and the floor_numbers of our model."""
    rows, labels, series = [], [], {"linear GEMMs": [], "+ attention FLOPs": [], "ours": [], "built-in": []}
    for r in results:
        ratio = r["ours_s"] / r["floor_s"]
        goal = FLOOR_GOAL if (r["batch"], r["length"]) in ((4, 512), (1, 4096)) else None
        rows.append(
            [
                shape_name(r["batch"], r["length"]),
                f"{r['gflops']:.0f}",
                fmt_ms(r["gemm_s"]),
                fmt_ms(r["attention_s"]),
                fmt_ms(r["floor_s"]),
                fmt_ms(r["ours_s"]),
                f"{ratio:.2f}×",
                f"{r['builtin_s'] / r['floor_s']:.2f}×",
                goal_cell(ratio, goal, higher_is_better=False),
            ]
        )
        labels.append(shape_name(r["batch"], r["length"]))
        series["linear GEMMs"].append(1000 * r["gemm_s"])
        series["+ attention FLOPs"].append(1000 * r["floor_s"])
        series["ours"].append(1000 * r["ours_s"])
        series["built-in"].append(1000 * r["builtin_s"])

    def plot(path: str) -> None:
        from common import bar_plot

        bar_plot(path, "Forward vs its GEMM floor (fp32, ms, log scale)", labels, series, "ms", log=True)

    method = (
        "Floor = time of our model's own per-token linear GEMMs (run alone on random activations, same "
        "weights and shapes, interleaved with the forwards) + attention FLOPs (QKᵀ and PV, 4·B·T²·C per layer) "
        "at the GEMM rate just measured. Ratios: forward time / floor (1.00× = nothing but GEMMs)."
    )
    headers = [
        "B×T",
        "GEMM GFLOP/s",
        "linear GEMMs ms",
        "attention @ GEMM rate ms",
        "floor ms",
        "ours ms",
        "ours / floor",
        "built-in / floor",
        "goal",
    ]
    return Section("floor", "Forward vs the GEMM floor", method, headers, rows, plot, {"rows": results})


def main() -> None:
    from common import interleaved

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    builtin, ours = make_pair(args.layers, 4096)
    results = []
    for batch, length in ((4, 512), (1, 4096)):
        inputs = random_batch(batch, length)
        with torch.no_grad():
            timing = interleaved(
                {
                    "builtin": partial(builtin, **inputs),
                    "ours": partial(ours, **inputs),
                    "gemm": linear_gemms(ours, batch, length),
                },
                reps=args.reps,
            )
        row = dict(batch=batch, length=length, ours_s=timing.median("ours"), builtin_s=timing.median("builtin"))
        results.append(row | floor_numbers(ours, batch, length, timing.median("gemm")))
    print(floor_section(results).markdown())


if __name__ == "__main__":
    main()
