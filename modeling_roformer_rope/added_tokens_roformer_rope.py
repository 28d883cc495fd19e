"""Added tokens (`[MASK]`, `[SEP]`, `add_tokens(...)`) found in text exactly as tokenizers' `AddedVocabulary`
finds them (`extract_and_normalize` and `find_matches` in tokenizers/src/tokenizer/added_vocabulary.rs),
so `RoFormerRopeTokenizer` cuts them out where transformers' built-in `RoFormerTokenizer` does:

1. tokens with `normalized=False` (special tokens by default) are matched in the raw text;
2. each stretch left over is normalised, then tokens with `normalized=True` (`add_tokens` by default) are
   matched in it, their content normalised the same way (so an added `Hello` also matches `HELLO`).

Matching is leftmost-longest; a `single_word` token only matches between non-word characters, `lstrip` /
`rstrip` tokens take the whitespace on their left / right; with `split_special_tokens` a matched special
token is skipped and its text stays ordinary text. Only the stdlib is imported (Hub loader rule).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

# Rust regex `\s` (the Unicode White_Space property), which tokenizers strips for lstrip/rstrip
_WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))
)
# letters outside category L that Unicode counts as Alphabetic (circled / squared Latin letters)
_ALPHABETIC_SYMBOLS = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169), (0x1F170, 0x1F189))


def _is_word_char(ch: str) -> bool:
    """Rust regex `\\w`: Alphabetic, marks, decimal digits, connector punctuation, joiners."""
    category = unicodedata.category(ch)
    if category[0] in "LM" or category in ("Nd", "Nl", "Pc") or ch in "\u200c\u200d":
        return True
    return any(lo <= ord(ch) <= hi for lo, hi in _ALPHABETIC_SYMBOLS)


class AddedTokenMatcher:
    """Finds one group of added tokens (all `normalized=False`, or all `normalized=True`) in a string."""

    def __init__(self, entries: list[tuple[str, int, Any]]) -> None:
        # entries: (pattern, token id, AddedToken); an empty pattern (content normalised away) never matches
        self._tokens: dict[str, tuple[int, Any]] = {}
        for pattern, token_id, token in entries:
            if pattern:
                self._tokens.setdefault(pattern, (token_id, token))
        # longest first: at one position Python's alternation takes the first alternative that matches
        ordered = sorted(self._tokens, key=len, reverse=True)
        self._regex = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def split(self, text: str, split_special_tokens: bool) -> list[tuple[int | None, int, int]]:
        """`text` as consecutive `(token id, start, end)` stretches; `None` = ordinary text."""
        if self._regex is None:
            return [(None, 0, len(text))]
        stretches: list[tuple[int | None, int, int]] = []
        done = 0  # end of the previous stretch
        for match in self._regex.finditer(text):
            start, stop = match.span()
            token_id, token = self._tokens[match.group()]
            if split_special_tokens and token.special:
                continue
            if token.single_word and (
                (start > 0 and _is_word_char(text[start - 1])) or (stop < len(text) and _is_word_char(text[stop]))
            ):
                continue
            if token.lstrip:  # the whitespace before, but not what the previous stretch took
                left = start
                while left > 0 and text[left - 1] in _WHITE_SPACE:
                    left -= 1
                start = max(left, done)
            if token.rstrip:
                while stop < len(text) and text[stop] in _WHITE_SPACE:
                    stop += 1
            if start >= stop:  # the previous token's rstrip took all of this one (it starts with whitespace)
                if start > stop:  # tokenizers panics here ("AddedVocabulary bad split")
                    raise ValueError(
                        f"added token {token.content!r} lies inside the whitespace the previous one stripped"
                    )
                continue  # an empty stretch, which tokenizers drops
            if done < start:
                stretches.append((None, done, start))
            stretches.append((token_id, start, stop))
            done = stop
        if done < len(text) or not stretches:
            stretches.append((None, done, len(text)))
        return stretches


def added_token_matchers(
    added_tokens: dict[int, Any], normalize: Callable[[str], str]
) -> tuple[AddedTokenMatcher, AddedTokenMatcher | None]:
    """(raw-text matcher, normalised-text matcher or None) for `{id: AddedToken}`."""
    raw = [(t.content, i, t) for i, t in added_tokens.items() if not t.normalized]
    normalized = [(normalize(t.content), i, t) for i, t in added_tokens.items() if t.normalized]
    return AddedTokenMatcher(raw), AddedTokenMatcher(normalized) if normalized else None
