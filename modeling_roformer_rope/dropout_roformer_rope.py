"""Dropout on CPU with a quarter of torch's random draws and a bool mask.

Training with dropout (0.1 everywhere in RoFormer's configs) spends much of a CPU step making dropout masks:
torch's CPU dropout draws one random number per element (`bernoulli_`, serial) into a tensor of the input's
dtype, divides it by 1 - p and multiplies. The attention probabilities alone are (B, H, T, S) elements a layer.

Here each 64-bit random word (torch's CPU generator, so `torch.manual_seed` reproduces a run) gives four
16-bit uniform integers, and an element is dropped when its integer falls in the lowest k = round(p · 2¹⁶) of
2¹⁶ values: dropout with probability p' = k / 2¹⁶, kept elements scaled by 1 / (1 - p'), so the expectation is
exact for p'. p' differs from p by at most 2⁻¹⁷ (6·10⁻⁵ of p at the usual 0.1); a p that 16 bits cannot hold
within 0.1% (below ~0.008) goes to torch's dropout, as do other devices, non-float dtypes, p = 0 or 1, and
tracing (torch.compile / export). The mask is kept as bool for the backward (torch keeps a tensor of the
input's dtype): the step also saves memory. `python bench/experiments.py --only dropout` times it against
torch's on the running CPU.
"""

import torch
from torch import nn
from torch.nn import functional as F

from .onednn_roformer_rope import tracing

LEVELS = 1 << 16  # values of one 16-bit draw
_TOLERANCE = 1e-3  # largest relative |p' - p| taken without falling back to torch's dropout


def dropped_levels(p: float) -> int | None:
    """k of p' = k / 2¹⁶, or None when 16 bits cannot hold p within `_TOLERANCE` (or p is 0 or 1)."""
    levels = round(p * LEVELS)
    if not 0 < levels < LEVELS or abs(levels - p * LEVELS) > _TOLERANCE * p * LEVELS:
        return None
    return levels


def drop_mask(shape: torch.Size, levels: int) -> torch.Tensor:
    """(shape) bool, True with probability levels / 2¹⁶ for each element, independently."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)  # ⌈n/4⌉ uniform 64-bit words
    draws = words.view(torch.int16)[:n].view(shape)  # (shape) uniform in [-2¹⁵, 2¹⁵)
    return draws < levels - LEVELS // 2


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, drop: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(drop)
        ctx.scale = scale
        return x.masked_fill(drop, 0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (drop,) = ctx.saved_tensors
        return grad.masked_fill(drop, 0).mul_(ctx.scale), None, None


def _levels_here(x: torch.Tensor, p: float) -> int | None:
    """k for `x` where the 16-bit masks apply (CPU float tensors, eager), else None (torch's dropout)."""
    if x.device.type != "cpu" or not x.is_floating_point() or tracing():
        return None
    return dropped_levels(p)


def applies(x: torch.Tensor, p: float) -> bool:
    """Whether `dropout` uses the 16-bit masks for `x` (else torch's dropout)."""
    return _levels_here(x, p) is not None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)` with the masks above where they apply."""
    levels = _levels_here(x, p) if training else None
    if levels is None:
        return F.dropout(x, p, training)
    drop = drop_mask(x.shape, levels)
    scale = LEVELS / (LEVELS - levels)  # 1 / (1 - p')
    if torch.is_grad_enabled() and x.requires_grad:
        return _Dropout.apply(x, drop, scale)
    return x.masked_fill(drop, 0).mul_(scale)


class RoFormerRopeDropout(nn.Dropout):
    """`nn.Dropout` (same arguments, no state) whose CPU training masks come from `dropout` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)


__all__ = ["LEVELS", "RoFormerRopeDropout", "applies", "drop_mask", "dropout", "dropped_levels"]
