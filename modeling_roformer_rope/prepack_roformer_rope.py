"""Weights packed once for CPU inference: MKL's packed float32 GEMM, and oneDNN's blocked weight layout.

Why: a linear layer on few rows (a 128-token sentence is 128 rows) reuses each weight element only M times, and a
large share of its GEMM goes to laying the weight out for the kernel, again on every call. Both libraries can lay
the weight out once and compute from that layout, what inductor emits for frozen CPU linears:
- "mkl": `torch.ops.mkl._mkl_reorder_linear_weight` / `torch.ops.mkl._mkl_linear` (MKL's `cblas_sgemm_pack` /
  `cblas_sgemm_compute`), float32 only. A pack is made for one row count M and used only for inputs of exactly M
  rows (any other input is computed with the original weight: correct either way); it takes ~2.2× the weight's
  memory. Its GEMM is Intel's fast path (5-25% faster than oneDNN at 128-1024 rows on Sapphire Rapids).
- "onednn": `torch.ops.mkldnn._reorder_linear_weight` / `torch.ops.mkldnn._linear_pointwise`: the weight in
  oneDNN's blocked layout, float32 or bf16, for any row count, ~1× the weight's memory. The same GEMM as the
  unpacked oneDNN one minus its per-call reorder of the weight (results equal from 16 rows; a one-row GEMV may
  differ in the last bits): on a Zen 5 EPYC 2× faster at one row, 1.5× at 16, 3-8% at 256-2048 rows.
`python bench/experiments.py --only packed_gemm` measures both against `F.linear` on the running CPU.

This file is the mechanism; when to pack and which kind (measured per shape class, inference only) is
`onednn_roformer_rope.linear`.
- At most one pack per weight and kind. An MKL pack is made on the second of two calls in a row with the same row
  count and the same weight (a stream of varying lengths never packs); a later row count that repeats replaces it.
  A oneDNN pack is made on the second call with the same weight, whatever the row counts. (A class that chose MKL's
  pack also uses the weight's oneDNN pack on row counts that change from call to call, where its decision timed
  that pack faster than the unpacked GEMM: `onednn_roformer_rope.MKL_OR_ONEDNN`.)
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


def _onednn_ops():
    """oneDNN's (pack, compute) pair, or None when this torch build lacks it (checked once, on a tiny problem)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        pack, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        if not torch.equal(linear(x, pack(w), None, "none", [], ""), torch.full((2, 3), 4.0)):
            return None
        return pack, lambda x2d, packed, weight, bias, rows: linear(x2d, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return None


_OPS = _mkl_ops()
_ONEDNN_OPS = _onednn_ops()
KINDS = ("mkl", "onednn")


def _ops(kind: str):
    return _OPS if kind == "mkl" else _ONEDNN_OPS


class _Pack:
    __slots__ = ("rows", "state", "sample", "packed")

    def __init__(self, weight: torch.Tensor, rows: int | None, state: tuple, kind: str):
        self.rows, self.state = rows, state  # rows: the row count an MKL pack is for (None: any, oneDNN)
        self.sample = _sample(weight).clone()
        # MKL's layout of weightᵀ for rows × I inputs, or oneDNN's blocked layout of weight (opaque mkldnn tensors)
        self.packed = make_pack(weight, kind, rows)


_packs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → {kind: its _Pack}
_previous: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → {kind: (rows, state) of its previous call}


def available(kind: str = "mkl") -> bool:
    return _ops(kind) is not None


def _sample(weight: torch.Tensor) -> torch.Tensor:
    """Every (O·I / _SAMPLES)-th element of `weight`, (≈ 61,): a strided view (a copy for a non-contiguous weight)."""
    numel = weight.numel()
    step = max(1, numel // _SAMPLES)
    if weight.is_contiguous():  # one view op, not two: every packed call takes a sample (µs count on a decode step)
        return weight.as_strided((-(-numel // step),), (step,))  # (⌈O·I / step⌉,) from weight's storage offset
    return weight.reshape(-1)[::step]


def _state(weight: torch.Tensor) -> tuple:
    return weight._version, weight.data_ptr(), tuple(weight.shape), weight.stride()


def _fits(pack: "_Pack", weight: torch.Tensor, state: tuple) -> bool:
    """Whether `pack` was made from `weight` as it is now (`state`: `_state(weight)`): same version, memory and
    layout, and the same sampled values (an in-place change through `.data` keeps the version counter)."""
    return pack.state == state and torch.equal(_sample(weight), pack.sample)


def packed_weight(weight: torch.Tensor, rows: int, kind: str = "mkl"):
    """The weight's pack of `kind` (MKL: for `rows` rows), made now if this call repeats the previous one (MKL: `rows`
    again; oneDNN: any rows) with an unchanged weight; None when there is no such pack (the caller computes with the
    weight itself)."""
    key, weight = weight, weight.detach()  # packs are keyed by the parameter itself (`detach` makes a new object)
    if weight.is_inference():  # no version counter to tell an in-place change by
        return None
    rows, state = rows if kind == "mkl" else None, _state(weight)
    packs = _packs.get(key)
    pack = None if packs is None else packs.get(kind)
    if pack is not None and not _fits(pack, weight, state):
        _packs.pop(key, None)  # the weight changed (in place, new storage, or through `.data`): free its stale packs now
        _previous.pop(key, None)
        pack = None
    if pack is None or pack.rows != rows:
        previous = _previous.setdefault(key, {})
        if previous.get(kind) != (rows, state):
            previous[kind] = (rows, state)
            return None
        pack = _packs.setdefault(key, {})[kind] = _Pack(weight, rows, state, kind)
    _previous.setdefault(key, {})[kind] = (rows, state)
    return pack.packed


def packed_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str = "mkl"
) -> torch.Tensor | None:
    """x2d (N, I) · weightᵀ + bias → (N, O) from the weight's pack of `kind` (`packed_weight`), or None when there is
    none yet (the caller runs an unpacked GEMM). Inference only: the ops have no autograd formula."""
    packed = packed_weight(weight, x2d.shape[0], kind)
    if packed is None:
        return None
    return _ops(kind)[1](x2d, packed, weight.detach(), bias, x2d.shape[0])  # (N, O)


def rows_changed(weight: torch.Tensor, rows: int) -> bool:
    """The weight's previous call for an MKL pack had another row count than `rows` (a stream of varying lengths)."""
    previous = _previous.get(weight, {}).get("mkl")
    return previous is not None and previous[0] != rows


def forget(weight: torch.Tensor) -> None:
    """Drop `weight`'s packs (a training step is about to change the weight: don't hold their memory meanwhile)."""
    if _packs or _previous:
        _packs.pop(weight, None)
        _previous.pop(weight, None)


def pack_rows(weight: torch.Tensor) -> int | None:
    """The row count `weight` has an MKL pack for, or None (tests and debugging)."""
    pack = held(weight, "mkl")
    return None if pack is None else pack.rows


def pack_kinds(weight: torch.Tensor) -> list[str]:
    """The kinds of pack `weight` has (tests and debugging)."""
    return sorted(_packs.get(weight, {}))


def make_pack(weight: torch.Tensor, kind: str, rows: int | None = None) -> torch.Tensor:
    """A new pack of `weight` (MKL: for `rows` rows), held by nobody but the caller (calibration candidates)."""
    return _ops(kind)[0](weight, rows) if kind == "mkl" else _ops(kind)[0](weight)


def trial_pack(weight: torch.Tensor, kind: str, rows: int, earlier: _Pack | None = None) -> _Pack | None:
    """For timing a packed candidate on a real call (`calibration_roformer_rope.run_timed`): the weight's current
    pack of `kind` (MKL: for `rows` rows), else `earlier` (a trial pack of this weight from an earlier call), if
    either still fits the weight; else a new one that nobody holds but the caller, who hands it to `adopt` if the
    candidate wins. None where the weight cannot be packed (an inference tensor)."""
    key, weight = weight, weight.detach()
    if weight.is_inference():
        return None
    rows, state = rows if kind == "mkl" else None, _state(weight)
    for pack in (held(key, kind), earlier):
        if pack is not None and pack.rows == rows and _fits(pack, weight, state):
            return pack
    return _Pack(weight, rows, state, kind)


def held(weight: torch.Tensor, kind: str) -> _Pack | None:
    """The weight's own pack of `kind` (made by `packed_weight` or kept by `adopt`), None if it has none."""
    return _packs.get(weight, {}).get(kind)


def adopt(weight: torch.Tensor, kind: str, pack: _Pack) -> None:
    """Keep `pack` (from `trial_pack`) as the weight's pack of `kind`: used from its next call on, as if made there
    (`packed_weight` checks it against the weight first, like any pack)."""
    _packs.setdefault(weight, {})[kind] = pack
    _previous.setdefault(weight, {})[kind] = (pack.rows, pack.state)


def check(pack: _Pack, weight: torch.Tensor) -> None:
    """The checks `packed_weight` makes on every call before it uses a pack (does it still fit the weight?), for a
    candidate timed on a real call with a pack it holds itself: timed without them, at one row, where they cost
    several times the GEMM on a slow core, packs won classes they then lost."""
    weight = weight.detach()
    _fits(pack, weight, _state(weight))


def trial_linear(x2d: torch.Tensor, pack: _Pack, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
    """x2d (N, I) · weightᵀ + bias → (N, O) from a `trial_pack` of `kind`, after the checks a packed call makes."""
    check(pack, weight)
    return _ops(kind)[1](x2d, pack.packed, weight.detach(), bias, x2d.shape[0])  # (N, O)


def proxy_pack(weight: torch.Tensor, kind: str, rows: int | None = None) -> Callable[[], torch.Tensor]:
    """For calibration candidates: a callable returning a pack of `weight` (MKL: for `rows` rows), made on its first
    call (the warm-up call, which `calibration_roformer_rope.choose` does not time), and making on every call the
    checks `packed_weight` makes before it uses a pack, so that they are timed too."""
    made = []

    def get() -> torch.Tensor:
        if not made:
            made.append(_Pack(weight, rows, _state(weight), kind))
        check(made[0], weight)
        return made[0].packed

    return get


def proxy_gemm(
    proxy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str = "mkl"
) -> Callable[[], torch.Tensor]:
    """A calibration candidate: the packed GEMM of `kind` on `proxy` (R, I), like a layer that runs again and again
    (`proxy_pack`)."""
    rows, compute = proxy.shape[0], _ops(kind)[1]
    pack = proxy_pack(weight, kind, rows)
    return lambda: compute(proxy, pack(), weight, bias, rows)  # (R, O)


__all__ = ["KINDS", "adopt", "available", "check", "forget", "held", "make_pack", "pack_kinds", "pack_rows", "packed_linear", "packed_weight",
           "proxy_gemm", "proxy_pack", "rows_changed", "trial_linear", "trial_pack"]
