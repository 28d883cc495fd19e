"""RoFormer vs a same-size BERT (learned absolute positions): the paper's Figure 3 (left) in miniature.

    python scripts/experiments/rope_vs_bert.py            # ~15 + 30 min of CPU time on a loaded 2-core AVX2 machine
    python scripts/experiments/rope_vs_bert.py --quick    # 1-minute smoke run (written under /tmp)

Two runs of `roformer-rope pretrain` with the same stage YAML except `architecture` (roformer / bert): same
People's Daily 1998 lines, same held-out slice, same vocabulary (the BERT run gets the RoFormer run's
vocab.txt through `--vocab`), same stages, steps, batches, learning rates, masks and seed. Then both exported
models are evaluated on the held-out slice with identical sequences and whole-word masks, at the stage
lengths; the RoFormer also at 2x and 4x its training length L (the held-out stream packed at 2L and 4L),
where BERT cannot run: its learned position table ends at L.

Writes `results/rope_vs_bert.{json,md,png}`. The pretraining runs live in `results/models/runs/` and the two
exported folders in `results/models/roformer` and `results/models/bert` (used by the fine-tuning table; not
committed). An existing exported folder is reused (the evaluation reruns) unless `--retrain`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import exp_common as common

NAME = "rope_vs_bert"
ARCHS = ("roformer", "bert")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, help="results folder (default: scripts/experiments/results, or /tmp/... with --quick)")
    p.add_argument("--models-dir", type=Path, help="where runs and exported models go (default: OUT_DIR/models)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab-words", type=int, default=4000, help="jieba words in the vocabulary (plus characters and ## pieces)")
    p.add_argument("--held-out-lines", type=int, default=1000)
    p.add_argument("--eval-sequences", type=int, default=128, help="held-out sequences of the per-stage evaluation in the runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short-length", type=int, default=128)
    p.add_argument("--short-batch", type=int, default=16)
    p.add_argument("--short-steps", type=int, default=400)
    p.add_argument("--short-lr", type=float, default=1e-3)
    p.add_argument("--long-length", type=int, default=512, help="the training length L (0: single-stage run)")
    p.add_argument("--long-batch", type=int, default=4)
    p.add_argument("--long-steps", type=int, default=60)
    p.add_argument("--long-lr", type=float, default=5e-4)
    p.add_argument("--deepspeed", default="zero2")
    p.add_argument("--corpus-lines", type=int, help="use only the first N corpus lines (smoke runs)")
    p.add_argument("--smooth", type=int, default=25, help="moving-average window of the plotted training loss")
    p.add_argument("--retrain", action="store_true", help="train again even if the exported models exist")
    p.add_argument("--quick", action="store_true", help="tiny model and budget: a 1-minute smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate = 2, 64, 2, 128
        args.vocab_words, args.held_out_lines, args.eval_sequences, args.corpus_lines = 500, 100, 16, 1500
        args.short_steps, args.long_steps, args.short_batch, args.long_batch = 12, 4, 8, 4
        args.long_length, args.smooth = 256, 3
    args.out_dir = args.out_dir or (common.QUICK_RESULTS if args.quick else common.RESULTS)
    args.models_dir = args.models_dir or args.out_dir / "models"
    return args


def stage_yaml(args: argparse.Namespace, architecture: str) -> dict:
    stages = [{"name": "short", "max_length": args.short_length, "global_batch": args.short_batch,
               "steps": args.short_steps, "lr": args.short_lr, "warmup_steps": max(1, args.short_steps // 10)}]
    if args.long_length:
        stages.append({"name": "long", "max_length": args.long_length, "global_batch": args.long_batch,
                       "steps": args.long_steps, "lr": args.long_lr, "warmup_steps": max(1, args.long_steps // 10)})
    return {
        "architecture": architecture,
        "model": {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
                  "intermediate_size": args.intermediate, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "data": {"held_out_lines": args.held_out_lines, "vocab_words": args.vocab_words, "eval_sequences": args.eval_sequences},
        "train": {"seed": args.seed, "micro_batch": args.short_batch, "weight_decay": 0.01, "checkpoint_every": 10**6,
                  "log_every": 10, "keep_checkpoints": 1},
        "stages": stages,
    }  # fmt: skip


def pretrain(args: argparse.Namespace, architecture: str) -> dict:
    """Run (or reuse) one pretraining run; returns its timing. The export is copied to MODELS/<architecture>."""
    runs = args.models_dir / "runs"
    run_dir, model_dir = runs / architecture, args.models_dir / architecture
    if model_dir.is_dir() and (run_dir / "train_log.jsonl").is_file() and not args.retrain:
        print(f"{architecture}: reusing {model_dir} (pass --retrain to train again)")
        saved = run_dir / "experiment_timing.json"
        return json.loads(saved.read_text()) if saved.is_file() else {}
    if args.retrain:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
    runs.mkdir(parents=True, exist_ok=True)
    import yaml

    config_file = runs / f"{architecture}.yaml"
    config_file.write_text(yaml.safe_dump(stage_yaml(args, architecture), sort_keys=False))
    command = [sys.executable, "-m", "roformer_rope.scripts.pretrain", "--config", str(config_file),
               "--deepspeed", args.deepspeed, "--out", str(run_dir)]  # fmt: skip
    if architecture != "roformer":  # exactly the RoFormer run's vocabulary
        command += ["--vocab", str(runs / "roformer" / "tokenizer" / "vocab.txt")]
    if args.corpus_lines:
        command += ["--corpus-lines", str(args.corpus_lines)]
    if (run_dir / "checkpoints" / "latest").is_file():
        command.append("--resume")  # an interrupted run continues exactly where it stopped
    elif run_dir.exists():
        shutil.rmtree(run_dir)
    print("+", " ".join(command), flush=True)
    clock = common.Clock()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    timing = clock.read()
    shutil.copytree(run_dir / "model", model_dir, dirs_exist_ok=True)
    (run_dir / "experiment_timing.json").write_text(json.dumps(timing))
    return timing


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]


def evaluate(args: argparse.Namespace) -> dict:
    """Held-out MLM loss / accuracy of both exports: same sequences and masks at every length."""
    import numpy as np
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from roformer_rope.scripts import mlm_data

    runs = args.models_dir / "runs"
    streams = {arch: mlm_data.TokenStream.load(runs / arch / "data" / "held_out") for arch in ARCHS}
    if not np.array_equal(streams["roformer"].tokens, streams["bert"].tokens):
        raise RuntimeError("the two runs' held-out token streams differ: they did not share the vocabulary")
    stream = streams["roformer"]
    tokenizer = AutoTokenizer.from_pretrained(args.models_dir / "roformer", trust_remote_code=True)
    if tokenizer.get_vocab() != AutoTokenizer.from_pretrained(args.models_dir / "bert", trust_remote_code=True).get_vocab():
        raise RuntimeError("the exported tokenizers differ")
    train_length = args.long_length or args.short_length
    lengths = sorted({args.short_length, train_length, 2 * train_length, 4 * train_length})
    results: dict[str, dict] = {}
    for arch in ARCHS:
        model = AutoModelForMaskedLM.from_pretrained(args.models_dir / arch, trust_remote_code=True)
        positions = model.config.max_position_embeddings
        results[arch] = {"parameters": sum(p.numel() for p in model.parameters()), "max_positions": positions,
                         "class": type(model).__name__, "by_length": {}}  # fmt: skip
        for length in lengths:
            if arch == "bert" and length > positions:
                results[arch]["by_length"][str(length)] = None  # no position embedding past its table
                continue
            split = train_length if length > train_length else None
            metrics = common.mlm_evaluate(model, stream, tokenizer, length, seed=args.seed, split_at=split)
            results[arch]["by_length"][str(length)] = metrics
            print(f"{arch} @ {length}: loss {metrics['loss']:.3f}, accuracy {metrics['accuracy']:.1%} "
                  f"({metrics['masked_tokens']} masked tokens)", flush=True)  # fmt: skip
    return {"train_length": train_length, "lengths": lengths, "held_out_tokens": stream.num_tokens, "models": results}


def plot(args: argparse.Namespace, logs: dict[str, list[dict]], evaluation: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"roformer": "tab:red", "bert": "tab:blue"}
    labels = {"roformer": "RoFormer (RoPE)", "bert": "BERT (learned absolute positions)"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for arch, log in logs.items():
        steps = [r["global_step"] for r in log]
        losses = [r["loss"] for r in log]
        left.plot(steps, losses, color=colors[arch], alpha=0.15, linewidth=0.7)
        left.plot(steps, common.smooth(losses, args.smooth), color=colors[arch], label=labels[arch])
    if args.long_length:
        left.axvline(args.short_steps, color="gray", linestyle=":", linewidth=1)
        left.text(args.short_steps, left.get_ylim()[1], f" length {args.short_length} → {args.long_length}",
                  va="top", fontsize=8, color="gray")  # fmt: skip
    left.set_xlabel("training step")
    left.set_ylabel(f"MLM training loss (moving average of {args.smooth})")
    left.set_title("Pretraining on People's Daily 1998 (same data, vocabulary, steps, seed)")
    left.legend()
    left.grid(alpha=0.3)
    train_length = evaluation["train_length"]
    for arch in ARCHS:
        points = [(int(n), m["loss"]) for n, m in evaluation["models"][arch]["by_length"].items() if m]
        right.plot(*zip(*points), marker="o", color=colors[arch], label=labels[arch])
    right.axvline(train_length, color="gray", linestyle=":", linewidth=1)
    right.set_xscale("log", base=2)
    right.set_xticks(evaluation["lengths"], [str(n) for n in evaluation["lengths"]])
    right.set_xlabel("held-out sequence length (tokens)")
    right.set_ylabel("held-out MLM loss")
    right.set_title(f"Held-out MLM loss vs length (trained up to L = {train_length})", fontsize=10)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args: argparse.Namespace, cpu: dict, timings: dict, logs: dict, evaluation: dict) -> str:
    train_length = evaluation["train_length"]
    rows = []
    for length in evaluation["lengths"]:
        row = [f"{length}" + (" (L)" if length == train_length else f" ({length // train_length}L)" if length > train_length else "")]
        for arch in ARCHS:
            m = evaluation["models"][arch]["by_length"][str(length)]
            if m is None:
                row += [f"n/a ({evaluation['models'][arch]['max_positions']} positions)", "n/a"]
            else:
                row += [f"{m['loss']:.3f}", f"{m['accuracy']:.1%}"]
        m = evaluation["models"]["roformer"]["by_length"][str(length)]
        row.append(m["masked_tokens"])
        split = f"before_{train_length}_"
        row.append(f"{m[split + 'loss']:.3f} / {m[f'after_{train_length}_loss']:.3f}" if split + "loss" in m else "")
        rows.append(row)
    headers = ["held-out length", "RoFormer loss", "RoFormer acc", "BERT loss", "BERT acc", "masked tokens",
               f"RoFormer loss, positions < {train_length} / ≥ {train_length}"]  # fmt: skip
    table = common.markdown_table(headers, rows)
    final = {arch: sum(r["loss"] for r in log[-args.smooth:]) / len(log[-args.smooth:]) for arch, log in logs.items()}
    stages = " then ".join(f"{s['steps']} steps × {s['global_batch']} × {s['max_length']} tokens (lr {s['lr']:g})"
                           for s in stage_yaml(args, "roformer")["stages"])  # fmt: skip
    m = evaluation["models"]
    lines = [
        f"# RoFormer vs BERT (learned absolute positions), MLM pretraining{' (QUICK smoke run)' if args.quick else ''}",
        "",
        f"Model: {args.layers} layers × {args.hidden} wide, {args.heads} heads, FFN {args.intermediate}; "
        f"RoFormer {m['roformer']['parameters'] / 1e6:.2f}M parameters, BERT {m['bert']['parameters'] / 1e6:.2f}M "
        f"(+{m['bert']['max_positions']} learned positions); shared vocabulary of "
        f"{json.loads((args.models_dir / 'roformer' / 'config.json').read_text())['vocab_size']} tokens. "
        f"Stages: {stages}; seed {args.seed}, ZeRO ({args.deepspeed}), fp32, whole-word masking 15%.",
        "",
        "Held-out MLM (the last held-out lines of People's Daily, packed at each length; same sequences and masks "
        "for both models):",
        "",
        table,
        "",
        f"Training loss over the last {args.smooth} steps: RoFormer {final['roformer']:.3f}, BERT {final['bert']:.3f}.",
    ]
    for arch in ARCHS:
        t = timings.get(arch) or {}
        if t:
            lines.append(f"{arch} run: {t['wall_seconds'] / 60:.1f} min wall, {t['cpu_seconds'] / 60:.1f} min CPU (shared machine).")
    lines += ["", common.cpu_line(cpu), "", f"![loss curves]({NAME}.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = common.cpu_info()
    print(common.cpu_line(cpu), flush=True)
    timings = {arch: pretrain(args, arch) for arch in ARCHS}
    logs = {arch: read_log(args.models_dir / "runs" / arch) for arch in ARCHS}
    evaluation = evaluate(args)
    stage_tables = {arch: json.loads((args.models_dir / "runs" / arch / "stage_table.json").read_text()) for arch in ARCHS}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"{NAME}.png"
    common.save_plot(lambda: plot(args, logs, evaluation, png), png)
    markdown = report(args, cpu, timings, logs, evaluation)
    data = {
        "experiment": NAME,
        "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": stage_yaml(args, "roformer"),
        "cpu": cpu,
        "timings": timings,
        "evaluation": evaluation,
        "stage_tables": stage_tables,
        "train_loss": {arch: [[r["global_step"], r["loss"]] for r in log] for arch, log in logs.items()},
        "models": {arch: str(args.models_dir / arch) for arch in ARCHS},
    }
    common.write_results(args.out_dir, NAME, data, markdown)
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
