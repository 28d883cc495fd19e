"""What every fine-tuning task shares: the `Task` description, deterministic splits, deduplication.

A task module (`task_sentiment`, `task_ner`, `task_long`) builds one `Task`: where its examples come
from (`load`, always the same split for the same corpus file), how a batch of them becomes model
inputs (`encode`, a `datasets.map` function), and how predictions are scored (`compute_metrics`).
`finetune.py` only talks to this interface.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

SPLITS = ("train", "dev", "test")


def tokenizer_identity(tokenizer) -> str:
    """JSON of what decides a tokenizer's ids: its class, vocabulary (added tokens included), jieba words, how text
    is cut before WordPiece (jieba or not, case, accents, CJK splitting), its special tokens and the side it
    truncates: the same vocabulary can give other ids. Cached token ids are keyed by it."""
    settings = ("word_segmentation", "do_lower_case", "strip_accents", "tokenize_chinese_chars")
    return json.dumps(
        [
            type(tokenizer).__name__,
            sorted(tokenizer.get_vocab().items()),
            sorted(map(str, getattr(tokenizer, "jieba_words", None) or [])),
            {key: tokenizer.init_kwargs.get(key) for key in settings},
            sorted(tokenizer.special_tokens_map.items()),
            getattr(tokenizer, "truncation_side", "right"),
        ],
        ensure_ascii=False,
        default=str,
    )


@dataclass
class Splits:
    """Column-oriented examples per split (ready for `datasets.Dataset.from_dict`) and how they were made."""

    train: dict[str, list]
    dev: dict[str, list]
    test: dict[str, list]
    stats: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> dict[str, list]:
        return getattr(self, name)

    def sizes(self) -> dict[str, int]:
        return {name: len(next(iter(self[name].values()), [])) for name in SPLITS}


@dataclass(frozen=True)
class Task:
    name: str
    kind: Literal["sequence", "token"]  # which Auto head: ForSequenceClassification / ForTokenClassification
    labels: tuple[str, ...]  # id -> name, saved as config.id2label
    default_max_length: int
    metric: str  # key of `compute_metrics` used for early stopping and the best checkpoint
    description: str
    load: Callable[[], Splits]
    encode: Callable[..., dict]  # (batch, tokenizer, max_length) -> model inputs + "labels"
    compute_metrics: Callable[[Any], dict[str, float]]  # EvalPrediction -> metrics
    vocab_texts: Callable[[Splits], list[str]]  # training text to build a fresh vocabulary from
    pipeline_inputs: Callable[[dict[str, list], int], list]  # the first n examples as pipeline inputs
    # optional: extra test metrics needing example columns the model never sees (e.g. lengths)
    subset_metrics: Callable[[dict[str, list], np.ndarray], dict[str, float]] | None = None


def columns(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, list]:
    """Rows -> `{name: [values]}` (also when `rows` is empty)."""
    return {name: [row[name] for row in rows] for name in names}


def text_key(text: str) -> str:
    """Identity of a text for deduplication: whitespace removed, lower case."""
    return "".join(text.split()).lower()


def stable_bucket(text: str, buckets: int = 10) -> int:
    """A bucket that depends only on the text (not on file order, Python's hash seed or the run)."""
    return int.from_bytes(hashlib.sha1(text_key(text).encode("utf-8")).digest()[:8], "big") % buckets


def dedup_splits(
    splits: dict[str, list[dict]], key: Callable[[dict], Hashable], priority: Sequence[str] = ("test", "dev", "train")
) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """Keep each key once over all splits: the copy in the first split of `priority` wins, file order
    inside a split. Returns the kept rows and how many copies were dropped from each split."""
    seen: set[Hashable] = set()
    kept: dict[str, list[dict]] = {}
    dropped: dict[str, int] = {}
    for name in priority:
        kept[name], dropped[name] = [], 0
        for row in splits[name]:
            k = key(row)
            if k in seen:
                dropped[name] += 1
            else:
                seen.add(k)
                kept[name].append(row)
    return {name: kept[name] for name in splits}, {name: dropped[name] for name in splits}


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of equal entries; 0.0 for no examples."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    return float((predictions == labels).mean()) if labels.size else 0.0


def classification_metrics(eval_prediction) -> dict[str, float]:
    """`compute_metrics` for single-label classification: accuracy of the arg-max class."""
    logits = eval_prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": accuracy(np.argmax(logits, axis=-1), eval_prediction.label_ids)}
