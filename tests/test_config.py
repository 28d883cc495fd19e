"""Configuration: v5 `rope_parameters` (and the old fields of saved folders), per-layer types, switches."""

import json
import subprocess
import sys

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import padded_batch, tiny_config
from modeling_roformer_rope.rotary_roformer_rope import RoFormerRopeRotaryEmbedding, rotary_inv_freq


def test_rope_parameters_linear_scaling_is_applied():
    """The issue's example: accepted *and* used (positions divided by the factor)."""
    config = tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    scaled, plain = RoFormerRopeRotaryEmbedding(config), RoFormerRopeRotaryEmbedding(tiny_config())
    torch.testing.assert_close(scaled(torch.tensor([[30]]))[0], plain(torch.tensor([[15]]))[0])


def test_rope_theta_changes_the_frequencies():
    config = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.testing.assert_close(RoFormerRopeRotaryEmbedding(config).inv_freq, rotary_inv_freq(config.head_dim, 500.0))


def test_model_outputs_follow_rope_parameters():
    torch.manual_seed(0)
    base = rr.RoFormerRopeModel(tiny_config()).eval()
    with torch.no_grad():
        for layer in base.layers:  # sharp attention, so that positions visibly matter
            layer.attention.qkv.weight.mul_(30)
    scaled = rr.RoFormerRopeModel(tiny_config(rope_parameters={"rope_type": "linear", "factor": 4.0})).eval()
    scaled.load_state_dict(base.state_dict())
    ids = padded_batch()["input_ids"][:1]
    with torch.no_grad():
        expected = base(ids, position_ids=torch.arange(12)[None] * 0.25).last_hidden_state  # fractional positions
        different = base(ids).last_hidden_state
        got = scaled(ids).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, different, atol=1e-3)


def test_old_saved_config_fields_load(tmp_path):
    """Folders written before v5 `rope_parameters`: `rope_theta` + `rope_scaling` keep their meaning."""
    torch.manual_seed(0)
    model = rr.RoFormerRopeModel(tiny_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    old = {k: v for k, v in saved.items() if k not in ("rope_parameters", "head_dim")}
    old.update(rope_theta=500.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = rr.RoFormerRopeModel.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters == {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    assert loaded.config.head_dim == 8
    ids = torch.arange(1, 91)[None] % 90 + 1  # past max_position_embeddings = 64: dynamic scaling active
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_head_dim_is_computed_once_and_checked():
    assert tiny_config().head_dim == 8
    with pytest.raises(Exception, match="head_dim"):
        tiny_config(head_dim=16)


def test_layer_types_choose_per_layer_attention():
    config = tiny_config(attention_type="linear", layer_types=["full_attention", "linear_attention"])
    assert [config.attention_kind(i) for i in range(2)] == ["softmax", "linear"]
    assert [tiny_config(attention_type="performer").attention_kind(i) for i in range(2)] == ["performer"] * 2
    with pytest.raises(Exception, match="layer_types has 3 entries"):
        tiny_config(attention_type="linear", layer_types=["full_attention"] * 3)
    with pytest.raises(Exception, match="attention_type='softmax'"):
        tiny_config(layer_types=["linear_attention"] * 2)
    with pytest.raises(Exception, match="performer_nb_features must be an even"):
        tiny_config(attention_type="performer", performer_nb_features=7)


def test_classifier_dropout_falls_back_once_in_the_config():
    assert tiny_config(hidden_dropout_prob=0.3).classifier_dropout_prob == 0.3
    assert tiny_config(hidden_dropout_prob=0.3, classifier_dropout=0.1).classifier_dropout_prob == 0.1
    model = rr.RoFormerRopeForTokenClassification(tiny_config(hidden_dropout_prob=0.3, num_labels=2))
    assert model.dropout.p == 0.3


def test_unknown_activation_is_a_config_error():
    with pytest.raises(Exception, match="hidden_act 'swishy' is not an activation"):
        tiny_config(hidden_act="swishy")


@pytest.mark.parametrize("name", ["ROFORMER_ROPE_ONEDNN", "ROFORMER_ROPE_ONEDNN_ATTENTION_MIN_KEYS"])
def test_garbage_switch_values_do_not_break_import(name):
    probe = "import modeling_roformer_rope.onednn_attention_roformer_rope as oa; print(oa.MIN_KEYS)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={name: "lots", "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "384"
    assert f"ignoring {name}='lots'" in result.stderr
