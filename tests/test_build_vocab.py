"""build-vocab: layout, determinism, atomic write, coverage report, CLI behaviour."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roformer_rope.tokenization import build_vocab
from roformer_rope.tokenization.corpus import people_daily_lines, review_lines, split_held_out, untag

REPO = Path(__file__).resolve().parents[1]

# a corpus whose counts are known by hand (jieba, HMM off: 我们/喜欢/北京, 北京/欢迎/你们)
TINY = ["我们喜欢北京。"] * 3 + ["北京欢迎你们！"] * 2 + ["ABC 北京"]


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(TINY) + "\n\n", encoding="utf-8")
    return path


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    build_vocab.add_arguments(parser)
    return build_vocab.run(parser.parse_args(list(argv)))


def _read(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_layout_on_known_corpus(tiny_corpus, tmp_path):
    out = tmp_path / "vocab.txt"
    # --held-out-every 1000: nothing is held out of this 6-line corpus
    assert (
        _run(
            "--corpus", str(tiny_corpus), "--out", str(out), "--words", "3", "--held-out-every", "1000", "--no-progress"
        )
        == 0
    )
    tokens = _read(out)
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = tokens[5 : tokens.index("##" + tokens[5])]
    # 北/京 appear 6 times, most frequent first; upper case is folded like the tokenizer does
    assert chars[:2] == ["京", "北"] and "a" in chars and "A" not in chars
    assert set(chars) == {c for line in TINY for c in line.lower() if not c.isspace()}
    pieces = tokens[5 + len(chars) : 5 + 2 * len(chars)]
    assert pieces == ["##" + c for c in chars]
    # 北京 x6, then 喜欢/我们 x3 (tie broken by the string), 欢迎/你们 x2 are cut by --words 3
    assert tokens[5 + 2 * len(chars) :] == ["北京", "喜欢", "我们"]
    assert len(tokens) == len(set(tokens))


def test_min_char_count(tiny_corpus, tmp_path):
    out = tmp_path / "vocab.txt"
    _run(
        "--corpus",
        str(tiny_corpus),
        "--out",
        str(out),
        "--words",
        "0",
        "--min-char-count",
        "3",
        "--held-out-every",
        "1000",
        "--no-progress",
    )
    tokens = _read(out)
    assert "京" in tokens and "迎" not in tokens and "a" not in tokens  # 迎 x2, a x1


def test_deterministic(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(people_daily_lines(800)), encoding="utf-8")
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for out in (a, b):
        assert _run("--corpus", str(corpus), "--out", str(out), "--words", "500", "--no-progress") == 0
    assert a.read_bytes() == b.read_bytes()


def test_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "vocab.txt"
    out.write_text("old\n", encoding="utf-8")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)  # the atomic swap (roformer_rope.safe_write)
    with pytest.raises(OSError):
        build_vocab.write_vocab(["[PAD]", "new"], out)
    assert out.read_text(encoding="utf-8") == "old\n"  # the old file is untouched
    assert os.listdir(tmp_path) == ["vocab.txt"]  # and no temporary file is left behind
    monkeypatch.undo()
    build_vocab.write_vocab(["[PAD]", "new"], out)
    assert _read(out) == ["[PAD]", "new"]


def test_default_corpus_and_coverage_report(tmp_path, capsys):
    out = tmp_path / "vocab.txt"
    assert build_vocab.main(["--out", str(out), "--words", "5000"]) == 0
    captured = capsys.readouterr()
    assert "counting" in captured.err  # the tqdm progress bar
    assert "UNK rate" in captured.out and "tokens/char" in captured.out
    tokens = _read(out)
    assert 5000 < len(tokens) - 5 and tokens.count("中国") == 1
    _, held_out = split_held_out(people_daily_lines() + [t for t, _ in review_lines()])
    cov = build_vocab.coverage(held_out[:500], tokens)
    # every character of held-out text is almost always seen in training; words shorten the text
    assert cov.unk_rate < 0.002 and 0.5 < cov.tokens_per_char < 0.95
    words_only = build_vocab.coverage(held_out[:500], [t for t in tokens if len(t) == 1 or t[0] == "["])
    assert words_only.tokens_per_char > cov.tokens_per_char  # the words are actually used


def test_coverage_tokenization_matches_the_tokenizer(tmp_path):
    """The report's tokenization is the shipped tokenizer's (so its UNK rate is the real one)."""
    if importlib.util.find_spec("modeling_roformer_rope") is None:
        sys.path.insert(0, str(REPO))
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    out = tmp_path / "vocab.txt"
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(people_daily_lines(2000)), encoding="utf-8")
    _run("--corpus", str(corpus), "--out", str(out), "--words", "2000", "--no-progress")
    tokens = _read(out)
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(out))
    lines = [t for t, _ in review_lines(300)] + ["Hello WORLD 1998年 ＡＢＣ café 😀 " + "x" * 120]
    vocab = set(tokens)
    for line in lines:
        assert build_vocab.wobert_tokenize(line, vocab) == tokenizer.tokenize(line)


def test_untag_recovers_raw_text():
    assert untag("迈向/v  充满/v  希望/n  ——/w  １/２/m") == "迈向充满希望——１/２"
    assert people_daily_lines(1)[0] == "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）"
    labels = [label for _, label in review_lines(10)]
    assert labels == [1, 0] * 5


def test_bad_input_exits_nonzero_with_one_line(tmp_path, capsys):
    def fails(*argv: str) -> str:
        assert build_vocab.main([*argv, "--out", str(tmp_path / "v.txt"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("build-vocab: error: ") and "\n" not in err, err
        assert not (tmp_path / "v.txt").exists()
        return err

    assert "corpus file not found" in fails("--corpus", str(tmp_path / "missing.txt"))
    assert "--words >= 0" in fails("--words", "-1")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    assert "no non-empty line" in fails("--corpus", str(empty))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("今天\n".encode() + b"ok\n\xff\xfe bad\n")
    assert "latin.txt: line 3 is not UTF-8 text" in fails("--corpus", str(latin))
    good = tmp_path / "good.txt"
    good.write_text("我喜欢北京\n", encoding="utf-8")
    assert build_vocab.main(["--corpus", str(good), "--out", str(good), "--no-progress"]) == 2  # --out is the corpus
    err = capsys.readouterr().err.strip()
    assert err.startswith("build-vocab: error: ") and "--out" in err and "\n" not in err
    assert good.read_text(encoding="utf-8") == "我喜欢北京\n"


def test_cli_errors_carry_the_command_prefix(tmp_path, capsys):
    from roformer_rope.cli import main

    assert main(["build-vocab", "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "v.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("roformer-rope build-vocab: error: corpus file not found") and "missing.txt" in err


def test_standalone_module_entry_point(tiny_corpus, tmp_path):
    out = tmp_path / "vocab.txt"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "roformer_rope.tokenization.build_vocab",
            "--corpus",
            str(tiny_corpus),
            "--out",
            str(out),
            "--words",
            "2",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert _read(out)[-2:] == ["北京", "喜欢"]


def test_corpus_lines_end_at_bare_carriage_returns_too(tmp_path):
    from roformer_rope.tokenization.corpus import read_text_files

    old_mac = tmp_path / "mac.txt"
    old_mac.write_bytes("今天\r天气\r\n好\n\n".encode())
    assert list(read_text_files([old_mac])) == ["今天", "天气", "好"]
