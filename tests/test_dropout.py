"""Dropout with 16-bit masks (`dropout_roformer_rope.py`) and the attention path CPU training takes with dropout."""

import math

import pytest
import torch
from torch.nn import functional as F

import modeling_roformer_rope as rr
from conftest import builtin_model, padded_batch, spy, tiny_config
from modeling_roformer_rope import attention_roformer_rope as attn
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import dropout_roformer_rope as dr
from roformer_rope.conversion.from_transformers import convert_model


@pytest.fixture
def forced():
    saved = calibration._forced.get("attention_dropout")
    calibration.reset()
    yield lambda path: calibration.force("attention_dropout", path)
    calibration.force("attention_dropout", saved)


@pytest.mark.parametrize(
    "p, levels", [(0.1, 6554), (0.5, 32768), (0.01, 655), (0.9, 58982), (0.0, None), (1.0, None), (1e-4, None)]
)
def test_dropped_levels(p, levels):
    """k = round(p · 2¹⁶) where that is within 0.1% of p · 2¹⁶; None (torch's dropout) otherwise."""
    assert dr.dropped_levels(p) == levels


def test_mask_rate_and_independence():
    """Each of the four 16-bit draws of a 64-bit word drops at rate k/2¹⁶, and two draws of one word are
    independent (both dropped at rate (k/2¹⁶)²): within 5 standard errors over 2²² elements."""
    torch.manual_seed(0)
    p = dr.dropped_levels(0.1) / dr.LEVELS
    mask = dr.drop_mask(torch.Size([1 << 22]), dr.dropped_levels(0.1)).view(-1, 4)  # (words, draws of a word)
    n = mask.shape[0]
    for lane in range(4):
        assert abs(mask[:, lane].double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    both = (mask[:, 0] & mask[:, 1]).double().mean().item()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)


def test_mask_of_odd_size_and_empty():
    assert dr.drop_mask(torch.Size([3, 5, 7]), 6554).shape == (3, 5, 7)
    assert dr.drop_mask(torch.Size([0, 4]), 6554).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_and_gradient_follow_the_mask(monkeypatch, dtype):
    """Kept elements are x / (1 - p') in torch's arithmetic for the dtype (float32 for bf16 and float32, the scale a
    float32 number there), dropped ones 0; the gradient is the upstream one through the same mask and scale."""
    masks = spy(monkeypatch, dr, "drop_mask")
    x = torch.randn(64, 48, dtype=dtype, requires_grad=True)
    grad = torch.randn(64, 48, dtype=dtype)
    out = dr.dropout(x, 0.1)
    out.backward(grad)
    (mask,) = masks
    scale = dr.LEVELS / (dr.LEVELS - dr.dropped_levels(0.1))
    wide = torch.promote_types(dtype, torch.float32)
    scale = torch.tensor(scale, dtype=wide)

    def expected(t):
        return torch.where(mask, 0.0, t.detach().to(wide) * scale).to(dtype)

    assert out.dtype == dtype and torch.equal(out, expected(x))
    assert torch.equal(x.grad, expected(grad))
    assert 0.05 < mask.double().mean().item() < 0.15


def test_no_grad_and_reproducible():
    x = torch.randn(128, 64)
    torch.manual_seed(3)
    first = dr.dropout(x, 0.1)
    torch.manual_seed(3)
    assert torch.equal(first, dr.dropout(x, 0.1))
    assert not torch.equal(first, dr.dropout(x, 0.1))


def test_falls_back_to_torch(monkeypatch):
    """Eval mode, p that 16 bits cannot hold, integer tensors and tracing go to torch's dropout."""
    masks = spy(monkeypatch, dr, "drop_mask")
    x = torch.randn(32, 32)
    assert dr.dropout(x, 0.1, training=False) is x
    torch.manual_seed(0)
    expected = F.dropout(x, 1e-4, True)
    torch.manual_seed(0)
    assert torch.equal(dr.dropout(x, 1e-4), expected)
    assert torch.equal(dr.dropout(x, 1.0), torch.zeros_like(x))
    assert not masks
    compiled = torch.compile(lambda t: dr.dropout(t, 0.1), fullgraph=True, backend="eager")
    out = compiled(x)
    assert not masks and out.shape == x.shape and ((out == 0) | torch.isclose(out, x / 0.9)).all()


def test_module_is_a_dropout():
    module = dr.RoFormerRopeDropout(0.1)
    assert isinstance(module, torch.nn.Dropout) and module.state_dict() == {} and "p=0.1" in repr(module)
    x = torch.randn(16, 16)
    assert module.eval()(x) is x
    inplace = dr.RoFormerRopeDropout(0.5, inplace=True).train()
    y = x.clone()
    inplace(y)
    assert ((y == 0) | torch.isclose(y, 2 * x)).all() and (y == 0).any()


def test_every_model_dropout_is_ours():
    model = rr.RoFormerRopeForSequenceClassification(tiny_config(hidden_dropout_prob=0.1, num_labels=2))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropouts) >= 4 and all(isinstance(m, dr.RoFormerRopeDropout) for m in dropouts)


def _reference(q, k, v, mask, keep, scale, scaling):
    """float64 softmax(q kᵀ · scaling, masked) ⊙ keep · scale, times v: (B, T, H, D)."""
    scores = (q.double() @ k.double().transpose(2, 3)) * scaling  # (B, H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1) * keep * scale
    return (weights @ v.double()).transpose(1, 2)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
def test_eager_path_with_dropout_matches_the_formula(monkeypatch, forced, dtype, atol):
    """Forced "eager": the output and the gradients of q, k, v are eq. 2 with the recorded dropout mask (float64)."""
    forced("eager")
    masks = spy(monkeypatch, dr, "drop_mask")
    calls = spy(monkeypatch, attn, "eager_attention_forward")
    module = torch.nn.Module().train()
    module.is_causal = False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    mask[1, :, :, 25:] = False
    out, _ = attn.sdpa_attention_forward(module, q, k, v, mask, dropout=0.1, scaling=8**-0.5)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    assert len(calls) == 1 and len(masks) == 1
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scale = dr.LEVELS / (dr.LEVELS - dr.dropped_levels(0.1))
    expected = _reference(*leaves, mask, ~masks[0], scale, 8**-0.5)
    expected.backward(grad.double())
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    for t, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(t.grad.double(), ref.grad, atol=4 * atol, rtol=0)


def test_sdpa_path_with_dropout(monkeypatch, forced):
    """Forced "sdpa": torch's SDPA runs with the dropout probability, eager does not."""
    forced("sdpa")
    eager = spy(monkeypatch, attn, "eager_attention_forward")
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(kw["dropout_p"]) or real(*a, **kw))
    module = torch.nn.Module().train()
    module.is_causal = False
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    attn.sdpa_attention_forward(module, q, k, v, None, dropout=0.1, scaling=8**-0.5)[0].sum().backward()
    assert seen == [0.1] and not eager


def test_eager_is_the_rule_on_cpu_and_can_be_forced(forced):
    """Not a timed decision (the path picks the masks a step draws): eager for every CPU dtype unless forced; a path
    that is not one raises, naming the paths."""
    module = torch.nn.Module().train()
    module.is_causal = False
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert attn.dropout_attention_path(module, torch.randn(1, 2, 8, 4, dtype=dtype), None) == "eager"
    assert not [d for d in calibration.decisions() if d["class"][0] == "attention_dropout"]
    forced("sdpa")
    assert attn.dropout_attention_path(module, torch.randn(1, 2, 8, 4), None) == "sdpa"
    forced("flash")
    with pytest.raises(ValueError, match="attention_dropout forced to 'flash'.*'eager', 'sdpa'"):
        attn.dropout_attention_path(module, torch.randn(1, 2, 8, 4), None)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "float32 under bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_softmax_is_the_float32_softmax_rounded(mask_kind, dtype):
    """bf16/fp16 scores on CPU are softmaxed in their own dtype (no float32 copies): the weights are bit for bit a
    float32 softmax of the same scores rounded once, fully masked rows zero; the scores' gradient stays within a few
    of the dtype's rounding steps of float64's."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    q, k, v = (3 * torch.randn(2, 3, 16, 8).to(dtype) for _ in range(3))
    keep = torch.rand(2, 1, 16, 16) > 0.3
    keep[1, :, 5] = False  # a fully masked row
    mask = {"none": None, "bool": keep, "float": torch.zeros(2, 1, 16, 16, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min),
            "float32 under bf16": torch.zeros(2, 1, 16, 16).masked_fill(~keep, torch.finfo(torch.float32).min)}[mask_kind]  # fmt: skip
    _, weights = attn.eager_attention_forward(module, q, k, v, mask, scaling=8**-0.5)
    scores = torch.matmul(q * 8**-0.5, k.transpose(2, 3)).float()  # (2, 3, 16, 16), the eager's own bits widened
    if mask is not None:
        scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min) if mask.dtype == torch.bool else scores + mask.float()
    expected = F.softmax(scores, dim=-1)
    if mask is not None:
        expected = expected.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    assert weights.dtype == dtype
    torch.testing.assert_close(weights, expected.to(dtype), atol=0, rtol=0)
    if mask is not None:
        assert (weights[1, :, 5] == 0).all()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = attn.eager_attention_forward(module, *leaves, mask, scaling=8**-0.5)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference, _ = attn.eager_attention_forward(module, *wide, None if mask is None else keep, scaling=8**-0.5)
    grad = torch.randn_like(reference)
    out.backward(grad.to(dtype))
    reference.backward(grad)
    step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # the dtype's rounding step at 1
    for leaf, exact in zip(leaves, wide):
        scale = exact.grad.abs().max().item()
        assert (leaf.grad.double() - exact.grad).abs().max().item() <= 16 * step * scale


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_dtype_is_attended_in_float32(monkeypatch, forced, dtype, autocast):
    """Where the CPU emulates the dtype, eager runs on float32 copies of q, k, v (as SDPA's math path does; emulated
    bf16 GEMMs took 7× the float32 ones), under bf16 autocast too, and rounds the output once: equal to float32
    eager with the same masks."""
    from modeling_roformer_rope import onednn_roformer_rope as lin

    monkeypatch.setitem(lin._NATIVE, dtype, False)
    calls = spy(monkeypatch, attn, "eager_attention_forward")
    masks = spy(monkeypatch, dr, "drop_mask")
    module = torch.nn.Module().train()
    module.is_causal = False
    q, k, v = (torch.randn(2, 3, 24, 8).to(dtype) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = attn.sdpa_attention_forward(module, q, k, v, None, dropout=0.1, scaling=8**-0.5)
    assert out.dtype == dtype and calls[0][0].dtype == torch.float32
    monkeypatch.setattr(dr, "drop_mask", lambda shape, levels: masks[0])  # the same mask, outside autocast
    expected, _ = attn.eager_attention_forward(module, q.float(), k.float(), v.float(), None, dropout=0.1, scaling=8**-0.5)
    torch.testing.assert_close(out, expected.to(dtype), atol=0, rtol=0)


def test_causal_without_mask_stays_on_sdpa(forced):
    """SDPA's own causal flag (no mask given) cannot be handed to eager, which needs the mask."""
    forced("eager")
    module = torch.nn.Module().train()
    module.is_causal = True
    q = torch.randn(1, 2, 8, 4)
    assert attn.dropout_attention_path(module, q, None) == "sdpa"
    assert attn.dropout_attention_path(module, q[:, :, :1], None) == "eager"  # one query: no causality
    assert attn.dropout_attention_path(module, q, torch.ones(1, 1, 8, 8, dtype=torch.bool)) == "eager"


@pytest.mark.parametrize("path", ["eager", "sdpa"])
@pytest.mark.parametrize("bf16", [False, True])
def test_training_with_dropout_on_each_path(forced, path, bf16):
    """A dropout-0.1 MLM step on each path: finite loss and gradients, reproducible under one seed, and in eval mode
    the built-in's loss (the paths differ only in training)."""
    forced(path)
    builtin = builtin_model("RoFormerForMaskedLM", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    ours = convert_model(builtin).train()
    batch = padded_batch()
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    losses = []
    for _ in range(2):
        torch.manual_seed(11)
        ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ours(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    assert torch.equal(losses[0], losses[1])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(**batch).loss, builtin(**batch).loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["eager", "sdpa"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_with_dropout_gives_the_same_gradients(forced, path, reentrant):
    """Activation checkpointing recomputes each layer with the masks of its forward (torch restores the CPU generator,
    which our masks and SDPA's both draw from): the gradients equal those of the plain step under the same seed."""
    forced(path)
    builtin = builtin_model("RoFormerForMaskedLM", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    batch = padded_batch()
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def grads(checkpointing: bool) -> dict:
        model = convert_model(builtin).train()
        if checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.24's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        torch.manual_seed(7)
        model(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
