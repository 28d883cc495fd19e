"""RoFormer / WoBERT tokenizer: jieba words kept whole when in the vocabulary, else BERT WordPiece.

Pipeline (identical ids to transformers' built-in `RoFormerTokenizer`):

1. added tokens with `normalized=False` (`[MASK]`, `[SEP]`, special tokens) are cut out of the raw text;
2. the rest is normalised like BERT (control characters dropped, whitespace -> space, accents
   stripped, lower case), and added tokens with `normalized=True` (`add_tokens`) are cut out of it
   (steps 1-2 follow tokenizers' AddedVocabulary: `added_tokens_roformer_rope.py`);
3. jieba segments the normalised text with HMM off (rjieba when installed, else jieba);
4. a jieba word found in the vocabulary is one piece; any other word is cut into single Chinese
   characters and runs of other non-space characters;
5. each piece goes through WordPiece (`##` continuations, `[UNK]` when not coverable), then
   `[CLS] A [SEP] (B [SEP])` is added.

Steps 1-4 run in Python here (the jieba segmenter and its user dictionary live in
`jieba_roformer_rope.py`) and step 5 (plus truncation, padding, overflow) runs in a plain
`tokenizers.Tokenizer` (WhitespaceSplit + WordPiece, no added tokens of its own: see `_encoder_state`)
fed the pieces joined by spaces. Nothing in the Rust object is a Python callback, so the tokenizer
pickles and deep-copies (datasets `num_proc`, DataLoader workers), and `tokenizer.json` is never
written: that file could only describe step 5,
so a generic loader would silently tokenize without jieba. Offsets are mapped back to the caller's
text (`offsets_roformer_rope.py`), so `offset_mapping`, `char_to_token` and `word_ids` are usable
for QA and NER.

`_encode_plus`, `_encode_without_added_tokens`, `_decode` and `_save_pretrained` override private
transformers methods; `tests/test_tokenizer_signatures.py` pins their signatures to the installed
transformers. Only transformers, the stdlib and sibling files are imported at module level: the Hub
loader refuses a remote-code file whose top-level imports are missing, so jieba and `tokenizers`
(always present with transformers, but not ours to assume at import) are imported where they are used.
"""

from __future__ import annotations

import functools
import json
import os
import re

from transformers.tokenization_utils_base import BatchEncoding, PaddingStrategy, TruncationStrategy
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils import logging

from .added_tokens_roformer_rope import AddedTokenMatcher, added_token_matchers
from .jieba_roformer_rope import JiebaSegmenter, JiebaWord, as_jieba_words, read_jieba_dict, write_jieba_dict
from .offsets_roformer_rope import AlignedEncoding, Location

VOCAB_FILES_NAMES = {"vocab_file": "vocab.txt", "jieba_dict_file": "jieba_dict.txt"}

# BERT's "Chinese character" blocks (those `tokenize_chinese_chars` isolates), as a regex class
_CJK = (
    "\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002f800-\U0002fa1f"
)
_HAS_SPACE = re.compile(r"\s").search
# word-level ("jieba") vocabularies hold words of several Chinese characters; character-level ones do not
_CJK_WORD = re.compile(f"[{_CJK}]{{2,}}").fullmatch
WORD_SEGMENTATION = ("auto", "jieba", "none")


@functools.cache
def _punctuation_class() -> str:
    """BERT's punctuation (`_is_punctuation`: the ASCII symbol ranges and Unicode category P*) as the inside of a
    regex class; Python's `re` has no \\p{P}. Every P* character lies below U+20000 (~20 ms to scan, once)."""
    import unicodedata

    chars = [chr(c) for c in range(0x20000) if unicodedata.category(chr(c)).startswith("P")]
    return r"!-/:-@\[-`{-~" + "".join(re.escape(ch) for ch in chars)


@functools.cache
def _splitters(tokenize_chinese_chars: bool):
    """(split, tile). `split` cuts a jieba word that is not in the vocabulary as the built-in tokenizer does:
    single Chinese characters and runs of other non-spaces. `tile` cuts a whole text as BERT's basic tokenizer
    (bert4keras `Tokenizer._tokenize` without `pre_tokenize`) does: single Chinese characters, single
    punctuation characters, runs of everything else; its whitespace runs are kept, so the matches cover the
    text. `tile` gives the words of a character-level checkpoint, which the original tokenized without jieba."""
    cjk = _CJK if tokenize_chinese_chars else ""
    split = re.compile(f"[{cjk}]|[^{cjk}\\s]+" if cjk else r"\S+")
    alone = f"[{cjk}{_punctuation_class()}]"
    rest = f"[^{cjk}{_punctuation_class()}\\s]+"
    return split, re.compile(f"\\s+|{alone}|{rest}")


def read_vocab_lines(path: str) -> list[str]:
    """Tokens of a `vocab.txt`, one per line, line number = id (a UTF-8 byte-order mark before the first is no part
    of it: it would make id 0 "\ufeff[PAD]" and give [PAD] a new id)."""
    with open(path, encoding="utf-8-sig") as handle:
        return [line.rstrip("\n") for line in handle]


def _warn_on_repeated_tokens(lines: list[str], vocab: dict[str, int], path: str) -> None:
    """One warning when a token is on several lines: its id is its last line (as transformers' BertTokenizer
    reads it; every other id stays its line number, the embedding row); bert4keras would shift later ids."""
    if len(vocab) == len(lines):
        return
    first: dict[str, int] = {}
    repeats = [(token, first.setdefault(token, i), i) for i, token in enumerate(lines) if first.setdefault(token, i) != i]
    token, line, again = repeats[0]
    logging.get_logger(__name__).warning(
        "%s: %d repeated token(s), first %r on lines %d and %d; a repeated token's id is its last line, every "
        "other id is its line number",
        path, len(repeats), token, line + 1, again + 1,
    )  # fmt: skip


def _is_ascii_alnum(ch: str) -> bool:
    return ch.isascii() and ch.isalnum()


def _batch_item(item, is_split_into_words: bool) -> tuple:
    """One element of a batch given without `text_pair`: `(sequence,)`, or `(first, second)` for a pair.

    Read as tokenizers' `Tokenizer.encode_batch` (so the built-in tokenizer) reads it: a string (a list
    of strings when `is_split_into_words`) is one sequence, any other 2-tuple or 2-list is a pair.
    `_prepare` checks the sequences themselves.
    """
    if is_split_into_words:
        single = isinstance(item, (list, tuple)) and all(isinstance(word, str) for word in item)
    else:
        single = isinstance(item, str)
    if single or not isinstance(item, (list, tuple)):
        return (item,)
    if len(item) != 2:
        one = "a list of words" if is_split_into_words else "a string"
        raise ValueError(f"a batch element must be {one} or a pair of two, got a {type(item).__name__} of {len(item)}")
    return tuple(item)


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
        word_segmentation (`str`, *optional*, defaults to `"auto"`): `"jieba"` (words first, as the
            word-level checkpoints were trained), `"none"` (BERT's basic tokenizer straight away, as the
            character-level checkpoints were), or `"auto"`: `"jieba"` when the vocabulary holds words of
            two or more Chinese characters, else `"none"`. Saved resolved.

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
        word_segmentation: str = "auto",
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
            _warn_on_repeated_tokens(self._vocab_lines, vocab, vocab_file)
        else:
            self._vocab_lines = None
        missing = [str(t) for t in (unk_token, cls_token, sep_token) if str(t) not in vocab]
        if missing:
            raise ValueError(f"the vocabulary lacks the special token(s) {missing}")
        # the words kept whole: not a token holding whitespace (a line " " of a vocab.txt), which the space-joined
        # input of the WordPiece backend would drop or split, shifting every later offset (bert4keras strips such
        # lines to nothing)
        self._word_vocab = frozenset(token for token in vocab if token and not any(c.isspace() for c in token))
        self._tokenize_chinese_chars = tokenize_chinese_chars
        if word_segmentation not in WORD_SEGMENTATION:
            raise ValueError(f"word_segmentation must be one of {WORD_SEGMENTATION}, got {word_segmentation!r}")
        if word_segmentation == "auto":
            word_segmentation = "jieba" if any(_CJK_WORD(token) for token in vocab) else "none"
        self._use_jieba = word_segmentation == "jieba"
        if not self._use_jieba and (jieba_dict_file or jieba_words):
            logging.get_logger(__name__).warning(
                "word_segmentation='none' (a character-level vocabulary, or asked for): the jieba words are kept "
                "but not used; pass word_segmentation='jieba' to segment with them"
            )

        custom = read_jieba_dict(jieba_dict_file) if jieba_dict_file else []
        self._segmenter = JiebaSegmenter(custom + as_jieba_words(jieba_words or []))

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
        self._encoder = None  # see _encoder_state
        self._encoder_key: tuple | None = None
        self._matchers: tuple[AddedTokenMatcher, AddedTokenMatcher | None] | None = None
        self._added_pieces: dict[int, str] = {}
        # what transformers read from a tokenizer.json next to vocab.txt (one the built-in saved, or a stale one):
        # never used, this tokenizer builds its own backend, and passing it on would collide with ours
        for key in ("tokenizer_file", "post_processor", "tokenizer_padding", "tokenizer_truncation", "_json_truncation",
                    "_json_padding"):  # fmt: skip
            kwargs.pop(key, None)
        super().__init__(
            do_lower_case=do_lower_case,
            unk_token=unk_token,
            sep_token=sep_token,
            pad_token=pad_token,
            cls_token=cls_token,
            mask_token=mask_token,
            tokenize_chinese_chars=tokenize_chinese_chars,
            strip_accents=strip_accents,
            word_segmentation=word_segmentation,
            post_processor=processors.TemplateProcessing(
                single=f"{cls_token}:0 $A:0 {sep_token}:0",
                pair=f"{cls_token}:0 $A:0 {sep_token}:0 $B:1 {sep_token}:1",
                special_tokens=[(str(cls_token), vocab[str(cls_token)]), (str(sep_token), vocab[str(sep_token)])],
            ),
            **kwargs,
        )

    def _add_tokens(self, new_tokens: list, special_tokens: bool = False) -> int:
        """As transformers adds tokens, refusing where it would give a new token an id already in use: it numbers
        new tokens from the count of distinct tokens, and a token repeated in vocab.txt leaves its earlier line's id
        without a token, so that count is below the largest id + 1 (the built-in tokenizer collides silently)."""
        taken = self._tokenizer.get_vocab(with_added_tokens=True)  # {token: id}
        fresh = [str(token) for token in new_tokens if str(token) not in taken]
        if fresh and taken:
            rows = max(taken.values()) + 1
            counted = self._tokenizer.get_vocab_size(with_added_tokens=True)
            if counted < rows:
                raise ValueError(
                    f"cannot add {fresh[:3]}: ids 0..{rows - 1} are in use but the vocabulary holds {counted} distinct "
                    f"tokens (a token repeated in vocab.txt leaves its earlier line's id without a token), so "
                    f"transformers would give a new token an id already in use; in vocab.txt, replace the repeated "
                    f"line by the token to add (the line count, hence every id, stays), and load it again"
                )
        return super()._add_tokens(new_tokens, special_tokens)

    # ---- custom jieba dictionary -------------------------------------------------------------

    @property
    def jieba_words(self) -> list[JiebaWord]:
        """The user's jieba words (saved to `jieba_dict.txt`)."""
        return list(self._segmenter.words)

    def add_jieba_words(self, words: list[str | tuple[str, int]]) -> None:
        """Teach jieba new words (`word` or `(word, freq)`); they are saved with the tokenizer.
        A word only stays whole if it is also in the vocabulary; a word containing whitespace
        raises `ValueError` (jieba cuts text at whitespace, so it could never match)."""
        self._segmenter.add_words(as_jieba_words(words))

    # ---- text -> pieces ----------------------------------------------------------------------

    def _encoder_state(self) -> tuple[AddedTokenMatcher, AddedTokenMatcher | None]:
        """The added-token matchers, and `self._encoder`: the Rust tokenizer that encodes pieces.

        `self._tokenizer` (the base class's backend) keeps the added tokens, and would match them
        again inside ordinary pieces (an added `ab` inside the piece `ab` of the text `AB`). The
        encoder has no added tokens: `_pieces` finds them, and passes each one as a piece WordPiece
        maps to its id whole: its vocabulary entry, or for ids past the vocabulary a `\\x00<id>`
        entry of the encoder's own vocabulary (normalised text never holds \\x00). Rebuilt when the
        added tokens change.
        """
        from tokenizers import Tokenizer, models, pre_tokenizers

        added = self.added_tokens_decoder
        key = tuple(
            (i, t.content, t.normalized, t.special, t.single_word, t.lstrip, t.rstrip) for i, t in added.items()
        )
        if key != self._encoder_key:
            model = self._tokenizer.model
            vocab = self._tokenizer.get_vocab(with_added_tokens=False)
            pieces: dict[int, str] = {}
            extra: dict[str, int] = {}
            whole = model.max_input_chars_per_word  # WordPiece gives [UNK] for a longer piece
            for i in added:
                token = model.id_to_token(i)
                if token is not None and vocab.get(token) == i and len(token) <= whole and not _HAS_SPACE(token):
                    pieces[i] = token
                else:
                    pieces[i] = f"\x00{i}"
                    extra[pieces[i]] = i
            if extra:
                model = models.WordPiece(
                    {**vocab, **extra},
                    unk_token=model.unk_token,
                    continuing_subword_prefix=model.continuing_subword_prefix,
                    max_input_chars_per_word=model.max_input_chars_per_word,
                )
            encoder = Tokenizer(model)
            encoder.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            self._encoder, self._added_pieces = encoder, pieces
            self._matchers = added_token_matchers(added, self._normalizer.normalize_str)
            self._encoder_key = key
        return self._matchers

    def _normalize(self, text: str) -> tuple[str, list | None]:
        """(normalised `text`, `align`): `align[k]` is the source span of `norm[k]`, None when one-to-one."""
        norm = self._normalizer.normalize_str(text)
        if norm == text or (len(norm) == len(text) and norm == text.lower()):
            return norm, None  # one-to-one: positions in `norm` are positions in `text`
        return norm, self._aligner.encode(text).offsets

    def jieba_word_starts(self, text: str) -> list[int] | None:
        """Where each jieba word of `text` starts (offsets in `text`), cut as this tokenizer cuts it: normalised,
        with its user words. None for a tokenizer that does not cut with jieba (`word_segmentation="none"`).
        Used as the unit of whole-word masking; added tokens are not cut out first."""
        if not self._use_jieba:
            return None
        norm, align = self._normalize(text)
        words = self._segmenter(norm)  # HMM off: the words cover `norm`
        starts, at = [], 0  # in `norm`
        for word in words:
            starts.append(at)
            at += len(word)
        if align is None:
            return starts
        return sorted({align[k][0] for k in starts if k < len(norm)}) or [0]

    def _segment_span(
        self,
        text: str,
        begin: int,
        end: int,
        matcher: AddedTokenMatcher | None,
        split_special_tokens: bool,
        out: list[str],
        spans: list[tuple],
    ) -> None:
        """Append the pieces of `text[begin:end]` (normalised, then added tokens with
        `normalized=True` cut out, the rest segmented) and their spans in `text`."""
        chunk = text[begin:end]
        norm, align = self._normalize(chunk)
        if matcher is None:
            self._segment_words(norm, 0, len(norm), begin, align, out, spans)
            return
        for token_id, s, e in matcher.split(norm, split_special_tokens):
            if token_id is None:
                self._segment_words(norm, s, e, begin, align, out, spans)
            else:
                out.append(self._added_pieces[token_id])
                source = (begin + s, begin + e) if align is None else (begin + align[s][0], begin + align[e - 1][1])
                spans.append((*source, norm[s:e]))

    def _segment_words(
        self, norm: str, start: int, stop: int, begin: int, align: list | None, out: list[str], spans: list[tuple]
    ) -> None:
        """Append the pieces of the normalised `norm[start:stop]`; `begin` is where `norm`'s source
        starts in the caller's text, `align[k]` the source span of `norm[k]` (None: one-to-one)."""
        vocab = self._word_vocab
        split, tile = _splitters(self._tokenize_chinese_chars)
        add_piece, add_span = out.append, spans.append
        text = norm[start:stop] if start or stop < len(norm) else norm
        words = self._segmenter(text) if self._use_jieba else tile.findall(text)
        if align is None:  # the hot path, kept flat on purpose
            e = begin + start
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
        e = start
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

    def _pieces(
        self, text: str, matchers: tuple[AddedTokenMatcher, AddedTokenMatcher | None], split_special_tokens: bool
    ) -> tuple[list[str], list[tuple]]:
        """WordPiece inputs of `text` and their character spans in `text` (see `Location`)."""
        pieces: list[str] = []
        spans: list[tuple] = []
        raw, normalized = matchers
        for token_id, start, end in raw.split(text, split_special_tokens):
            if token_id is None:
                self._segment_span(text, start, end, normalized, split_special_tokens, pieces, spans)
            else:  # added tokens matched in the raw text
                pieces.append(self._added_pieces[token_id])
                spans.append((start, end, text[start:end]))
        return pieces, spans

    def _prepare(
        self,
        item,
        is_split_into_words: bool,
        matchers: tuple[AddedTokenMatcher, AddedTokenMatcher | None],
        split_special_tokens: bool,
    ) -> tuple[list[str], Location]:
        """One input sequence -> its pieces and where each piece comes from."""
        if not is_split_into_words:
            if not isinstance(item, str):
                raise ValueError(f"text input must be a string or a list of strings, got {type(item).__name__}")
            pieces, spans = self._pieces(item, matchers, split_special_tokens)
            return pieces, (None, spans, pieces)
        if isinstance(item, str):  # the built-in refuses it too (its words would be the characters)
            raise ValueError("is_split_into_words expects a list of words per sequence, got a string")
        pieces, spans, words = [], [], []
        for w, word in enumerate(item):
            if not isinstance(word, str):
                raise ValueError(f"is_split_into_words expects lists of strings, got {type(word).__name__}")
            p, sp = self._pieces(word, matchers, split_special_tokens)
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
        # batch detection and pairs as in TokenizersBackend._encode_plus (see `_batch_item`)
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and len(text) > 0 and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        if not batched:  # like every v5 fast tokenizer, a single empty pair ("") means no pair
            items = [(text, text_pair)] if text_pair else [(text,)]
        elif text_pair is not None:
            if isinstance(text_pair, str) or len(text_pair) != len(text):
                raise ValueError("for a batch, `text_pair` must be a list as long as `text`")
            items = list(zip(text, text_pair))
        else:
            items = [_batch_item(item, is_split_into_words) for item in text]
        if not items:
            raise ValueError("cannot tokenize an empty batch")

        if split_special_tokens is None:
            split_special_tokens = self.split_special_tokens
        matchers = self._encoder_state()
        # per item: (pieces, Location) of its one or two sequences
        prepared = [
            [self._prepare(seq, is_split_into_words, matchers, split_special_tokens) for seq in item] for item in items
        ]

        self.set_truncation_and_padding(
            padding_strategy=padding_strategy,
            truncation_strategy=truncation_strategy,
            max_length=max_length,
            stride=stride,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
        )
        # the base class configured the backend; the encoder runs with the same settings
        backend, encoder = self._tokenizer, self._encoder
        truncation, padding = backend.truncation, backend.padding
        if encoder.truncation != truncation:
            encoder.no_truncation() if truncation is None else encoder.enable_truncation(**truncation)
        if encoder.padding != padding:
            encoder.no_padding() if padding is None else encoder.enable_padding(**padding)
        encoder.post_processor = backend.post_processor
        # pieces never contain whitespace (ordinary pieces are cut at it, added tokens are passed as
        # whitespace-free stand-ins: see _encoder_state), so joining them with spaces and splitting on
        # whitespace is lossless; it is much cheaper for the encoder than one pre-tokenized word per piece
        # (a batch may mix single sequences and pairs, as the built-in allows)
        inputs = [" ".join(seqs[0][0]) if len(seqs) == 1 else tuple(" ".join(p) for p, _ in seqs) for seqs in prepared]
        raw = encoder.encode_batch(inputs, add_special_tokens=add_special_tokens)
        encodings = [AlignedEncoding(enc, [loc for _, loc in seqs]) for enc, seqs in zip(raw, prepared)]

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

    # ---- special tokens on id lists (the built-in RoFormerTokenizer's / BERT's layout) -----------

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        """`[CLS] A [SEP]`, or `[CLS] A [SEP] B [SEP]` for a pair."""
        output = [self.cls_token_id, *token_ids_0, self.sep_token_id]
        if token_ids_1 is not None:
            output += [*token_ids_1, self.sep_token_id]
        return output

    def create_token_type_ids_from_sequences(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        """Token types of `build_inputs_with_special_tokens`' output: 0 for `[CLS] A [SEP]`, 1 for `B [SEP]`."""
        types = [0] * (len(token_ids_0) + 2)
        if token_ids_1 is not None:
            types += [1] * (len(token_ids_1) + 1)
        return types

    def get_special_tokens_mask(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        """1 where `build_inputs_with_special_tokens` puts `[CLS]`/`[SEP]`, 0 on the sequences' ids; with
        `already_has_special_tokens`, the base rule (1 on every special id found in `token_ids_0`)."""
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        mask = [1] + [0] * len(token_ids_0) + [1]
        if token_ids_1 is not None:
            mask += [0] * len(token_ids_1) + [1]
        return mask

    # ---- decoding ----------------------------------------------------------------------------

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join tokens as written Chinese: no spaces, except between two ASCII words/numbers;
        `##` pieces attach to the previous token (a first token keeps its `##`, as the built-in's decoder does)."""
        out: list[str] = []
        for token in tokens:
            if token.startswith("##") and len(token) > 2 and out:
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
        tokens = self.convert_ids_to_tokens(list(token_ids), skip_special_tokens)
        # An id no token has (a model vocabulary padded past the tokenizer's) is skipped, as the built-in does.
        text = self.convert_tokens_to_string([token for token in tokens if token is not None])
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
            write_jieba_dict(dict_path, self._segmenter.words)
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
        # go to added_tokens.json, which from_pretrained reads back. That file holds content -> id
        # only, so every added token's flags (normalized, lstrip, rstrip, single_word, special: they
        # decide where it matches) also go to tokenizer_config.json's `added_tokens_decoder`, which
        # from_pretrained prefers when present.
        for config_file in (f for f in file_names if str(f).endswith("tokenizer_config.json")):
            with open(config_file, encoding="utf-8") as handle:
                config = json.load(handle)
            decoder = self.added_tokens_decoder
            config["added_tokens_decoder"] = {str(i): decoder[i].__getstate__() for i in sorted(decoder)}
            with open(config_file, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
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
