"""convert-hf on folders as transformers v5 saves them: the tokenizer from tokenizer.json, untied LM heads."""

import json
import logging

import pytest
import torch
import transformers
from tokenizers import AddedToken

from conftest import builtin_model, padded_batch
from roformer_rope.conversion.from_transformers import ConversionError, convert_folder

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "今", "天", "气", "非", "常", "好", "今天", "天气", "非常"]
VOCAB += ["我", "爱", "北京", "hello", "##s", "!"]
TEXTS = ["今天天气非常好", "我爱北京天安门", "Hello 北京!", "hellos, 今天好冷"]  # 安门, 冷, "," are not in VOCAB


def save_v5_folder(folder, **tokenizer_kwargs) -> transformers.PreTrainedTokenizerBase:
    """A built-in MaskedLM + RoFormerTokenizer saved by transformers v5: tokenizer.json, no vocab.txt."""
    tokenizer = transformers.RoFormerTokenizer(vocab={t: i for i, t in enumerate(VOCAB)}, **tokenizer_kwargs)
    builtin_model("RoFormerForMaskedLM", vocab_size=len(VOCAB)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file() and not (folder / "vocab.txt").exists()
    return tokenizer


@pytest.mark.parametrize("do_lower_case", [True, False])
def test_v5_folder_gets_our_tokenizer_from_tokenizer_json(tmp_path, do_lower_case):
    save_v5_folder(tmp_path / "builtin", do_lower_case=do_lower_case)
    out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    assert (out / "vocab.txt").read_text(encoding="utf-8").splitlines() == VOCAB
    assert not (out / "tokenizer.json").exists()
    ours = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert type(ours).__name__ == "RoFormerRopeTokenizer"
    builtin = transformers.AutoTokenizer.from_pretrained(tmp_path / "builtin")
    assert type(builtin).__name__ == "RoFormerTokenizer"
    for text in TEXTS:
        assert ours(text)["input_ids"] == builtin(text)["input_ids"], text
    assert builtin(TEXTS[1])["input_ids"].count(VOCAB.index("[UNK]")) == 2  # the out-of-vocabulary case is tested
    assert (builtin(TEXTS[2])["input_ids"][1] == VOCAB.index("hello")) == do_lower_case


def test_v5_folder_special_tokens_are_carried_over(tmp_path):
    save_v5_folder(tmp_path / "builtin", unk_token="[MASK]", mask_token="[UNK]")  # swapped: not the defaults
    out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    ours = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    builtin = transformers.RoFormerTokenizer.from_pretrained(tmp_path / "builtin")
    assert (ours.unk_token, ours.mask_token) == ("[MASK]", "[UNK]")
    for text in TEXTS:
        assert ours(text)["input_ids"] == builtin(text)["input_ids"], text


ADDED_TEXTS = ["北京[E1]今天[E2]好", "[e1] hello [E2]!", "我爱[E1][E1]北京"]


def _v4_layout(folder, legacy: bool) -> None:
    """Rewrite a v5-saved built-in tokenizer as older transformers saved it: vocab.txt and the added tokens in
    tokenizer_config.json's `added_tokens_decoder` (v4.34+), or, `legacy`, in added_tokens.json with the special
    tokens in special_tokens_map.json; no tokenizer.json."""
    saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = saved["model"]["vocab"]
    (folder / "vocab.txt").write_text("".join(t + "\n" for t in sorted(vocab, key=vocab.get)), encoding="utf-8")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    extra = config.pop("extra_special_tokens")
    added = [a for a in saved["added_tokens"] if a["id"] >= len(vocab)]
    if legacy:
        (folder / "added_tokens.json").write_text(json.dumps({a["content"]: a["id"] for a in added}))
        specials = {key: config.pop(key) for key in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
        (folder / "special_tokens_map.json").write_text(json.dumps({**specials, "extra_special_tokens": extra}))
    else:
        fields = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
        config["added_tokens_decoder"] = {str(a["id"]): {k: a[k] for k in fields} for a in saved["added_tokens"]}
        config["additional_special_tokens"] = extra
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize("layout", ["v5", "v4", "v4-legacy"])
def test_added_tokens_and_settings_are_carried_over_as_transformers_loads_them(tmp_path, layout):
    """Added tokens (a normalised one and an extra special one, past the vocabulary), `strip_accents` and special
    tokens named in special_tokens_map.json reach the converted tokenizer with the built-in's ids, in each layout
    transformers has saved tokenizers in (they used to be dropped: `[E1]` cut into pieces, accents stripped, a
    special_tokens_map.json `<unk>` replaced by `[UNK]`)."""
    vocab = VOCAB + ["<unk>", "é", "e"]
    source = tmp_path / "builtin"
    tokenizer = transformers.RoFormerTokenizer(vocab={t: i for i, t in enumerate(vocab)}, strip_accents=False, unk_token="<unk>")
    tokenizer.add_tokens(["[E1]"])
    tokenizer.add_special_tokens({"extra_special_tokens": [AddedToken("[E2]", lstrip=True, rstrip=True, special=True)]})
    builtin_model("RoFormerForMaskedLM", vocab_size=len(tokenizer)).save_pretrained(source)
    tokenizer.save_pretrained(source)
    builtin = transformers.AutoTokenizer.from_pretrained(source)
    assert len(builtin) == len(vocab) + 2 and builtin.unk_token == "<unk>"
    if layout != "v5":
        _v4_layout(source, legacy=layout == "v4-legacy")
        # the rewritten folder holds the same tokens as transformers reads them (its RoFormerTokenizer, built from a
        # vocab.txt, then cuts words by another vocabulary: the v5-loaded one is the ids' oracle)
        reread = transformers.AutoTokenizer.from_pretrained(source)
        past_vocab = [(i, str(t), t.special) for i, t in builtin.added_tokens_decoder.items() if i >= len(vocab)]
        assert [(i, str(t), t.special) for i, t in reread.added_tokens_decoder.items() if i >= len(vocab)] == past_vocab
        assert (reread.unk_token, reread.all_special_tokens) == ("<unk>", builtin.all_special_tokens)
    out = convert_folder(source, tmp_path / "converted")
    ours = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert (len(ours), ours.unk_token, ours.all_special_tokens) == (len(builtin), "<unk>", builtin.all_special_tokens)
    for text in ADDED_TEXTS + ["é e É 冷"]:
        assert ours(text)["input_ids"] == builtin(text)["input_ids"], text
    if layout != "v4-legacy":  # added_tokens.json holds no flags
        flags = [(i, str(t), t.lstrip, t.rstrip, t.normalized, t.special) for i, t in builtin.added_tokens_decoder.items()]
        assert [(i, str(t), t.lstrip, t.rstrip, t.normalized, t.special) for i, t in ours.added_tokens_decoder.items()
                if i >= len(vocab)] == [f for f in flags if f[0] >= len(vocab)]  # fmt: skip
    assert builtin("É 冷")["input_ids"][1:-1] == [vocab.index("é"), vocab.index("<unk>")]  # accent kept, <unk>
    assert ours("[e1]")["input_ids"][1:-1] == [len(vocab)]  # normalised added token: matched lower-cased


def test_added_tokens_with_a_gap_in_their_ids_are_refused_by_name(tmp_path):
    source = tmp_path / "builtin"
    save_v5_folder(source)
    saved = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    saved["added_tokens"].append({"id": len(VOCAB) + 1, "content": "[E9]", "special": True, "normalized": False})
    (source / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ConversionError, match=r"added token '\[E9\]' has id 21 there but would get 20 here"):
        convert_folder(source, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_a_character_vocabulary_keeps_the_builtin_cut_when_asked(tmp_path, caplog):
    """The built-in RoFormerTokenizer cuts every vocabulary with jieba; a character vocabulary converts to the
    original code's cut (no jieba: `１９９８` stays one word of WordPiece pieces), with a warning naming the flag
    that keeps the built-in's, and `word_segmentation="jieba"` gives the built-in's ids."""
    chars = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "１", "##９", "##８", "９", "８", "年"]
    source = tmp_path / "builtin"
    builtin = transformers.RoFormerTokenizer(vocab={t: i for i, t in enumerate(chars)})
    builtin_model("RoFormerForMaskedLM", vocab_size=len(chars)).save_pretrained(source)
    builtin.save_pretrained(source)
    text = "１９９８年"
    with caplog.at_level(logging.WARNING):
        original = transformers.AutoTokenizer.from_pretrained(
            convert_folder(source, tmp_path / "auto"), trust_remote_code=True
        )
    assert any("--word-segmentation jieba" in r.getMessage() for r in caplog.records)
    assert original.tokenize(text) == ["１", "##９", "##９", "##８", "年"]
    cut = transformers.AutoTokenizer.from_pretrained(
        convert_folder(source, tmp_path / "jieba", word_segmentation="jieba"), trust_remote_code=True
    )
    assert cut(text)["input_ids"] == builtin(text)["input_ids"] != original(text)["input_ids"]


def test_generation_defaults_are_carried_over(tmp_path):
    """A causal LM's generation_config.json (eos ids, penalties, lengths) comes along: `generate()` with no
    arguments gives the built-in's tokens (it used to stop at the model config's defaults)."""
    source = tmp_path / "builtin"
    builtin = builtin_model("RoFormerForCausalLM")
    builtin.generation_config = transformers.GenerationConfig(
        eos_token_id=[3, 7], repetition_penalty=1.3, max_new_tokens=40, bos_token_id=2, pad_token_id=0
    )
    builtin.save_pretrained(source)
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        convert_folder(source, tmp_path / "converted"), trust_remote_code=True
    ).eval()
    for key in ("eos_token_id", "repetition_penalty", "max_new_tokens"):
        assert getattr(ours.generation_config, key) == getattr(builtin.generation_config, key), key
    prompt = torch.tensor([[2, 5, 17]])
    with torch.no_grad():
        expected, actual = builtin.generate(prompt), ours.generate(prompt)
    assert expected.shape[1] > 23  # past the model config's 20-token default
    assert actual.tolist() == expected.tolist()


def test_tokenizer_json_with_gaps_in_ids_is_refused(tmp_path):
    source = tmp_path / "builtin"
    save_v5_folder(source)
    saved = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    saved["model"]["vocab"]["!"] = len(VOCAB) + 5
    (source / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ConversionError, match=r"tokenizer\.json: model\.vocab ids are not contiguous"):
        convert_folder(source, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_folder_without_any_tokenizer_converts_with_a_warning(tmp_path, caplog):
    builtin_model("RoFormerForMaskedLM").save_pretrained(tmp_path / "builtin")
    with caplog.at_level(logging.INFO):
        out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    assert (out / "model.safetensors").is_file() and not (out / "vocab.txt").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no tokenizer written" in message for message in warnings), warnings


@pytest.mark.parametrize(
    "class_name, auto_class",
    [("RoFormerForMaskedLM", "AutoModelForMaskedLM"), ("RoFormerForCausalLM", "AutoModelForCausalLM")],
)
def test_untied_lm_head_uses_the_decoder_bias(tmp_path, caplog, class_name, auto_class):
    builtin = builtin_model(class_name, tie_word_embeddings=False)
    head = builtin.cls.predictions
    assert head.bias.data_ptr() != head.decoder.bias.data_ptr()  # two tensors, as after untied training
    with torch.no_grad():
        head.bias.fill_(3.0)
        head.decoder.bias.copy_(torch.linspace(-1, 1, head.decoder.bias.numel()))
    builtin.save_pretrained(tmp_path / "builtin")
    with caplog.at_level(logging.INFO):
        out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    assert any("'cls.predictions.bias'" in r.getMessage() for r in caplog.records)
    ours = getattr(transformers, auto_class).from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        expected, actual = builtin(**padded_batch()).logits, ours(**padded_batch()).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_checkpoint_converts_and_keeps_its_precision(tmp_path, dtype):
    """The stored sinusoid table is the standard one rounded to the checkpoint's dtype; the mapping is verified in
    float32 and the folder is written in the checkpoint's dtype."""
    builtin = builtin_model("RoFormerForMaskedLM")
    builtin.to(dtype).save_pretrained(tmp_path / "builtin")
    out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    ours = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, dtype="auto").eval()
    assert ours.dtype == dtype
    reference = builtin_model("RoFormerForMaskedLM")  # the same weights, rounded to dtype and back
    reference.load_state_dict({k: v.to(dtype).float() for k, v in reference.state_dict().items()})
    with torch.no_grad():
        expected = reference(**padded_batch()).logits
        actual = ours.float()(**padded_batch()).logits
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)  # the table: exact vs rounded to dtype


def test_missing_or_unknown_weights_are_refused_not_drawn_at_random(tmp_path):
    from safetensors.torch import load_file, save_file

    builtin_model("RoFormerForMaskedLM").save_pretrained(tmp_path / "builtin")
    weights_file = tmp_path / "builtin" / "model.safetensors"
    weights = load_file(weights_file)
    del weights["roformer.encoder.layer.0.output.LayerNorm.weight"]
    weights["roformer.encoder.layer.0.extra.weight"] = torch.zeros(2)
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"do not fit RoFormerForMaskedLM: 1 missing \(roformer.encoder.layer.0.output"
                       r".LayerNorm.weight\); 1 unexpected \(roformer.encoder.layer.0.extra.weight\)"):  # fmt: skip
        convert_folder(tmp_path / "builtin", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_a_mis_shaped_weight_is_refused_by_name_and_a_missing_sinusoid_table_is_rebuilt(tmp_path):
    from safetensors.torch import load_file, save_file

    builtin_model("RoFormerForMaskedLM").save_pretrained(tmp_path / "builtin")
    weights_file = tmp_path / "builtin" / "model.safetensors"
    weights = load_file(weights_file)
    del weights["roformer.encoder.embed_positions.weight"]  # a function of its shape: transformers rebuilds it
    save_file(weights, weights_file, metadata={"format": "pt"})
    convert_folder(tmp_path / "builtin", tmp_path / "converted")
    weights["roformer.encoder.layer.1.intermediate.dense.bias"] = torch.zeros(3)
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"1 mismatched \(.*roformer.encoder.layer.1.intermediate.dense.bias"):
        convert_folder(tmp_path / "builtin", tmp_path / "converted2")
    assert not (tmp_path / "converted2").exists()


@pytest.mark.parametrize("positions", [1, 8])
def test_a_position_table_shorter_than_the_check_batch_converts(tmp_path, positions):
    builtin_model("RoFormerForMaskedLM", max_position_embeddings=positions).save_pretrained(tmp_path / "builtin")
    out = convert_folder(tmp_path / "builtin", tmp_path / "converted")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == positions


def test_a_config_returning_tuples_is_still_checked_and_keeps_returning_tuples(tmp_path, monkeypatch):
    """`return_dict: false` in the built-in's config.json: the output check still compares the outputs (it used to
    compare nothing, pass, and write a broken conversion), and the converted model returns tuples as the source did."""
    from roformer_rope.conversion import from_transformers

    builtin = builtin_model("RoFormerForSequenceClassification", num_labels=3)
    builtin.config.return_dict = False
    builtin.save_pretrained(tmp_path / "builtin")
    convert = from_transformers.convert_model

    def broken(model, *args, **kwargs):  # a mapping slip: the classifier's weights shifted
        ours = convert(model, *args, **kwargs)
        with torch.no_grad():
            ours.classifier.out_proj.weight.add_(1.0)
        return ours

    monkeypatch.setattr(from_transformers, "convert_model", broken)
    with pytest.raises(ConversionError, match=r"verification failed: logits differs from the built-in by"):
        convert_folder(tmp_path / "builtin", tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
    monkeypatch.setattr(from_transformers, "convert_model", convert)
    convert_folder(tmp_path / "builtin", tmp_path / "converted")
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["return_dict"] is False
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "converted", trust_remote_code=True
    )
    inputs = padded_batch()
    with torch.no_grad():
        got, want = model(**inputs), builtin(**inputs)
    assert isinstance(got, tuple) and isinstance(want, tuple)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
