"""Float32 weights packed once for MKL's GEMM, for CPU inference on short inputs.

Why: a linear layer on few rows (a 128-token sentence is 128 rows) reuses each weight element only M times, and a
large share of its GEMM goes to laying the weight out for the kernel, again on every call. MKL can lay the weight
out once (`cblas_sgemm_pack`) and compute from that layout (`cblas_sgemm_compute`); PyTorch exposes the pair as
`torch.ops.mkl._mkl_reorder_linear_weight` / `torch.ops.mkl._mkl_linear`, what inductor emits for frozen CPU
linears. `python bench/experiments.py packed_gemm` measures it against oneDNN and `F.linear` on the running CPU.

The op's terms: a pack is made for one row count M, and `_mkl_linear` uses it only for inputs of exactly M rows
(any other input is computed with the original weight: correct either way); a pack takes ~2.2× the weight's memory.

This file is the mechanism; when to pack (measured per shape class, inference only) is `onednn_roformer_rope.linear`.
- At most one pack per weight. It is made on the second of two calls in a row with the same row count and the same
  weight (a stream of varying lengths never packs); a later row count that repeats replaces it.
- Held weakly, keyed by the weight tensor itself: freed with it, invisible to `state_dict`, `copy` and `pickle`;
  dropped when the weight runs with autograd (training is about to change it).
- Dropped when the weight changes: in place (its version counter), new storage (its data pointer), or a write
  through `.data`, which the version counter does not see: a fixed sample of the weight's elements is compared on
  every use, which whole-tensor writes (`copy_`, `mul_`, `normal_`, an optimizer step) cannot get past. A write to
  a few elements through `.data` can; write under `torch.no_grad()` instead, or set `ROFORMER_ROPE_PACK=0`.

Shapes: N rows (tokens), I input features, O output features; weight (O, I).
"""

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_SAMPLES = 61  # weight elements compared on each use: a prime count spreads them over rows and columns


def _mkl_ops():
    """MKL's (pack, compute) pair, or None when this torch build lacks it (checked once, on a tiny problem)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        pack, compute = torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        if not torch.equal(compute(x, pack(w, 2), w, None, 2), torch.full((2, 3), 4.0)):
            return None
        return pack, compute
    except (AttributeError, RuntimeError):
        return None


_OPS = _mkl_ops()


class _Pack:
    __slots__ = ("rows", "state", "sample", "packed")

    def __init__(self, weight: torch.Tensor, rows: int, state: tuple):
        self.rows, self.state = rows, state
        self.sample = _sample(weight).clone()
        self.packed = _OPS[0](weight, rows)  # MKL's layout of weightᵀ for rows × I inputs (an opaque mkldnn tensor)


_packs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → its _Pack
_previous: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → (rows, state) of its previous call


def available() -> bool:
    return _OPS is not None


def _sample(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.reshape(-1)  # (O·I,) view
    return flat[:: max(1, flat.numel() // _SAMPLES)]  # (≈ 61,) strided view


def _state(weight: torch.Tensor) -> tuple:
    return weight._version, weight.data_ptr(), tuple(weight.shape), weight.stride()


def packed_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x2d (N, I) · weightᵀ + bias → (N, O) from the weight's pack for N rows, made now if this is the second call
    in a row with N rows and an unchanged weight; None when there is no such pack (the caller runs an unpacked GEMM).
    Inference only: the op has no autograd formula."""
    key, weight = weight, weight.detach()  # packs are keyed by the parameter itself (`detach` makes a new object)
    if weight.is_inference():  # no version counter to tell an in-place change by
        return None
    rows, state = x2d.shape[0], _state(weight)
    pack = _packs.get(key)
    if pack is not None and (pack.state != state or not torch.equal(_sample(weight), pack.sample)):
        _packs.pop(key, None)  # the weight changed (in place, new storage, or through `.data`): free the stale pack now
        _previous.pop(key, None)
        pack = None
    if pack is None or pack.rows != rows:
        if _previous.get(key) != (rows, state):
            _previous[key] = (rows, state)
            return None
        pack = _packs[key] = _Pack(weight, rows, state)
    _previous[key] = (rows, state)
    return _OPS[1](x2d, pack.packed, weight, bias, rows)  # (N, O)


def forget(weight: torch.Tensor) -> None:
    """Drop `weight`'s pack (a training step is about to change the weight: don't hold ~2.2× its memory meanwhile)."""
    if _packs:
        _packs.pop(weight, None)
        _previous.pop(weight, None)


def pack_rows(weight: torch.Tensor) -> int | None:
    """The row count `weight` is packed for, or None (tests and debugging)."""
    pack = _packs.get(weight)
    return None if pack is None else pack.rows


def proxy_gemm(proxy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    """A calibration candidate: the packed GEMM on `proxy` (R, I), packed on its first call (the warm-up call,
    which `calibration_roformer_rope.choose` does not time), like a layer that runs again and again at R rows."""
    rows, made = proxy.shape[0], []

    def run() -> torch.Tensor:
        if not made:
            made.append((_OPS[0](weight, rows), _sample(weight).clone()))
        packed, sample = made[0]
        _state(weight), torch.equal(_sample(weight), sample)  # the checks `packed_linear` makes on each call, timed too
        return _OPS[1](proxy, packed, weight, bias, rows)  # (R, O)

    return run


__all__ = ["available", "forget", "pack_rows", "packed_linear", "proxy_gemm"]
