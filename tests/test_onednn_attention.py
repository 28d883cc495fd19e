"""The oneDNN attention kernel against a float64 softmax oracle and SDPA, and its use inside the model."""

import pytest
import torch
import torch.nn.functional as F
import transformers

import modeling_roformer_rope as rr
from conftest import builtin_model, decoder_or_unilm_outputs, padded_batch, tiny_config
from modeling_roformer_rope import attention_roformer_rope as attention
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_attention_roformer_rope as oa
from roformer_rope.conversion.from_transformers import convert_model

pytestmark = pytest.mark.skipif(oa._LINEAR_POINTWISE is None, reason="this torch build has no oneDNN linear op")


@pytest.fixture(autouse=True)
def kernel_chosen():
    """These tests are about our kernel: where it applies, the dispatcher is told to pick it (on a CPU where
    SDPA measures faster it would pick SDPA; test_dispatch.py covers that choice)."""
    calibration.force("attention", "onednn")
    yield
    calibration.force("attention", None)


@pytest.fixture(params=["exp2", "exp"])
def exponent(request):
    """Each elementwise exponential the kernel may measure fastest (`exponent_here`), forced in turn."""
    calibration.force("attention_exp", request.param)
    yield request.param
    calibration.force("attention_exp", None)


def oracle(q, k, v, mask=None, scaling=None, is_causal=False) -> torch.Tensor:
    """Naive float64 softmax attention → (B, T, H, Dv); fully masked rows → 0 (as SDPA on CPU)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)  # (B, H, T, S)
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2).float()  # (B, T, H, Dv)


def qkv_views(B, T, H=3, D=16, S=None, seed=0):
    """Strided (B, H, ·, D) views into one fused projection, like the model passes them."""
    generator = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, H, D, generator=generator).transpose(1, 2)
    kv = (2 * torch.randn(B, S, 2, H, D, generator=generator)).transpose(1, 3)  # (B, H, 2, S, D)
    return q, kv[:, :, 0], kv[:, :, 1]


def spy_on_checks(monkeypatch) -> list[bool]:
    """Every (head, query block) verdict of `_well_scaled` from now on, in order: False = redone the safe way."""
    checks = []
    original = oa._well_scaled

    def spy(denoms, bound, block):
        verdicts = original(denoms, bound, block)  # per head of the group, per query block
        checks.extend(ok for head in verdicts for ok in head)
        return verdicts

    monkeypatch.setattr(oa, "_well_scaled", spy)
    return checks


@pytest.mark.parametrize("B, T, S", [(1, 700, 700), (2, 129, 300), (1, 64, 1100)])
def test_matches_float64_oracle_without_mask(B, T, S, exponent):
    q, k, v = qkv_views(B, T, S=S)
    out = oa.onednn_attention(q, k, v, scaling=0.3)
    torch.testing.assert_close(out, oracle(q, k, v, scaling=0.3), atol=2e-6, rtol=1e-5)
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)  # SDPA itself is ~2e-6 off the oracle


def test_boolean_mask_with_padding_and_fully_masked_rows(exponent):
    B, T = 2, 600
    q, k, v = qkv_views(B, T)
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(B, 1, T, T, generator=generator) > 0.3  # (B, 1, T, S), broadcast over heads
    mask[1, :, :, 450:] = False  # padding keys of the second sequence
    mask[0, 0, 5] = False  # a query that sees nothing
    out = oa.onednn_attention(q, k, v, mask)
    torch.testing.assert_close(out, oracle(q, k, v, mask), atol=2e-6, rtol=1e-5)
    assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5]))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2))


@pytest.mark.parametrize("full_rows", [True, False])
@pytest.mark.parametrize("bf16_pv", [False, True])
def test_key_padding_attends_to_the_kept_keys_only(full_rows, bf16_pv, monkeypatch):
    """A key-padding mask ((B, 1, T | 1, S), every query row the same): each batch row runs on its kept keys, unmasked;
    the oracle's output, zeros for a row with no key kept (as SDPA), and the unmasked output where all are kept."""
    if bf16_pv and not oa._NATIVE[torch.bfloat16]:
        pytest.skip("bf16 PV needs bf16 instructions")
    B, T = 4, 520
    q, k, v = (t.to(torch.bfloat16 if bf16_pv else torch.float32) for t in qkv_views(B, T))
    keep = torch.arange(T) < torch.tensor([T, 300, 0, 1])[:, None]  # (B, S)
    mask = keep[:, None, None, :].expand(B, 1, T if full_rows else 1, T)
    gemms = []
    real = oa._LINEAR_POINTWISE
    monkeypatch.setattr(oa, "_LINEAR_POINTWISE", lambda x, w, *args: gemms.append(w.shape) or real(x, w, *args))
    out = oa.onednn_attention(q, k, v, mask, bf16_pv=bf16_pv)
    tolerance = dict(atol=2e-6, rtol=1e-5) if not bf16_pv else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), oracle(q, k, v, mask), **tolerance)
    assert (out[2] == 0).all()
    assert torch.equal(out[:1], oa.onednn_attention(q[:1], k[:1], v[:1], bf16_pv=bf16_pv))
    assert {shape[0] for shape in gemms[::2]} == {T, 300, 1}  # the scores' GEMMs ran on the kept keys only


def test_float_mask_is_added_per_head(exponent):
    B, H, T = 1, 3, 520
    q, k, v = qkv_views(B, T, H=H)
    bias = torch.randn(B, H, T, T, generator=torch.Generator().manual_seed(2))
    bias[..., 500:] = torch.finfo(torch.float32).min  # transformers' large-negative padding value
    out = oa.onednn_attention(q, k, v, bias)
    torch.testing.assert_close(out, oracle(q, k, v, bias), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("T, S", [(777, 777), (300, 900)])
def test_causal_is_upper_left_like_sdpa(T, S, exponent):
    q, k, v = qkv_views(1, T, S=S)
    out = oa.onednn_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, oracle(q, k, v, is_causal=True), atol=2e-6, rtol=1e-5)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)  # SDPA itself is ~2e-6 off the oracle


@pytest.mark.parametrize("block", [64, 100, None])
def test_extreme_scores_take_the_max_subtracting_path(block, monkeypatch, exponent):
    """Scores far beyond exp's float32 range (overflow) and rows whose every score is hugely negative
    (underflow) still give the softmax, as close to a float64 oracle as SDPA; a spy checks the safe path really ran
    for those query blocks."""
    q, k, v = qkv_views(1, 600, H=2)
    q = q * torch.tensor([40.0, 1.0]).view(1, 2, 1, 1)  # head 0: scores ~ ±600, 2^s' overflows
    bias = torch.zeros(1, 2, 600, 600)
    bias[:, 1, 300:] = -200.0  # head 1: every weight of these rows underflows without the maximum
    checks = spy_on_checks(monkeypatch)
    out = oa.onednn_attention(q, k, v, bias, block=block)
    starts = range(0, 600, block or 600)  # block=None: one block of all 600 queries
    head_1 = [start + (block or 600) <= 300 for start in starts]  # blocks reaching query 300 underflow
    assert out.isfinite().all() and checks == [False] * len(starts) + head_1  # head 0 overflows everywhere
    want = oracle(q, k, v, bias)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    # scores of ±600 carry float32 rounding of ~6e-5 before any exponential: SDPA is as far off (6.7e-5 here)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)
    assert (out - want).abs().max() <= 1.5 * (sdpa - want).abs().max()


@pytest.mark.parametrize("bf16_pv", [False, True])
def test_head_groups_redo_only_the_blocks_that_fail_the_check(bf16_pv, monkeypatch):
    """Operands are prepared for groups of heads (GROUP_FLOATS), row sums checked once per group: with groups of two
    over five heads (the last group smaller) and query blocks of 128 over 300 queries, only the blocks of head 3
    (scores overflow 2^s' everywhere) and head 1's blocks past query 200 (every weight underflows) take the safe
    path; every head matches the oracle, bit for bit what one head per group gives."""
    if bf16_pv and not oa._NATIVE[torch.bfloat16]:
        pytest.skip("bf16 PV needs a CPU with bf16 instructions")
    q, k, v = qkv_views(2, 300, H=5)
    q = q * torch.tensor([1.0, 1.0, 1.0, 40.0, 1.0]).view(1, 5, 1, 1)  # head 3: scores ~ ±600
    bias = torch.zeros(1, 5, 300, 300)
    bias[:, 1, 200:] = -200.0  # head 1, queries 200+: blocks 1 and 2
    monkeypatch.setattr(oa, "GROUP_FLOATS", 2 * 300 * 16)
    checks = spy_on_checks(monkeypatch)
    if bf16_pv:
        q, k, v = (t.bfloat16() for t in (q, k, v))
    out = oa.onednn_attention(q, k, v, bias, block=128, bf16_pv=bf16_pv)
    T, F_ = True, False
    per_row = [T, T, T] + [T, F_, F_] + [T, T, T] + [F_, F_, F_] + [T, T, T]  # heads 0-4 × 3 blocks
    assert checks == per_row * 2  # groups (0, 1), (2, 3), (4,) of each batch row
    tolerance = dict(atol=2e-2, rtol=2e-2) if bf16_pv else dict(atol=2e-4, rtol=1e-4)  # scores ±600: float32's ulp
    torch.testing.assert_close(out.float(), oracle(q, k, v, bias), **tolerance)
    monkeypatch.setattr(oa, "GROUP_FLOATS", 1)  # one head per group: the same arithmetic, bit for bit
    torch.testing.assert_close(oa.onednn_attention(q, k, v, bias, block=128, bf16_pv=bf16_pv), out, atol=0, rtol=0)


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_another_default_dtype_changes_nothing(default):
    """The kernel's float32 buffers name their dtype: a bf16 or float64 default (some bf16 users set it) must not
    reach oneDNN."""
    q, k, v = qkv_views(2, 300)
    expected = oa.onednn_attention(q, k, v, block=128)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        out = oa.onednn_attention(q, k, v, block=128)
    finally:
        torch.set_default_dtype(previous)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_the_exponential_is_measured_once_and_can_be_forced():
    """exp2 or exp, whichever is faster on this CPU: one timed decision per process, listed with the others; forcing
    the other one gives the same attention to float32 rounding."""
    calibration.force("attention_exp", None)
    calibration.reset()
    q, k, v = qkv_views(1, 520)
    measured = oa.onednn_attention(q, k, v)
    made = [d for d in calibration.decisions() if d["class"][0] == "attention_exp"]
    assert len(made) == 1 and made[0]["choice"] in ("exp2", "exp") and set(made[0]["ms"]) == {"exp2", "exp"}
    oa.onednn_attention(q, k, v)
    assert len([d for d in calibration.decisions() if d["class"][0] == "attention_exp"]) == 1  # looked up, not timed
    other = "exp" if made[0]["choice"] == "exp2" else "exp2"
    calibration.force("attention_exp", other)
    try:
        torch.testing.assert_close(oa.onednn_attention(q, k, v), measured, atol=1e-6, rtol=1e-5)
    finally:
        calibration.force("attention_exp", None)


def test_no_queries_give_an_empty_output():
    q, k, v = qkv_views(2, 0, S=300)
    out = oa.onednn_attention(q, k, v)
    assert out.shape == (2, 0, 3, 16) and out.dtype == q.dtype


def test_huge_values_take_the_safe_path(monkeypatch):
    """Moderate scores, but values near float32's limit: unsubtracted weights (row sums ~2²⁰) times
    values ~2¹¹⁵ overflow the numerator; the value bound must send those blocks the safe way."""
    q, k, v = qkv_views(1, 600)
    v = v * 3e34
    checks = spy_on_checks(monkeypatch)
    out = oa.onednn_attention(q, k, v)
    assert False in checks and out.isfinite().all()
    torch.testing.assert_close(out / 3e34, oracle(q, k, v) / 3e34, atol=2e-6, rtol=1e-5)


def test_the_value_bound_is_per_group_of_heads(monkeypatch):
    """Huge values in batch row 0 only: its blocks go the safe way, row 1's (the next group) keep the fast path."""
    q, k, v = qkv_views(2, 600)
    v = v * torch.tensor([3e34, 1.0]).view(2, 1, 1, 1)
    checks = spy_on_checks(monkeypatch)
    out = oa.onednn_attention(q, k, v, block=128)  # 3 heads in one group per row, 5 query blocks per head
    assert checks == [False] * 15 + [True] * 15
    torch.testing.assert_close(out[0] / 3e34, oracle(q, k, v)[0] / 3e34, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(out[1], oracle(q, k, v)[1], atol=2e-6, rtol=1e-5)


def test_moderate_scores_skip_the_max_subtraction(monkeypatch):
    q, k, v = qkv_views(1, 600)
    checks = spy_on_checks(monkeypatch)
    out = oa.onednn_attention(q, k, v, block=128)
    assert checks and all(checks)
    torch.testing.assert_close(out, oracle(q, k, v), atol=2e-6, rtol=1e-5)


def test_float_mask_rows_of_finfo_min_average_like_sdpa(exponent):
    """transformers' older large-negative masks: a fully masked row averages its values (SDPA, eager)."""
    q, k, v = qkv_views(1, 520)
    bias = torch.zeros(1, 1, 520, 520)
    bias[..., 400:] = torch.finfo(torch.float32).min  # padding keys
    bias[..., 7, :] = torch.finfo(torch.float32).min  # a query that sees nothing
    bias[..., 9, :] = float("-inf")  # and one masked with −inf: zeros, as SDPA
    out = oa.onednn_attention(q, k, v, bias)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 7], v[0, :, :].mean(1), atol=1e-5, rtol=1e-5)


def test_is_causal_argument_overrides_the_module_flag():
    """The attention-interface `is_causal` kwarg wins over `module.is_causal`, as in SDPA's integration."""
    q, k, v = qkv_views(1, 500)
    decoder, encoder = torch.nn.Module(), torch.nn.Module()
    decoder.is_causal, encoder.is_causal = True, False
    causal = oracle(q, k, v, is_causal=True)
    full = oracle(q, k, v)
    for module, flag, expected in ((decoder, None, causal), (decoder, False, full), (encoder, True, causal)):
        out, _ = oa.onednn_attention_forward(module, q, k, v, None, is_causal=flag)
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_attended_in_float32(dtype):
    """bf16/fp16 q, k, v: the result is the float32 softmax of those inputs, rounded once to `dtype`,
    so it is at least as close to the exact answer as SDPA's reduced-precision kernel."""
    q, k, v = (t.to(dtype) for t in qkv_views(2, 520))
    mask = torch.ones(2, 1, 520, 520, dtype=torch.bool)
    mask[1, ..., 300:] = False
    out = oa.onednn_attention(q, k, v, mask)
    assert out.dtype == dtype
    exact = oracle(q, k, v, mask)
    ours_err = (out.float() - exact).abs().max().item()
    assert ours_err <= 2 * torch.finfo(dtype).eps * exact.abs().max().item()  # one rounding to dtype
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert ours_err <= (sdpa.float() - exact).abs().max().item()


def test_value_head_size_may_differ():
    q, k, _ = qkv_views(1, 600)
    v = torch.randn(1, 3, 600, 24)
    torch.testing.assert_close(oa.onednn_attention(q, k, v), oracle(q, k, v), atol=2e-6, rtol=1e-5)


def test_bad_shapes_and_arguments_raise():
    q, k, v = qkv_views(1, 600)
    with pytest.raises(ValueError, match="must be"):
        oa.onednn_attention(q, k[:, :2], v)
    with pytest.raises(ValueError, match="either attention_mask or is_causal"):
        oa.onednn_attention(q, k, v, torch.ones(1, 1, 600, 600, dtype=torch.bool), is_causal=True)


def test_applies_only_where_it_is_exact_and_faster(monkeypatch):
    q, k, _ = qkv_views(1, 600)
    assert oa.onednn_attention_applies(q, k, None, 0.0)
    short_q, short_k, _ = qkv_views(1, 100)
    assert not oa.onednn_attention_applies(short_q, short_k, None, 0.0)  # short: SDPA is faster
    assert not oa.onednn_attention_applies(q[:, :, :1], k, None, 0.0)  # one-token decode step
    assert not oa.onednn_attention_applies(q, k, None, 0.1)  # dropout
    assert oa.onednn_attention_applies(q.bfloat16(), k.bfloat16(), None, 0.0)  # computed in float32
    assert not oa.onednn_attention_applies(q.double(), k.double(), None, 0.0)
    assert not oa.onednn_attention_applies(q.bfloat16(), k, None, 0.0)
    assert not oa.onednn_attention_applies(q.detach().requires_grad_(), k, None, 0.0)  # no backward here
    assert not oa.onednn_attention_applies(q, k, None, 0.0, value=k.detach().requires_grad_())
    with torch.no_grad():
        assert oa.onednn_attention_applies(q.detach().requires_grad_(), k, None, 0.0)
    monkeypatch.setenv("ROFORMER_ROPE_ONEDNN_ATTENTION", "0")
    assert not oa.onednn_attention_applies(q, k, None, 0.0)


@pytest.fixture
def counted(monkeypatch):
    """Counts the model's calls of the oneDNN attention."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args[1].shape, args[4] is None))  # (query shape, whether the mask was None)
        return oa.onednn_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "onednn_attention_forward", spy)
    return calls


def test_model_uses_it_for_long_inputs_and_matches_the_builtin(counted):
    """A padded batch of 600 tokens: the "sdpa" model routes to oneDNN and equals the built-in (eager)."""
    builtin = builtin_model("RoFormerModel", max_position_embeddings=600)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=600)
    with torch.no_grad():
        expected = builtin(**batch).last_hidden_state
        got = ours(**batch).last_hidden_state
    assert len(counted) == ours.config.num_hidden_layers
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_model_keeps_sdpa_for_short_inputs_and_training(counted):
    ours = rr.RoFormerRopeModel(tiny_config()).eval()
    with torch.no_grad():
        ours(**padded_batch(seq_len=64))
    ours(**padded_batch(seq_len=600)).last_hidden_state.sum().backward()  # grad enabled: SDPA
    assert counted == []


@pytest.mark.parametrize("unilm, padded", [(False, True), (False, False), (True, True)])
def test_decoder_and_unilm_long_prefill_equal_eager(counted, unilm, padded):
    """Decoder: a 4-D mask when padded, SDPA's `is_causal` route (no mask) when not; UniLM: its mask."""
    fast, eager, valid, config = decoder_or_unilm_outputs(unilm, padded, seq_len=560)
    assert len(counted) == config.num_hidden_layers
    assert all(mask_is_none == (not padded and not unilm) for _, mask_is_none in counted)
    torch.testing.assert_close(fast[valid], eager[valid], atol=1e-5, rtol=1e-5)


def test_builtin_module_is_untouched():
    assert transformers.RoFormerModel.__module__.startswith("transformers.")


def test_compile_and_export_see_sdpa_at_long_lengths(counted):
    """Tracing never enters the Python-loop kernel (no graph break, no shape guard) and still agrees."""
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    batch = padded_batch(seq_len=600)
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        assert len(counted) == model.config.num_hidden_layers
        counted.clear()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(**batch).last_hidden_state
    assert counted == []
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(compiled[valid], eager[valid], atol=1e-5, rtol=1e-5)


def float32_then_bf16(between=lambda: None):
    """A 600-token padded batch through a tiny model in float32, then (after `between()`) in bf16: the model and
    both last hidden states at the valid positions (bf16 as float32)."""
    torch.manual_seed(0)
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    batch = padded_batch(seq_len=600)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        reference = model(**batch).last_hidden_state[valid]
        between()
        low = model.to(torch.bfloat16)(**batch).last_hidden_state[valid].float()
    return model, reference, low


def test_bf16_model_uses_it_and_stays_close_to_float32(counted):
    model, reference, low = float32_then_bf16(counted.clear)
    assert len(counted) == model.config.num_hidden_layers
    assert (low - reference).abs().max().item() < 0.1  # bf16 weights and activations, 2 layers
    assert torch.nn.functional.cosine_similarity(low, reference, dim=-1).min().item() > 0.999


@pytest.mark.parametrize(
    "is_causal, dtype, bf16_pv", [(False, torch.float32, False), (True, torch.float32, False), (True, torch.bfloat16, True)]
)
def test_every_gemm_gets_dense_operands(is_causal, dtype, bf16_pv, monkeypatch):
    """oneDNN's GEMM on an operand with gaps falls to a kernel ~1000x slower (a causal 2048-token forward took 48 s
    instead of 0.4 s when the causal blocks passed a column slice of vᵀ): every call must get a contiguous input and
    a weight that is contiguous or the transpose of a contiguous tensor (the values' (Dv, keys) view)."""
    seen = []
    real = oa._LINEAR_POINTWISE

    def checked(x, w, *args):
        seen.append((x.is_contiguous(), w.is_contiguous() or w.t().is_contiguous()))
        return real(x, w, *args)

    if bf16_pv and not oa._NATIVE[torch.bfloat16]:
        pytest.skip("bf16 PV needs bf16 instructions")
    monkeypatch.setattr(oa, "_LINEAR_POINTWISE", checked)
    q, k, v = (torch.randn(1, 2, 300, 16, dtype=dtype) for _ in range(3))
    out = oa.onednn_attention(q, k, v, is_causal=is_causal, block=64, bf16_pv=bf16_pv)
    assert len(seen) >= 2 * 5 and all(x and w for x, w in seen), seen
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), oracle(q, k, v, is_causal=is_causal).float(), **tolerance)


needs_native_bf16 = pytest.mark.skipif(
    oa._LINEAR_POINTWISE is None or not oa._NATIVE[torch.bfloat16], reason="bf16 PV needs bf16 instructions"
)


@needs_native_bf16
@pytest.mark.parametrize("case", ["plain", "bool-mask", "float-mask", "causal", "extreme-scores"])
def test_bf16_pv_stays_within_sdpa_error(case):
    """bf16 PV (float32 scores and softmax statistics, weights rounded once to bf16): against the float64 oracle of
    the same bf16 inputs, an RMS error at most 1.5× that of SDPA's own bf16 kernel (which also rounds its weights)
    and no element off by more than two bf16 roundings of the largest output, on every mask kind and on the
    max-subtracting path; fully masked rows give zeros."""
    q, k, v = (t.bfloat16() for t in qkv_views(2, 520, H=2))
    mask, causal = None, case == "causal"
    if case == "bool-mask":
        mask = torch.rand(2, 1, 520, 520, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[1, :, :, 400:] = False
        mask[0, 0, 5] = False  # a query that sees nothing
    elif case == "float-mask":
        mask = torch.randn(2, 2, 520, 520, generator=torch.Generator().manual_seed(4))
        mask[..., 500:] = torch.finfo(torch.float32).min
    elif case == "extreme-scores":
        q = q * torch.tensor([40.0, 1.0], dtype=torch.bfloat16).view(1, 2, 1, 1)  # 2^s' overflows in head 0
    out = oa.onednn_attention(q, k, v, mask, is_causal=causal, bf16_pv=True, block=128)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 520, 2, 16)
    exact = oracle(q, k, v, mask, is_causal=causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).transpose(1, 2)
    def rms(x):
        return (x.float() - exact).pow(2).mean().sqrt().item()

    assert rms(out) <= 1.5 * rms(sdpa) + 1e-7
    assert (out.float() - exact).abs().max().item() <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item()
    if case == "bool-mask":
        assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5]))


def test_bf16_pv_refuses_other_dtypes():
    q, k, v = qkv_views(1, 520)
    with pytest.raises(ValueError, match="bf16_pv needs bf16"):
        oa.onednn_attention(q, k, v, bf16_pv=True)


@needs_native_bf16
def test_the_model_runs_bf16_pv_where_chosen_and_float32_models_never(monkeypatch):
    """With the attention decision at "onednn_bf16": a bf16 model's layers run bf16 PV and stay close to its float32
    twin; a float32 model runs the float32-attended kernel (the forced path does not apply to it)."""
    calibration.force("attention", "onednn_bf16")
    seen = []

    def spy(*args, **kwargs):
        seen.append((args[1].dtype, kwargs.get("bf16_pv")))
        return oa.onednn_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "onednn_attention_forward", spy)
    model, reference, low = float32_then_bf16()
    layers = model.config.num_hidden_layers
    assert seen == [(torch.float32, False)] * layers + [(torch.bfloat16, True)] * layers
    assert torch.nn.functional.cosine_similarity(low, reference, dim=-1).min().item() > 0.999


def test_nan_values_in_one_batch_row_leave_the_others_exact():
    """The value bound is taken per group of heads: a NaN in one row's values must send that row's blocks the safe way
    rather than hide the bound (max() with NaN), and another row's large values must still be bounded."""
    q = torch.full((2, 1, 512, 16), 15.6)  # every score ≈ 90 in base-2 units: denominators ≈ 2⁹⁹, in range
    k = torch.ones(2, 1, 512, 16)
    v = torch.full((2, 1, 512, 16), 1e30)  # large, finite
    v[0, 0, 7, 0] = float("nan")  # in batch row 0 only
    out = oa.onednn_attention(q, k, v)
    assert out[1].isfinite().all() and out[0, :, :, 1:].isfinite().all()  # row 0: only its NaN column is NaN
    torch.testing.assert_close(out[1], torch.full_like(out[1], 1e30), atol=0, rtol=1e-5)  # the mean of equal values
    torch.testing.assert_close(out[0, :, :, 1:], torch.full_like(out[0, :, :, 1:], 1e30), atol=0, rtol=1e-5)
    assert out[0, :, :, 0].isnan().all()


def test_float64_inputs_are_attended_in_float32_when_called_directly():
    """The model never routes float64 here, but the public function takes it (float32 inside, float64 out)."""
    q, k, v = (t.double() for t in qkv_views(1, 520))
    out = oa.onednn_attention(q, k, v)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, oracle(q, k, v).double(), atol=2e-6, rtol=1e-5)


def test_a_forced_attention_path_wins_over_the_on_switch(monkeypatch):
    q, k, v = qkv_views(1, 600)
    monkeypatch.setenv("ROFORMER_ROPE_ONEDNN_ATTENTION", "1")
    with torch.no_grad():
        assert oa.onednn_attention_path(q, k, None, 0.0, v) == "onednn"  # the fixture forces "onednn"
        calibration.force("attention", "sdpa")
        assert oa.onednn_attention_path(q, k, None, 0.0, v) is None
        calibration.force("attention", None)
        assert oa.onednn_attention_path(q, k, None, 0.0, v) == "onednn"  # nothing forced: the switch says on
