"""How far FAVOR+ attention lies from the softmax attention it estimates, as the number of features M grows.

    python scripts/experiments/favor_error.py                   # writes results/favor_error.{json,md}
    python scripts/experiments/favor_error.py --stds 0.5 --nb-features 64 1024

Random queries and keys (entries N(0, std²)) and values (N(0, 1)), N tokens, head width D, one head: exact attention
softmax(q kᵀ/√D) v in float64 against FAVOR+ (Performer's positive orthogonal random features, Lemma 1:
φ(x) = exp(W x' − |x'|²/2) / √M with x' = x · D^-1/4) through the model's own kernels
(`favor_plus_features`, `linear_attention`, float32): the relative error ‖out − exact‖ / ‖exact‖ of the whole
(N, D) output, averaged over projection seeds. The positive estimator of exp(q'ᵀk') has a relative variance of
about (exp(|q' + k'|²) − 1) / M (Performer, Lemma 2), exponential in the norms: at small std the error falls as
1/√M, at larger std it stays high even for large M. That is why a softmax-trained model run with Performer
attention without retraining loses accuracy (softmax_to_linear.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import exp_common as common
import torch

NAME = "favor_error"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stds", type=float, nargs="+", default=[0.5, 1.0], help="std of the q, k entries")
    p.add_argument("--nb-features", type=int, nargs="+", default=[64, 1024, 16384, 65536])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="projection seeds")
    p.add_argument("--out-dir", type=str, help="results folder (default: scripts/experiments/results)")
    return p.parse_args(argv)


def relative_error(std: float, nb_features: int, tokens: int, dim: int, seed: int) -> float:
    """‖FAVOR+ attention − softmax attention‖ / ‖softmax attention‖ on one draw of q, k, v (data seed 0, the same
    for every call) and one random projection (`seed`)."""
    from modeling_roformer_rope import linear_attention_roformer_rope as la

    data = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, tokens, dim, generator=data, dtype=torch.float64) for _ in range(3))  # (1, 1, N, D)
    q, k = q * std, k * std
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim), dim=-1) @ v  # (1, 1, N, D)
    W = la.gaussian_orthogonal_random_matrix(nb_features, dim, generator=torch.Generator().manual_seed(seed))  # (M, D)
    q_feat, _ = la.favor_plus_features(q.float(), W)  # (1, 1, N, M); a query's scale cancels
    k_feat, k_log_scale = la.favor_plus_features(k.float(), W)  # (1, 1, N, M), (1, 1, N)
    out = la.linear_attention(q_feat, k_feat, v.float(), k_log_scale=k_log_scale)  # (1, N, 1, D)
    out = out.transpose(1, 2).double()  # (1, 1, N, D)
    return float((out - exact).norm() / exact.norm())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = common.cpu_info()
    print(common.cpu_line(cpu), flush=True)
    clock = common.Clock()
    rows = []
    for std in args.stds:
        for m in args.nb_features:
            errors = [relative_error(std, m, args.tokens, args.head_dim, seed) for seed in args.seeds]
            rows.append({"std": std, "nb_features": m, "errors": errors, "mean": statistics.fmean(errors)})
            print(f"std {std}, M = {m}: relative error {rows[-1]['mean']:.3f} (seeds {[round(e, 3) for e in errors]})", flush=True)
    timing = clock.read()
    table = common.markdown_table(
        ["q, k entry std", *[f"M = {m}" for m in args.nb_features]],
        [[f"{std}", *[f"{r['mean']:.3f}" for r in rows if r["std"] == std]] for std in args.stds],
    )
    markdown = "\n".join([
        "# FAVOR+ attention vs the softmax attention it estimates",
        "",
        f"Relative error ‖FAVOR+ − softmax‖ / ‖softmax‖ of the attention output, {args.tokens} tokens, one head of "
        f"{args.head_dim}, q and k entries N(0, std²), v entries N(0, 1), mean over {len(args.seeds)} projection "
        "seeds; the model's kernels in float32 against exact softmax in float64. "
        f"Command: `{' '.join(['python', f'scripts/experiments/{NAME}.py', *(sys.argv[1:] if argv is None else argv)])}`.",
        "",
        table,
        "",
        f"Time: {timing['wall_seconds']:.0f} s wall.",
        "",
        common.cpu_line(cpu),
    ])  # fmt: skip
    data = {"experiment": NAME, "args": vars(args), "cpu": cpu, "timing": timing, "rows": rows}
    out_dir = common.RESULTS if args.out_dir is None else Path(args.out_dir)
    common.write_results(out_dir, NAME, data, markdown)
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
