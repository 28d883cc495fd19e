"""Rotary position embedding (RoFormer, Su et al. 2021, §3.2–3.4), interleaved as the original.

Notation used in the shape comments:
    B: batch size, T: query length, N: projections rotated together (q, k [, v]), H: heads,
    D: rotated size (even; the head size, or the feature size of linear attention), D/2: rotated pairs.

The paper (eq. 34) rotates each pair (x_{2i}, x_{2i+1}) of a vector at position m by angle m·θ_i,
θ_i = base^(-2i/D) (eq. 15):
    x'_{2i}   = x_{2i} cos(mθ_i) - x_{2i+1} sin(mθ_i)
    x'_{2i+1} = x_{2i+1} cos(mθ_i) + x_{2i} sin(mθ_i)
which is the complex product (x_{2i} + i·x_{2i+1}) · e^{i·mθ_i} (eq. 12). The pairs are adjacent in
memory, so `torch.view_as_complex` reads them in place and one complex multiply rotates queries and keys
of every head together, straight out of the fused QKV projection: in eager mode on CPU this is ~15× faster
than the real-valued form on stride-2 views (measured at 4×512, 12 heads × 64). Under `torch.compile` /
`torch.export` / ONNX export, where complex tensors are poorly supported, the real-valued form of eq. 34
must run instead; both give the same numbers (tests check them against each other, a float64 complex oracle
and the built-in transformers implementation). Which form runs where is decided by the caller
(`onednn_roformer_rope.rotate`); the functions here are pure math.

Frequencies: `rope_parameters["rope_type"]` "default" is eq. 15; "linear" and "dynamic" come from
transformers' own `ROPE_INIT_FUNCTIONS` (the same formulas Llama & co. use), computed for dimension D.
"""

import copy

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rotary_inv_freq(dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(-2i/D) for i = 0..D/2-1 (paper eq. 15), float32, shape (D/2,)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / (base**exponents)


def _config_for_dim(config, dim: int):
    """A shallow copy of `config` whose `head_dim` is `dim`: transformers' rope functions read the size there."""
    if config.head_dim == dim:
        return config
    proxy = copy.copy(config)
    object.__setattr__(proxy, "head_dim", dim)  # bypass @strict: a throwaway view, never validated or saved
    return proxy


class RoFormerRopeRotaryEmbedding(nn.Module):
    """Computes cos/sin of m·θ_i for the actual positions, once per forward, in float32.

    No position table: any position (and any length) works. `dim` is the rotated size (default: the head
    size; linear attention may rotate feature vectors of another size). `rope_type` "linear" stretches
    positions (θ_i / f), "dynamic" raises the base once the sequence outgrows `max_position_embeddings`
    (NTK-aware: base·(f·T/L - (f-1))^(D/(D-2))) so the lowest frequencies cover the new length.
    """

    def __init__(self, config, dim: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.head_dim = dim or config.head_dim  # the rotated size D (name kept: it is the head size by default)
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.original_max_positions = config.max_position_embeddings
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, seq_len: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """(D/2,) float32 frequencies; `seq_len` matters for "dynamic" only."""
        if self.rope_type == "default":
            return rotary_inv_freq(self.head_dim, float(self.config.rope_parameters["rope_theta"])).to(device)
        inv_freq, _ = ROPE_INIT_FUNCTIONS[self.rope_type](
            _config_for_dim(self.config, self.head_dim), device, seq_len=seq_len
        )  # attention factor: 1.0 for "linear" and "dynamic"
        return inv_freq.float()

    def _apply(self, fn, recurse: bool = True):
        """`.to(device)` moves the frequencies; `.to(dtype)` / `.bfloat16()` / `.half()` do not round them: θ_i in
        bf16 is off by up to 2^-9 relative, and m·θ_i then by 0.22 rad at position 512, 1.8 rad at 4096."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if not inv_freq.is_meta and self.inv_freq.dtype != inv_freq.dtype:
            self.inv_freq = inv_freq.to(self.inv_freq.device)  # the float32 values, on the new device
        return self

    def _inv_freq_for(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.rope_type == "dynamic":
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.original_max_positions:
                return self.compute_inv_freq(seq_len, self.inv_freq.device)
        if self.inv_freq.dtype not in (torch.float32, torch.float64):  # made or filled in low precision: recompute
            return self.compute_inv_freq(device=self.inv_freq.device)
        return self.inv_freq

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B or 1, T) integers → (cos, sin), each (B or 1, T, D/2) float32."""
        # The angles m·θ_i are formed in float32 whatever the model dtype: at m ~ 10^4 a bf16 angle would be
        # off by whole radians.
        angles = position_ids.to(torch.float32)[..., None] * self._inv_freq_for(position_ids).float()  # (B, T, D/2)
        return angles.cos(), angles.sin()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype rotations are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eq. 34 as one complex multiply: x (..., D) any strides with a unit last stride; cos, sin float32
    broadcastable to (..., D/2) → (..., D) contiguous, dtype of `x`; products in float32 (float64 for float64)."""
    wide = _wide(x.dtype)
    pairs = torch.view_as_complex(x.to(wide).unflatten(-1, (-1, 2)))  # (..., D/2) complex, no copy if x is wide
    rotated = torch.view_as_real(pairs * torch.complex(cos.to(wide), sin.to(wide)))  # (..., D/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., D)


# bf16/fp16 rotate through a float32 copy made this many elements at a time (1 MiB): the copy, the multiply
# and the copy back stay in L2 instead of streaming the whole (B, T, 2, H, D) slice three times. Sapphire
# Rapids, 12 heads × 64: 1.2–1.35× faster than the out-of-place form at 8×128, 4×512 and 1×4096 with one
# thread and with two (smaller chunks lose with two threads: too little work per parallel region).
_LOW_PRECISION_CHUNK = 1 << 18


def rotate_pairs_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_pairs` in x's own memory; returns x. float32: one complex multiply on x viewed as complex.
    bf16/fp16 (x: (B, T, ...), cos/sin: (B or 1, T, ...)): products in float32 on a copy of a few positions
    at a time, rounded once into x, exactly as `rotate_pairs` rounds them."""
    if x.dtype in (torch.float32, torch.float64):
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (..., D/2) complex view of x
        pairs.mul_(torch.complex(cos.to(x.dtype), sin.to(x.dtype)))  # × e^{i·m·θ}
        return x
    if x.dim() < 3 or cos.dim() != x.dim():
        return x.copy_(rotate_pairs(x, cos, sin))
    rotation = torch.complex(cos, sin)  # (B or 1, T, ..., D/2)
    step = max(1, _LOW_PRECISION_CHUNK // (x[:, :1].numel()))  # positions per chunk
    for start in range(0, x.shape[1], step):
        part = x[:, start : start + step]  # (B, t, ..., D) view of x
        wide = part.float()  # (B, t, ..., D) float32, contiguous
        torch.view_as_complex(wide.unflatten(-1, (-1, 2))).mul_(rotation[:, start : start + step])  # eq. 34
        part.copy_(wide)
    return x


def apply_rotary_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eq. 34 with real tensors: x·cos + rot(x)·sin, rot(x) = (-x_1, x_0, -x_3, x_2, ...).

    x: (..., D); cos, sin broadcastable to (..., D/2) → (..., D), dtype of `x`. Traceable by compile/export.
    """
    pairs = x.to(_wide(x.dtype)).unflatten(-1, (-1, 2))  # (..., D/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (..., D/2) each
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)  # (..., D/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., D)


def per_head(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, D/2) angles → (B, T, 1, 1, D/2): broadcast over the N projections and H heads of a fused QKV."""
    return cos[:, :, None, None], sin[:, :, None, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (B, T, N, H, D) slice of a fused projection; cos, sin: (B or 1, T, D/2) → (B, T, N, H, D)."""
    return rotate_pairs(x, *per_head(cos, sin))


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place (inference): rotates x's own memory and returns x."""
    return rotate_pairs_(x, *per_head(cos, sin))


__all__ = [
    "RoFormerRopeRotaryEmbedding",
    "apply_rotary",
    "apply_rotary_",
    "apply_rotary_real",
    "per_head",
    "rotary_inv_freq",
    "rotate_pairs",
    "rotate_pairs_",
]
