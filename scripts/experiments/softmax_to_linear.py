"""A softmax-pretrained RoFormer run with Performer (FAVOR+) or eq. 19 linear attention, without any training.

    python scripts/experiments/softmax_to_linear.py          # uses results/models/roformer (rope_vs_bert.py)
    python scripts/experiments/softmax_to_linear.py --model path/to/roformer_rope_mlm --lengths 128 512
    python scripts/experiments/softmax_to_linear.py --quick  # 1-minute smoke run on the --quick model

The same weights are loaded with `attention_type="performer"` (`performer_nb_features` M in `--nb-features`,
both `performer_rope_placement`s, each with `--projection-seeds` independent random projections drawn by
`redraw_features`) and with `attention_type="linear"` (eq. 19, φ = elu + 1 and relu), and evaluated on the
held-out slice of the pretraining corpus (the last `--held-out-lines` lines of People's Daily, as in
pretraining) with exactly the masks the softmax original is evaluated with: masked-token loss and accuracy.

What to expect: FAVOR+ with RoPE *before* the feature map is an unbiased estimate of the very softmax
attention the model was trained with (its error shrinks as M grows); the "numerator" placement rotates the
M-dimensional features instead, a different position kernel the model never saw; eq. 19 linear attention
replaces exp(qᵀk/√d) by φ(q)ᵀφ(k), a different function altogether.

Writes `results/softmax_to_linear.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import exp_common as common
import torch

NAME = "softmax_to_linear"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a roformer_rope MLM folder trained with softmax attention "
                   "(default: RESULTS/models/roformer, made by rope_vs_bert.py)")  # fmt: skip
    p.add_argument("--out-dir", type=Path, help="results folder (default: scripts/experiments/results, or /tmp/... with --quick)")
    p.add_argument("--held-out-lines", type=int, default=1000, help="as in the model's pretraining (rope_vs_bert.py: 1000)")
    p.add_argument("--corpus-lines", type=int, help="as in the model's pretraining, if it used only the first N lines")
    p.add_argument("--lengths", type=int, nargs="+", default=[512], help="packed held-out lengths to evaluate")
    p.add_argument("--nb-features", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--placements", nargs="+", default=["before_features", "numerator"], choices=["before_features", "numerator"])
    p.add_argument("--projection-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--feature-maps", nargs="+", default=["elu", "relu"], choices=["elu", "relu"], help="eq. 19 feature maps")
    p.add_argument("--seed", type=int, default=0, help="mask seed")
    p.add_argument("--max-sequences", type=int, help="evaluate only the first N packed held-out sequences")
    p.add_argument("--quick", action="store_true", help="the --quick model of rope_vs_bert.py, few settings")
    args = p.parse_args(argv)
    if args.quick:
        args.nb_features, args.projection_seeds, args.lengths, args.max_sequences = [16, 64], [0], [128], 16
        args.held_out_lines, args.corpus_lines = 100, 1500
    args.out_dir = args.out_dir or (common.QUICK_RESULTS if args.quick else common.RESULTS)
    args.model = args.model or args.out_dir / "models" / "roformer"
    return args


def load(path: Path, **overrides):
    """The folder's weights in our RoFormerRopeForMaskedLM, config fields overridden (sparse MLM head for speed)."""
    from transformers.utils import logging as hf_logging

    from modeling_roformer_rope import RoFormerRopeForMaskedLM

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the Performer's projection is not in a softmax checkpoint: expected
    try:
        model = RoFormerRopeForMaskedLM.from_pretrained(path, sparse_prediction=True, **overrides)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def same_weights(a, b) -> bool:
    """Every parameter of `a` equals `b`'s (the Performer's extra projection buffer aside)."""
    pb = dict(b.named_parameters())
    return all(torch.equal(p, pb[name]) for name, p in a.named_parameters())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    cpu = common.cpu_info()
    print(common.cpu_line(cpu), flush=True)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model folder (run rope_vs_bert.py first, or pass --model)")
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    clock = common.Clock()
    with tempfile.TemporaryDirectory() as tmp:
        stream = common.held_out_stream(tokenizer, args.held_out_lines, Path(tmp) / "held_out", args.corpus_lines)
        base = load(args.model)
        if base.config.attention_type != "softmax":
            raise SystemExit(f"{args.model}: attention_type is {base.config.attention_type!r}, expected a softmax model")

        def evaluate(model) -> dict[str, dict]:
            return {str(n): common.mlm_evaluate(model, stream, tokenizer, n, seed=args.seed, sparse=True,
                                                max_sequences=args.max_sequences) for n in args.lengths}  # fmt: skip

        rows: list[dict] = []
        softmax = evaluate(base)
        rows.append({"attention": "softmax (as trained)", "kind": "softmax", "metrics": softmax})
        print("softmax:", {n: f"{m['accuracy']:.1%}" for n, m in softmax.items()}, flush=True)
        for feature_map in args.feature_maps:
            model = load(args.model, attention_type="linear", linear_feature_map=feature_map)
            assert same_weights(model, base), "the linear model did not load the softmax weights"
            metrics = evaluate(model)
            rows.append({"attention": f"linear eq. 19, φ = {'elu + 1' if feature_map == 'elu' else 'relu'}",
                         "kind": "linear", "feature_map": feature_map, "metrics": metrics})  # fmt: skip
            print(f"linear {feature_map}:", {n: f"{m['accuracy']:.1%}" for n, m in metrics.items()}, flush=True)
        for placement in args.placements:
            for m in args.nb_features:
                per_seed = []
                for seed in args.projection_seeds:
                    model = load(args.model, attention_type="performer", performer_nb_features=m,
                                 performer_rope_placement=placement)  # fmt: skip
                    model.redraw_features(torch.Generator().manual_seed(seed))
                    assert same_weights(model, base), "the performer model did not load the softmax weights"
                    per_seed.append(evaluate(model))
                    print(f"performer {placement} M={m} seed {seed}:",
                          {n: f"{r['accuracy']:.1%}" for n, r in per_seed[-1].items()}, flush=True)  # fmt: skip
                summary = {}
                for n in map(str, args.lengths):
                    accs, losses = [r[n]["accuracy"] for r in per_seed], [r[n]["loss"] for r in per_seed]
                    summary[n] = {
                        "accuracy": statistics.fmean(accs), "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                        "loss": statistics.fmean(losses), "loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                        "accuracy_per_seed": accs, "loss_per_seed": losses, "masked_tokens": per_seed[0][n]["masked_tokens"],
                    }  # fmt: skip
                rows.append({"attention": f"Performer, RoPE {'before features' if placement == 'before_features' else 'in numerator'}, M = {m}",
                             "kind": "performer", "placement": placement, "nb_features": m, "metrics": summary})  # fmt: skip
    timing = clock.read()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"{NAME}.png"
    common.save_plot(lambda: plot(rows, args, png), png)
    markdown = report(rows, args, cpu, base, timing)
    data = {"experiment": NAME, "quick": args.quick, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cpu": cpu, "timing": timing, "held_out_tokens": stream.num_tokens, "rows": rows}  # fmt: skip
    common.write_results(args.out_dir, NAME, data, markdown)
    print("\n" + markdown)
    return 0


def report(rows: list[dict], args: argparse.Namespace, cpu: dict, base, timing: dict) -> str:
    lengths = list(map(str, args.lengths))
    softmax = rows[0]["metrics"]
    table_rows = []
    for row in rows:
        cells = [row["attention"]]
        for n in lengths:
            m = row["metrics"][n]
            std = f" ± {m['accuracy_std']:.1%}" if "accuracy_std" in m and len(args.projection_seeds) > 1 else ""
            cells += [f"{m['loss']:.3f}", f"{m['accuracy']:.1%}{std}", f"{m['accuracy'] / softmax[n]['accuracy']:.0%}"]
        table_rows.append(cells)
    headers = ["attention (no further training)"]
    for n in lengths:
        headers += [f"MLM loss @ {n}", f"accuracy @ {n}", "kept"]
    table = common.markdown_table(headers, table_rows)
    c = base.config
    lines = [
        f"# Softmax-pretrained RoFormer run with linear attention, no further training{' (QUICK smoke run)' if args.quick else ''}",
        "",
        f"Model: `{args.model}` ({c.num_hidden_layers} layers × {c.hidden_size}, {c.num_attention_heads} heads of "
        f"{c.head_dim}, vocabulary {c.vocab_size}), pretrained with softmax attention. Held-out: the last "
        f"{args.held_out_lines} lines of People's Daily 1998, packed at {', '.join(lengths)} tokens "
        f"({softmax[lengths[0]]['masked_tokens']:,} masked tokens at {lengths[0]}), whole-word masks with seed "
        f"{args.seed}: the same masks for every row. Performer rows: mean ± std over {len(args.projection_seeds)} "
        f"random projections. \"kept\" = accuracy / softmax accuracy.",
        "",
        table,
        "",
        f"Evaluation time: {timing['wall_seconds'] / 60:.1f} min wall, {timing['cpu_seconds'] / 60:.1f} min CPU.",
        "",
        common.cpu_line(cpu),
        "",
        f"![accuracy vs features]({NAME}.png)",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(map(str, args.lengths))
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for placement, color in (("before_features", "tab:red"), ("numerator", "tab:orange")):
            points = [(r["nb_features"], r["metrics"][n]) for r in rows if r.get("placement") == placement]
            if points:
                xs = [x for x, _ in points]
                ax.errorbar(xs, [100 * m["accuracy"] for _, m in points], yerr=[100 * m["accuracy_std"] for _, m in points],
                            marker="o", capsize=3, color=color,
                            label=f"Performer, RoPE {'before features' if placement == 'before_features' else 'in numerator'}")  # fmt: skip
        ax.axhline(100 * rows[0]["metrics"][n]["accuracy"], color="black", label="softmax (as trained)")
        for row, style in zip([r for r in rows if r["kind"] == "linear"], ("--", ":")):
            ax.axhline(100 * row["metrics"][n]["accuracy"], color="tab:blue", linestyle=style, label=row["attention"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.nb_features, [str(m) for m in args.nb_features])
        ax.set_xlabel("random features per head (M)")
        ax.set_ylabel("held-out masked-token accuracy (%)")
        ax.set_title(f"Softmax-trained RoFormer, attention swapped, no training (length {n})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
