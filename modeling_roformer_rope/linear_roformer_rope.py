"""`nn.Linear` whose CPU float32 GEMMs run on oneDNN instead of the BLAS behind `F.linear`.

Why: on the CPUs we measured (AMD EPYC, AVX-512) PyTorch's float32 `F.linear` goes to MKL sgemm, which
reaches ~190 GFLOP/s, while oneDNN's inner-product primitive reaches ~420 GFLOP/s on the same shapes
(`bench/experiments.py gemm_rate`). An encoder forward is >80% linear GEMMs at 512 tokens, so this is
the single largest speed lever; `bench/` measures it against the built-in model.

The oneDNN entry point is `torch.ops.mkldnn._linear_pointwise` (what inductor emits for CPU linears). It
has no usable autograd formula, so `_OneDNNLinear` supplies one: every GEMM of the backward pass
(grad_input = grad_out · W, grad_weight = grad_outᵀ · x) also runs on oneDNN. Everything else (other
devices and dtypes, autocast, `torch.compile` / export tracing, a torch build without the op) falls back
to `F.linear`, so the module is a drop-in `nn.Linear` with the same parameters and state-dict keys.
Set `ROFORMER_ROPE_ONEDNN=0` to always use `F.linear`.
"""

import os

import torch
from torch import nn
from torch.nn import functional as F


def _onednn_op():
    """The oneDNN linear op, or None when this torch build lacks it (checked once, with a tiny call)."""
    if os.environ.get("ROFORMER_ROPE_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
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


def tracing() -> bool:
    """torch.compile / torch.export / jit / ONNX tracing: the payload's eager-only fast paths step aside.

    Shared by the linear, rotary and attention modules (this file imports no sibling, so all can use it).
    """
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return torch.compiler.is_compiling() or exporting() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


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


__all__ = ["RoFormerRopeLinear", "linear", "tracing"]
