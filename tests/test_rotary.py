"""Rotary embedding against independent oracles: complex numbers, the built-in formula, the paper's property."""

import pytest
import torch
import transformers

from conftest import tiny_config
from modeling_roformer_rope import rotary_roformer_rope as rotary_module
from modeling_roformer_rope.rotary_roformer_rope import (
    RoFormerRopeRotaryEmbedding,
    apply_rotary,
    apply_rotary_,
    apply_rotary_real,
)

BuiltinAttention = transformers.models.roformer.modeling_roformer.RoFormerSelfAttention
BuiltinTable = transformers.models.roformer.modeling_roformer.RoFormerSinusoidalPositionalEmbedding


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Oracle in float64: pairs (x_2i, x_2i+1) as complex numbers times e^{i·m·θ_i} (paper eq. 12/34).

    x: (B, T, ..., D), positions: (T,)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.polar(torch.ones_like(theta), positions.double()[:, None] * theta)  # (T, D/2)
    freqs = freqs.view(1, len(positions), *([1] * (x.dim() - 3)), d // 2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * freqs).flatten(-2)


def rotary(head_dim: int = 16, **overrides):
    return RoFormerRopeRotaryEmbedding(tiny_config(hidden_size=head_dim * 2, num_attention_heads=2, **overrides))


@pytest.mark.parametrize("offset", [0, 7, 5000])
def test_matches_complex_oracle(offset):
    torch.manual_seed(0)
    x = torch.randn(2, 11, 3, 4, 16)  # (B, T, N, H, D)
    positions = torch.arange(offset, offset + 11)
    cos, sin = rotary()(positions[None])
    expected = complex_rope(x, positions).float()
    # float32 angles m·θ carry a relative rounding error of ~6e-8, i.e. ~3e-4 rad at m = 5000 (as in the original).
    atol = 2e-5 + 1.2e-7 * offset * x.abs().max().item()
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=atol, rtol=1e-5)
    real = apply_rotary_real(x, cos[:, :, None, None], sin[:, :, None, None])
    torch.testing.assert_close(real, expected, atol=atol, rtol=1e-5)


def test_strided_qk_slice_of_fused_projection():
    torch.manual_seed(0)
    qkv = torch.randn(2, 9, 3, 4, 8)
    cos, sin = rotary(head_dim=8)(torch.arange(9)[None])
    torch.testing.assert_close(apply_rotary(qkv[:, :, :2], cos, sin), apply_rotary(qkv[:, :, :2].clone(), cos, sin))


def test_matches_builtin_roformer_rotary():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))  # built-in layout (B, H, T, D)
    table = BuiltinTable(64, 8)
    table.weight.data = table.create_weight()
    bq, bk, bv = BuiltinAttention.apply_rotary_position_embeddings(table((2, 9))[None, None], q, k, v)
    cos, sin = rotary(head_dim=8)(torch.arange(9)[None])
    ours = apply_rotary(torch.stack((q, k, v), dim=2).transpose(1, 3), cos, sin)  # (B, T, 3, H, D)
    for got, want in zip(ours.transpose(1, 3).unbind(2), (bq, bk, bv)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_scores_depend_only_on_relative_position():
    """q_m · k_n depends on m − n only (paper eq. 11): shifting both positions leaves scores unchanged."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 1, 16), torch.randn(1, 1, 1, 1, 16)
    rope = rotary()

    def score(m: int, n: int) -> float:
        return (apply_rotary(q, *rope(torch.tensor([[m]]))) * apply_rotary(k, *rope(torch.tensor([[n]])))).sum().item()

    for m, n in [(3, 1), (10, 0), (0, 10), (100, 37)]:
        reference = score(m, n)
        for shift in (1, 17, 1000):
            assert score(m + shift, n + shift) == pytest.approx(reference, abs=2e-4)
    assert abs(score(5, 1) - score(5, 4)) > 1e-3  # and it does depend on m − n


def test_per_sample_position_ids_broadcast():
    rope = rotary()
    cos, sin = rope(torch.tensor([[0, 1, 2], [5, 6, 7]]))
    assert cos.shape == (2, 3, 8) and cos.dtype == torch.float32
    torch.testing.assert_close(cos[1:], rope(torch.tensor([[5, 6, 7]]))[0])


def test_linear_scaling_divides_positions():
    plain, scaled = rotary(), rotary(rope_scaling={"type": "linear", "factor": 4.0})
    torch.testing.assert_close(scaled(torch.tensor([[40]]))[0], plain(torch.tensor([[10]]))[0])


def test_dynamic_ntk_only_changes_past_trained_length():
    plain, dynamic = rotary(), rotary(rope_scaling={"type": "dynamic", "factor": 2.0})
    short = torch.arange(64)[None]  # max_position_embeddings = 64
    torch.testing.assert_close(dynamic(short)[0], plain(short)[0])
    long = torch.arange(200)[None]
    assert not torch.allclose(dynamic(long)[0], plain(long)[0])
    # The highest frequency (θ_0 = 1) is unchanged by a larger base.
    torch.testing.assert_close(dynamic(long)[0][..., 0], plain(long)[0][..., 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_rotate_in_float32(dtype):
    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, 2, 16).to(dtype)
    cos, sin = rotary()(torch.tensor([[30000, 30001, 30002, 30003, 30004]]))
    out = apply_rotary(x, cos, sin)
    assert out.dtype == dtype
    expected = complex_rope(x.float(), torch.arange(30000, 30005)).to(dtype)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("chunk", [None, 1, 7 * 2 * 4 * 16])
@pytest.mark.parametrize("per_batch_positions", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_rotation_equals_out_of_place(dtype, per_batch_positions, chunk, monkeypatch):
    """apply_rotary_ rotates the q/k slice of the fused projection in its own memory, bit for bit as the
    out-of-place form; bf16/fp16 go through float32 a few positions at a time (`chunk` forces 1 or several)."""
    if chunk is not None:
        monkeypatch.setattr(rotary_module, "_LOW_PRECISION_CHUNK", chunk)
    torch.manual_seed(0)
    qkv = (torch.randn(2, 9, 3, 4, 16) * 3).to(dtype)  # (B, T, 3, H, D)
    positions = torch.stack([torch.arange(9), torch.arange(9) + 500]) if per_batch_positions else torch.arange(9)[None]
    cos, sin = RoFormerRopeRotaryEmbedding(tiny_config(hidden_size=64))(positions)
    expected = apply_rotary(qkv[:, :, :2], cos, sin)
    untouched = qkv[:, :, 2].clone()
    got = apply_rotary_(qkv[:, :, :2], cos, sin)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :, :2], expected, atol=0, rtol=0)
    assert torch.equal(qkv[:, :, 2], untouched)  # values stay as they were


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_casts_keep_the_frequencies_exact(cast):
    """`.to(dtype)` moves nothing but the dtype of the weights: θ_i rounded to bf16 would put m·θ_i whole radians off
    by position ~1000 (the built-in's table only rounds its cos/sin values)."""
    model = RoFormerRopeRotaryEmbedding(tiny_config(hidden_size=128, num_attention_heads=2))
    exact = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cast_model = torch.nn.Sequential(model).to(cast)[0]
    assert cast_model.inv_freq.dtype == torch.float32
    torch.testing.assert_close(cast_model.inv_freq.double(), exact, atol=0, rtol=1e-7)
    positions = torch.tensor([[4000]])
    cos, _ = cast_model(positions)
    torch.testing.assert_close(cos.double(), torch.cos(4000 * exact)[None, None], atol=2e-4, rtol=0)
    cast_model.inv_freq = cast_model.inv_freq.to(torch.bfloat16)  # a buffer filled in low precision some other way
    torch.testing.assert_close(cast_model(positions)[0], cos, atol=0, rtol=0)
