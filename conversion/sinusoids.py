"""The built-in RoFormer's stored sinusoid table must be the standard one, since ours is computed.

The built-in keeps `[max_position_embeddings, head_size]` sin/cos values as a (frozen) weight: the first
half holds sin(m θ_i), the second cos(m θ_i), θ_i = 10000^(-2i/d) (paper eq. 15). Our model computes the
same angles on the fly and has no place for a modified table, so a checkpoint whose table differs
(edited, trained, another base) cannot be converted faithfully: say so, rather than let the output
check report an unexplained logits difference.
"""

from __future__ import annotations

import torch

from .key_map import ConversionError


def standard_table(num_positions: int, dim: int) -> torch.Tensor:
    """[num_positions, dim]: sin(m θ_i) in the first ceil(dim/2) columns, cos(m θ_i) after (float64)."""
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]
    theta = 10000.0 ** (-2 * torch.arange((dim + 1) // 2, dtype=torch.float64) / dim)
    angles = positions * theta[None]
    return torch.cat([angles.sin(), angles[:, : dim // 2].cos()], dim=1)


def check_sinusoid_table(table: torch.Tensor, name: str, atol: float = 1e-4) -> None:
    """Raise a ConversionError naming the first position where `table` departs from the standard table (by more
    than `atol`, or than the rounding of a bf16/fp16 table: one unit in the last place of 1)."""
    if table.dim() != 2:
        raise ConversionError(
            f"{name}: expected a [positions, head_size] sinusoid table, got shape {list(table.shape)}"
        )
    expected = standard_table(*table.shape)
    if table.numel() == 0:
        return
    if table.is_floating_point():
        atol = max(atol, torch.finfo(table.dtype).eps)
    per_position = (table.double() - expected).abs().amax(dim=1)
    bad = (~(per_position <= atol)).nonzero()  # NaN counts as bad
    if len(bad):
        raise ConversionError(
            f"{name} is not the standard RoFormer sinusoid table (max |diff| {per_position.max().item():.3g}, "
            f"first at position {int(bad[0])}): roformer_rope computes the standard sinusoids on the fly and "
            "cannot reproduce this model"
        )
