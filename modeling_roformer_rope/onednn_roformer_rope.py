"""The CPU fast paths behind one small interface, so the model files state only the math.

What lives here (and nowhere else):
- `settings`: the `ROFORMER_ROPE_*` switches, read once at import; a malformed value is ignored with a warning,
  never an import error.
- the dispatch: oneDNN or `F.linear` for each GEMM (forward and backward) is whichever is faster *on this CPU*,
  measured once per shape class (`calibration_roformer_rope.py`); a bf16/fp16 GEMM on a CPU without instructions
  for its dtype is computed in float32 (`_upcast_linear`, the same numbers) where that measures faster than torch's
  emulated kernel, and such a model logs one warning (the rest of it is still emulated: float32 is faster there).
- `tracing()`: torch.compile / export / jit / ONNX tracing, where every eager-only path steps aside.
- `RoFormerRopeLinear` / `linear`: `nn.Linear` whose CPU float32 GEMMs (forward *and* backward) run on oneDNN;
  at inference also MKL's or oneDNN's GEMM on a weight packed once (`prepack_roformer_rope.py`), where faster.
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

Switches: `ROFORMER_ROPE_ONEDNN=0` turns off every oneDNN path, `=1` uses it wherever it applies without
measuring (unset or `auto`: measure); `ROFORMER_ROPE_ONEDNN_ATTENTION=0|1|auto` does the same for the attention
kernel; `ROFORMER_ROPE_ONEDNN_ATTENTION_MIN_KEYS=n` is the kernel's lower length limit (default 384 keys);
`ROFORMER_ROPE_PACK=0|1|auto` the same for packed weights (`=0` also saves their memory: ~2.2× each weight packed
for MKL, ~1× for oneDNN); `ROFORMER_ROPE_CALIBRATE_ON_CALLS=0` times every inference linear class on proxies before
its first call instead of on its real calls (`_TimedLinear`), and `=1` starts the rounds of a decision on its class's
first call (unset or `auto`: once what its calls may have lost by waiting reaches what a decision costs,
`calibration_roformer_rope.rent_paid`).
"""

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import GELUActivation

from .calibration_roformer_rope import (
    choose,
    decided,
    force_default,
    forced,
    measured,
    memo,
    pending,
    rent,
    rent_paid,
    row_bucket,
    run_timed,
    run_waiting,
    stalled,
    trial_state,
)
from .prepack_roformer_rope import (
    adopt,
    check,
    forget,
    held,
    packed_linear,
    packed_weight,
    proxy_gemm,
    proxy_pack,
    rows_changed,
    trial_linear,
    trial_pack,
)
from .prepack_roformer_rope import available as packing_available
from .rotary_roformer_rope import apply_rotary_real, per_head, rotate_pairs, rotate_pairs_

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _ignore(name: str, value: str, expected: str, default) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("ignoring %s=%r: expected %s; using %s", name, value, expected, default)


def _env_mode(name: str) -> str:
    """ "off", "on" or "auto" (measure) from 0 / 1 / auto (also false/true, no/yes, off/on)."""
    raw = os.environ.get(name) or ""
    value = raw.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    _ignore(name, raw, "0, 1 or auto", "auto")
    return "auto"


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
    onednn: str = "auto"  # oneDNN GEMMs for CPU linears (and the attention kernel): "auto" | "on" | "off"
    onednn_attention: str = "auto"  # our blocked attention kernel where it applies: "auto" | "on" | "off"
    onednn_attention_min_keys: int = 384  # below this many keys SDPA's fused kernel wins on every CPU measured
    pack: str = "auto"  # packed weights at inference (MKL: float32, ≤ PACK_MAX_ROWS rows; oneDNN): "auto" | "on" | "off"
    # "off": every inference linear class is timed on proxies before its first call, never on its real calls; "on": on
    # its real calls from its first; "auto": on its real calls once waiting may have cost what a decision costs
    calibrate_on_calls: str = "auto"

    @property
    def onednn_attention_enabled(self) -> bool:
        return self.onednn != "off" and self.onednn_attention != "off"


def read_settings() -> Settings:
    return Settings(
        onednn=_env_mode("ROFORMER_ROPE_ONEDNN"),
        onednn_attention=_env_mode("ROFORMER_ROPE_ONEDNN_ATTENTION"),
        onednn_attention_min_keys=_env_int("ROFORMER_ROPE_ONEDNN_ATTENTION_MIN_KEYS", 384),
        pack=_env_mode("ROFORMER_ROPE_PACK"),
        calibrate_on_calls=_env_mode("ROFORMER_ROPE_CALIBRATE_ON_CALLS"),
    )


settings = read_settings()


@functools.cache  # resolved on first use: importing the exporter's modules takes a moment
def _onnx_exporting() -> Callable[[], bool]:
    """`torch.onnx.is_in_onnx_export` without its two imports per call (~4 µs per linear layer)."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

        return lambda: GLOBALS.in_onnx_export or _flags._is_onnx_exporting
    except (ImportError, AttributeError):
        return torch.onnx.is_in_onnx_export


_EXPORTING = getattr(torch.compiler, "is_exporting", lambda: False)


def tracing() -> bool:
    """torch.compile / torch.export / jit / ONNX tracing: the payload's eager-only fast paths step aside."""
    return torch.compiler.is_compiling() or _EXPORTING() or torch.jit.is_tracing() or _onnx_exporting()()


def _onednn_op():
    """The oneDNN linear op, or None when switched off or this torch build lacks it (checked once, tiny call)."""
    if settings.onednn == "off" or not torch.backends.mkldnn.is_available():
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
if settings.onednn == "on":
    force_default("linear", "onednn")
    force_default("linear_backward", "onednn")
    force_default("linear_gelu", "fused")
if settings.pack == "on":
    force_default("linear_packed", "packed")

# What each `ONEDNN_MAX_CPU_ISA` (or its older name `DNNL_MAX_CPU_ISA`) value lets oneDNN use of the three
# instruction sets we ask about: "bf16" (AVX512_CORE_BF16), "amx" (AVX512_CORE_AMX), "amx_fp16". oneDNN's levels
# are not one line (AVX10_2 has bf16 but no AMX), hence a set per value; aliases (AVX512_CORE_AMX =
# AVX10_1_512_AMX ...) are listed under both names. A process limited below a set never runs its instructions,
# whatever the CPU has: with `ONEDNN_MAX_CPU_ISA=AVX2` on an AVX512-BF16 EPYC (Zen 5), bf16 `F.linear` ran at
# 50-60 GFLOP/s against 203-215 in float32, and oneDNN's bf16 inner product could not be created at all
# (`python bench/experiments.py --only gemm_rate`, logged in bench/results/*-limited-to-avx2/).
_BF16, _AMX, _AMX_FP16 = frozenset({"bf16"}), frozenset({"bf16", "amx"}), frozenset({"bf16", "amx", "amx_fp16"})
ONEDNN_ISA_LIMITS: dict[str, frozenset] = {
    **dict.fromkeys(("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"), frozenset()),
    **dict.fromkeys(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2", "AVX10_2_512"), _BF16),
    **dict.fromkeys(("AVX10_2_ACE", "AVX10_2_512_ACE"), _BF16),
    **dict.fromkeys(("AVX512_CORE_AMX", "AVX10_1_512_AMX"), _AMX),
    **dict.fromkeys(("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_AMX_2", "AVX10_2_512_AMX_2"), _AMX_FP16),
}  # fmt: skip


def onednn_isa_limit(environ=os.environ) -> str | None:
    """The limit oneDNN applies: `ONEDNN_MAX_CPU_ISA` if set (any case), else `DNNL_MAX_CPU_ISA`; None for no limit,
    `ALL`/`DEFAULT`, or a value oneDNN does not know (it ignores those too)."""
    limit = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return limit if limit in ONEDNN_ISA_LIMITS else None


def onednn_isa_allows(feature: str, environ=os.environ) -> bool:
    """Whether oneDNN may use `feature` ("bf16", "amx" or "amx_fp16") in this process."""
    limit = onednn_isa_limit(environ)
    return limit is None or feature in ONEDNN_ISA_LIMITS[limit]


def native_dtypes(environ=os.environ, flags: set[str] | None = None) -> dict[torch.dtype, bool]:
    """Dtypes this process computes in hardware: the CPU has the instructions (AVX512-BF16 or AMX for bf16,
    AMX-FP16 for fp16; `flags` as /proc/cpuinfo names them, else torch's checks) and no oneDNN ISA limit rules them
    out. Else torch emulates them: its bf16 GEMM is 7× slower than float32 on an AVX2-only EPYC, so the linears
    compute them in float32 where that measures faster (`_upcast_linear`)."""
    has = {
        name: name in flags if flags is not None else getattr(torch.cpu, f"_is_{name}_supported", lambda: False)()
        for name in ("avx512_bf16", "amx_tile", "amx_fp16")
    }
    return {
        torch.bfloat16: (has["avx512_bf16"] and onednn_isa_allows("bf16", environ))
        or (has["amx_tile"] and onednn_isa_allows("amx", environ)),
        torch.float16: has["amx_fp16"] and onednn_isa_allows("amx_fp16", environ),
    }


_NATIVE = native_dtypes()
_warned_dtypes: set = set()


def _isa_limit_note() -> str:
    if onednn_isa_limit() is None:
        return ""
    name = "ONEDNN_MAX_CPU_ISA" if os.environ.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
    return f", or none allowed by {name}={os.environ[name]}"


def warn_if_emulated(x: torch.Tensor) -> None:
    """One warning per dtype when a bf16/fp16 model runs on a CPU without instructions for it."""
    if x.device.type == "cpu" and x.dtype in _NATIVE and not _NATIVE[x.dtype] and x.dtype not in _warned_dtypes:
        _warned_dtypes.add(x.dtype)
        logger.warning(
            "%s on this CPU (no %s instructions%s) is emulated and cannot be faster than float32: the linear layers "
            "compute it in float32 where that beats torch's emulated GEMM (7× slower than float32 on an AVX2-only "
            "EPYC), the rest converts back and forth; use float32 here",
            x.dtype,
            "AVX512-BF16/AMX" if x.dtype == torch.bfloat16 else "AMX-FP16",
            _isa_limit_note(),
        )


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, I) · weightᵀ (I, O) + bias on oneDNN → (N, O)."""
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


def _emulated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CPU bf16/fp16 GEMM (weight in x's dtype) that this process has no instructions for (`native_dtypes`)."""
    return x.device.type == "cpu" and weight.dtype == x.dtype and not _NATIVE.get(x.dtype, True) and x.numel() > 0


# An emulated dtype's GEMM in float32 converts the weight slice by slice, each slice used at once while it is in
# cache: with the vocabulary projection (50000×768 bf16) converted whole, out of cache, the float32 GEMM took 65 ms at
# 32 rows, slower than torch's emulated one (49 ms); slice by slice 18 ms, and 3.6-4.4× faster than emulated from
# 77 rows up (Zen 5 EPYC limited to AVX2, `python bench/experiments.py --only emulated_gemm`).
_UPCAST_SLICE = 1 << 20  # weight elements converted at a time (4 MiB in float32)


def _weight_slices(weight: torch.Tensor) -> list[slice]:
    """Ranges of output features (weight rows) of ≤ _UPCAST_SLICE weight elements each."""
    step = max(1, _UPCAST_SLICE // max(1, weight.shape[1]))
    return [slice(start, start + step) for start in range(0, weight.shape[0], step)]


def _upcast_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d (N, I) · weightᵀ + bias in bf16/fp16, computed as float32 GEMMs rounded to their dtype → (N, O).

    The same numbers as torch's emulated kernel, several times sooner: a product of two bf16 (8-bit significand)
    or fp16 (11-bit) numbers is exact in float32 (24 bits) and that kernel accumulates in float32 too, so the two
    differ only in the order of the float32 additions. Each float32 GEMM is the faster of oneDNN and `F.linear`."""
    with torch.autocast("cpu", enabled=False):  # under autocast, the float32 GEMM would cast its operands back
        x32 = x2d.float()  # (N, I)
        onednn = _LINEAR_POINTWISE is not None and x32.numel() > 0
        out = x2d.new_empty(x2d.shape[0], weight.shape[0])  # (N, O) in x's dtype
        for rows in _weight_slices(weight):
            w32 = weight[rows].float()  # (C, I)
            b32 = None if bias is None else bias[rows].float()  # (C,)
            out[:, rows] = _unpacked_gemm(x32, w32, b32, onednn)(x32, w32, b32)  # (N, C), rounded into place
        return out


def _upcast_grad_gemms(go: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool):
    """`_grad_gemms` for bf16/fp16 operands in float32, one weight slice at a time (`_upcast_linear`): grad_x sums
    the slices' go[:, C]·W[C] in float32, grad_W[C] = go[:, C]ᵀ·x; both rounded to the dtype."""
    with torch.autocast("cpu", enabled=False):  # a backward run under autocast would cast float32 `mm`s back
        x32 = x2d.float()  # (N, I)
        grad_x = x32.new_zeros(x2d.shape) if need_x else None  # (N, I), float32 until the end
        grad_w = weight.new_empty(weight.shape) if need_w else None  # (O, I)
        for rows in _weight_slices(weight):
            g32, w32 = go[:, rows].float(), weight[rows].float()  # (N, C), (C, I)
            path = _backward_choice(g32, x32, w32) if _LINEAR_POINTWISE is not None and g32.numel() else "torch"
            part_x, part_w = _grad_gemms(g32, x32, w32, need_x, need_w, path)
            if need_x:
                grad_x += part_x
            if need_w:
                grad_w[rows] = part_w
        return None if grad_x is None else grad_x.to(go.dtype), grad_w


class _OneDNNLinear(torch.autograd.Function):
    """y = x Wᵀ + b (x flattened to (N, I)); each GEMM, forward and backward, on oneDNN or BLAS (or, for a dtype the
    CPU emulates, in float32: `_upcast_linear`), whichever is faster for its shape class on this CPU. One autograd
    node whatever the choice: see `linear`."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, zero_rows: bool = False
    ) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # (N, I)
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        ctx.input_shape = x.shape
        ctx.zero_rows = zero_rows
        if _emulated(x2d, weight):
            y = (_upcast_linear if _emulated_choice(x2d, weight, bias) == "upcast" else F.linear)(x2d, weight, bias)
        elif _forward_choice(x2d, weight, bias) == "onednn":
            y = _mm(x2d, weight, bias)  # (N, O)
        else:
            y = x2d.mm(weight.t()) if bias is None else torch.addmm(bias, x2d, weight.t())  # (N, O), = F.linear
        return y.view(*x.shape[:-1], weight.shape[0])  # (..., O)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, weight.shape[0]).contiguous()  # (N, O)
        if ctx.zero_rows:
            sparse = _backward_on_nonzero_rows(ctx, go, x2d, weight)
            if sparse is not None:
                return sparse
        if _emulated(go, weight):
            path = _emulated_backward_choice(go, x2d, weight)
        else:
            path = _backward_choice(go, x2d, weight)
        grad_x, grad_w = _grad_gemms(go, x2d, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1], path)
        grad_b = go.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (O,)
        return None if grad_x is None else grad_x.view(ctx.input_shape), grad_w, grad_b, None


def _grad_gemms(go: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool, path: str):
    """go (N, O), x2d (N, I), weight (O, I) → (grad_x = go·W (N, I), grad_W = goᵀ·x (O, I)), each only if needed, on
    `path`: "onednn", "torch" (BLAS `mm`, reads transposes in place) or "upcast" (`_upcast_grad_gemms`)."""
    if path == "upcast":
        return _upcast_grad_gemms(go, x2d, weight, need_x, need_w)
    if path == "onednn":
        # grad_x: on oneDNN a linear layer whose "weight" is Wᵀ (I, O); grad_W: one on goᵀ (O, N) with "weight" xᵀ (I, N)
        grad_x = _mm(go, weight.t().contiguous(), None) if need_x else None
        grad_w = _mm(go.t().contiguous(), x2d.t().contiguous(), None) if need_w else None
        return grad_x, grad_w
    return go.mm(weight) if need_x else None, go.t().mm(x2d) if need_w else None


def _backward_on_nonzero_rows(ctx, go: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor):
    """The backward GEMMs on the rows whose upstream gradient is not all zero, or None when most rows are.

    An MLM loss with `ignore_index` gives the vocabulary projection a gradient that is zero on every unlabelled
    position (~85% of them): those rows add nothing to grad_W = goᵀ·x and get grad_x = 0, so both GEMMs
    (2·N·I·O FLOPs each, the largest of a dense-head MLM step) can skip them. Exact: the same sums without
    zero terms; the rows are found by looking at the gradient itself (NaN/inf rows count as non-zero, −0.0 as zero).
    """
    # (N,) any(x ≠ 0) per row in one reduction: at the MLM decoder's (2048, 50000) gradient 49 ms in bf16 and in
    # float32, against 89 and 68 ms for `ne(0).any` (a bool tensor as large as the gradient first; Zen 5 EPYC,
    # `python bench/experiments.py --only zero_rows`)
    nonzero = go.any(dim=1)
    rows = nonzero.nonzero().squeeze(1)  # (M,)
    if rows.numel() * 2 > go.shape[0]:
        return None
    go_m, x_m = go.index_select(0, rows), x2d.index_select(0, rows)  # (M, O), (M, I)
    path = _emulated_backward_choice(go_m, x_m, weight) if _emulated(go_m, weight) else "torch"
    grad_x, grad_w = _grad_gemms(go_m, x_m, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1], path)
    if grad_x is not None:
        grad_x = x2d.new_zeros(x2d.shape).index_copy_(0, rows, grad_x).view(ctx.input_shape)  # (..., I)
    grad_b = go_m.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (O,)
    return grad_x, grad_w, grad_b, None


_PROXY_ROWS = 256  # rows of the slice a shape class is timed on


def _backward_choice(go: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor) -> str:
    """oneDNN (with its operand transposes) or BLAS `mm` (reads transposes in place) for the backward GEMMs."""
    key = ("linear_backward", str(go.dtype), weight.shape[1], weight.shape[0], row_bucket(go.shape[0]))

    def candidates():
        g, x = go[:_PROXY_ROWS], x2d[:_PROXY_ROWS]

        def onednn():
            _mm(g, weight.t().contiguous(), None)
            _mm(g.t().contiguous(), x.t().contiguous(), None)

        def blas():
            g.mm(weight)
            g.t().mm(x)

        return {"onednn": onednn, "torch": blas}

    return choose(key, candidates)


# An emulated GEMM is slow to time (the vocabulary projection's two backward GEMMs took 3.2 s on 32 rows in bf16, 68 ms
# in float32 slices: Zen 5 EPYC limited to AVX2, `emulated_gemm`), so the two paths are timed on at most 64 rows and
# one weight slice of outputs: the float32 path's time is one slice's times the slices, and its lead only grows with
# the rows (each slice's conversion is shared by more of them: 0.25-0.3× at 1 row, ~1× at 16, 1.7-2.8× at 32,
# 2.9-4.4× from 256), so a class won on 64 rows stays won.
_EMULATED_PROXY_ROWS = 64


def _emulated_proxy(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, outputs_of_a: bool):
    """The first rows of `a` (x2d, or go with its columns cut to the slice: `outputs_of_a`) and the first weight slice."""
    rows = _weight_slices(weight)[0] if weight.shape[0] else slice(0, 0)
    a = a.detach()[:_EMULATED_PROXY_ROWS]
    a = (a[:, rows] if outputs_of_a else a).contiguous()  # (≤ 64, C) or (≤ 64, I)
    return a, weight.detach()[rows], None if bias is None else bias.detach()[rows]


def _emulated_choice(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The faster of "upcast" (`_upcast_linear`) and "torch" (`F.linear`, torch's emulated kernel) for a bf16/fp16
    GEMM the CPU has no instructions for, measured once per shape class."""
    key = ("linear_emulated", "forward", str(x2d.dtype), weight.shape[1], weight.shape[0], row_bucket(x2d.shape[0]))

    def candidates():
        proxy, w, b = _emulated_proxy(x2d, weight, bias, False)  # (≤ 64, I), (C, I), (C,)
        return {"upcast": lambda: _upcast_linear(proxy, w, b), "torch": lambda: F.linear(proxy, w, b)}

    return choose(key, candidates)


def _emulated_backward_choice(go: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor) -> str:
    """`_emulated_choice` for the backward GEMMs (`_grad_gemms`)."""
    key = ("linear_emulated", "backward", str(go.dtype), weight.shape[1], weight.shape[0], row_bucket(go.shape[0]))

    def candidates():
        g, w, _ = _emulated_proxy(go, weight, None, True)  # (≤ 64, C), (C, I)
        x = x2d[:_EMULATED_PROXY_ROWS]  # (≤ 64, I)
        return {path: functools.partial(_grad_gemms, g, x, w, True, True, path) for path in ("upcast", "torch")}

    return choose(key, candidates)


def _onednn_applies(x: torch.Tensor, weight: torch.Tensor, traced: bool | None = None) -> bool:
    """oneDNN's GEMM can run this linear (`traced`: `tracing()` if the caller has it already)."""
    return (
        _LINEAR_POINTWISE is not None
        and x.is_cpu
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _NATIVE[torch.bfloat16]))
        and weight.dtype == x.dtype
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not (tracing() if traced is None else traced)
    )


def _autocast_to_bf16(x: torch.Tensor) -> bool:
    """CPU autocast to bf16 around a float32/bf16 input (the caller checks tracing)."""
    return (
        x.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and x.dtype in (torch.float32, torch.bfloat16)
    )


def _linear_key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return ("linear", str(x.dtype), weight.shape[1], weight.shape[0], row_bucket(x.numel() // x.shape[-1]))


def _forward_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """oneDNN or `F.linear` for this GEMM's shape class, measured once (see `calibration_roformer_rope.py`)."""
    key = _linear_key(x, weight)

    def candidates():
        proxy = x.detach().reshape(-1, x.shape[-1])[:_PROXY_ROWS].contiguous()  # (≤ 256, I)
        w, b = weight.detach(), None if bias is None else bias.detach()
        return {"onednn": lambda: _mm(proxy, w, b), "torch": lambda: F.linear(proxy, w, b)}

    return choose(key, candidates)


# Packing pays where laying the weight out is a large share of the GEMM (few rows). MKL's packs are for one row
# count; at 128-1024 rows they took float32 GEMMs 5-25% faster on Sapphire Rapids, and the calibration proxy (≤ 256
# rows) stands for that range. oneDNN's packs fit any row count (float32 and bf16): on a Zen 5 EPYC 2× at one row,
# 1.5× at 16, 3-8% at 256-2048 rows (`prepack_roformer_rope.py`).
PACK_MAX_ROWS = 1024
PACK_PATHS = ("packed", "onednn_packed", "unpacked")  # the `linear_packed` decision: MKL's pack, oneDNN's, none


def _packing_applies(x: torch.Tensor, weight: torch.Tensor, traced: bool | None = None) -> bool:
    """MKL's pack: float32 CPU inference on ≤ PACK_MAX_ROWS rows, eager, MKL's packed GEMM available and not switched
    off. Not for DeepSpeed ZeRO-3 parameters (`ds_id`): a pack per gathered layer would undo the partitioning."""
    return (
        settings.pack != "off"
        and packing_available()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]  # else F.linear raises its shape error (MKL's packed GEMM would not)
        and weight.is_contiguous()
        and 0 < x.numel() <= PACK_MAX_ROWS * x.shape[-1]
        and not hasattr(weight, "ds_id")
        and not torch.is_autocast_enabled("cpu")
        and not (tracing() if traced is None else traced)
    )


def _onednn_packing_applies(x: torch.Tensor, weight: torch.Tensor, onednn: bool) -> bool:
    """oneDNN's pack: where oneDNN's GEMM applies (`onednn`: `_onednn_applies`) to a plain 2-D weight of x's width,
    any row count, packing not switched off, not a ZeRO-3 parameter, not under autocast."""
    return (
        onednn
        and settings.pack != "off"
        and packing_available("onednn")
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and weight.is_contiguous()
        and not hasattr(weight, "ds_id")
        and not torch.is_autocast_enabled("cpu")  # autocast inference passes `onednn` itself: its weights are casts
    )


def _unpacked_gemm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool | None = None):
    """The faster of oneDNN (`_mm`) and `F.linear` for this shape class (`F.linear` where oneDNN does not apply;
    `onednn`: `_onednn_applies` if the caller has it already); for a dtype the CPU emulates, the faster of
    `_upcast_linear` and `F.linear`."""
    if (_onednn_applies(x2d, weight) if onednn is None else onednn) and _forward_choice(x2d, weight, bias) == "onednn":
        return _mm
    if _emulated(x2d, weight) and _emulated_choice(x2d, weight, bias) == "upcast":
        return _upcast_linear
    return F.linear


def _packed_choice(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm, mkl: bool, dnn: bool
) -> str:
    """One of PACK_PATHS for x2d's shape class: "packed" (MKL's GEMM on a weight packed once), "onednn_packed"
    (oneDNN's on its blocked layout) or "unpacked" (`gemm`), measured among those that apply (`mkl`, `dnn`).

    Forced (`ROFORMER_ROPE_PACK=1` forces "packed"): "packed" takes MKL's pack where it applies, else oneDNN's;
    "onednn_packed" takes oneDNN's where it applies; else unpacked. Another name is refused by `choose`."""
    path = forced("linear_packed")
    if path in PACK_PATHS:
        if path == "packed" and not mkl:
            path = "onednn_packed"
        return path if path == "unpacked" or (path == "packed" and mkl) or dnn else "unpacked"
    key = _packed_key(x2d, weight)

    def candidates():
        proxy = x2d[:_PROXY_ROWS].contiguous()  # (≤ 256, I)
        w, b = weight.detach(), None if bias is None else bias.detach()
        paths = {"unpacked": lambda: gemm(proxy, w, b)}
        if mkl:
            paths["packed"] = proxy_gemm(proxy, w, b)
        if dnn:
            paths["onednn_packed"] = proxy_gemm(proxy, w, b, "onednn")
        return paths

    return choose(key, candidates)


def _packed_key(x2d: torch.Tensor, weight: torch.Tensor) -> tuple:
    return ("linear_packed", str(x2d.dtype), weight.shape[1], weight.shape[0], row_bucket(x2d.shape[0]))


_PACK_KIND = {"packed": "mkl", "onednn_packed": "onednn", "unpacked": None}
# MKL's pack where the row count repeats, else the weight's oneDNN pack (`_inference_linear`). An MKL pack serves one
# row count, so in a stream of varying lengths (one sentence at a time) it never applies and the class ran unpacked;
# the oneDNN pack serves any row count. Taken where the `linear_packed` decision timed oneDNN's pack faster than the
# unpacked GEMM too: on a 2-core Cascade Lake 40 review lengths at batch 1 (12 layers) then ran 1.15-1.19× the
# built-in's speed after the first pass instead of 1.08-1.11× (`python bench/experiments.py --only varied_lengths
# --layers 12`).
MKL_OR_ONEDNN = "mkl_or_onednn"


def _decide_inference(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool, traced: bool):
    """(the faster unpacked GEMM, the pack kind that beats it or None) for x2d's shape class, each measured once;
    (a `_TimedLinear`, None) while the class is timed on its real calls."""
    mkl, dnn = _packing_applies(x2d, weight, traced), _onednn_packing_applies(x2d, weight, onednn)
    if _on_calls(x2d, traced):
        timed = _TimedLinear(onednn, mkl, dnn)
        key = timed.open_decision(x2d, weight)
        if key is not None:
            if settings.calibrate_on_calls == "auto":  # the decision's rounds wait until they may pay (`rent`)
                timed.rent = rent(key, (_linear_key(x2d, weight),) if key[0] == "linear_packed" else ())
                timed.waiting_gemm = F.linear if key[0] == "linear" else _unpacked_gemm(x2d, weight, bias, onednn)
            return timed, None
    gemm = _unpacked_gemm(x2d, weight, bias, onednn)
    if not (mkl or dnn):
        return gemm, None
    kind = _PACK_KIND[_packed_choice(x2d, weight, bias, gemm, mkl, dnn)]
    if kind == "mkl" and dnn:
        times = measured(_packed_key(x2d, weight)) or {}  # none when forced
        if times.get("onednn_packed", float("inf")) < times.get("unpacked", 0.0):
            return gemm, MKL_OR_ONEDNN
    return gemm, kind


def _on_calls(x2d: torch.Tensor, traced: bool) -> bool:
    """Whether x2d's linear decisions are timed on its real calls (`_TimedLinear`) rather than on proxies: float32
    inference in eager mode on at most _PROXY_ROWS rows, where the proxy would be the whole problem anyway (on more
    rows a proxy call is cheaper than a real one, and its candidates' times are what a real call's would be).
    Not under `torch.use_deterministic_algorithms(True)`: while a class is timed, two calls on the same input may run
    two kernels, whose results differ in the last bits; timed on proxies, a class runs its choice from its first call
    (a packed choice unpacked on that call: the pack is made on the second)."""
    return (
        settings.calibrate_on_calls != "off"
        and x2d.dtype == torch.float32
        and 0 < x2d.shape[0] <= _PROXY_ROWS
        and not traced
        and not torch.is_grad_enabled()
        and not torch.are_deterministic_algorithms_enabled()
    )


_GEMMS = ("onednn", "torch")
# A packed candidate is timed on a few weights of its class (its trial weights), the first TRIAL_WEIGHTS it meets:
# timing it on every weight would pack each of them, and a pack costs about half a 128-row GEMM on a 2-core Zen 1
# EPYC (4.5 ms), wasted where packing loses; on one weight only, its rounds could run once per forward (a round
# waits for that weight's call), so a 12-layer model's `linear_packed` took 3-6 forwards; on two, they can run twice per forward, for one wasted pack more per losing
# kind. The model as a whole settles no sooner for it (Emerald Rapids, `python bench/experiments.py --only
# first_forwards`: after call 7 at 12 layers, 12-13 at 4, as with one): the MLP's GELU decision, which waits for its
# linear's, sets the pace. A trial pack is timed from its
# second call: just made, it sits in cache where the unpacked candidates' weights were read a forward ago. Meanwhile
# the call runs another candidate of the round. By decision key: {pack kind: [[trial weight ref, its pack, calls of
# the class since it last ran], ...]}. The winner's packs are kept as their weights' once the class is decided
# (`_keep_trial_packs`); the others are dropped then.
_trial_packs: dict[tuple, dict] = trial_state()
TRIAL_WEIGHTS = 2
# calls of a class without a trial weight before the longest unused one gives its place to the current weight (the
# model it belonged to may have gone out of use)
_TRIAL_PATIENCE = 64


def _trial_pack(key: tuple, weight: torch.Tensor, kind: str, rows: int):
    """The pack of `kind` that a packed candidate of decision `key` is timed with on this call of `weight`
    (`trial_pack`, kept in `_trial_packs`), or None where `weight` is not one of the class's trial weights for `kind`
    or its pack was made on this call (timed from the next; the kind's first pack runs at once: the rounds' untimed
    warm-up)."""
    with _trial_lock:  # threads calling one class share its trial weights (making a pack under it: ~1-5 ms, rarely)
        return _trial_pack_locked(key, weight, kind, rows)


_trial_lock = threading.Lock()


def _trial_pack_locked(key: tuple, weight: torch.Tensor, kind: str, rows: int):
    made = _trial_packs.setdefault(key, {}).setdefault(kind, [])
    made[:] = [entry for entry in made if entry[0]() is not None]  # weights freed meanwhile
    entry = next((entry for entry in made if entry[0]() is weight), None)
    if entry is None:
        for other in made:
            other[2] += 1
        if len(made) >= TRIAL_WEIGHTS:
            idle = max(made, key=lambda other: other[2])
            if idle[2] < _TRIAL_PATIENCE:
                return None
            made.remove(idle)
    pack = trial_pack(weight, kind, rows, None if entry is None else entry[1])
    if pack is None:
        return None
    fresh = pack is not held(weight, kind) and (entry is None or pack is not entry[1])
    if entry is None:
        made.append(entry := [weakref.ref(weight), pack, 0])
    entry[1], entry[2] = pack, 0
    return None if fresh and len(made) > 1 else pack


def _keep_trial_packs(key: tuple, kinds) -> None:
    """Decision `key` is made: its trial packs of `kinds` become their weights' packs (`adopt`), the rest are dropped."""
    with _trial_lock:
        made = _trial_packs.pop(key, {})
    for kind, entries in made.items():
        for ref, pack, _ in entries:
            if kind in kinds and ref() is not None:
                adopt(ref(), kind, pack)


class _TimedLinear:
    """The GEMM of an inference linear class whose decisions are timed on its real calls (`calibration_roformer_rope.
    run_timed`): first oneDNN against `F.linear` (`linear`), then that winner against the packs that apply
    (`linear_packed`), each call running one candidate on its real input. Once both are decided, calls run the
    class's plan (`_decide_inference`). A 12-layer model meets each class 12 times per forward, so `linear` is
    decided within its first forward; the packed candidates run on up to TRIAL_WEIGHTS trial weights each, and
    `linear_packed` takes 1-3 forwards more. The slower candidates cost only their extra time
    on a few calls: on a 2-core Zen 1 EPYC the first 1×128 forward of a fresh 12-layer model took ~0.43 s instead of
    ~1.26 s."""

    def __init__(self, onednn: bool, mkl: bool, dnn: bool):
        self.onednn, self.mkl, self.dnn = onednn, mkl, dnn
        self.rent = None  # [seconds, calls] on `waiting_gemm` before the rounds of the open decision (`rent`)
        self.waiting_gemm = F.linear  # what the calls run meanwhile: `F.linear`, or the unpacked GEMM once decided

    def _pack_paths(self) -> tuple[str, ...]:
        return ("unpacked",) + ("packed",) * self.mkl + ("onednn_packed",) * self.dnn

    def open_decision(self, x2d: torch.Tensor, weight: torch.Tensor) -> tuple | None:
        """The key of the first decision of x2d's class still open, or None (each `pending` only where it applies)."""
        key = _linear_key(x2d, weight)
        if self.onednn and pending(key, _GEMMS):
            return key
        key = _packed_key(x2d, weight)
        if (self.mkl or self.dnn) and pending(key, self._pack_paths()):
            return key
        return None

    def __call__(self, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2d (N, I) → (N, O) on the candidate being timed, or the plan once the class is decided; on
        `waiting_gemm` until what the class's calls may have lost by it reaches what timing its open decision costs
        (`calibration_roformer_rope.rent_paid`)."""
        spent = self.rent
        if spent is not None and not rent_paid(spent):
            return run_waiting(spent, self.waiting_gemm, x2d, weight, bias)
        key = self.open_decision(x2d, weight)
        if key is None:  # decided meanwhile by another way (a choice another process stored, a thread's call)
            return _run_plan(x2d, weight, bias, *_decide_inference(x2d, weight, bias, self.onednn, False))
        rows = x2d.shape[0]
        # a stream of varying sizes, or deterministic algorithms switched on since this plan was made
        if stalled(key) or not _on_calls(x2d, False):
            self.decide_on_proxies(x2d, weight, bias)
            return _run_plan(x2d, weight, bias, *_decide_inference(x2d, weight, bias, self.onednn, False))
        if key[0] == "linear":
            return run_timed(key, {"onednn": lambda: functools.partial(_mm, x2d, weight, bias),
                                   "torch": lambda: functools.partial(F.linear, x2d, weight, bias)},
                             functools.partial(F.linear, x2d, weight, bias), rows)  # fmt: skip
        gemm = _unpacked_gemm(x2d, weight, bias, self.onednn)  # decided above
        unpacked = functools.partial(gemm, x2d, weight, bias)
        candidates = {"unpacked": lambda: unpacked}
        for path, kind, applies in (("packed", "mkl", self.mkl), ("onednn_packed", "onednn", self.dnn)):
            if applies:
                candidates[path] = functools.partial(_trial_call, key, x2d, weight, bias, kind, gemm)
        y = run_timed(key, candidates, unpacked, rows)
        if not pending(key, candidates):
            self.keep_packs(key, x2d, weight, bias)
        return y

    def decide_on_proxies(self, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Decide the class's open decisions on proxies now (`choose`; it ends their rounds on real calls)."""
        while (key := self.open_decision(x2d, weight)) is not None:
            if key[0] == "linear":
                _forward_choice(x2d, weight, bias)
            else:
                _packed_choice(x2d, weight, bias, _unpacked_gemm(x2d, weight, bias, self.onednn), self.mkl, self.dnn)
        _plans.clear()  # this plan, remembered for the class, gives way to its choice's

    def keep_packs(self, key: tuple, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep the packs made for timing whose kind the decided plan uses as their weights' packs."""
        kind = _decide_inference(x2d, weight, bias, self.onednn, False)[1]
        _keep_trial_packs(key, {"mkl", "onednn"} if kind == MKL_OR_ONEDNN else {kind})


def _trial_call(key: tuple, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, gemm):
    """The preparation of a packed candidate timed on a real call: a trial weight's pack of `kind`, made untimed
    (`_trial_pack`); then the GEMM on it. None on the call of a weight that is not a trial weight or whose pack was
    just made, and on an inference tensor, which `packed_weight` never packs (a class of such weights only stalls,
    and is decided on proxies)."""
    if weight.is_inference():
        return None
    pack = _trial_pack(key, weight, kind, x2d.shape[0])
    return None if pack is None else functools.partial(trial_linear, x2d, pack, weight, bias, kind)


# `_decide_inference`'s answers, by everything they depend on: deciding again walks five checks and two lookups,
# 3-5% of a forward of a 2-layer, 64-wide model on 16-256 tokens (Zen 5 EPYC,
# `python bench/experiments.py --only small_models`).
# Cleared when a choice may change (`calibration.force` / `reset`) and when `settings` is replaced.
_plans = memo()
_plans_settings = [settings]


def _forget_plans_of_old_settings() -> None:
    """Empty `_plans` when `settings` has been replaced since they were made (the switches decide what applies)."""
    if _plans_settings[0] is not settings:
        _plans.clear()
        _plans_settings[0] = settings


def _inference_choice(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    onednn: bool | None = None,
    traced: bool | None = None,
):
    """(the faster unpacked GEMM, the pack kind that beats it or None) for x2d's shape class (`_decide_inference`)."""
    onednn = _onednn_applies(x2d, weight) if onednn is None else onednn
    traced = tracing() if traced is None else traced
    _forget_plans_of_old_settings()
    rows = x2d.shape[0]
    key = (
        x2d.dtype, x2d.device.type, x2d.shape[1], row_bucket(rows), 0 < rows <= PACK_MAX_ROWS,
        weight.dtype, weight.shape, weight.is_contiguous(), hasattr(weight, "ds_id"),
        onednn, traced, torch.is_autocast_enabled("cpu"),
    )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _decide_inference(x2d, weight, bias, onednn, traced)
    return plan


def _inference_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool | None = None
) -> torch.Tensor:
    """x2d (N, I) → (N, O) without autograd, on the GEMM measured fastest for the shape class (eager only)."""
    return _run_plan(x2d, weight, bias, *_inference_choice(x2d, weight, bias, onednn, False))  # `linear` checked tracing


def _fast_inference_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """For a float32 CPU call of `linear` without autograd or autocast, outside tracing: the (gemm, kind) plan its
    whole path runs (`_inference_choice`'s, or `F.linear` unpacked where neither oneDNN nor a pack applies), looked
    up by the inputs' shapes and the weight's layout alone; None for any other call. Walking the whole path
    (tracing, oneDNN and packing checks, the plan's longer key) cost ~25 µs per linear on a 2-core Cascade Lake, as
    much as the one-row GEMM of a small model's decode step."""
    if not (x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2):
        return None
    if torch.is_autocast_enabled("cpu") or tracing():
        return None
    width, numel = x.shape[-1], x.numel()
    if width != weight.shape[1] or numel == 0:
        return None  # the whole path raises F.linear's shape error, or returns F.linear's empty output
    rows = numel // width
    _forget_plans_of_old_settings()
    # everything else the whole path reads: the shape class (its row bucket also tells whether MKL's pack applies,
    # ≤ PACK_MAX_ROWS), and the weight's layout and ZeRO-3 partitioning (whether any pack applies)
    key = ("fast", width, weight.shape[0], row_bucket(rows), weight.is_contiguous(), hasattr(weight, "ds_id"))
    plan = _plans.get(key)
    if plan is None:
        x2d = x.reshape(-1, width)  # (N, I)
        plan = _plans[key] = _inference_choice(x2d, weight, bias, _onednn_applies(x, weight, False), False)
    return plan


def _run_plan(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm, kind) -> torch.Tensor:
    """x2d (N, I) → (N, O) on the plan's unpacked GEMM, or on the weight's pack of `kind` once it has one."""
    if kind is not None:
        x2d = x2d.contiguous()
        # the oneDNN pack only once the row count has changed between calls: a first call records nothing for it
        varying = kind == MKL_OR_ONEDNN and rows_changed(weight, x2d.shape[0])
        # None until the weight has run twice (MKL: at N rows twice in a row)
        y = packed_linear(x2d, weight, bias, "mkl" if kind == MKL_OR_ONEDNN else kind)
        if y is None and varying:
            y = packed_linear(x2d, weight, bias, "onednn")
        if y is not None:
            return y
    return gemm(x2d if gemm is F.linear else x2d.contiguous(), weight, bias)  # F.linear reads strided inputs as is


def _proxy_gemm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """A callable running on x2d's first rows the GEMM `_inference_linear` would choose for x2d's shape class."""
    proxy = x2d[:_PROXY_ROWS]  # (≤ 256, I)
    gemm, kind = _inference_choice(x2d, weight, bias)
    if isinstance(gemm, _TimedLinear):  # timing on proxies must not step the class's rounds on real calls
        gemm.decide_on_proxies(x2d, weight, bias)
        gemm, kind = _inference_choice(x2d, weight, bias)
    kind = "mkl" if kind == MKL_OR_ONEDNN else kind  # the proxy's row count repeats
    return proxy_gemm(proxy.contiguous(), weight, bias, kind) if kind else lambda: gemm(proxy, weight, bias)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, zero_grad_rows: bool = False
) -> torch.Tensor:
    """`F.linear` semantics; the GEMMs of CPU float32/bf16 run on oneDNN where that is faster on this CPU.

    `zero_grad_rows`: the upstream gradient is expected to be zero on most rows (an MLM decoder under a loss
    with ignored positions); the backward then runs its GEMMs on the other rows only."""
    if not torch.is_grad_enabled():
        plan = _fast_inference_plan(x, weight, bias)
        if plan is not None:
            if plan[0] is F.linear and plan[1] is None:  # F.linear flattens x itself: no reshape and view here
                return F.linear(x, weight, bias)
            return _run_plan(x.reshape(-1, x.shape[-1]), weight, bias, *plan).view(*x.shape[:-1], weight.shape[0])
    if weight.dim() == 2 and x.dim() > 0 and x.shape[-1] != weight.shape[1]:
        return F.linear(x, weight, bias)  # its error names both shapes (calibrating them failed with "no candidate")
    if x.dtype != torch.float32:
        warn_if_emulated(x)
    grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    traced = tracing()  # once per call: every check below needs it
    if grad and weight.requires_grad and not traced:
        forget(weight)  # training is about to change the weight: free its inference pack now
    onednn = _onednn_applies(x, weight, traced)
    if not onednn and (grad or not _packing_applies(x, weight, traced)):
        if not traced and _autocast_to_bf16(x):
            # What CPU autocast does to a linear (inputs cast to bf16, a bf16 GEMM, a bf16 output; gradients flow
            # back through the casts in float32), but through the node below: its backward skips zero gradient rows,
            # and where the CPU emulates bf16 its GEMMs may run in float32 (`_upcast_linear`).
            low = [t if t is None else t.to(torch.bfloat16) for t in (x, weight, bias)]
            # inference: the GEMM measured fastest, called directly (autocast leaves bf16 as is)
            if not grad and x.numel() > 0:
                x2d = low[0].reshape(-1, x.shape[-1])  # (N, I)
                onednn = _NATIVE[torch.bfloat16] and _LINEAR_POINTWISE is not None
                return _inference_linear(x2d, low[1], low[2], onednn).view(*x.shape[:-1], weight.shape[0])  # (..., O)
            with torch.autocast("cpu", enabled=False):
                return linear(*low, zero_grad_rows)
        if traced or torch.is_autocast_enabled("cpu") or not _emulated(x, weight):
            return F.linear(x, weight, bias)
    if grad:
        # Training: always this one autograd node, the kernels chosen inside. The autograd graph must not depend
        # on a per-process timing: it fixes the order in which gradients become ready, which DeepSpeed ZeRO and
        # DDP bucket their reductions by, and two ranks that measured differently would exchange buckets of
        # different sizes (gloo aborts: "Received data size doesn't match expected size").
        return _OneDNNLinear.apply(x, weight, bias, zero_grad_rows)
    x2d = x.reshape(-1, x.shape[-1])  # (N, I)
    return _inference_linear(x2d, weight, bias, onednn).view(*x.shape[:-1], weight.shape[0])  # (..., O)


class RoFormerRopeLinear(nn.Linear):
    """Drop-in `nn.Linear` (same parameters and state dict) routed through `linear` above."""

    zero_grad_rows = False  # set on an MLM decoder: see `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.zero_grad_rows)


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook could hold on to these modules' outputs: then they must not change in place."""
    return bool(
        nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
        or any(m._forward_hooks or m._forward_pre_hooks for m in modules)
        # PEFT's LoRA wrappers may return their base layer's output tensor itself (a submodule: `_modules` holds it;
        # `getattr` of a missing name costs nn.Module.__getattr__'s exception, a few µs per layer of a decode step)
        or any(hooked(m._modules["base_layer"]) for m in modules if m._modules.get("base_layer") is not None)
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


def _exact_gelu(act_fn: nn.Module) -> bool:
    return isinstance(act_fn, GELUActivation) and act_fn.act is F.gelu


def activation(act_fn: nn.Module, x: torch.Tensor, *producers: nn.Module) -> torch.Tensor:
    """act_fn(x); exact GELU runs in place at inference (~3× faster at 4096 tokens than a second (B, T, I) buffer)."""
    if _exact_gelu(act_fn) and may_modify_in_place(*producers, act_fn):
        return torch.ops.aten.gelu_(x)
    return act_fn(x)


def native_gelu_(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU in place on torch's own vectorised kernel, not oneDNN's. For a contiguous float32/bf16 CPU tensor
    aten's GELU calls oneDNN's eltwise primitive, whose fixed cost dominates a few rows (one 3072-wide row on a 2-core
    Cascade Lake: 36 µs, against 21 µs here) and which is faster on large tensors (2× at 1.5M elements); aten runs
    its own kernel on a non-contiguous view, here of the same memory. Both are the erf form, within 1.2e-6."""
    if not x.is_contiguous():
        return torch.ops.aten.gelu_(x)  # aten's own kernel already
    n = x.numel()
    if n < 4:  # a (1, 2) view would count as contiguous: one element at a time (oneDNN takes only more than one)
        flat = x.view(-1)  # (n,)
        for i in range(n):
            torch.ops.aten.gelu_(flat[i : i + 1])
        return x
    half = n // 2
    # (n/2, 2) view of x's first 2·(n/2) elements, strides (1, n/2): not contiguous, so aten's own kernel, which walks
    # it as one run of memory. One view op (a few µs each on a slow core, a decode step's concern).
    torch.ops.aten.gelu_(x.as_strided((half, 2), (1, half)))
    if n % 2:
        torch.ops.aten.gelu_(x.view(-1)[-1:])  # the odd one out: oneDNN takes only more than one element
    return x


_GELU_PATHS = ("fused", "separate", "separate_native", "fused_packed")


def _gelu_key(x2d: torch.Tensor, weight: torch.Tensor) -> tuple:
    return ("linear_gelu", str(x2d.dtype), weight.shape[1], weight.shape[0], row_bucket(x2d.shape[0]))


def _timed_linear_gelu(key: tuple, x: torch.Tensor, x2d: torch.Tensor, producer: nn.Module, act_fn: nn.Module, dnn):
    """act_fn(producer(x)) (..., O) while its `linear_gelu` class is timed on its real calls (`_on_calls`): each
    call on one of `_GELU_PATHS` (`dnn`: the weight can have a oneDNN pack), once the producer's own GEMM class is
    decided (until then its caller runs "separate", which times it)."""
    weight, bias = producer.weight, producer.bias
    shape = (*x.shape[:-1], producer.out_features)

    def fused_packed():
        if weight.is_inference():  # never packed (`packed_weight`): not timed on its calls
            return None
        pack = _trial_pack(key, weight, "onednn", x2d.shape[0])
        if pack is None:  # timed on another weight of the class
            return None
        return lambda: check(pack, weight) or _LINEAR_POINTWISE(x2d, pack.packed, bias, "gelu", [], "none").view(shape)

    def fused():
        return _LINEAR_POINTWISE(x2d, weight, bias, "gelu", [], "none").view(shape)

    # each candidate as `linear_activation` runs it once decided (no hook, eager: checked by the caller)
    project = _projection(producer)
    candidates = {
        "fused": lambda: fused,
        "separate": lambda: lambda: torch.ops.aten.gelu_(project(x)),
        "separate_native": lambda: lambda: native_gelu_(project(x)),
    }
    if dnn:
        candidates["fused_packed"] = fused_packed
    y = run_timed(key, candidates, lambda: activation(act_fn, producer(x), producer), x2d.shape[0])
    if not pending(key, candidates):
        _keep_trial_packs(key, {"onednn"} if _gelu_epilogue_choice(x2d, weight, bias, key, dnn) == "fused_packed" else set())
    return y


def _gelu_epilogue_choice(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: tuple | None = None, dnn: bool | None = None
) -> str:
    """GELU in oneDNN's GEMM epilogue ("fused", or "fused_packed" on the weight's oneDNN pack) or the GEMM then an
    in-place GELU ("separate", or "separate_native" on torch's own GELU kernel: `native_gelu_`), measured: the
    epilogue saves a pass over the (N, O) output with one thread and loses with two on Sapphire Rapids, and oneDNN's
    GELU costs a fixed ~20 µs more per call than torch's, a decode step's share of a layer on small models. A forced
    "fused_packed" runs "fused" where packing does not apply. `key` (`_gelu_key`) and `dnn`
    (`_onednn_packing_applies`): if the caller has them already."""
    if dnn is None:
        dnn = _onednn_packing_applies(x2d, weight, True)
    if forced("linear_gelu") == "fused_packed" and not dnn:
        return "fused"
    if key is None:
        key = _gelu_key(x2d, weight)

    def candidates():
        proxy = x2d[:_PROXY_ROWS]  # (≤ 256, I)

        def fused():
            _LINEAR_POINTWISE(proxy, weight, bias, "gelu", [], "none")

        gemm = []  # the GEMM `separate` stands for, looked up once, only if timed

        def separate(gelu_=torch.ops.aten.gelu_):
            if not gemm:
                gemm.append(_proxy_gemm(x2d, weight, bias))
            gelu_(gemm[0]())

        paths = {"fused": fused, "separate": separate, "separate_native": functools.partial(separate, native_gelu_)}
        if dnn:
            pack = proxy_pack(weight.detach(), "onednn")  # made on the untimed warm-up call
            paths["fused_packed"] = lambda: _LINEAR_POINTWISE(proxy, pack(), bias, "gelu", [], "none")
        return paths

    choice = choose(key, candidates)
    # a class decided on a packable weight may meet one that is not (a ZeRO-3 or non-contiguous weight): no pack there
    return "fused" if choice == "fused_packed" and not dnn else choice


def _projection(producer: nn.Module):
    """The producer's forward itself, without `nn.Module.__call__` (a few µs a call on a slow core), for callers that
    checked it has no hook; the module as is where it was compiled on its own (`producer.compile()`)."""
    return producer.forward if getattr(producer, "_compiled_call_impl", None) is None else producer


def linear_activation(x: torch.Tensor, producer: nn.Linear, act_fn: nn.Module) -> torch.Tensor:
    """act_fn(producer(x)). At CPU inference with exact GELU, where `producer`'s output cannot be seen by a hook,
    the GELU may run inside oneDNN's GEMM (erf form, as F.gelu) or on torch's own GELU kernel (`native_gelu_`) when
    that measures faster on this CPU (`_gelu_epilogue_choice`)."""
    if not (isinstance(producer, RoFormerRopeLinear) and _exact_gelu(act_fn)) or torch.is_grad_enabled():
        return activation(act_fn, producer(x), producer)
    traced = tracing()  # once: `may_modify_in_place` and `_onednn_applies` would each ask (a decode step's µs)
    if traced or hooked(producer, act_fn) or not _onednn_applies(x, producer.weight, traced):
        return activation(act_fn, producer(x), producer)
    # Inference, eager, no hook: producer's output may change in place, and its forward runs without __call__.
    weight, bias = producer.weight, producer.bias
    x2d = x.reshape(-1, x.shape[-1]).contiguous()  # (N, I)
    key = _gelu_key(x2d, weight)
    dnn = _onednn_packing_applies(x2d, weight, True)
    # decided (the steady state) first: one dict lookup
    if not decided(key) and _on_calls(x2d, False):
        plan = _fast_inference_plan(x2d, weight, bias)
        if plan is not None and isinstance(plan[0], _TimedLinear):  # the producer's own class is still open: it waits
            return torch.ops.aten.gelu_(_projection(producer)(x))  # "separate" (in place: no hook, checked above)
        if pending(key, _GELU_PATHS if dnn else _GELU_PATHS[:-1]) and not stalled(key):
            after = (_linear_key(x2d, weight), _packed_key(x2d, weight))  # the producer's decisions
            spent = rent(key, after) if settings.calibrate_on_calls == "auto" else None
            if spent is not None and not rent_paid(spent):  # waits until its rounds may pay, on "separate"
                return run_waiting(spent, lambda: torch.ops.aten.gelu_(_projection(producer)(x)))
            return _timed_linear_gelu(key, x, x2d, producer, act_fn, dnn)
    choice = _gelu_epilogue_choice(x2d, weight, bias, key, dnn)
    if choice == "separate_native":
        return native_gelu_(_projection(producer)(x))
    if choice == "separate":
        return torch.ops.aten.gelu_(_projection(producer)(x))
    if choice == "fused_packed":  # the weight's oneDNN pack, once it has run twice (None before)
        pack = packed_weight(weight, x2d.shape[0], "onednn")
        weight = weight if pack is None else pack
    out = _LINEAR_POINTWISE(x2d, weight, bias, "gelu", [], "none")  # (N, O)
    return out.view(*x.shape[:-1], producer.out_features)


__all__ = [
    "RoFormerRopeLinear",
    "activation",
    "hooked",
    "linear",
    "linear_activation",
    "may_modify_in_place",
    "native_gelu_",
    "rotate",
    "rotate_qkv",
    "settings",
    "tracing",
]
