"""Offsets and word ids of `RoFormerRopeTokenizer` encodings, mapped back to the caller's text.

The WordPiece backend sees the pieces of a sequence joined by single spaces, so its offsets are
positions in that string and its word ids index pieces. `AlignedEncoding` wraps a backend
`tokenizers.Encoding` and translates both with one `Location` per sequence. Only the stdlib is
imported (the Hub loader refuses remote code whose top-level imports are missing).
"""

from __future__ import annotations

# Where the pieces of one sequence come from: `(words, spans, pieces)`.
# - `pieces`: the backend's input for the sequence, joined by spaces;
# - `spans[piece]`: `(start, end)` of the piece in the caller's text (in the caller's word for
#   `is_split_into_words` input), or `(start, end, char_starts, char_ends)` when normalisation changed
#   the piece's text (then `char_starts[k], char_ends[k]` is the source span of its k-th character),
#   or `(start, end, text)` for an added token: one token covering the span, `text` its token string
#   (what tokenizers reports: the matched text, whitespace taken by lstrip/rstrip included);
# - `words[piece]`: the caller's word index of each piece for `is_split_into_words` input, else None
#   (raw text: word ids are piece indices, as in the built-in tokenizer).
Location = tuple[list[int] | None, list[tuple], list[str]]


def joined_starts(pieces: list[str]) -> list[int]:
    """Where each piece starts in `" ".join(pieces)`."""
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece) + 1
    return starts


class AlignedEncoding:
    """A `tokenizers.Encoding` stand-in whose offsets and word ids refer to the caller's input.

    `locations[seq]` is the `Location` of sequence `seq` (0, or 1 for the pair). The overflowing windows of
    one encoding share its locations and the pieces' start positions, computed once: a window's offsets cost
    its own tokens, not the whole text's pieces again (a 141k-character text in 512-token windows with stride
    128 and offsets on a Zen 4 EPYC: 77.6k → 449k characters/s, `python bench/bench_tokenizer.py`).
    """

    def __init__(self, encoding, locations: list[Location], starts: list[list[int]] | None = None) -> None:
        self._encoding = encoding
        self._locations = locations
        self._starts = starts if starts is not None else []  # joined_starts per sequence, filled on first use
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
        return [AlignedEncoding(o, self._locations, self._starts) for o in self._encoding.overflowing]

    def _align(self) -> None:
        # computed on first use only: most callers never ask for offsets or word ids
        word_ids, offsets = [], []
        if not self._starts:  # (a list shared with the other windows: filled in place, once, in one step)
            self._starts[:] = [joined_starts(pieces) for _, _, pieces in self._locations]
        starts_in_joined = self._starts
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
            elif len(span) == 3:  # an added token (its piece is a stand-in, not its text)
                offsets.append((span[0], span[1]))
            else:  # normalisation changed it: per-character source spans
                starts, ends = span[2], span[3]
                offsets.append((starts[a] if a < len(starts) else span[1], ends[b - 1] if b > 0 else span[0]))
        self._word_ids, self._offsets = word_ids, offsets

    @property
    def tokens(self) -> list[str]:
        tokens = self._encoding.tokens
        for i, (piece, seq) in enumerate(zip(self._encoding.word_ids, self._encoding.sequence_ids)):
            if piece is not None:
                span = self._locations[seq][1][piece]
                if len(span) == 3:  # an added token: report its text, not the stand-in piece
                    tokens[i] = span[2]
        return tokens

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
