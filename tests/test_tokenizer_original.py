"""Our tokenizer against the original RoFormer code's (bert4keras 0.10.4 + jieba 0.42.1) on real text.

Expected ids come from tests/fixtures/generate_bert4keras_tokens.py (run once in a Python 3.7 venv, committed):
the word-level checkpoints were trained with jieba words first, the character-level ones without jieba, and
`word_segmentation="auto"` picks each from the vocabulary alone.
"""

import json
from pathlib import Path

import pytest

from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "bert4keras_tokens"
MODES = {"words_jieba": "jieba", "chars": "none"}


@pytest.fixture(scope="module")
def fixture():
    texts = json.loads((FIXTURES / "texts.json").read_text(encoding="utf-8"))
    expected = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
    return texts, expected


def _mismatches(got, want, inputs) -> list[str]:
    return [f"{text!r}: {g} != {w}" for text, g, w in zip(inputs, got, want) if g != w]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_ids_and_segments_equal_the_original_code(fixture, mode):
    texts, expected = fixture
    want = expected[mode]
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(FIXTURES / want["vocab"]))  # word_segmentation="auto"
    assert tokenizer.init_kwargs["word_segmentation"] == MODES[mode]
    singles = tokenizer(texts["singles"], return_token_type_ids=True)
    got = [[ids, types] for ids, types in zip(singles["input_ids"], singles["token_type_ids"])]
    bad = _mismatches(got, want["singles"], texts["singles"])
    assert not bad, f"{len(bad)} of {len(got)} lines differ from bert4keras, e.g.\n" + "\n".join(bad[:3])
    firsts, seconds = zip(*texts["pairs"])
    pairs = tokenizer(list(firsts), list(seconds), return_token_type_ids=True)
    got = [[ids, types] for ids, types in zip(pairs["input_ids"], pairs["token_type_ids"])]
    bad = _mismatches(got, want["pairs"], texts["pairs"])
    assert not bad, f"{len(bad)} of {len(got)} pairs differ from bert4keras, e.g.\n" + "\n".join(bad[:3])


def test_character_level_vocabulary_is_not_cut_by_jieba_first():
    """Where jieba changes a character-level checkpoint's ids (full-width digits, symbol runs), "auto" follows
    the original code (no jieba); "jieba" forced gives the built-in RoFormerTokenizer's reading."""
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(FIXTURES / "vocab_chars.txt"))
    forced = RoFormerRopeTokenizer(vocab_file=str(FIXTURES / "vocab_chars.txt"), word_segmentation="jieba")
    assert tokenizer.tokenize("１９９８年") == ["１", "##９", "##９", "##８", "年"]
    assert forced.tokenize("１９９８年") == ["１", "９", "９", "８", "年"]
    # ～ is a symbol (Sm), not punctuation: it continues a word
    assert tokenizer.tokenize("C++ 好～～") == ["c", "+", "+", "好", "～", "##～"]


def test_word_segmentation_is_saved_resolved_and_checked(tmp_path):
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(FIXTURES / "vocab_chars.txt"))
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["word_segmentation"] == "none"
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    assert reloaded.tokenize("１９９８年") == tokenizer.tokenize("１９９８年")
    with pytest.raises(ValueError, match="word_segmentation must be one of"):
        RoFormerRopeTokenizer(vocab_file=str(FIXTURES / "vocab_chars.txt"), word_segmentation="words")


def test_cached_token_streams_know_the_segmentation_mode():
    """The same vocabulary cut with or without jieba gives other ids: a pretraining stream made one way is not
    reused for the other."""
    from types import SimpleNamespace

    from roformer_rope.scripts.mlm_data import stream_fingerprint

    texts = SimpleNamespace(_fingerprint="corpus")
    vocab = str(FIXTURES / "vocab_chars.txt")
    prints = {
        mode: stream_fingerprint(texts, RoFormerRopeTokenizer(vocab_file=vocab, word_segmentation=mode))
        for mode in ("jieba", "none")
    }
    assert prints["jieba"] != prints["none"]
