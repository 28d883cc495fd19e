"""Eager attention in blocks (`eager_attention_in_blocks`): equal to eager attention on the whole problem whatever the
blocks, and the inference path the dispatcher may choose for bf16 on a CPU with bf16 instructions."""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import decoder_or_unilm_outputs, padded_batch, spy, tiny_config
from modeling_roformer_rope import attention_roformer_rope as attention
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import eager_attention_roformer_rope as ea
from modeling_roformer_rope import onednn_attention_roformer_rope as oa

needs_native_bf16 = pytest.mark.skipif(not oa._NATIVE[torch.bfloat16], reason="the path is for CPUs with bf16")


class Module(torch.nn.Module):
    is_causal = False


def views(B, H, T, S, D=16, Dv=8, seed=0):
    """q (B, H, T, D) and k, v (B, H, S, D | Dv) as strided views into fused tensors, like the model passes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    k = (2 * torch.randn(B, S, H, D, generator=g)).transpose(1, 2)
    v = torch.randn(B, S, H, Dv, generator=g).transpose(1, 2)
    return q, k, v


@pytest.fixture
def forced():
    saved = calibration._forced.get("attention")
    calibration.reset()
    yield lambda path: calibration.force("attention", path)
    calibration.force("attention", saved)


MASKS = {
    "none": lambda B, H, T, S: None,
    "bool per row": lambda B, H, T, S: torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) > 0.3,
    "bool per head, keys only": lambda B, H, T, S: torch.rand(1, H, 1, S, generator=torch.Generator().manual_seed(2)) > 0.3,
    "float": lambda B, H, T, S: torch.randn(B, H, T, S, generator=torch.Generator().manual_seed(3)),
}


@pytest.mark.parametrize("block_scores", [1 << 22, 2000, 300, 7])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("B, H, T, S", [(3, 4, 50, 70), (2, 3, 40, 40), (1, 2, 1, 33)])
def test_equals_eager_on_the_whole_problem(monkeypatch, block_scores, mask, B, H, T, S):
    """Whole batch rows, groups of heads and slices of one head's queries: the same output as one eager call."""
    monkeypatch.setattr(ea, "BLOCK_SCORES", block_scores)
    q, k, v = views(B, H, T, S)
    m = MASKS[mask](B, H, T, S)
    expected, _ = ea.eager_attention_forward(Module().eval(), q, k, v, m, 0.25)
    got = ea.eager_attention_in_blocks(q, k, v, m, 0.25)
    assert got.shape == (B, T, H, 8)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_scores", [1 << 22, 300, 7])
@pytest.mark.parametrize("mask", [*MASKS, "causal", "key padding", "bf16 float", "dead rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [0.25, 0.1])
def test_scratch_buffers_give_the_bits_of_fresh_blocks(monkeypatch, block_scores, mask, dtype, scaling):
    """Blocks computed in the two reused scratch buffers (bmm `out=`, softmax `out=`, mask and dead rows in place),
    with the queries scaled once per call or once per block, equal blocks computed in fresh tensors, bit for bit
    (0.1: a scaling that rounds), and leave no trace between calls; under autograd the blocks are fresh (an `out=`
    GEMM has no backward) and gradients flow."""
    monkeypatch.setattr(ea, "BLOCK_SCORES", block_scores)
    B, H, T, S = 2, 3, 24, 30
    q, k, v = (x.to(dtype) for x in views(B, H, T, S))
    causal = mask == "causal"
    if mask == "key padding":
        m = padding_mask(B, T, S, [30, 11])
    elif mask == "bf16 float":
        m = MASKS["float"](B, H, T, S).to(dtype)
    elif mask == "dead rows":
        m = torch.ones(B, 1, T, S, dtype=torch.bool)
        m[1, :, 5] = False
    else:
        m = None if causal else MASKS[mask](B, H, T, S)
    monkeypatch.setattr(ea, "SCRATCH", False)
    fresh = ea.eager_attention_in_blocks(q, k, v, m, scaling, is_causal=causal)
    monkeypatch.setattr(ea, "SCRATCH", True)
    calls = []
    real = ea._weights_into
    monkeypatch.setattr(ea, "_weights_into", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ea, "SCALE_ONCE", False)
    assert torch.equal(ea.eager_attention_in_blocks(q, k, v, m, scaling, is_causal=causal), fresh)
    monkeypatch.setattr(ea, "SCALE_ONCE", True)
    assert torch.equal(ea.eager_attention_in_blocks(q, k, v, m, scaling, is_causal=causal), fresh)
    assert torch.equal(ea.eager_attention_in_blocks(q, k, v, m, scaling, is_causal=causal), fresh)  # no state kept
    mixed = mask == "float" and dtype == torch.bfloat16  # a float32 mask on bf16 scores: promoted, computed fresh
    assert bool(calls) != mixed
    if mask == "dead rows":
        assert (fresh[1, 5] == 0).all()
    calls.clear()
    q.requires_grad_(True)
    ea.eager_attention_in_blocks(q, k, v, m, scaling, is_causal=causal).float().sum().backward()
    assert not calls and q.grad is not None and torch.isfinite(q.grad).all()
    if m is not None and m.is_floating_point():  # a learned bias: tracked, so fresh blocks, and its gradient flows
        q, bias = q.detach(), m.detach().requires_grad_(True)
        ea.eager_attention_in_blocks(q, k, v, bias, 0.25).float().sum().backward()
        assert not calls and bias.grad is not None and torch.isfinite(bias.grad).all()


def padding_mask(B, T, S, lengths, full_rows=True):
    """A key-padding mask: batch row b attends to its first lengths[b] keys, as (B, 1, T, S) (what transformers builds
    from a 2-D padding mask) or (B, 1, 1, S)."""
    keep = torch.arange(S) < torch.tensor(lengths)[:, None]  # (B, S)
    return keep[:, None, None, :].expand(B, 1, T if full_rows else 1, S).contiguous()


@pytest.mark.parametrize("block_scores", [1 << 22, 300, 7])
@pytest.mark.parametrize("full_rows", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_padding_attends_to_the_kept_keys_only(monkeypatch, block_scores, full_rows, dtype):
    """A key-padding mask: each batch row runs on its kept keys with no mask; the same output as one eager call with
    the mask (a row with no key kept gives zeros, as on SDPA; one with every key kept runs unmasked)."""
    monkeypatch.setattr(ea, "BLOCK_SCORES", block_scores)
    q, k, v = (t.to(dtype) for t in views(4, 3, 20, 20))
    m = padding_mask(4, 20, 20, [20, 11, 0, 1], full_rows)
    assert ea.key_padding(m).tolist() == m[:, 0, 0].tolist()
    expected, _ = ea.eager_attention_forward(Module().eval(), q, k, v, m, 0.25)
    got = ea.eager_attention_in_blocks(q, k, v, m, 0.25)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)
    assert (got[2] == 0).all()
    unmasked = ea.eager_attention_in_blocks(q[:1], k[:1], v[:1], None, 0.25)
    assert torch.equal(got[:1], unmasked)  # every key kept: the unmasked computation, bit for bit
    one_row = ea.eager_attention_in_blocks(q[1:2], k[1:2], v[1:2], m[1:2], 0.25)  # blocks of one row at any size
    assert torch.equal(one_row, ea.eager_attention_in_blocks(q[1:2], k[1:2, :, :11], v[1:2, :, :11], None, 0.25))


def test_key_padding_only_for_masks_that_are_one():
    """Masks whose query rows differ, per-head masks, float masks: not a key-padding mask (the masked path runs)."""
    m = padding_mask(2, 6, 6, [6, 3])
    assert ea.key_padding(m) is not None
    rows_differ = m.clone()
    rows_differ[1, 0, 4, 0] = False
    assert ea.key_padding(rows_differ) is None
    assert ea.key_padding(m.expand(2, 3, 6, 6)) is None  # (B, H, T, S): per head
    assert ea.key_padding(m.float()) is None
    assert ea.key_padding(None) is None
    assert ea.key_padding(torch.ones(2, 1, 6, 6, dtype=torch.bool)).all()


@pytest.mark.parametrize("block_scores", [1 << 22, 300, 7])
def test_causal_is_upper_left_and_fully_masked_rows_give_zeros(monkeypatch, block_scores):
    monkeypatch.setattr(ea, "BLOCK_SCORES", block_scores)
    q, k, v = views(2, 3, 24, 30)
    causal = torch.ones(24, 30, dtype=torch.bool).tril()  # query i sees keys j ≤ i, as SDPA's flag
    expected, _ = ea.eager_attention_forward(Module().eval(), q, k, v, causal, 16**-0.5)
    torch.testing.assert_close(ea.eager_attention_in_blocks(q, k, v, is_causal=True), expected, atol=1e-6, rtol=1e-6)
    mask = torch.ones(2, 1, 24, 30, dtype=torch.bool)
    mask[1, :, 5] = False
    out = ea.eager_attention_in_blocks(q, k, v, mask)
    assert (out[1, 5] == 0).all() and out[0, 5].abs().sum() > 0


def test_bad_shapes_and_arguments_raise():
    q, k, v = views(2, 3, 10, 12)
    with pytest.raises(ValueError, match="must be"):
        ea.eager_attention_in_blocks(q, k[:, :2], v)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 1, 10, 11\) must broadcast to \(2, 3, 10, 12\)"):
        ea.eager_attention_in_blocks(q, k, v, torch.ones(2, 1, 10, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="either attention_mask or is_causal"):
        ea.eager_attention_in_blocks(q, k, v, torch.ones(2, 1, 10, 12, dtype=torch.bool), is_causal=True)


def test_a_candidate_only_for_bf16_with_instructions(monkeypatch):
    """A rule on top of the timing: float32 eager took 1.2-2× SDPA's time at every shape measured (AVX-512 and AVX2),
    emulated bf16 GEMMs ~7× float32's, and fp16 scores could overflow an fp16 GEMM."""
    q = torch.randn(1, 2, 8, 4)
    assert not oa._eager_applies(q) and not oa._eager_applies(q.half())
    monkeypatch.setitem(oa._NATIVE, torch.bfloat16, True)
    assert oa._eager_applies(q.bfloat16())
    monkeypatch.setitem(oa._NATIVE, torch.bfloat16, False)
    assert not oa._eager_applies(q.bfloat16())


def test_short_float32_inference_makes_no_attention_decision(forced):
    """Below the oneDNN kernel's length, float32 has SDPA only: no decision is timed (a fresh process pays nothing)."""
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    with torch.no_grad():
        model(**padded_batch(seq_len=64))
    assert not [d for d in calibration.decisions() if d["class"][0] == "attention"]


@needs_native_bf16
def test_short_bf16_inference_times_eager_against_sdpa_per_batch_bucket(forced):
    """Short bf16 inputs: one decision per (key-length bucket, batch bucket), SDPA and eager timed; long ones also time
    the oneDNN kernel; the decided path is what runs."""
    torch.manual_seed(0)
    model = rr.RoFormerRopeModel(tiny_config()).eval().to(torch.bfloat16)
    with torch.no_grad():
        model(**padded_batch(seq_len=64, batch=2))
        model(**padded_batch(seq_len=64, batch=8))
        model(**padded_batch(seq_len=400, batch=1))
    made = {tuple(d["class"]): set(d["ms"]) for d in calibration.decisions() if d["class"][0] == "attention"}
    assert made == {
        ("attention", "torch.bfloat16", 256, "short", 4): {"sdpa", "eager"},
        ("attention", "torch.bfloat16", 256, "short", 16): {"sdpa", "eager"},
        ("attention", "torch.bfloat16", 512): {"sdpa", "eager", "onednn", "onednn_bf16"},
    }


@needs_native_bf16
@pytest.mark.parametrize("seq_len", [64, 400])
def test_forced_eager_bf16_model_stays_as_close_to_float32_as_sdpa(forced, monkeypatch, seq_len):
    """bf16 scores lose precision against SDPA's float32 ones in one layer (max error vs float64 6-10× SDPA's at
    scores of a few units, `bench/experiments.py --only eager_blocks`), but a bf16 model's q and k are rounded to bf16
    already: the model's output stays as close to its float32 twin as on SDPA."""
    torch.manual_seed(0)
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    batch = padded_batch(seq_len=seq_len)
    valid = batch["attention_mask"].bool()
    calls = spy(monkeypatch, attention, "eager_blocks_forward")
    with torch.no_grad():
        reference = model(**batch).last_hidden_state[valid].double()
        model.to(torch.bfloat16)
        errors = {}
        for path in ("sdpa", "eager"):
            forced(path)
            errors[path] = (model(**batch).last_hidden_state[valid].double() - reference).pow(2).mean().sqrt().item()
    assert len(calls) == model.config.num_hidden_layers  # only the forced eager run
    assert errors["eager"] < 1.25 * errors["sdpa"], errors


@needs_native_bf16
@pytest.mark.parametrize("unilm, padded", [(False, True), (False, False), (True, True)])
def test_decoder_and_unilm_equal_the_eager_implementation(forced, monkeypatch, unilm, padded):
    """Decoder: a 4-D mask when padded, SDPA's causal flag (no mask) when not; UniLM: its mask. Forced to eager in
    blocks, bit for bit the eager attention implementation's output in bf16."""
    forced("eager")
    calls = spy(monkeypatch, attention, "eager_blocks_forward")
    fast, eager, valid, config = decoder_or_unilm_outputs(unilm, padded, seq_len=40, dtype=torch.bfloat16)
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(fast[valid], eager[valid], atol=0, rtol=0)


def test_forced_eager_where_it_does_not_apply_runs_sdpa(forced, monkeypatch):
    """A float32 model forced to "eager" keeps SDPA (the path is bf16's), as "onednn" forced on short inputs does."""
    forced("eager")
    calls = spy(monkeypatch, attention, "eager_blocks_forward")
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    with torch.no_grad():
        model(**padded_batch(seq_len=64))
    assert calls == []
