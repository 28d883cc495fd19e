"""A [CLS] (or last-token) head's last layer computes only the position it reads (`summary_position`).

Oracles: the built-in transformers RoFormer on identical weights (its last layer computes every position), and our
own model with hidden states requested, which turns the reduction off.
"""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import backward_both, builtin_model, padded_batch, randomise_, spy_last_layer, tiny_config
from modeling_roformer_rope import calibration_roformer_rope as calibration
from roformer_rope.conversion.from_transformers import convert_model


def _choices(batch: dict, n: int = 3) -> dict:
    """(B, T) inputs → (B, n, T): the rows rolled per choice, so the choices differ."""
    return {k: torch.stack([v.roll(i, dims=1) for i in range(n)], dim=1) for k, v in batch.items()}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "class_name, summary_type",
    [("RoFormerForSequenceClassification", None), ("RoFormerForMultipleChoice", "first"),
     ("RoFormerForMultipleChoice", "last")],
)  # fmt: skip
def test_classification_heads_compute_one_position_in_the_last_layer(class_name, summary_type, attn):
    builtin = builtin_model(class_name, **({"summary_type": summary_type} if summary_type else {}))
    ours = convert_model(builtin)
    ours.set_attn_implementation(attn)
    batch = padded_batch(seq_len=13)
    if class_name == "RoFormerForMultipleChoice":
        batch = _choices(batch)
    shapes = spy_last_layer(ours)
    with torch.no_grad():
        expected = builtin(**batch).logits
        reduced = ours(**batch).logits
        full = ours(**batch, output_hidden_states=True).logits
    rows = batch["input_ids"].reshape(-1, 13).shape[0]
    assert shapes == [(rows, 1, 32), (rows, 13, 32)]  # reduced, then every position (hidden states returned)
    torch.testing.assert_close(reduced, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduced, full, atol=1e-5, rtol=1e-5)


def test_training_gradients_equal_the_builtin_s():
    """The reduction skips work in the backward too; every parameter's gradient stays the built-in's."""
    builtin = builtin_model("RoFormerForSequenceClassification").train()
    ours = convert_model(builtin).train()
    batch = padded_batch(batch=3, seq_len=11)
    labels = torch.tensor([0, 2, 1])
    backward_both(builtin, ours, **batch, labels=labels)
    params = dict(ours.named_parameters())
    builtin_grads = {name: p.grad for name, p in builtin.named_parameters() if p.grad is not None}
    # the built-in's query/key/value weights are our fused qkv rows [query; key; value]
    layer = builtin.roformer.encoder.layer[-1].attention.self
    fused = torch.cat([layer.query.weight.grad, layer.key.weight.grad, layer.value.weight.grad])
    torch.testing.assert_close(params["roformer.layers.1.attention.qkv.weight"].grad, fused, atol=1e-5, rtol=1e-4)
    up = builtin.roformer.encoder.layer[-1].intermediate.dense.weight.grad
    torch.testing.assert_close(params["roformer.layers.1.mlp.up_proj.weight"].grad, up, atol=1e-5, rtol=1e-4)
    word = builtin_grads["roformer.embeddings.word_embeddings.weight"]
    torch.testing.assert_close(params["roformer.embeddings.word_embeddings.weight"].grad, word, atol=1e-5, rtol=1e-4)
    head = builtin_grads["classifier.dense.weight"]
    torch.testing.assert_close(params["classifier.dense.weight"].grad, head, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_keeps_the_reduction_exact():
    model = randomise_(rr.RoFormerRopeForSequenceClassification(tiny_config(num_labels=3))).train()
    batch, labels = padded_batch(), torch.tensor([1, 2])
    model(**batch, labels=labels).loss.backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    shapes = spy_last_layer(model)
    model(**batch, labels=labels).loss.backward()
    assert shapes[0] == (2, 1, 32)
    for name, p in model.named_parameters():
        if name in plain:
            torch.testing.assert_close(p.grad, plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_base_model_summary_position_with_4d_masks_and_the_unilm_mask(attn):
    """A 4-D mask (one row per query) and the UniLM mask are cut to the one query's row."""
    model = randomise_(rr.RoFormerRopeModel(tiny_config(unilm_mask=True))).eval()
    model.set_attn_implementation(attn)
    batch = padded_batch(seq_len=10)
    keep = batch["attention_mask"][:, None, None, :].bool() & torch.ones(10, 10, dtype=torch.bool).tril()
    four_d = {**batch, "attention_mask": keep}  # (B, 1, T, T): padding and a causal rule
    with torch.no_grad():
        for inputs in (batch, four_d):
            full = model(**inputs).last_hidden_state  # (B, T, C)
            for position in (0, -1):
                one = model(**inputs, summary_position=position).last_hidden_state
                assert one.shape == (2, 1, 32)
                torch.testing.assert_close(one[:, 0], full[:, position], atol=1e-5, rtol=1e-5)


def test_the_onednn_kernel_and_long_inputs_give_the_full_result():
    """At ≥ 384 keys CPU inference may run our blocked kernel; one query row must give that row of the full result."""
    model = randomise_(rr.RoFormerRopeModel(tiny_config(max_position_embeddings=512))).eval()
    batch = padded_batch(seq_len=400)
    for path in ("onednn", "sdpa"):
        calibration.force("attention", path)
        try:
            with torch.no_grad():
                full = model(**batch).last_hidden_state
                one = model(**batch, summary_position=0).last_hidden_state
        finally:
            calibration.force("attention", None)
        torch.testing.assert_close(one[:, 0], full[:, 0], atol=1e-5, rtol=1e-5, msg=path)


def test_no_reduction_where_it_cannot_apply():
    """Attentions requested, a linear-attention last layer, a KV cache: every position, as without the argument."""
    model = randomise_(rr.RoFormerRopeModel(tiny_config())).eval()
    model.set_attn_implementation("eager")
    batch = padded_batch()
    with torch.no_grad():
        out = model(**batch, summary_position=0, output_attentions=True)
    assert out.last_hidden_state.shape == (2, 12, 32) and len(out.attentions) == 2
    mixed = randomise_(rr.RoFormerRopeModel(tiny_config(attention_type="linear", layer_types=["full_attention", "linear_attention"]))).eval()
    with torch.no_grad():
        assert mixed(**batch, summary_position=0).last_hidden_state.shape == (2, 12, 32)
    decoder = randomise_(rr.RoFormerRopeModel(tiny_config(is_decoder=True))).eval()
    with torch.no_grad():
        out = decoder(**batch, summary_position=-1, use_cache=True)
    assert out.last_hidden_state.shape == (2, 12, 32)


def test_a_position_other_than_first_or_last_is_refused():
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    with pytest.raises(ValueError, match="summary_position must be 0 .* or -1"):
        model(**padded_batch(), summary_position=3)


def test_the_reduced_forward_is_fewer_flops():
    """The last layer's attention output, MLP and norms run on one row per sequence: count the MLP's rows."""
    model = rr.RoFormerRopeForSequenceClassification(tiny_config(num_labels=2)).eval()
    rows = []
    model.roformer.layers[-1].mlp.up_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:2]))
    with torch.no_grad():
        model(**padded_batch(batch=4, seq_len=16))
    assert rows == [torch.Size([4, 1])]
