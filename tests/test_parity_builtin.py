"""Converted built-in transformers RoFormer models must give the built-in's outputs (atol 1e-5)."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import builtin_model, padded_batch
from roformer_rope.conversion.from_transformers import (
    ConversionError,
    convert_folder,
    convert_model,
    convert_state_dict,
)

HEADS = [
    "RoFormerModel",
    "RoFormerForMaskedLM",
    "RoFormerForCausalLM",
    "RoFormerForSequenceClassification",
    "RoFormerForTokenClassification",
    "RoFormerForQuestionAnswering",
    "RoFormerForMultipleChoice",
]
OUTPUT_KEYS = ("last_hidden_state", "logits", "start_logits", "end_logits")
MAX_DIFFS: dict[str, float] = {}  # filled by the parity tests; `pytest tests/test_parity_builtin.py -s` prints them


def inputs_for(class_name: str) -> dict:
    batch = padded_batch()
    if class_name == "RoFormerForMultipleChoice":  # (B, N, T): three choices per example
        batch = {k: torch.stack([v, v.roll(1, dims=1), v.flip(0)], dim=1) for k, v in batch.items()}
    return batch


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("embedding_size", [None, 16])
@pytest.mark.parametrize("rotary_value", [False, True])
@pytest.mark.parametrize("class_name", HEADS)
def test_every_head_matches_builtin(class_name, rotary_value, embedding_size, attn):
    builtin = builtin_model(class_name, rotary_value=rotary_value, embedding_size=embedding_size)
    ours = convert_model(builtin)
    ours.set_attn_implementation(attn)
    inputs = inputs_for(class_name)
    with torch.no_grad():
        expected, actual = builtin(**inputs), ours(**inputs)
    compared = 0
    for key in OUTPUT_KEYS:
        if expected.get(key) is not None:
            torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-5)
            name = f"{class_name} {key} {attn}"
            MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), (actual[key] - expected[key]).abs().max().item())
            compared += 1
    assert compared >= 1


@pytest.mark.parametrize("class_name", ["RoFormerForMultipleChoice", "RoFormerForSequenceClassification"])
def test_heads_drop_out_where_the_builtin_does(class_name):
    """In training mode, with the encoder's dropout off, a head equals the built-in's only if both drop out in the
    same places: multiple choice has no dropout before its classifier, sequence classification has."""
    builtin = builtin_model(class_name, hidden_dropout_prob=0.3)
    ours = convert_model(builtin)
    for model in (builtin, ours):
        for module in model.base_model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        model.train()
    inputs = inputs_for(class_name)
    torch.manual_seed(0)
    expected = builtin(**inputs).logits
    torch.manual_seed(0)
    actual = ours(**inputs).logits
    if class_name == "RoFormerForMultipleChoice":
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # the same dropout draws are not guaranteed: check that both are random in training mode
        assert not torch.equal(ours(**inputs).logits, actual) and not torch.equal(builtin(**inputs).logits, expected)


def test_hidden_states_and_attentions_match_builtin():
    builtin = builtin_model("RoFormerModel")
    ours = convert_model(builtin)
    ours.set_attn_implementation("eager")
    with torch.no_grad():
        expected = builtin(**padded_batch(), output_hidden_states=True, output_attentions=True)
        actual = ours(**padded_batch(), output_hidden_states=True, output_attentions=True)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 3
    for a, b in zip(actual.hidden_states, expected.hidden_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(actual.attentions, expected.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def generation_pair(attn: str):
    """(built-in causal LM, ours converted from it on `attn`, a (2, 5) prompt)."""
    builtin = builtin_model("RoFormerForCausalLM", max_position_embeddings=128)
    ours = convert_model(builtin)
    ours.set_attn_implementation(attn)
    return builtin, ours, torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_generation_matches_builtin(attn):
    builtin, ours, prompt = generation_pair(attn)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = builtin.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    for use_cache in (True, False):
        actual = ours.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=use_cache, **kwargs)
        assert torch.equal(actual, expected), f"use_cache={use_cache}"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_static_cache_generation_matches_builtin(attn):
    """`cache_implementation="static"` (transformers' compileable cache) asks the model for its masks first."""
    builtin, ours, prompt = generation_pair(attn)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    expected = builtin.generate(prompt, **kwargs)
    assert torch.equal(ours.generate(prompt, cache_implementation="static", **kwargs), expected)
    left_padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt[:1, :3]], dim=1)  # (1, 5)
    mask = (left_padded != 0).long()
    kwargs.update(attention_mask=mask)
    assert torch.equal(
        ours.generate(left_padded, cache_implementation="static", **kwargs), ours.generate(left_padded, **kwargs)
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_static_cache_steps_attend_over_the_written_slots_only(attn, monkeypatch):
    """Eager steps with a static cache attend over the past + T written slots, not all `max_cache_len`, and give the
    built-in's logits at every step; under tracing (torch.compile / export) the fixed shape stays."""
    from transformers import DynamicCache, StaticCache

    from modeling_roformer_rope import attention_roformer_rope as attention

    builtin, ours, prompt = generation_pair(attn)
    seen = []
    choose = attention.softmax_attention_function

    def recording(config):
        function = choose(config)

        def record(module, query, key, value, mask, **kwargs):
            seen.append((key.shape[-2], None if mask is None else mask.shape[-1]))
            return function(module, query, key, value, mask, **kwargs)

        return record

    monkeypatch.setattr(attention, "softmax_attention_function", recording)
    steps = [prompt, prompt[:, :1] + 1, prompt[:, 1:2] + 2]  # a 5-token prompt, then two one-token steps
    for traced in (False, True):
        monkeypatch.setattr(attention, "tracing", lambda traced=traced: traced)
        seen.clear()
        static, dynamic, past = StaticCache(config=ours.config, max_cache_len=16), DynamicCache(), 0
        with torch.no_grad():
            for ids in steps:
                mask = torch.ones(2, past + ids.shape[1], dtype=torch.long)  # (B, past + T), as generate passes it
                got = ours(ids, attention_mask=mask, cache=static, use_cache=True)
                want = builtin(ids, attention_mask=mask, cache=dynamic, use_cache=True)
                torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
                past += ids.shape[1]
        layers = ours.config.num_hidden_layers
        if traced:
            assert {key for key, _ in seen} == {16}
        else:
            assert [key for key, _ in seen] == [5] * layers + [6] * layers + [7] * layers
        assert all(masked in (None, key) for key, masked in seen)


def test_unknown_and_missing_keys_raise():
    builtin = builtin_model("RoFormerForMaskedLM")
    state = builtin.state_dict()
    with pytest.raises(ConversionError, match="unknown built-in RoFormer weight 'roformer.extra.weight'"):
        convert_state_dict({**state, "roformer.extra.weight": torch.zeros(1)})
    state.pop("roformer.encoder.layer.1.attention.self.key.weight")
    with pytest.raises(ConversionError, match=r"layers\.1\.attention: missing \['key'\]"):
        convert_state_dict(state)


def test_convert_hf_cli_writes_a_loadable_folder(tmp_path):
    builtin = builtin_model("RoFormerForMaskedLM")
    source = tmp_path / "builtin"
    builtin.save_pretrained(source)
    (source / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "今", "天"]) + "\n")
    out = tmp_path / "converted"
    result = subprocess.run(
        [sys.executable, "-m", "roformer_rope.cli", "convert-hf", "--model", str(source), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").is_file() and (out / "modeling_roformer_rope.py").is_file()
    assert (out / "vocab.txt").is_file() and not (out / "tokenizer.json").exists()
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(**padded_batch()).logits, builtin(**padded_batch()).logits, atol=1e-5, rtol=1e-5
        )
    # Refuses to overwrite, and a bad input leaves nothing behind.
    again = subprocess.run(
        [sys.executable, "-m", "roformer_rope.cli", "convert-hf", "--model", str(source), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    with pytest.raises(ConversionError, match="config.json: not found"):
        convert_folder(tmp_path / "nowhere", tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builtin", "converted"]


@pytest.mark.parametrize("length, bound", [(512, 1e-5), (4096, 1e-4)])
def test_long_inputs_differ_only_by_the_float32_rotary_angles(length, bound):
    """Our angles m·θ are formed in float32 (as the original code forms them); the built-in's sin/cos table in
    float64, then rounded. The gap grows with the position: hidden states at 4,096 tokens (64-dim heads) stay
    within 1e-4 (README quotes the printed figures); a real mapping slip would be O(1)."""
    builtin = builtin_model(
        "RoFormerModel", hidden_size=128, num_attention_heads=2, intermediate_size=64, max_position_embeddings=length
    )
    ours = convert_model(builtin).eval()
    ids = torch.randint(5, 99, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(input_ids=ids).last_hidden_state - builtin(input_ids=ids).last_hidden_state).abs().max().item()
    MAX_DIFFS[f"long {length} hidden_states"] = diff
    assert diff < bound


def test_report_max_differences():
    """Printed with `pytest tests/test_parity_builtin.py -s`: the figures quoted in the README."""
    for name, diff in sorted(MAX_DIFFS.items()):
        print(f"{name}: {diff:.1e}")


def test_multiple_choice_summary_type_is_carried_over_or_refused():
    """The built-in's summary reads `summary_type` ("last" when unset); it used to be converted as "last" always."""
    for summary_type, expected in ((None, "last"), ("first", "first"), ("last", "last")):
        extra = {"summary_type": summary_type} if summary_type else {}
        assert convert_model(builtin_model("RoFormerForMultipleChoice", **extra)).config.summary_type == expected
    with pytest.raises(ConversionError, match="summary_type='mean'"):
        convert_model(builtin_model("RoFormerForMultipleChoice", summary_type="mean"))
    with pytest.raises(ConversionError, match="summary_use_proj=True"):
        convert_model(builtin_model("RoFormerForMultipleChoice", summary_use_proj=True))


def test_multiple_choice_summary_dropouts_become_one_classifier_dropout():
    """The built-in summary's `summary_first_dropout` then `summary_last_dropout` (nothing between them) act as one
    dropout of rate 1 - (1 - p1)(1 - p2); they used to be dropped, so a converted model fine-tuned without them.
    Checked by statistics on the summary vector the classifier sees, in train mode: zeroed share and mean scale."""
    builtin = builtin_model("RoFormerForMultipleChoice", summary_first_dropout=0.3, summary_last_dropout=0.5)
    ours = convert_model(builtin)
    assert ours.config.classifier_dropout == pytest.approx(1 - 0.7 * 0.5)
    assert convert_model(builtin_model("RoFormerForMultipleChoice")).config.classifier_dropout is None
    assert convert_model(builtin_model("RoFormerForSequenceClassification", summary_first_dropout=0.3)).config.classifier_dropout is None
    x = torch.ones(20_000, 16)
    torch.manual_seed(0)
    seen = {"built-in": builtin.train().sequence_summary.last_dropout(builtin.sequence_summary.first_dropout(x)),
            "ours": ours.train().dropout(x)}  # fmt: skip
    for name, out in seen.items():
        assert (out == 0).float().mean().item() == pytest.approx(0.65, abs=0.01), name
        assert out.mean().item() == pytest.approx(1.0, abs=0.03), name
    config = json.loads(json.dumps(ours.config.to_dict()))
    assert config["classifier_dropout"] == pytest.approx(0.65)
    with pytest.raises(ConversionError, match="summary_last_dropout=1.0"):
        convert_model(builtin_model("RoFormerForMultipleChoice", summary_last_dropout=1.0))


def test_output_hidden_states_and_attentions_defaults_are_carried_over(tmp_path):
    """A built-in config with `output_hidden_states` / `output_attentions` true returns them by default; the
    converted folder did not (both were dropped from the config)."""
    builtin = builtin_model("RoFormerForMaskedLM", output_hidden_states=True, output_attentions=True)
    builtin.save_pretrained(tmp_path / "builtin")
    convert_folder(tmp_path / "builtin", tmp_path / "ours")
    ours = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", trust_remote_code=True, attn_implementation="eager")
    inputs = padded_batch()
    with torch.no_grad():
        got, want = ours(**inputs), builtin(**inputs)
    assert got.hidden_states is not None and len(got.hidden_states) == len(want.hidden_states)
    assert got.attentions is not None and len(got.attentions) == len(want.attentions)
    for a, b in zip(got.hidden_states + got.attentions, want.hidden_states + want.attentions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
