"""Inputs mean one thing on every backend, and malformed inputs fail with a clear error (issue 15 item 8)."""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import builtin_model, padded_batch, randomise_, tiny_config
from roformer_rope.conversion.from_transformers import convert_model

LONG = 420  # long enough that "sdpa" routes CPU inference to the oneDNN kernel


def model_of(**overrides):
    torch.manual_seed(0)
    return randomise_(rr.RoFormerRopeModel(tiny_config(**overrides)).eval())


def run(model, attn, **inputs):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def explicit_mask(batch) -> torch.Tensor:
    """A (B, 1, T, T) bool mask: padding keys dropped, plus a band so it is not a plain padding mask."""
    keep = batch["attention_mask"].bool()  # (B, T)
    T = keep.shape[1]
    band = (torch.arange(T)[:, None] - torch.arange(T)[None]).abs() <= 5  # (T, T)
    return keep[:, None, None, :] & band[None, None]


def reference(model, batch, mask4d: torch.Tensor) -> torch.Tensor:
    """The same model with the bool mask turned into an additive float mask by hand (an independent reading)."""
    additive = torch.zeros(mask4d.shape).masked_fill(~mask4d, torch.finfo(torch.float32).min)
    return run(model, "eager", input_ids=batch["input_ids"], attention_mask=additive)


@pytest.mark.parametrize("seq_len", [10, LONG])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bool_4d_mask_is_honoured_by_every_backend(attn, seq_len):
    model = model_of()
    batch = padded_batch(seq_len=seq_len)
    mask = explicit_mask(batch)
    expected = reference(model, batch, mask)
    got = run(model, attn, input_ids=batch["input_ids"], attention_mask=mask)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)
    plain = run(model, attn, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert not torch.allclose(got[valid], plain[valid], atol=1e-3)  # the band really changed the result


@pytest.mark.parametrize("seq_len", [10, LONG])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_integer_4d_mask_is_refused_at_every_length(attn, seq_len):
    model = model_of()
    batch = padded_batch(seq_len=seq_len)
    model.set_attn_implementation(attn)
    with pytest.raises(ValueError, match="4-D attention_mask must be bool .* or floating point"):
        model(input_ids=batch["input_ids"], attention_mask=explicit_mask(batch).long())


@pytest.mark.parametrize(
    "mask_shape, message",
    [
        ((2, 11), r"attention_mask shape \(2, 11\) must be \(batch, past \+ seq_len\) = \(2, 12\)"),
        ((1, 12), r"attention_mask shape \(1, 12\)"),
        ((2, 1, 12, 11), r"4-D attention_mask shape \(2, 1, 12, 11\) must be"),
        ((2, 1, 3, 12), r"4-D attention_mask shape \(2, 1, 3, 12\) must be \(batch or 1, heads or 1, seq_len or 1"),
        ((3, 1, 12, 12), r"4-D attention_mask shape \(3, 1, 12, 12\)"),
        ((2, 12, 12), "must be 2-D .* or 4-D"),
    ],
)
def test_wrongly_shaped_masks_raise_instead_of_broadcasting(mask_shape, message):
    model = model_of()
    batch = padded_batch()
    with pytest.raises(ValueError, match=message):
        model(input_ids=batch["input_ids"], attention_mask=torch.ones(mask_shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_empty_inputs_say_what_is_wrong(shape):
    with pytest.raises(ValueError, match=rf"empty input: .* got shape \({shape[0]}, {shape[1]}\)"):
        model_of()(input_ids=torch.ones(shape, dtype=torch.long))


def test_other_bad_inputs():
    model = model_of()
    with pytest.raises(ValueError, match="integer token ids"):
        model(input_ids=torch.ones(2, 5))
    with pytest.raises(ValueError, match="position_ids shape"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), position_ids=torch.arange(4)[None])
    with pytest.raises(ValueError, match="inputs_embeds must have shape"):
        model(inputs_embeds=torch.ones(5, 32))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("head", ["mlm", "token"])
def test_per_token_labels_of_another_shape_are_refused(head, sparse):
    """Flattened, (2, 6) labels would pair with the wrong (2, 7) rows and give a loss; the flat (14,) form is fine."""
    config = tiny_config(sparse_prediction=sparse, num_labels=3)
    model = (rr.RoFormerRopeForMaskedLM if head == "mlm" else rr.RoFormerRopeForTokenClassification)(config).eval()
    ids = torch.randint(5, 90, (2, 7))
    labels = torch.randint(0, 3, (2, 7))
    for shape in [(2, 6), (1, 7), (13,), (2, 8)]:
        with pytest.raises(ValueError, match=rf"labels shape \({shape[0]}, ?{shape[1] if len(shape) > 1 else ''}\) does not"):
            model(ids, labels=labels.reshape(-1)[: torch.Size(shape).numel()].reshape(shape) if shape != (2, 8) else
                  torch.zeros(2, 8, dtype=torch.long))  # fmt: skip
    with torch.no_grad():
        assert torch.equal(model(ids, labels=labels.reshape(-1)).loss, model(ids, labels=labels).loss)


def test_multiple_choice_masks_must_have_one_row_per_choice():
    model = rr.RoFormerRopeForMultipleChoice(tiny_config()).eval()
    ids = torch.randint(5, 90, (2, 3, 7))
    for name, shape in [("attention_mask", (2, 7)), ("token_type_ids", (2, 7)), ("attention_mask", (2, 3, 6))]:
        message = rf"{name} shape \({', '.join(map(str, shape))}\) must be the inputs' .* = \(2, 3, 7\)"
        with pytest.raises(ValueError, match=message):
            model(ids, **{name: torch.ones(shape, dtype=torch.long)})


def test_4d_mask_needs_an_eager_or_sdpa_backend():
    model = model_of()
    batch = padded_batch()
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="needs attn_implementation 'eager' or 'sdpa'"):
        model(input_ids=batch["input_ids"], attention_mask=explicit_mask(batch))


def test_2d_masks_of_any_dtype_mean_keep_or_drop():
    model = model_of()
    batch = padded_batch()
    expected = run(model, "sdpa", input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    valid = batch["attention_mask"].bool()
    for dtype in (torch.bool, torch.int32, torch.float32):
        got = run(model, "sdpa", input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].to(dtype))
        torch.testing.assert_close(got[valid], expected[valid], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seq_len", [10, LONG])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["additive", "bool"])
def test_bert_extended_mask_broadcasts_over_queries_like_the_builtin(attn, seq_len, form):
    """BERT's "extended" (B, 1, 1, S) mask, additive or bool, equals the 2-D mask (and the built-in, which takes it)."""
    builtin = builtin_model("RoFormerModel", max_position_embeddings=512)
    ours = convert_model(builtin)
    batch = padded_batch(seq_len=seq_len)
    keep = batch["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, S)
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = builtin(input_ids=batch["input_ids"], attention_mask=additive).last_hidden_state
    got = run(ours, attn, input_ids=batch["input_ids"], attention_mask=additive if form == "additive" else keep)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)
    plain = run(ours, attn, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(got[valid], plain[valid], atol=1e-5, rtol=1e-5)


def test_cross_attention_inputs_are_refused_not_ignored():
    model = model_of()
    batch = padded_batch()
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        with pytest.raises(ValueError, match=f"{name} was given, but RoFormer has no cross-attention"):
            model(input_ids=batch["input_ids"], **{name: torch.ones(2, 4, 32)})
    with pytest.raises(Exception, match="add_cross_attention=True: RoFormer has no cross-attention"):
        tiny_config(is_decoder=True, add_cross_attention=True)


@pytest.mark.parametrize("overrides", [dict(is_decoder=True), dict(unilm_mask=True)], ids=["causal", "unilm"])
def test_one_row_4d_mask_is_refused_where_it_would_drop_the_model_s_own_mask(overrides):
    model = model_of(**overrides)
    batch = padded_batch()
    keep = batch["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, S)
    with pytest.raises(ValueError, match="would replace the (causal|UniLM) mask: pass the 2-D"):
        model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"], attention_mask=keep)
    if overrides.get("is_decoder"):  # a decoding step (one query) may take it: nothing to broadcast over
        with torch.no_grad():
            model(input_ids=batch["input_ids"][:, :1], attention_mask=keep[..., :1])
