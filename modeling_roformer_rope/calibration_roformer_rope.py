"""Pick each CPU fast path by measuring it on the running CPU, once per process and shape class.

Which kernel is fastest is a property of the CPU, not of the code: oneDNN's float32 GEMM is ~2.2× MKL's
sgemm on an AVX-512 EPYC and no faster on an AVX2-only one; its bf16 GEMM uses AMX on Sapphire Rapids and is
emulated (7× slower than float32) where the CPU has no bf16 instructions. So instead of a hard-coded choice,
the first call of a shape class times the candidates on a small slice of the real problem and keeps the
faster (`choose`); later calls look the choice up. The classes are coarse (the GEMM's inner and outer
sizes and a row bucket; the attention's dtype and key-length bucket), so a model calibrates a handful of
them per row bucket, each in 2-70 ms on a 2-core Cascade Lake (~0.7 s over a 4-layer model's first forwards at 1,
16, 128 and 4×512 tokens: `python bench/experiments.py --only calibration_cost`). The choices are kept on disk for
the next process on the same machine (`stored_choices_roformer_rope.py`; `ROFORMER_ROPE_CACHE=0` switches that off).

Visible: every decision is logged at DEBUG ("roformer_rope dispatch: ...") and listed by `decisions()`
(the benchmarks print them). Overridable: `ROFORMER_ROPE_ONEDNN=0|1` / `ROFORMER_ROPE_ONEDNN_ATTENTION=0|1` /
`ROFORMER_ROPE_PACK=0|1` force a path off or on (unset or `auto`: measure); `ROFORMER_ROPE_FORCE=kind=path,...`
(e.g. `sdpa_layout=strided,linear=torch`) fixes any decision, and `force(...)` does the same in-process (tests
run every path this way).
"""

import logging
import os
import time
from collections.abc import Callable

import torch

from .stored_choices_roformer_rope import store, stored

logger = logging.getLogger(__name__)

_choices: dict[tuple, str] = {}
_timings: dict[tuple, dict[str, float]] = {}
_forced: dict[str, str | None] = {}
_checked: set[tuple] = set()  # (key, forced path) pairs known to name a candidate
_from_store: set[tuple] = set()  # keys whose choice was read from disk (`stored_choices_roformer_rope.py`)
KINDS = (
    "linear", "linear_backward", "linear_gelu", "linear_packed", "linear_emulated", "attention", "attention_dropout",
    "attention_exp", "sdpa_layout",
)  # fmt: skip
# ("attention_dropout" is a rule, never timed: `attention_roformer_rope.dropout_attention_path`; it is here to be forced.)


def _forced_by_environment(raw: str) -> dict[str, str]:
    """`ROFORMER_ROPE_FORCE`: comma-separated kind=path; a malformed entry is ignored with a warning."""
    paths = {}
    for entry in filter(None, (part.strip() for part in raw.split(","))):
        kind, _, path = (part.strip() for part in entry.partition("="))
        if kind in KINDS and path:
            paths[kind] = path
        else:
            logger.warning("ignoring ROFORMER_ROPE_FORCE entry %r: expected kind=path, kind one of %s", entry, KINDS)
    return paths


_environment = _forced_by_environment(os.environ.get("ROFORMER_ROPE_FORCE", ""))
_forced.update(_environment)


_memos: list[dict] = []


def memo() -> dict:
    """A new dict for answers derived from the choices (a caller's whole plan for a shape class), emptied whenever
    a choice may change: by `force` and `reset`."""
    derived: dict = {}
    _memos.append(derived)
    return derived


def _forget_derived() -> None:
    for derived in _memos:
        derived.clear()


def force(kind: str, path: str | None) -> None:
    """Force the `kind` decision (one of KINDS) to `path`; None = measure again."""
    if kind not in KINDS:
        raise ValueError(f"roformer_rope dispatch: unknown decision kind {kind!r}; expected one of {KINDS}")
    _forced[kind] = path
    for key in [k for k in _choices if k[0] == kind]:
        del _choices[key]
        _from_store.discard(key)
    _forget_derived()


def force_default(kind: str, path: str) -> None:
    """`force`, unless ROFORMER_ROPE_FORCE names this kind: the switches that force a whole family of paths
    (`ROFORMER_ROPE_ONEDNN=1`, `ROFORMER_ROPE_PACK=1`) yield to a decision named explicitly."""
    if kind not in _environment:
        force(kind, path)


def forced(kind: str) -> str | None:
    return _forced.get(kind)


def reset() -> None:
    """Forget every choice made in this process (a choice stored on disk is read again on its next use)."""
    _choices.clear()
    _timings.clear()
    _from_store.clear()
    _forget_derived()


ROUNDS = 5  # timed rounds per decision at most, after one untimed warm-up call of each candidate
# A candidate FAR times slower than the leader after two timed rounds is not timed again: it cannot win, and some
# lose by seconds (an emulated bf16 backward GEMM, 0.2-3 s a call where the float32 one takes 10-130 ms).
FAR = 3.0
# Timing stops after MIN_ROUNDS timed rounds once no candidate's best lies between TIE and CLEAR times the leader's:
# each is then either clearly slower or so close that taking either costs ≤ 3%. The rounds after that rarely changed
# a choice and were most of a first forward's calibration (`python bench/experiments.py --only calibration_cost`).
MIN_ROUNDS = 2
TIE = 1.03
CLEAR = 1.10


def _settled(best: dict[str, float]) -> bool:
    """No candidate is within reach of the leader without being a tie (see CLEAR, TIE)."""
    leader = min(best.values())
    return all(seconds <= TIE * leader or seconds > CLEAR * leader for seconds in best.values())


def _time_interleaved(candidates: dict[str, Callable[[], object]], key: tuple) -> dict[str, float]:
    """Best time (s) of each candidate over MIN_ROUNDS to ROUNDS rounds that run every candidate once, in turn.

    Interleaving puts the candidates under the same conditions (a first forward also faults in fresh memory and
    wakes the thread pool; timed one after the other, the first candidate paid for that and lost ~1 decision in 4
    on Sapphire Rapids between GEMMs 6-18% apart); the best of the rounds drops the interruptions."""
    best = dict.fromkeys(candidates, float("inf"))
    beaten: set[str] = set()
    for round_ in range(ROUNDS + 1):  # round 0: the untimed warm-up (first-call allocations, oneDNN primitives)
        for name, fn in candidates.items():
            if name not in best or name in beaten:
                continue
            start = time.perf_counter()
            try:
                fn()
            except RuntimeError as error:  # e.g. oneDNN has no bf16 kernel for a CPU without bf16 instructions
                logger.debug("roformer_rope dispatch: %s: %s unavailable (%s)", key, name, str(error)[:80])
                del best[name]
                continue
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
        if round_ >= MIN_ROUNDS and best:
            if _settled(best):
                break
            leader = min(best.values())
            beaten.update(name for name, seconds in best.items() if seconds > FAR * leader)
    return best


Candidates = dict[str, Callable[[], object]]


def choose(key: tuple, candidates: Candidates | Callable[[], Candidates]) -> str:
    """The fastest candidate for `key` (measured on first use, then cached). key[0] names the decision kind.

    `candidates` may be a function returning them, called only when `key` is decided: a lookup then costs no
    proxy slices or closures (a decode step's linears are called thousands of times, ~100 µs each)."""
    path = _forced.get(key[0])
    if path is not None:
        if (key, path) not in _checked:
            names = candidates() if callable(candidates) else candidates
            if path not in names:
                raise ValueError(
                    f"roformer_rope dispatch: {key[0]} forced to {path!r} (by ROFORMER_ROPE_FORCE or force()); "
                    f"the paths are {sorted(names)}"
                )
            _checked.add((key, path))
        return path
    choice = _choices.get(key)
    if choice is None:
        if callable(candidates):
            candidates = candidates()
        kept = stored(key)  # timed by an earlier process on this machine (`stored_choices_roformer_rope.py`)
        if kept is not None and kept[0] in candidates:
            (choice, times), how = kept, "stored"
            _from_store.add(key)
        else:
            with torch.no_grad():
                times = _time_interleaved(candidates, key)
            if not times:
                raise RuntimeError(f"roformer_rope dispatch: no candidate runs for {key}")
            choice, how = min(times, key=times.get), "measured"
            store(key, choice, times)
        _choices[key], _timings[key] = choice, times
        logger.debug(
            "roformer_rope dispatch: %s → %s (%s %s)",
            key,
            choice,
            how,
            ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in times.items()),
        )
    return choice


def measured(key: tuple) -> dict[str, float] | None:
    """The seconds each candidate of `key`'s decision took (this process's or the stored timing), None if forced or
    not decided."""
    return None if _forced.get(key[0]) is not None else _timings.get(key)


def from_store(key: tuple) -> bool:
    """Whether `key`'s choice in this process was read from disk rather than timed here."""
    return key in _from_store


def decisions() -> list[dict]:
    """Every decision made in this process: the shape class, the choice and the measured times (ms)."""
    return [
        {"class": list(key), "choice": choice, "ms": {k: round(1e3 * v, 3) for k, v in _timings.get(key, {}).items()}}
        for key, choice in _choices.items()
    ]


def row_bucket(rows: int) -> int:
    """Rows of a GEMM grouped by powers of 4 (1, 4, 16, 64, 256, ...): GEMM efficiency changes slowly with them,
    except at a few rows, where a decode step's one-row GEMV wants other kernels than its prompt's GEMM."""
    bucket = 1
    while bucket < rows and bucket < 4096:
        bucket *= 4
    return bucket


def length_bucket(length: int) -> int:
    """Key lengths grouped by powers of 2 from 256 up."""
    bucket = 256
    while bucket < length:
        bucket *= 2
    return bucket


__all__ = [
    "KINDS", "choose", "decisions", "force", "force_default", "forced", "from_store", "length_bucket", "measured", "memo", "reset",
    "row_bucket",
]  # fmt: skip
