"""Rotary position embedding (RoFormer, Su et al. 2021, §3.2–3.4), interleaved as the original.

Notation used in the shape comments:
    B: batch size, T: query length, H: heads, D: head size (even), D/2: rotated pairs.

The paper (eq. 34) rotates each pair (x_{2i}, x_{2i+1}) of a query/key at position m by angle m·θ_i,
θ_i = base^(-2i/D) (eq. 15):
    x'_{2i}   = x_{2i} cos(mθ_i) - x_{2i+1} sin(mθ_i)
    x'_{2i+1} = x_{2i+1} cos(mθ_i) + x_{2i} sin(mθ_i)

Speed trick (exact, not an approximation): attention only ever uses the dot product q'_m · k'_n, and a
dot product is unchanged when the same permutation is applied to the dimensions of both vectors. So we
write the rotated pairs as [all x'_{2i} | all x'_{2i+1}] ("de-interleaved") instead of interleaving them
back: one `torch.cat` on strided views, no stack/reshape copies. Queries and keys (and the KV cache)
share this layout; the weights keep the checkpoint's interleaved layout. Values are different: their
dimensions reach the output, so `rotary_value` uses `apply_rotary_interleaved`, which keeps the order.
"""

import torch
from torch import nn


def rotary_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(-2i/D) for i = 0..D/2-1 (paper eq. 15), float32, shape (D/2,)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (base**exponents)


class RoFormerRopeRotaryEmbedding(nn.Module):
    """Computes cos/sin of m·θ_i for the actual positions, once per forward, in float32.

    No position table: any position (and any length) works. `rope_scaling` stretches positions
    (`linear`: m/f) or, once the sequence outgrows `max_position_embeddings`, raises the base
    (`dynamic`, NTK-aware: base·(f·T/L - (f-1))^(D/(D-2))) so the lowest frequencies cover the new length.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.base = float(config.rope_theta)
        scaling = config.rope_scaling or {}
        self.scaling_type = scaling.get("type", scaling.get("rope_type"))
        self.scaling_factor = float(scaling.get("factor", 1.0))
        self.original_max_positions = config.max_position_embeddings
        self.register_buffer("inv_freq", rotary_inv_freq(self.head_dim, self.base), persistent=False)

    def _inv_freq_for(self, max_position: int) -> torch.Tensor:
        if self.scaling_type == "dynamic" and max_position > self.original_max_positions:
            f, length, d = self.scaling_factor, self.original_max_positions, self.head_dim
            base = self.base * ((f * max_position / length) - (f - 1)) ** (d / (d - 2))
            return rotary_inv_freq(d, base).to(self.inv_freq.device)
        return self.inv_freq

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B or 1, T) integers → (cos, sin), each (B or 1, 1, T, D/2) in `dtype`."""
        positions = position_ids.to(torch.float32)
        if self.scaling_type == "linear":
            positions = positions / self.scaling_factor
        inv_freq = self._inv_freq_for(int(position_ids.max()) + 1 if self.scaling_type == "dynamic" else 0)
        # The angles m·θ_i are formed in float32 whatever the model dtype: at m ~ 10^4 a bf16 angle would be
        # off by whole radians.
        angles = positions[..., None] * inv_freq.float()  # (B, T, D/2)
        angles = angles[:, None]  # (B, 1, T, D/2): broadcast over heads
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x` and return them de-interleaved (see module docstring).

    x: (B, H, T, D) (any strides); cos, sin: (B or 1, 1, T, D/2) → (B, H, T, D) with dims ordered
    [x'_0, x'_2, ..., x'_{D-2}, x'_1, x'_3, ..., x'_{D-1}].
    """
    x_even, x_odd = x[..., 0::2], x[..., 1::2]  # (B, H, T, D/2) strided views, no copy
    return torch.cat((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x` keeping the original dimension order (paper eq. 34).

    Used for values (`rotary_value`), whose dimension order reaches the layer output.
    x: (B, H, T, D); cos, sin: (B or 1, 1, T, D/2) → (B, H, T, D).
    """
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)  # (B, H, T, D/2, 2)
    return rotated.flatten(-2)  # (B, H, T, D)


__all__ = ["RoFormerRopeRotaryEmbedding", "apply_rotary", "apply_rotary_interleaved", "rotary_inv_freq"]
