"""Jieba word segmentation for `RoFormerRopeTokenizer`, and the user dictionary it saves.

Only the stdlib is imported at module level: rjieba / jieba are optional, and the Hub loader refuses a
remote-code file whose top-level imports are missing, so they are imported where the segmenter is built.

User words (`jieba_words=`, `add_jieba_words`, `jieba_dict.txt`) must be segmentable by jieba:
jieba cuts text at whitespace before it looks words up (both jieba and rjieba), so a word containing
whitespace could never come out whole, and its dictionary format (`word [freq] [tag]`, split on
whitespace) could not store it. Such words are refused with a `ValueError` when added or read.
"""

from __future__ import annotations

import importlib.util
import logging
import operator
import re
from typing import Any

# (word, freq or None) as jieba's `add_word` takes them; None lets jieba pick the frequency
JiebaWord = tuple[str, int | None]

_TAG = re.compile(r"[A-Za-z]+")  # a part-of-speech tag (`n`, `nr`, `ns`, ...), read and ignored

logger = logging.getLogger(__name__)


class JiebaSegmenter:
    """`text -> [word]` (jieba with HMM off; the words cover the text) plus the user's dictionary.

    The backend (rjieba's Rust segmenter, or jieba) is created lazily and dropped when pickled, so
    the segmenter can cross process boundaries; only the custom words travel and are re-applied.
    Without custom words the process-wide default dictionary is shared (as the built-in does).
    """

    def __init__(self, words: list[JiebaWord] | None = None) -> None:
        self.words: list[JiebaWord] = list(words or [])
        self._tokenize = None
        self.backend: str | None = None  # "rjieba" or "jieba" once built

    def __getstate__(self) -> dict[str, Any]:
        return {"words": self.words, "_tokenize": None, "backend": None}

    def add_words(self, words: list[JiebaWord]) -> None:
        self.words.extend(words)
        self._tokenize = None  # rebuilt with the new words on next use

    def _build(self):
        try:
            import rjieba
        except ImportError:
            rjieba = None
        # A frequency of 0 is jieba's way of deleting a word (it leaves the word out of every cut); rjieba keeps
        # such a word and scores it log 0 = -inf, which can sink a whole sentence's best path: jieba itself, if
        # installed, segments for such a dictionary (and is imported only where it segments).
        deleting = any(freq == 0 for _, freq in self.words)
        if rjieba is not None and (not deleting or not _installed("jieba")):
            if deleting:
                logger.warning(
                    "jieba words with frequency 0 are cut as jieba cuts them only by the jieba package (pip install "
                    "jieba); rjieba may still cut them out"
                )  # fmt: skip
            seg = rjieba.Jieba() if self.words else rjieba  # the module cuts with its default instance
            add_words_as_jieba_does(seg, self.words)
            self.backend = "rjieba"
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
        self.backend = "jieba"
        return lambda text: list(seg.cut(text, HMM=False))

    def __call__(self, text: str) -> list[str]:
        if self._tokenize is None:
            self._tokenize = self._build()
        return self._tokenize(text)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # `sys.modules[name] = None`, the way to hide a package
        return False


# A dictionary entry no text can reach: jieba looks words up only inside runs of CJK, letters, digits and `+#&._%-`
# (both jieba and rjieba), so this word is never cut out; its frequency only adds to the dictionary's total.
_TOTAL_PAD = "\x00"


def add_words_as_jieba_does(seg, words: list[JiebaWord]) -> None:
    """Add `words` to the rjieba segmenter `seg` with jieba's arithmetic, so that it cuts as jieba (the original
    code's segmenter) does.

    Re-adding a word the dictionary holds, jieba adds the new frequency to its total and leaves the old one counted;
    rjieba (jieba-rs) replaces the old frequency in its total. Every word's probability is its frequency over that
    total, so ties in the best cut then break differently: one re-added word (`这样`, 100) turned jieba's `相结合`
    into `相 | 结合`. The difference, the old frequencies, is kept in the total through `_TOTAL_PAD`, set after each
    such word, so a later word without a frequency is suggested one from the same total. Not emulated: the two
    suggest a frequency with different rounding (±1, jieba multiplies shares, jieba-rs adds logarithms), so a
    dictionary holding many words without frequencies may still cut a rare line differently; frequency 0 is left to
    jieba (`_build`)."""
    replaced = 0  # old frequencies jieba still counts and rjieba dropped
    held: dict[str, int] = {}  # frequencies set here, for a word added twice
    known, unknown = None, []
    for word, freq in words:
        old = held.get(word)
        if old is None and seg.has_word(word):
            known = _dictionary_frequencies({w for w, _ in words}) if known is None else known
            old = known.get(word)
            if old is None:
                unknown.append(word)
        held[word] = seg.add_word(word, freq, None)  # the frequency set (rjieba's suggestion for None)
        if old:
            replaced += old
            seg.add_word(_TOTAL_PAD, replaced, None)
    if unknown:
        logger.warning(
            "%d jieba words are in rjieba's dictionary with frequencies unknown without the jieba package "
            "(pip install jieba), e.g. %r: cuts near them may differ from jieba's", len(unknown), unknown[0]
        )  # fmt: skip


def _dictionary_frequencies(words: set[str]) -> dict[str, int]:
    """Frequencies of `words` in jieba's default dictionary (the one rjieba embeds, whatever `jieba.set_dictionary`
    chose for jieba's own default instance), {} without the jieba package."""
    try:
        import jieba
    except ImportError:
        return {}
    found = {}
    with jieba.Tokenizer().get_dict_file() as handle:  # `word freq [tag]` lines; a later line wins, as in jieba
        for line in handle:
            word, freq = line.decode("utf-8").split(" ", 2)[:2]
            if word in words:
                found[word] = int(freq)
    return found


def as_jieba_words(words: list[str | tuple[str, int | None]]) -> list[JiebaWord]:
    """`word` or `(word, freq)` entries as `(word, freq)`, refusing what jieba cannot segment or
    `jieba_dict.txt` cannot store (see the module docstring)."""
    out = []
    for entry in words:
        word, freq = (entry, None) if isinstance(entry, str) else (entry[0], entry[1])  # a tag is ignored
        if not isinstance(word, str) or not word or any(ch.isspace() for ch in word):
            raise ValueError(
                f"jieba word {word!r} is empty or contains whitespace: jieba cuts text at whitespace, "
                "so it could never segment this word whole"
            )
        if freq is not None:
            # an int written back as digits: a bool, float or negative would not read back as itself
            if isinstance(freq, bool) or not hasattr(freq, "__index__") or operator.index(freq) < 0:
                raise ValueError(f"jieba word {word!r}: the frequency must be an int >= 0 or None, got {freq!r}")
            freq = operator.index(freq)
        out.append((word, freq))
    return out


def read_jieba_dict(path: str) -> list[JiebaWord]:
    """Words of a jieba user dictionary: one `word [freq] [tag]` per line, fields split on whitespace.

    A line that does not fit (e.g. `北京 大学`: a word holding a space) raises instead of being cut
    into a different word.
    """
    words = []
    with open(path, encoding="utf-8-sig") as handle:  # -sig: a leading BOM is not part of the first word
        for number, line in enumerate(handle, 1):
            parts = line.split()
            if not parts:
                continue
            word, rest = parts[0], parts[1:]
            freq = int(rest.pop(0)) if rest and rest[0].isdecimal() else None
            if len(rest) > 1 or (rest and not _TAG.fullmatch(rest[0])):
                raise ValueError(
                    f"{path}:{number}: {line.strip()!r} is not `word [freq] [tag]`; "
                    "a jieba word cannot contain whitespace"
                )
            words.append((word, freq))
    return words


def write_jieba_dict(path: str, words: list[JiebaWord]) -> None:
    """Write `words` as `word [freq]` lines, the format `read_jieba_dict` reads back."""
    with open(path, "w", encoding="utf-8") as handle:
        for word, freq in words:
            handle.write(word + ("" if freq is None else f" {freq}") + "\n")
