"""Helpers shared by the experiment scripts of this folder (not the fine-tuning table).

Importing this module sets the environment every experiment runs in: 2 OpenMP threads unless told otherwise,
and no network access for the Hugging Face libraries (nothing may be downloaded).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results"
QUICK_RESULTS = Path("/tmp/roformer_rope_experiments_quick")
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile")


def cpu_info() -> dict:
    """lscpu's model name, the flags that decide the fast paths, threads and library versions."""
    import torch
    import transformers

    model, flags = platform.processor() or "unknown CPU", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("Flags:"):
                flags = set(line.split(":", 1)[1].split())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "model": model,
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def cpu_line(info: dict) -> str:
    flags = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in info["flags"].items())
    return (
        f"CPU: {info['model']} ({flags}); {info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads; "
        f"torch {info['torch']}, transformers {info['transformers']}"
    )


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    if window <= 1 or len(values) == 0:
        return values.tolist()
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return ((csum[idx] - csum[lo]) / (idx - lo)).tolist()


def save_plot(draw, path: Path) -> None:
    """`draw()` (which writes the PNG `path`) when matplotlib is installed (the `bench` extra); without it, say
    so and go on: the .md/.json results do not need it, and a run of minutes must not end in an ImportError."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): {path.name} not drawn", flush=True)
        return
    draw()


def write_results(out_dir: Path, name: str, data: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(markdown.rstrip() + "\n", encoding="utf-8")
    print(f"wrote {out_dir / name}.json, .md")


class Clock:
    """Wall time and CPU time (this process and its finished children) since construction."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = self._cpu()

    @staticmethod
    def _cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def read(self) -> dict:
        return {"wall_seconds": time.perf_counter() - self.wall, "cpu_seconds": self._cpu() - self.cpu}


def mlm_evaluate(model, stream, tokenizer, length: int, *, seed: int = 0, token_budget: int = 4096,
                 split_at: int | None = None, max_sequences: int | None = None, sparse: bool = False) -> dict:
    """Held-out masked-token loss and accuracy of an MLM at packed length `length`.

    The held-out stream is packed to `length` (`mlm_data.pack`) and masked by `WholeWordMasker` with key
    (seed, length, index): two models given the same tokenizer, stream and arguments see exactly the same
    sequences and masks. With `split_at`, the loss and accuracy are also reported separately for masked
    positions < split_at and >= split_at (positions counted from [CLS] = 0). `sparse=True` (a RoFormer with
    `config.sparse_prediction`): the labels go in and the vocabulary projection runs on the masked rows only
    (same numbers, a fraction of the head's cost).
    """
    import torch

    from roformer_rope.scripts import mlm_data

    spans = mlm_data.pack(stream, length)
    if max_sequences is not None:
        spans = spans[:max_sequences]
    masker = mlm_data.WholeWordMasker(tokenizer, 0.15, seed)
    items = [(*mlm_data.sequence_body(stream, span, tokenizer.sep_token_id), (seed, length, i)) for i, span in enumerate(spans)]
    per_batch = max(1, token_budget // length)
    sums = {"all": [0.0, 0, 0], "before": [0.0, 0, 0], "after": [0.0, 0, 0]}  # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for start in range(0, len(items), per_batch):
            batch = masker.collate(items[start : start + per_batch])
            labels = batch.pop("labels")
            keep = labels != mlm_data.IGNORE_INDEX
            positions = torch.arange(labels.shape[1]).expand_as(labels)[keep]
            if sparse:
                logits = model(**batch, labels=labels).logits.float()  # (N, V): the masked rows, row-major
            else:
                logits = model(**batch).logits[keep].float()  # (B, T, V) -> (N, V)
            target = labels[keep]
            loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")
            right = logits.argmax(-1) == target
            groups = {"all": torch.ones_like(right)}
            if split_at is not None:
                groups["before"], groups["after"] = positions < split_at, positions >= split_at
            for name, chosen in groups.items():
                sums[name][0] += loss[chosen].sum().item()
                sums[name][1] += int(right[chosen].sum())
                sums[name][2] += int(chosen.sum())
    out = {"length": length, "sequences": len(items)}
    for name, (loss_sum, correct, count) in sums.items():
        if name != "all" and split_at is None:
            continue
        prefix = "" if name == "all" else f"{name}_{split_at}_"
        out[f"{prefix}masked_tokens"] = count
        out[f"{prefix}loss"] = loss_sum / count if count else float("nan")
        out[f"{prefix}accuracy"] = correct / count if count else float("nan")
    return out


def held_out_stream(tokenizer, held_out_lines: int, folder: Path, corpus_lines: int | None = None):
    """The pretraining held-out slice (the last `held_out_lines` lines of People's Daily), tokenized into `folder`."""
    from roformer_rope.scripts import mlm_data

    texts = mlm_data.load_texts(None)
    if corpus_lines:
        texts = texts.select(range(min(corpus_lines, len(texts))))
    _, held_out = mlm_data.split_held_out(texts, min(held_out_lines, max(1, len(texts) // 10)))
    return mlm_data.tokenize_to_stream(held_out, tokenizer, folder, 1, "tokenizing the held-out lines")
