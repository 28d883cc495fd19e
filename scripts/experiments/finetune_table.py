"""The fine-tuning results table: pretrained RoFormer vs pretrained BERT vs no pretraining.

    python scripts/experiments/finetune_table.py --roformer pretrain-out/roformer --bert pretrain-out/bert \
        --out finetune-table                       # full budget, 3 seeds
    python scripts/experiments/finetune_table.py --budget reduced --out finetune-table-reduced   # row (c) only
    python scripts/experiments/finetune_table.py ... --dry-run                                   # print the runs

Rows:
  (a) roformer  `--roformer DIR`: our pretrained small RoFormer (a `roformer_rope` folder)
  (b) bert      `--bert DIR`: the same-size BERT pretrained identically (`model_type: bert` + our tokenizer)
  (c) scratch   no pretraining: `--roformer`'s config and tokenizer with random weights
                (`finetune --model DIR --random_init`), or without `--roformer` a fresh RoFormer of
                `--scratch-layers` x `--scratch-hidden` with a vocabulary built from each task's train split
Columns: sentiment test accuracy, ner test entity F1, long test accuracy at max length 512 and 1024
(all pairs, and the pairs longer than 512 tokens). Every row gets the same budget (`BUDGETS`: examples,
epochs, batch, early stopping), the same learning rate(s) and the same seeds; each cell is mean ± sample
standard deviation over the seeds (min and max in the JSON). With several `--lrs`, every row and column
runs each of them and reports the test score of the one with the best mean dev score (test never chooses).

Each run is `python -m roformer_rope.scripts.finetune TASK ...` in its own process, writing
`OUT/runs/ROW-COLUMN-seedS/`; runs whose `finetune_results.json` exists and were made with the same flags
and the same model files (a content hash of the `--model` folder) are reused (rerunning the command resumes;
`--rerun` forces). The table goes to `OUT/table.md` and `OUT/table.json`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# column -> (task, extra finetune flags, metric keys in test results)
COLUMNS: dict[str, tuple[str, list[str]]] = {
    "sentiment": ("sentiment", []),
    "ner": ("ner", []),
    "long512": ("long", ["--max_length", "512"]),
    "long1024": ("long", ["--max_length", "1024"]),
}
# what goes in the table: (column, test metric key, header)
CELLS = [
    ("sentiment", "accuracy", "sentiment acc"),
    ("ner", "f1", "NER entity F1"),
    ("long512", "accuracy", "long-512 acc"),
    ("long1024", "accuracy", "long-1024 acc"),
    ("long512", "accuracy_long", "long-512 acc, pairs >512 tok"),
    ("long1024", "accuracy_long", "long-1024 acc, pairs >512 tok"),
]
ROW_NAMES = {"roformer": "(a) RoFormer, pretrained", "bert": "(b) BERT, pretrained", "scratch": "(c) no pretraining"}

# Same for every row. `full`: all training data; `reduced`: a subset, for a check on a busy CPU.
BUDGETS: dict[str, dict[str, list[str]]] = {
    "full": {
        "sentiment": ["--num_train_epochs", "3", "--per_device_train_batch_size", "32", "--max_eval_samples", "1000"],
        "ner": ["--num_train_epochs", "3", "--per_device_train_batch_size", "32", "--max_eval_samples", "1000"],
        "long": ["--num_train_epochs", "3", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16"],
    },
    "reduced": {
        "sentiment": ["--max_train_samples", "4000", "--num_train_epochs", "2", "--per_device_train_batch_size", "32",
                      "--max_eval_samples", "500", "--max_length", "96"],
        "ner": ["--max_train_samples", "4000", "--num_train_epochs", "2", "--per_device_train_batch_size", "32",
                "--max_eval_samples", "500"],
        "long": ["--max_train_samples", "800", "--num_train_epochs", "2", "--per_device_train_batch_size", "8",
                 "--per_device_eval_batch_size", "16", "--max_eval_samples", "200"],
    },
}  # fmt: skip
COMMON = ["--early_stopping_patience", "3", "--verify_reload", "False", "--show_examples", "1"]


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def row_flags(row: str, args: argparse.Namespace) -> list[str]:
    if row == "roformer":
        return ["--model", args.roformer]
    if row == "bert":
        return ["--model", args.bert]
    if args.roformer:
        return ["--model", args.roformer, "--random_init"]
    return ["--hidden_size", str(args.scratch_hidden), "--num_hidden_layers", str(args.scratch_layers),
            "--num_attention_heads", str(max(1, args.scratch_hidden // 64)),
            "--intermediate_size", str(4 * args.scratch_hidden)]  # fmt: skip


def skip_reason(row: str, column: str, args: argparse.Namespace) -> str | None:
    """Why a cell cannot be run: BERT's learned absolute positions end at max_position_embeddings."""
    if row != "bert" or not column.startswith("long"):
        return None
    positions = json.loads((Path(args.bert) / "config.json").read_text()).get("max_position_embeddings")
    length = int(COLUMNS[column][1][1])
    return f"n/a ({positions} positions)" if positions and length > positions else None


COMMAND_FILE = "table_command.json"  # written into each run folder after its run


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack")


def folder_fingerprint(folder: str, weights: bool = True) -> str:
    """SHA-256 over what a model folder holds (config, tokenizer files and, unless `weights=False`, the weights;
    not its README or copied code): a model retrained into the same path gives another fingerprint, so its old
    runs are not reused. Row (c) (`--random_init`) reads only the config and the tokenizer."""
    root = Path(folder)
    files = [
        path for path in (sorted(root.iterdir()) if root.is_dir() else [])
        if path.is_file() and path.name != "README.md" and path.suffix != ".py"
        and (weights or not path.name.endswith(WEIGHT_SUFFIXES))
    ]  # fmt: skip
    stats = tuple((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files)
    return _hash_files(stats)


@functools.cache  # every cell of a row has the same model: hashed once while its files stay
def _hash_files(stats: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stats:
        digest.update(Path(name).name.encode() + b"\0")
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def run_key(command: list[str]) -> str:
    """What makes two runs of a cell the same: the finetune flags, without the interpreter and the run's own
    folder, with `--model` as a path relative to the working directory (however it was spelt) followed by the
    folder's content fingerprint (the same path may hold a retrained model)."""
    flags, key = command[1:], []
    for i, flag in enumerate(flags):
        previous = flags[i - 1] if i else None
        if flag == "--output_dir" or previous == "--output_dir":
            continue
        if previous == "--model":
            folder = os.path.abspath(os.path.expanduser(flag))
            key += [os.path.relpath(folder), folder_fingerprint(folder, weights="--random_init" not in flags)]
        else:
            key.append(flag)
    return json.dumps(key)


def run_command(row: str, column: str, seed: int, lr: str, args: argparse.Namespace, out: Path) -> list[str]:
    task, column_flags = COLUMNS[column]
    return [
        sys.executable, "-m", "roformer_rope.scripts.finetune", task,
        *row_flags(row, args), *COMMON, *BUDGETS[args.budget][task], *column_flags, "--learning_rate", lr,
        "--seed", str(seed), "--output_dir", str(out), "--overwrite", "--disable_tqdm", "True", *args.extra,
    ]  # fmt: skip


def summarise(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def choose_lr(results: dict, row: str, column: str, args: argparse.Namespace) -> str:
    """The learning rate with the best mean dev score over the seeds (the only one with one lr)."""
    metric = next(key for c, key, _ in CELLS if c == column)
    dev = {lr: statistics.fmean(results[f"{row}-{column}-lr{lr}-seed{s}"]["dev"][metric] for s in args.seeds) for lr in args.lrs}
    return max(args.lrs, key=lambda lr: dev[lr])


def markdown(table: dict, args: argparse.Namespace) -> str:
    headers = [header for _, _, header in CELLS]
    lines = ["| model | " + " | ".join(headers) + " |", "|---|" + "---|" * len(headers)]
    for row, cells in table["rows"].items():
        shown = []
        for column, key, _ in CELLS:
            cell = cells.get(f"{column}.{key}")
            fallback = table["skipped"].get(f"{row}-{column}", "–")
            shown.append(f"{100 * cell['mean']:.1f} ± {100 * cell['std']:.1f}" if cell else fallback)
        lines.append(f"| {ROW_NAMES[row]} | " + " | ".join(shown) + " |")
    info = table["info"]
    lines += [
        "",
        f"Test-set scores in %, mean ± sample standard deviation over seeds {info['seeds']} "
        f"(budget `{info['budget']}`, learning rate {info['lr_note']}; {info['cpu']}, {info['threads']} thread(s), "
        f"runs {info['run_minutes']:.0f} min in total).",
        "Command: `" + info["command"] + "`",
    ]
    n_long = table.get("n_long")
    if n_long:
        lines.append(f"Long test set: {n_long['all']} pairs, {n_long['long']} longer than 512 tokens (row (c) tokenizer).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roformer", help="row (a): pretrained roformer_rope folder")
    parser.add_argument("--bert", help="row (b): pretrained BERT folder (model_type bert, our tokenizer)")
    parser.add_argument("--no-scratch", action="store_true", help="skip row (c)")
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", choices=list(BUDGETS), default="full")
    parser.add_argument(
        "--lrs", nargs="+", default=["5e-4"],
        help="learning rates; with several, each row and column uses the one with the best mean dev score",
    )  # fmt: skip
    parser.add_argument("--scratch-layers", type=int, default=4, help="row (c) without --roformer")
    parser.add_argument("--scratch-hidden", type=int, default=256, help="row (c) without --roformer")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for each run (1 is fastest on a busy machine)")
    parser.add_argument("--out", default="finetune-table")
    parser.add_argument("--rerun", action="store_true", help="ignore finished runs")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags appended to every finetune run")
    args = parser.parse_args(argv)

    rows = [row for row, on in (("roformer", args.roformer), ("bert", args.bert), ("scratch", not args.no_scratch)) if on]
    if not rows:
        parser.error("nothing to run: give --roformer and/or --bert, or leave row (c) on")
    for flag in ("roformer", "bert"):
        folder = getattr(args, flag)
        if folder and not Path(folder).is_dir():
            print(f"finetune_table: error: --{flag} {folder}: no such folder", file=sys.stderr)
            return 2
    out = Path(args.out)
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.monotonic()
    results: dict[str, dict] = {}  # "row-column-lrLR-seedS" -> finetune_results.json
    skipped = {}
    for row in rows:
        for column in args.columns:
            if skip_reason(row, column, args):
                skipped[f"{row}-{column}"] = skip_reason(row, column, args)
                print(f"[skip] {row} {column}: {skipped[f'{row}-{column}']}", flush=True)
                continue
            for lr in args.lrs:
                for seed in args.seeds:
                    name = f"{row}-{column}-lr{lr}-seed{seed}"
                    run_dir = out / "runs" / name
                    command = run_command(row, column, seed, lr, args, run_dir)
                    results_file = run_dir / "finetune_results.json"
                    made_by = run_dir / COMMAND_FILE  # the flags of the run in the folder: reused only for the same
                    flags = run_key(command)
                    same = results_file.is_file() and made_by.is_file() and made_by.read_text() == flags
                    if args.dry_run:  # what a real run would do with each: reuse the finished one or run it
                        print(f"[reuse] {run_dir}" if same and not args.rerun else f"[run] {shlex.join(command)}")
                        continue
                    if same and not args.rerun:
                        print(f"[reuse] {run_dir}", flush=True)
                    else:
                        changed = " (made with other flags or another model)" if results_file.is_file() and not same else ""
                        print(f"[run]{changed} {shlex.join(command)}", flush=True)
                        t0 = time.monotonic()
                        subprocess.run(command, env=env, check=True)
                        made_by.write_text(flags)
                        print(f"[done] {run_dir} in {time.monotonic() - t0:.0f} s", flush=True)
                    results[name] = json.loads(results_file.read_text())
    if args.dry_run:
        return 0

    table: dict = {"rows": {}, "skipped": skipped, "chosen_lr": {}, "runs": {}}
    for row in rows:
        cells = {}
        for column in args.columns:
            if f"{row}-{column}" in skipped:
                continue
            lr = choose_lr(results, row, column, args)
            table["chosen_lr"][f"{row}-{column}"] = lr
            for cell_column, key, _ in CELLS:
                if cell_column == column:
                    values = [results[f"{row}-{column}-lr{lr}-seed{s}"]["test"][key] for s in args.seeds]
                    cells[f"{column}.{key}"] = summarise(values)
        table["rows"][row] = cells
    for name, result in results.items():
        table["runs"][name] = {k: result[k] for k in ("task", "init", "model", "max_length", "seed", "learning_rate", "steps", "train_runtime_s", "dev", "test")}
    long_runs = [r for r in results.values() if r["task"] == "long"]
    if long_runs:
        test = long_runs[-1]["test"]
        table["n_long"] = {"all": test["n_long"] + test["n_short"], "long": test["n_long"]}
    argv_shown = argv if argv is not None else sys.argv[1:]
    table["info"] = {
        "seeds": args.seeds,
        "budget": args.budget,
        "budget_flags": BUDGETS[args.budget],
        "common_flags": COMMON,
        "lrs": args.lrs,
        "lr_note": args.lrs[0] if len(args.lrs) == 1 else f"best mean dev of {' / '.join(args.lrs)} per cell: {table['chosen_lr']}",
        "cpu": cpu_model(),
        "threads": args.threads or os.cpu_count(),
        "wall_minutes": (time.monotonic() - started) / 60,
        "run_minutes": sum(r.get("total_runtime_s") or 0 for r in results.values()) / 60,
        "command": shlex.join(["python", "scripts/experiments/finetune_table.py", *argv_shown]),
        "rows": {row: ROW_NAMES[row] for row in rows},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(table, indent=2, ensure_ascii=False))
    text = markdown(table, args)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
