"""The CPU fast paths behind one small interface, so the model files state only the math.

What lives here (and nowhere else):
- `settings`: the `ROFORMER_ROPE_*` switches, read once at import; a malformed value is ignored with a warning,
  never an import error.
- `tracing()`: torch.compile / export / jit / ONNX tracing, where every eager-only path steps aside.
- `RoFormerRopeLinear` / `linear`: `nn.Linear` whose CPU float32 GEMMs (forward *and* backward) run on oneDNN.
- `rotate_qkv`: the rotary step of a fused QKV projection: one complex multiply in eager mode (in place at
  inference), the real-valued eq. 34 under tracing.
- `activation`: the MLP activation, exact GELU in place at inference.
- `may_modify_in_place`: the in-place policy both use (inference only, and never on an output a hook could
  hold on to).
The blocked softmax attention kernel is `onednn_attention_roformer_rope.py`; `attention_roformer_rope.py`
decides when it runs.

Why oneDNN GEMMs: on the CPUs we measured (AMD EPYC, AVX-512) PyTorch's float32 `F.linear` goes to MKL sgemm,
which reaches ~190 GFLOP/s, while oneDNN's inner-product primitive reaches ~420 GFLOP/s on the same shapes
(`bench/experiments.py gemm_rate`). An encoder forward is >80% linear GEMMs at 512 tokens. The entry point
is `torch.ops.mkldnn._linear_pointwise` (what inductor emits for CPU linears); it has no usable autograd
formula, so `_OneDNNLinear` supplies one. Everything else (other devices and dtypes, autocast, tracing, a
torch build without the op) falls back to `F.linear`, so the module is a drop-in `nn.Linear` with the same
parameters and state-dict keys.

Switches: `ROFORMER_ROPE_ONEDNN=0` turns off every oneDNN path; `ROFORMER_ROPE_ONEDNN_ATTENTION=0` only the
attention kernel; `ROFORMER_ROPE_ONEDNN_ATTENTION_MIN_KEYS=n` moves its threshold (default 384 keys).
"""

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import GELUActivation

from .rotary_roformer_rope import apply_rotary_real, per_head, rotate_pairs, rotate_pairs_

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _ignore(name: str, value: str, expected: str, default) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("ignoring %s=%r: expected %s; using %s", name, value, expected, default)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    _ignore(name, value, "0 or 1", int(default))
    return default


def _env_int(name: str, default: int, minimum: int = 0) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        _ignore(name, value, f"an integer >= {minimum}", default)
        return default
    return number


@dataclass(frozen=True)
class Settings:
    onednn: bool = True  # oneDNN GEMMs for CPU float32 linears (and the attention kernel)
    onednn_attention: bool = True  # our blocked attention kernel where it applies
    onednn_attention_min_keys: int = 384  # below this many keys SDPA's fused kernel wins


def read_settings() -> Settings:
    return Settings(
        onednn=_env_flag("ROFORMER_ROPE_ONEDNN", True),
        onednn_attention=_env_flag("ROFORMER_ROPE_ONEDNN_ATTENTION", True),
        onednn_attention_min_keys=_env_int("ROFORMER_ROPE_ONEDNN_ATTENTION_MIN_KEYS", 384),
    )


settings = read_settings()


def tracing() -> bool:
    """torch.compile / torch.export / jit / ONNX tracing: the payload's eager-only fast paths step aside."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return torch.compiler.is_compiling() or exporting() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def _onednn_op():
    """The oneDNN linear op, or None when switched off or this torch build lacks it (checked once, tiny call)."""
    if not settings.onednn or not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        if not torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 3), 4.0)):
            return None
        return op
    except (AttributeError, RuntimeError):
        return None


_LINEAR_POINTWISE = _onednn_op()


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) · weightᵀ (I, O) + bias on oneDNN → (N, O)."""
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x Wᵀ + b with forward and backward GEMMs on oneDNN (x flattened to (N, I))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # (N, I)
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        ctx.input_shape = x.shape
        return _mm(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])  # (..., O)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, weight.shape[0]).contiguous()  # (N, O)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # grad_x = go · W: a linear layer whose "weight" is Wᵀ (I, O).
            grad_x = _mm(go, weight.t().contiguous(), None).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            # grad_W = goᵀ · x: a linear layer on goᵀ (O, N) whose "weight" is xᵀ (I, N).
            grad_w = _mm(go.t().contiguous(), x2d.t().contiguous(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = go.sum(0)
        return grad_x, grad_w, grad_b


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _LINEAR_POINTWISE is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not tracing()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` semantics; oneDNN GEMMs for CPU float32 (see the module docstring)."""
    if not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _mm(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])


class RoFormerRopeLinear(nn.Linear):
    """Drop-in `nn.Linear` (same parameters and state dict) routed through `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook could hold on to these modules' outputs: then they must not change in place."""
    return bool(
        nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
        or any(m._forward_hooks or m._forward_pre_hooks for m in modules)
        # PEFT's LoRA wrappers may return their base layer's output tensor itself.
        or any(hooked(m.base_layer) for m in modules if isinstance(getattr(m, "base_layer", None), nn.Module))
    )


def may_modify_in_place(*producers: nn.Module) -> bool:
    """Inference (no autograd), eager, and no hook on the modules whose outputs would be overwritten."""
    return not torch.is_grad_enabled() and not tracing() and not hooked(*producers)


def rotate_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_value: bool, producer: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate queries and keys (and values when `rotary_value`) of a fused projection (paper eq. 34).

    qkv: (B, T, 3, H, D) output of `producer`; cos, sin: (B or 1, T, D/2) float32 → q, k, v, each (B, T, H, D)
    (strided views into one buffer). Inference rotates the projection's own memory (no (B, T, 2, H, D) copy).
    """
    cos, sin = per_head(cos, sin)  # (B, T, 1, 1, D/2): broadcast over q/k/v and heads
    rotated = qkv if rotary_value else qkv[:, :, :2]  # (B, T, 2 or 3, H, D)
    if tracing():
        rotated = apply_rotary_real(rotated, cos, sin)
    elif may_modify_in_place(producer):
        rotated = rotate_pairs_(rotated, cos, sin)
    else:
        rotated = rotate_pairs(rotated, cos, sin)
    if rotary_value:  # the English ELECTRA-style RoFormers also rotate values
        return rotated.unbind(2)
    query, key = rotated.unbind(2)
    return query, key, qkv[:, :, 2]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eq. 34 on any layout (cos, sin broadcastable to (..., D/2)): complex form in eager, real under tracing."""
    return apply_rotary_real(x, cos, sin) if tracing() else rotate_pairs(x, cos, sin)


def activation(act_fn: nn.Module, x: torch.Tensor, *producers: nn.Module) -> torch.Tensor:
    """act_fn(x); exact GELU runs in place at inference (~3× faster at 4096 tokens than a second (B, T, I) buffer)."""
    exact_gelu = isinstance(act_fn, GELUActivation) and act_fn.act is F.gelu
    if exact_gelu and may_modify_in_place(*producers, act_fn):
        return torch.ops.aten.gelu_(x)
    return act_fn(x)


__all__ = [
    "RoFormerRopeLinear",
    "activation",
    "hooked",
    "linear",
    "may_modify_in_place",
    "rotate",
    "rotate_qkv",
    "settings",
    "tracing",
]
