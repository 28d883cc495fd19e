"""An MLM loss on the labelled tokens only (`sparse_prediction`): the last layer computes only those positions
(`selected_positions`), attending to every key.

Oracles: the built-in transformers RoFormer on identical weights (its last layer computes every position, its
head every row), and our own model with hidden states requested, which turns the reduction off.
"""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import backward_both, builtin_model, padded_batch, randomise_, spy_last_layer, tiny_config
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope.attention_roformer_rope import gather_positions, selected_queries
from roformer_rope.conversion.from_transformers import convert_model


def _labels(batch: dict, share: float = 0.3, seed: int = 0) -> torch.Tensor:
    """MLM labels on a random `share` of the real tokens (-100 elsewhere); row 1 gets none, row 0 its last real token."""
    generator = torch.Generator().manual_seed(seed)
    ids = batch["input_ids"]
    chosen = (torch.rand(ids.shape, generator=generator) < share) & batch["attention_mask"].bool()  # (B, T)
    chosen[1] = False
    chosen[0, int(batch["attention_mask"][0].sum()) - 1] = True
    return ids.masked_fill(~chosen, -100)


def _sparse_builtin_pair(**config) -> tuple[torch.nn.Module, torch.nn.Module]:
    builtin = builtin_model("RoFormerForMaskedLM", **config)
    ours = convert_model(builtin)
    ours.config.sparse_prediction = True
    return builtin, ours


def test_selected_queries_pad_each_row_to_the_longest_in_order():
    selected = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    index, valid = selected_queries(selected)
    assert index.shape == valid.shape == (3, 3)
    assert index[0].tolist() == [1, 3, 4] and index[2, 0].item() == 0
    assert valid.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    x = torch.randn(3, 5, 4)  # (B, T, C)
    torch.testing.assert_close(gather_positions(x, index, dim=1)[valid], x[selected], atol=0, rtol=0)
    index, valid = selected_queries(torch.zeros(2, 4, dtype=torch.bool))  # nothing selected: one padding slot
    assert index.shape == (2, 1) and not valid.any()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sparse_mlm_equals_the_builtin_on_the_labelled_rows(attn):
    builtin, ours = _sparse_builtin_pair()
    ours.set_attn_implementation(attn)
    batch = padded_batch(batch=3, seq_len=13)
    labels = _labels(batch)
    keep = labels != -100
    shapes = spy_last_layer(ours)
    with torch.no_grad():
        expected = builtin(**batch, labels=labels)
        reduced = ours(**batch, labels=labels)
        full = ours(**batch, labels=labels, output_hidden_states=True)
        flat = ours(**batch, labels=labels.reshape(-1)).logits  # labels flattened to (B·T,) as transformers accepts
    n = int(keep.sum())
    assert shapes == [(n, 32), (3, 13, 32), (n, 32)]  # reduced, every position (hidden states returned), reduced
    torch.testing.assert_close(reduced.logits, expected.logits[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduced.logits, full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduced.loss, expected.loss, atol=1e-6, rtol=1e-6)
    # the same path (no autograd) as `reduced`, up to the kernel a class being timed runs (and see test_model.py's
    # test_a_config_with_return_dict_false_gets_tuples_from_every_head: last bits may differ between calls)
    torch.testing.assert_close(flat, reduced.logits, atol=1e-6, rtol=1e-6)


def test_sparse_mlm_training_gradients_equal_the_builtin_s():
    builtin, ours = _sparse_builtin_pair()
    builtin.train(), ours.train()
    batch = padded_batch(batch=3, seq_len=11)
    labels = _labels(batch, seed=1)
    backward_both(builtin, ours, **batch, labels=labels)
    params = dict(ours.named_parameters())
    last = builtin.roformer.encoder.layer[-1]
    fused = torch.cat([last.attention.self.query.weight.grad, last.attention.self.key.weight.grad,
                       last.attention.self.value.weight.grad])  # fmt: skip
    pairs = {
        "roformer.layers.1.attention.qkv.weight": fused,  # our fused rows [query; key; value]
        "roformer.layers.1.attention.o_proj.weight": last.attention.output.dense.weight.grad,
        "roformer.layers.1.mlp.down_proj.weight": last.output.dense.weight.grad,
        "roformer.layers.0.mlp.up_proj.weight": builtin.roformer.encoder.layer[0].intermediate.dense.weight.grad,
        "roformer.embeddings.word_embeddings.weight": builtin.roformer.embeddings.word_embeddings.weight.grad,
        "lm_head.dense.weight": builtin.cls.predictions.transform.dense.weight.grad,
    }
    for name, grad in pairs.items():
        torch.testing.assert_close(params[name].grad, grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gradient_checkpointing_keeps_the_selection_exact():
    model = randomise_(rr.RoFormerRopeForMaskedLM(tiny_config(sparse_prediction=True))).train()
    batch = padded_batch(batch=3, seq_len=12)
    labels = _labels(batch, seed=2)
    model(**batch, labels=labels).loss.backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    shapes = spy_last_layer(model)
    model(**batch, labels=labels).loss.backward()
    assert shapes[0] == (int((labels != -100).sum()), 32)
    for name, p in model.named_parameters():
        if name in plain:
            torch.testing.assert_close(p.grad, plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_selected_positions_with_4d_masks_and_the_unilm_mask(attn):
    """A 4-D mask (one row per query) and the UniLM mask are cut to the selected queries' rows."""
    model = randomise_(rr.RoFormerRopeModel(tiny_config(unilm_mask=True), add_pooling_layer=False)).eval()
    model.set_attn_implementation(attn)
    batch = padded_batch(batch=3, seq_len=10)
    keep = batch["attention_mask"][:, None, None, :].bool() & torch.ones(10, 10, dtype=torch.bool).tril()
    four_d = {**batch, "attention_mask": keep}  # (B, 1, T, T): padding and a causal rule
    selected = _labels(batch, share=0.5) != -100
    with torch.no_grad():
        for inputs in (batch, four_d):
            full = model(**inputs).last_hidden_state  # (B, T, C)
            rows = model(**inputs, selected_positions=selected).last_hidden_state
            assert rows.shape == (int(selected.sum()), 32)
            torch.testing.assert_close(rows, full[selected], atol=1e-5, rtol=1e-5)


def test_the_onednn_kernel_and_long_inputs_give_the_full_result():
    """At ≥ 384 keys CPU inference may run our blocked kernel: the selected rows must be those of the full result."""
    model = randomise_(rr.RoFormerRopeModel(tiny_config(max_position_embeddings=512), add_pooling_layer=False)).eval()
    batch = padded_batch(batch=2, seq_len=400)
    selected = torch.rand(2, 400, generator=torch.Generator().manual_seed(3)) < 0.15
    for path in ("onednn", "sdpa"):
        calibration.force("attention", path)
        try:
            with torch.no_grad():
                full = model(**batch).last_hidden_state
                rows = model(**batch, selected_positions=selected).last_hidden_state
        finally:
            calibration.force("attention", None)
        torch.testing.assert_close(rows, full[selected], atol=1e-5, rtol=1e-5, msg=path)


def test_attention_dropout_training_runs_on_the_selected_rows():
    """Training with attention and hidden dropout (our eager dropout path) on the reduced last layer: the
    selected rows come out, and with dropout off in eval the result is the full computation's."""
    model = randomise_(
        rr.RoFormerRopeForMaskedLM(
            tiny_config(sparse_prediction=True, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
        )
    ).train()
    batch = padded_batch(batch=3, seq_len=12)
    labels = _labels(batch, seed=4)
    out = model(**batch, labels=labels)
    out.loss.backward()
    assert out.logits.shape == (int((labels != -100).sum()), model.config.vocab_size)
    assert torch.isfinite(out.loss) and model.roformer.layers[-1].attention.qkv.weight.grad.abs().sum() > 0


def test_a_batch_without_labels_gives_the_builtin_s_nan_loss():
    builtin, ours = _sparse_builtin_pair()
    batch = padded_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    with torch.no_grad():
        expected = builtin(**batch, labels=labels).loss
        out = ours(**batch, labels=labels)
    assert out.logits.shape == (0, ours.config.vocab_size)
    assert torch.isnan(expected) and torch.isnan(out.loss)


def test_no_reduction_where_it_cannot_apply():
    """Attentions requested, a linear-attention last layer: every position, then the labelled rows selected."""
    model = randomise_(rr.RoFormerRopeForMaskedLM(tiny_config(sparse_prediction=True))).eval()
    model.set_attn_implementation("eager")
    batch = padded_batch(batch=3)
    labels = _labels(batch)
    shapes = spy_last_layer(model)
    with torch.no_grad():
        reduced = model(**batch, labels=labels).logits
        out = model(**batch, labels=labels, output_attentions=True)
    assert shapes[1] == (3, 12, 32) and len(out.attentions) == 2
    torch.testing.assert_close(out.logits, reduced, atol=1e-5, rtol=1e-5)
    config = tiny_config(sparse_prediction=True, attention_type="linear", layer_types=["full_attention", "linear_attention"])
    mixed = randomise_(rr.RoFormerRopeForMaskedLM(config)).eval()
    shapes = spy_last_layer(mixed)
    with torch.no_grad():
        logits = mixed(**batch, labels=labels).logits
        full = mixed(**batch).logits  # (B, T, V)
    assert shapes == [(3, 12, 32), (3, 12, 32)]
    torch.testing.assert_close(logits, full[labels != -100], atol=1e-5, rtol=1e-5)


def test_bad_selections_are_refused_by_name():
    model = rr.RoFormerRopeModel(tiny_config(), add_pooling_layer=False).eval()
    batch = padded_batch()  # (2, 12)
    with pytest.raises(ValueError, match="selected_positions must be a bool tensor"):
        model(**batch, selected_positions=torch.ones(2, 12, dtype=torch.long))
    with pytest.raises(ValueError, match=r"selected_positions has shape \(2, 11\), the inputs \(2, 12\)"):
        model(**batch, selected_positions=torch.ones(2, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        model(**batch, selected_positions=torch.ones(2, 12, dtype=torch.bool), summary_position=0)
    pooled = rr.RoFormerRopeModel(tiny_config(), add_pooling_layer=True).eval()
    with pytest.raises(ValueError, match="pooler reads \\[CLS\\]"):
        pooled(**batch, selected_positions=torch.ones(2, 12, dtype=torch.bool))
    mlm = rr.RoFormerRopeForMaskedLM(tiny_config(sparse_prediction=True))
    with pytest.raises(ValueError, match=r"labels shape \(2, 11\) does not match the input shape \(2, 12\)"):
        mlm(**batch, labels=torch.zeros(2, 11, dtype=torch.long))


def test_the_reduced_forward_is_fewer_flops():
    """The last layer's MLP runs on the labelled rows only; the layers below on every row."""
    model = rr.RoFormerRopeForMaskedLM(tiny_config(sparse_prediction=True)).eval()
    rows = []
    for layer in model.roformer.layers:
        layer.mlp.up_proj.register_forward_hook(lambda m, args, out: rows.append(tuple(args[0].shape[:-1])))
    batch = padded_batch(batch=4, seq_len=16)
    labels = _labels(batch)
    with torch.no_grad():
        model(**batch, labels=labels)
    assert rows == [(4, 16), (int((labels != -100).sum()),)]
