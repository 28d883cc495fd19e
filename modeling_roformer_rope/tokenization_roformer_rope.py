"""RoFormer / WoBERT tokenizer: jieba words kept whole when in the vocabulary, else BERT WordPiece.

Pipeline (identical ids to transformers' built-in `RoFormerTokenizer`):

1. added tokens (`[MASK]`, `[SEP]`, user tokens) are cut out of the raw text first;
2. the rest is normalised like BERT (control characters dropped, whitespace -> space, accents
   stripped, lower case);
3. jieba segments the normalised text with HMM off (rjieba when installed, else jieba);
4. a jieba word found in the vocabulary is one piece; any other word is cut into single Chinese
   characters and runs of other non-space characters;
5. each piece goes through WordPiece (`##` continuations, `[UNK]` when not coverable), then
   `[CLS] A [SEP] (B [SEP])` is added.

Steps 1-4 run in Python here and step 5 (plus truncation, padding, overflow) runs in a plain
`tokenizers.Tokenizer` (WhitespaceSplit + WordPiece) fed the pieces joined by spaces. Nothing in the
Rust object is a Python callback, so the tokenizer pickles and deep-copies (datasets `num_proc`,
DataLoader workers), and `tokenizer.json` is never written: that file could only describe step 5,
so a generic loader would silently tokenize without jieba. Offsets are mapped back to the caller's text, so
`offset_mapping`, `char_to_token` and `word_ids` are usable for QA and NER.

Only transformers and the stdlib are imported at module level: the Hub loader refuses a
remote-code file whose top-level imports are missing, so jieba and `tokenizers` (always present
with transformers, but not ours to assume at import) are imported where they are used.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from transformers.tokenization_utils_base import BatchEncoding, PaddingStrategy, TruncationStrategy
from transformers.tokenization_utils_tokenizers import TokenizersBackend

VOCAB_FILES_NAMES = {"vocab_file": "vocab.txt", "jieba_dict_file": "jieba_dict.txt"}

# BERT's "Chinese character" blocks (those `tokenize_chinese_chars` isolates), as a regex class
_CJK = (
    "\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002f800-\U0002fa1f"
)
# a non-vocabulary jieba word splits into single CJK characters and runs of other non-spaces
_SPLIT_WORD = re.compile(f"[{_CJK}]|[^{_CJK}\\s]+")
_SPLIT_SPACES = re.compile(r"\S+")


class JiebaSegmenter:
    """`text -> [word]` (jieba with HMM off; the words cover the text) plus the user's dictionary.

    The backend (rjieba's Rust segmenter, or jieba) is created lazily and dropped when pickled, so
    the segmenter can cross process boundaries; only the custom words travel and are re-applied.
    Without custom words the process-wide default dictionary is shared (as the built-in does).
    """

    def __init__(self, words: list[tuple[str, int | None]] | None = None) -> None:
        self.words: list[tuple[str, int | None]] = list(words or [])
        self._tokenize = None

    def __getstate__(self) -> dict[str, Any]:
        return {"words": self.words, "_tokenize": None}

    def add_words(self, words: list[tuple[str, int | None]]) -> None:
        self.words.extend(words)
        self._tokenize = None  # rebuilt with the new words on next use

    def _build(self):
        try:
            import rjieba
        except ImportError:
            rjieba = None
        if rjieba is not None:
            seg = rjieba.Jieba() if self.words else rjieba  # the module cuts with its default instance
            for word, freq in self.words:
                seg.add_word(word, freq, None)
            return lambda text: seg.cut(text, hmm=False)
        try:
            import jieba
        except ImportError:
            raise ImportError(
                "RoFormerRopeTokenizer needs a jieba segmenter: pip install rjieba (or pip install jieba)"
            ) from None
        seg = jieba.Tokenizer() if self.words else jieba.dt
        for word, freq in self.words:
            seg.add_word(word, freq)
        return lambda text: list(seg.cut(text, HMM=False))

    def __call__(self, text: str) -> list[str]:
        if self._tokenize is None:
            self._tokenize = self._build()
        return self._tokenize(text)


def read_jieba_dict(path: str) -> list[tuple[str, int | None]]:
    """Words of a jieba user dictionary (`word [freq] [tag]` per line)."""
    words = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            parts = line.split()
            if parts:
                freq = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
                words.append((parts[0], freq))
    return words


def read_vocab_lines(path: str) -> list[str]:
    """Tokens of a `vocab.txt`, one per line, line number = id."""
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def _is_ascii_alnum(ch: str) -> bool:
    return ch.isascii() and ch.isalnum()


# (word index of each piece, or None when word = piece; span of each piece: `(start, end)`, or
# `(start, end, char_starts, char_ends)` when normalisation changed the piece's text; the pieces)
Location = tuple[list[int] | None, list[tuple], list[str]]


def _joined_starts(pieces: list[str]) -> list[int]:
    """Where each piece starts in `" ".join(pieces)`."""
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece) + 1
    return starts


class AlignedEncoding:
    """A `tokenizers.Encoding` stand-in whose offsets and word ids refer to the caller's input.

    The backend sees the pieces joined by spaces, so its offsets are positions in that string and
    its word ids index pieces. `locations[seq] = (words, spans, pieces)` maps them back: `spans[piece]` is
    the piece's `(start, end)` in the caller's text (in the caller's word for `is_split_into_words`
    input, where `words[piece]` is that word's index; `words` is None for raw text, whose word ids
    are piece indices as in the built-in tokenizer).
    """

    def __init__(self, encoding, locations: list[Location]) -> None:
        self._encoding = encoding
        self._locations = locations
        self._word_ids: list[int | None] | None = None
        self._offsets: list[tuple[int, int]] | None = None

    def __getattr__(self, name: str):
        # ids, type_ids, tokens, attention_mask, special_tokens_mask, sequence_ids, n_sequences:
        # read from the backend encoding on demand (each read copies a Rust vector)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._encoding, name)

    @property
    def overflowing(self) -> list[AlignedEncoding]:
        return [AlignedEncoding(o, self._locations) for o in self._encoding.overflowing]

    def _align(self) -> None:
        # computed on first use only: most callers never ask for offsets or word ids
        word_ids, offsets = [], []
        starts_in_joined = [_joined_starts(pieces) for _, _, pieces in self._locations]
        for piece, seq, (a, b) in zip(self._encoding.word_ids, self._encoding.sequence_ids, self._encoding.offsets):
            if piece is None:  # [CLS]/[SEP]/[PAD]
                word_ids.append(None)
                offsets.append((0, 0))
                continue
            words, spans, _ = self._locations[seq]
            span = spans[piece]
            word_ids.append(piece if words is None else words[piece])
            a -= starts_in_joined[seq][piece]  # backend offsets are in the space-joined pieces
            b -= starts_in_joined[seq][piece]
            if len(span) == 2:  # the piece is its source text, unchanged
                offsets.append((span[0] + a, span[0] + b))
            else:  # normalisation changed it: per-character source spans
                starts, ends = span[2], span[3]
                offsets.append((starts[a] if a < len(starts) else span[1], ends[b - 1] if b > 0 else span[0]))
        self._word_ids, self._offsets = word_ids, offsets

    @property
    def word_ids(self) -> list[int | None]:
        if self._word_ids is None:
            self._align()
        return self._word_ids

    @property
    def offsets(self) -> list[tuple[int, int]]:
        if self._offsets is None:
            self._align()
        return self._offsets

    @property
    def words(self) -> list[int | None]:
        return self.word_ids

    def __len__(self) -> int:
        return len(self.ids)

    def token_to_sequence(self, token_index: int) -> int | None:
        return self.sequence_ids[token_index]

    def token_to_word(self, token_index: int) -> int | None:
        return self.word_ids[token_index]

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None:
        return None if self.word_ids[token_index] is None else self.offsets[token_index]

    def _tokens_of(self, seq: int):
        return (i for i, s in enumerate(self.sequence_ids) if s == seq and self.word_ids[i] is not None)

    def word_to_tokens(self, word_index: int, sequence_index: int = 0) -> tuple[int, int] | None:
        hits = [i for i in self._tokens_of(sequence_index) if self.word_ids[i] == word_index]
        return (hits[0], hits[-1] + 1) if hits else None

    def word_to_chars(self, word_index: int, sequence_index: int = 0) -> tuple[int, int] | None:
        hits = [self.offsets[i] for i in self._tokens_of(sequence_index) if self.word_ids[i] == word_index]
        return (hits[0][0], hits[-1][1]) if hits else None

    def char_to_token(self, char_pos: int, sequence_index: int = 0) -> int | None:
        for i in self._tokens_of(sequence_index):
            start, end = self.offsets[i]
            if start <= char_pos < end:
                return i
        return None

    def char_to_word(self, char_pos: int, sequence_index: int = 0) -> int | None:
        token = self.char_to_token(char_pos, sequence_index)
        return None if token is None else self.word_ids[token]


class RoFormerRopeTokenizer(TokenizersBackend):
    r"""
    WoBERT-style tokenizer of the Chinese RoFormer checkpoints (see the module docstring).

    Args:
        vocab (`dict[str, int]` or `str`, *optional*): token -> id, or the path of a `vocab.txt`.
        vocab_file (`str`, *optional*): path of a `vocab.txt` (one token per line).
        jieba_dict_file (`str`, *optional*): a jieba user dictionary (`word [freq] [tag]` lines)
            applied on top of the default one; saved as `jieba_dict.txt` by `save_pretrained`.
        jieba_words (`list`, *optional*): extra words for jieba, as `word` or `(word, freq)`.
        do_lower_case, strip_accents, tokenize_chinese_chars: BERT normalisation switches.

    Example:
    ```python
    >>> tok = AutoTokenizer.from_pretrained("path/to/roformer_rope_checkpoint", trust_remote_code=True)
    >>> tok.tokenize("今天天气非常好。")
    ['今', '天', '天', '气', '非常', '好', '。']
    ```
    """

    vocab_files_names = VOCAB_FILES_NAMES
    # RoFormer has segment embeddings and pair tasks: return token_type_ids by default
    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]

    def __init__(
        self,
        vocab: dict[str, int] | str | None = None,
        vocab_file: str | None = None,
        jieba_dict_file: str | None = None,
        jieba_words: list[str | tuple[str, int]] | None = None,
        do_lower_case: bool = True,
        unk_token: str = "[UNK]",
        sep_token: str = "[SEP]",
        pad_token: str = "[PAD]",
        cls_token: str = "[CLS]",
        mask_token: str = "[MASK]",
        tokenize_chinese_chars: bool = True,
        strip_accents: bool | None = None,
        **kwargs,
    ) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

        # from_pretrained passes the vocab.txt path both as `vocab_file` and as `vocab`
        if isinstance(vocab, (str, os.PathLike)):
            vocab_file, vocab = str(vocab), None
        if vocab is None:
            if vocab_file is None or not os.path.isfile(vocab_file):
                raise ValueError(
                    f"RoFormerRopeTokenizer needs `vocab` (dict) or an existing vocab_file, got {vocab_file!r}"
                )
            # kept verbatim for save_vocabulary: some released vocabularies repeat a token, so
            # {token: id} alone cannot reproduce the file (later ids would shift)
            self._vocab_lines = read_vocab_lines(vocab_file)
            vocab = {token: i for i, token in enumerate(self._vocab_lines)}
        else:
            self._vocab_lines = None
        missing = [str(t) for t in (unk_token, cls_token, sep_token) if str(t) not in vocab]
        if missing:
            raise ValueError(f"the vocabulary lacks the special token(s) {missing}")
        self._word_vocab = frozenset(vocab)
        self._tokenize_chinese_chars = tokenize_chinese_chars

        custom: list[tuple[str, int | None]] = read_jieba_dict(jieba_dict_file) if jieba_dict_file else []
        custom += [(w, None) if isinstance(w, str) else (w[0], w[1]) for w in jieba_words or []]
        self._segmenter = JiebaSegmenter(custom)

        self._normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=False, strip_accents=strip_accents, lowercase=do_lower_case
        )
        # maps every normalised character to its source span; only used when normalisation changed
        # the text in a way that is not one-to-one (removed control chars, decomposed characters)
        self._aligner = Tokenizer(models.WordLevel({str(unk_token): 0}, unk_token=str(unk_token)))
        self._aligner.normalizer = self._normalizer
        self._aligner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")

        backend = Tokenizer(models.WordPiece(vocab, unk_token=str(unk_token), max_input_chars_per_word=100))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # see _encode_plus
        backend.decoder = decoders.WordPiece(prefix="##")
        self._tokenizer = backend
        self._added_pattern: re.Pattern | None = None
        self._added_pattern_key: tuple | None = None
        super().__init__(
            do_lower_case=do_lower_case,
            unk_token=unk_token,
            sep_token=sep_token,
            pad_token=pad_token,
            cls_token=cls_token,
            mask_token=mask_token,
            tokenize_chinese_chars=tokenize_chinese_chars,
            strip_accents=strip_accents,
            post_processor=processors.TemplateProcessing(
                single=f"{cls_token}:0 $A:0 {sep_token}:0",
                pair=f"{cls_token}:0 $A:0 {sep_token}:0 $B:1 {sep_token}:1",
                special_tokens=[(str(cls_token), vocab[str(cls_token)]), (str(sep_token), vocab[str(sep_token)])],
            ),
            **kwargs,
        )

    # ---- custom jieba dictionary -------------------------------------------------------------

    @property
    def jieba_words(self) -> list[tuple[str, int | None]]:
        """The user's jieba words (saved to `jieba_dict.txt`)."""
        return list(self._segmenter.words)

    def add_jieba_words(self, words: list[str | tuple[str, int]]) -> None:
        """Teach jieba new words (`word` or `(word, freq)`); they are saved with the tokenizer.
        A word only stays whole if it is also in the vocabulary."""
        self._segmenter.add_words([(w, None) if isinstance(w, str) else (w[0], w[1]) for w in words])

    # ---- text -> pieces ----------------------------------------------------------------------

    def _added_tokens_regex(self, split_special_tokens: bool) -> re.Pattern | None:
        """Regex of the added tokens to cut out of raw text (cached until tokens are added)."""
        decoder = self.added_tokens_decoder
        key = (len(decoder), split_special_tokens)
        if key != self._added_pattern_key:
            contents = sorted(
                (t.content for t in decoder.values() if not (split_special_tokens and t.special)),
                key=len,
                reverse=True,
            )
            self._added_pattern = re.compile("|".join(map(re.escape, contents))) if contents else None
            self._added_pattern_key = key
        return self._added_pattern

    def _segment_span(self, text: str, begin: int, end: int, out: list[str], spans: list[tuple]) -> None:
        """Append the pieces of `text[begin:end]` and their spans in `text`."""
        chunk = text[begin:end]
        norm = self._normalizer.normalize_str(chunk)
        if norm == chunk or (len(norm) == len(chunk) and norm == chunk.lower()):
            align = None  # one-to-one: positions in `norm` are positions in `chunk`
        else:
            align = self._aligner.encode(chunk).offsets
        vocab = self._word_vocab
        split = _SPLIT_WORD if self._tokenize_chinese_chars else _SPLIT_SPACES
        add_piece, add_span = out.append, spans.append
        words = self._segmenter(norm)
        if align is None:  # the hot path, kept flat on purpose
            e = begin
            for word in words:
                s = e
                e += len(word)
                if word in vocab:
                    add_piece(word)
                    add_span((s, e))
                elif len(word) == 1:
                    if not word.isspace():  # whitespace separates words and is never a token
                        add_piece(word)
                        add_span((s, e))
                else:  # isolate Chinese characters, keep other runs (WordPiece splits them)
                    for m in split.finditer(word):
                        add_piece(m.group())
                        add_span((s + m.start(), s + m.end()))
            return
        e = 0
        for word in words:
            s = e
            e += len(word)
            if word in vocab:
                parts = ((word, s, e),)
            else:
                parts = [(m.group(), s + m.start(), s + m.end()) for m in split.finditer(word)]
            for piece, ps, pe in parts:
                add_piece(piece)
                # keep where each normalised character came from, for WordPiece offsets
                starts = [begin + align[k][0] for k in range(ps, pe)]
                ends = [begin + align[k][1] for k in range(ps, pe)]
                add_span((starts[0], ends[-1], starts, ends))

    def _pieces(self, text: str, split_special_tokens: bool) -> tuple[list[str], list[tuple]]:
        """WordPiece inputs of `text` and their character spans in `text`."""
        pieces: list[str] = []
        spans: list[tuple] = []
        pattern = self._added_tokens_regex(split_special_tokens)
        pos = 0
        if pattern is not None:
            for m in pattern.finditer(text):
                self._segment_span(text, pos, m.start(), pieces, spans)
                pieces.append(m.group())
                spans.append(m.span())
                pos = m.end()
        self._segment_span(text, pos, len(text), pieces, spans)
        return pieces, spans

    def _prepare(self, item, is_split_into_words: bool, split_special_tokens: bool) -> tuple[list[str], Location]:
        """One input sequence -> its pieces and where each piece comes from."""
        if not is_split_into_words:
            if not isinstance(item, str):
                raise ValueError(f"text input must be a string or a list of strings, got {type(item).__name__}")
            pieces, spans = self._pieces(item, split_special_tokens)
            return pieces, (None, spans, pieces)
        pieces, spans, words = [], [], []
        for w, word in enumerate(item):
            if not isinstance(word, str):
                raise ValueError(f"is_split_into_words expects lists of strings, got {type(word).__name__}")
            p, sp = self._pieces(word, split_special_tokens)
            pieces += p
            spans += sp
            words += [w] * len(p)
        return pieces, (words, spans, pieces)

    # ---- encoding ----------------------------------------------------------------------------

    def _encode_plus(
        self,
        text,
        text_pair=None,
        add_special_tokens: bool = True,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        truncation_strategy: TruncationStrategy = TruncationStrategy.DO_NOT_TRUNCATE,
        max_length: int | None = None,
        stride: int = 0,
        is_split_into_words: bool = False,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors=None,
        return_token_type_ids: bool | None = None,
        return_attention_mask: bool | None = None,
        return_overflowing_tokens: bool = False,
        return_special_tokens_mask: bool = False,
        return_offsets_mapping: bool = False,
        return_length: bool = False,
        verbose: bool = True,
        split_special_tokens: bool | None = None,
        **kwargs,
    ) -> BatchEncoding:
        if kwargs.get("sanitize_control_tokens"):
            raise NotImplementedError("RoFormerRopeTokenizer has no chat template support")
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and len(text) > 0 and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        if text_pair is None:
            pairs = None
        elif batched:
            if isinstance(text_pair, str) or len(text_pair) != len(texts):
                raise ValueError("for a batch, `text_pair` must be a list as long as `text`")
            pairs = list(text_pair)
        else:  # like every v5 fast tokenizer, a single empty pair ("") means no pair
            pairs = [text_pair] if text_pair else None
        if not texts:
            raise ValueError("cannot tokenize an empty batch")

        if split_special_tokens is None:
            split_special_tokens = self.split_special_tokens
        if self._tokenizer.encode_special_tokens != split_special_tokens:
            self._tokenizer.encode_special_tokens = split_special_tokens
        first = [self._prepare(t, is_split_into_words, split_special_tokens) for t in texts]
        second = [self._prepare(t, is_split_into_words, split_special_tokens) for t in pairs] if pairs else None

        self.set_truncation_and_padding(
            padding_strategy=padding_strategy,
            truncation_strategy=truncation_strategy,
            max_length=max_length,
            stride=stride,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
        )
        # pieces never contain whitespace (added tokens may, but the backend matches those before
        # splitting), so joining them with spaces and splitting on whitespace is lossless; it is
        # much cheaper for the backend than one pre-tokenized word per piece
        if second is None:
            inputs = [" ".join(a[0]) for a in first]
        else:
            inputs = [(" ".join(a[0]), " ".join(b[0])) for a, b in zip(first, second)]
        raw = self._tokenizer.encode_batch(inputs, add_special_tokens=add_special_tokens)
        encodings = [
            AlignedEncoding(enc, [a[1]] if second is None else [a[1], second[i][1]])
            for i, (enc, a) in enumerate(zip(raw, first))
        ]

        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        data: dict[str, list] = {"input_ids": []}
        fields = {
            "token_type_ids": ("type_ids", return_token_type_ids),
            "attention_mask": ("attention_mask", return_attention_mask),
            "special_tokens_mask": ("special_tokens_mask", return_special_tokens_mask),
            "offset_mapping": ("offsets", return_offsets_mapping),
        }
        for key, (_, wanted) in fields.items():
            if wanted:
                data[key] = []
        if return_length:
            data["length"] = []
        if return_overflowing_tokens:
            data["overflow_to_sample_mapping"] = []
        flat: list[AlignedEncoding] = []
        for sample, enc in enumerate(encodings):
            for e in [enc, *enc.overflowing] if return_overflowing_tokens else [enc]:
                flat.append(e)
                data["input_ids"].append(e.ids)
                for key, (attr, wanted) in fields.items():
                    if wanted:
                        data[key].append(getattr(e, attr))
                if return_length:
                    data["length"].append(len(e.ids))
                if return_overflowing_tokens:
                    data["overflow_to_sample_mapping"].append(sample)
        for ids in data["input_ids"]:
            self._eventual_warn_about_too_long_sequence(ids, max_length, verbose)

        if not batched and return_tensors is None and not return_overflowing_tokens:
            return BatchEncoding({k: v[0] for k, v in data.items()}, flat)
        return BatchEncoding(data, flat, tensor_type=return_tensors)

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        # the base version runs the backend on raw text, which here would skip jieba
        return self._encode_plus(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    # ---- decoding ----------------------------------------------------------------------------

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join tokens as written Chinese: no spaces, except between two ASCII words/numbers;
        `##` pieces attach to the previous token."""
        out: list[str] = []
        for token in tokens:
            if token.startswith("##") and len(token) > 2:
                out.append(token[2:])
            else:
                if out and out[-1] and token and _is_ascii_alnum(out[-1][-1]) and _is_ascii_alnum(token[0]):
                    out.append(" ")
                out.append(token)
        return "".join(out)

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs,
    ) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.convert_tokens_to_string(self.convert_ids_to_tokens(list(token_ids), skip_special_tokens))
        if clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    # ---- saving ------------------------------------------------------------------------------

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Write `vocab.txt` (and `jieba_dict.txt` when there are custom jieba words)."""
        prefix = filename_prefix + "-" if filename_prefix else ""
        tokens = self._vocab_lines
        if tokens is None:
            vocab = self._tokenizer.get_vocab(with_added_tokens=False)
            tokens = sorted(vocab, key=vocab.__getitem__)
            if [vocab[t] for t in tokens] != list(range(len(tokens))):
                raise ValueError("vocabulary ids are not 0..N-1, so they cannot be written as vocab.txt lines")
        vocab_path = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["vocab_file"])
        with open(vocab_path, "w", encoding="utf-8") as handle:
            handle.write("".join(t + "\n" for t in tokens))
        files = [vocab_path]
        if self._segmenter.words:
            dict_path = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["jieba_dict_file"])
            with open(dict_path, "w", encoding="utf-8") as handle:
                for word, freq in self._segmenter.words:
                    handle.write(word + ("" if freq is None else f" {freq}") + "\n")
            files.append(dict_path)
        return tuple(files)

    def _save_pretrained(
        self,
        save_directory: str | os.PathLike,
        file_names: tuple[str, ...],
        legacy_format: bool | None = None,
        filename_prefix: str | None = None,
    ) -> tuple[str, ...]:
        # no tokenizer.json on purpose: it cannot express jieba, so a generic loader reading it
        # would tokenize silently wrong; vocab.txt + tokenizer_config.json (auto_map) suffice.
        # Tokens added after the vocabulary (add_tokens) would live in tokenizer.json, and the
        # base class drops them from tokenizer_config.json for tokenizers-backed classes, so they
        # go to added_tokens.json, which from_pretrained reads back.
        files = file_names + self.save_vocabulary(str(save_directory), filename_prefix)
        base_size = self.vocab_size
        added = {t.content: i for i, t in self.added_tokens_decoder.items() if i >= base_size}
        if added:
            prefix = filename_prefix + "-" if filename_prefix else ""
            path = os.path.join(str(save_directory), prefix + "added_tokens.json")
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(added, handle, ensure_ascii=False, indent=2, sort_keys=True)
            files += (path,)
        return files


RoFormerRopeTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["RoFormerRopeTokenizer"]
