"""Rotary embedding against independent oracles: complex numbers, the built-in table, the paper's property."""

import pytest
import torch
import transformers

from modeling_roformer_rope.rotary_roformer_rope import (
    RoFormerRopeRotaryEmbedding,
    apply_rotary,
    apply_rotary_interleaved,
)

from conftest import tiny_config


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Oracle: pairs (x_2i, x_2i+1) as complex numbers times e^{i·m·θ_i} (paper eq. 12/34)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.polar(torch.ones_like(theta), positions.double()[:, None] * theta)  # (T, D/2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * freqs).flatten(-2)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotary(head_dim: int = 16, **overrides):
    config = tiny_config(hidden_size=head_dim * 2, num_attention_heads=2, **overrides)
    return RoFormerRopeRotaryEmbedding(config)


@pytest.mark.parametrize("offset", [0, 7, 5000])
def test_matches_complex_oracle(offset):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 16)  # (B, H, T, D)
    positions = torch.arange(offset, offset + 11)
    cos, sin = rotary()(positions[None], torch.float32)
    expected = complex_rope(x, positions).float()
    # float32 angles m·θ carry a relative rounding error of ~6e-8, i.e. ~3e-4 rad at m = 5000 (as in the original).
    atol = 2e-5 + 1.2e-7 * offset * x.abs().max().item()
    torch.testing.assert_close(apply_rotary_interleaved(x, cos, sin), expected, atol=atol, rtol=1e-5)
    # The fast path returns the same numbers, de-interleaved.
    torch.testing.assert_close(apply_rotary(x, cos, sin), deinterleave(expected), atol=atol, rtol=1e-5)


def test_matches_builtin_roformer_rotary():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    table = transformers.models.roformer.modeling_roformer.RoFormerSinusoidalPositionalEmbedding(64, 8)
    table.weight.data = table.create_weight()
    sinusoidal_pos = table((2, 9))[None, None]
    builtin = transformers.models.roformer.modeling_roformer.RoFormerSelfAttention.apply_rotary_position_embeddings
    bq, bk, bv = builtin(sinusoidal_pos, q, k, v)
    cos, sin = rotary(head_dim=8)(torch.arange(9)[None], torch.float32)
    torch.testing.assert_close(apply_rotary_interleaved(q, cos, sin), bq, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(apply_rotary_interleaved(v, cos, sin), bv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), deinterleave(bk), atol=1e-6, rtol=1e-5)


def test_scores_depend_only_on_relative_position():
    """q_m · k_n depends on m − n only (paper eq. 11): shifting both positions leaves scores unchanged."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    rope = rotary()

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope(torch.tensor([[m]]), torch.float32)
        cos_n, sin_n = rope(torch.tensor([[n]]), torch.float32)
        return (apply_rotary(q, cos_m, sin_m) * apply_rotary(k, cos_n, sin_n)).sum().item()

    for m, n in [(3, 1), (10, 0), (0, 10), (100, 37)]:
        reference = score(m, n)
        for shift in (1, 17, 1000):
            assert score(m + shift, n + shift) == pytest.approx(reference, abs=2e-4)
    assert abs(score(5, 1) - score(5, 4)) > 1e-3  # and it does depend on m − n


def test_per_sample_position_ids_broadcast():
    rope = rotary()
    cos, sin = rope(torch.tensor([[0, 1, 2], [5, 6, 7]]), torch.float32)
    assert cos.shape == (2, 1, 3, 8)
    single_cos, _ = rope(torch.tensor([[5, 6, 7]]), torch.float32)
    torch.testing.assert_close(cos[1:], single_cos)


def test_linear_scaling_divides_positions():
    plain, scaled = rotary(), rotary(rope_scaling={"type": "linear", "factor": 4.0})
    torch.testing.assert_close(scaled(torch.tensor([[40]]), torch.float32)[0], plain(torch.tensor([[10]]), torch.float32)[0])


def test_dynamic_ntk_only_changes_past_trained_length():
    plain, dynamic = rotary(), rotary(rope_scaling={"type": "dynamic", "factor": 2.0})
    short = torch.arange(64)[None]  # max_position_embeddings = 64
    torch.testing.assert_close(dynamic(short, torch.float32)[0], plain(short, torch.float32)[0])
    long = torch.arange(200)[None]
    assert not torch.allclose(dynamic(long, torch.float32)[0], plain(long, torch.float32)[0])
    # The highest frequency (θ_0 = 1) is unchanged by a larger base.
    torch.testing.assert_close(dynamic(long, torch.float32)[0][..., 0], plain(long, torch.float32)[0][..., 0])


def test_angles_in_float32_for_low_precision_models():
    cos_bf16, _ = rotary()(torch.tensor([[30000]]), torch.bfloat16)
    cos_fp32, _ = rotary()(torch.tensor([[30000]]), torch.float32)
    assert cos_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(cos_bf16.float(), cos_fp32, atol=1e-2, rtol=0)
