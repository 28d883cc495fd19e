"""Pick each CPU fast path by measuring it on the running CPU, once per process and shape class.

Which kernel is fastest is a property of the CPU, not of the code: oneDNN's float32 GEMM is ~2.2× MKL's
sgemm on an AVX-512 EPYC and no faster on an AVX2-only one; its bf16 GEMM uses AMX on Sapphire Rapids and is
emulated (7× slower than float32) where the CPU has no bf16 instructions. So instead of a hard-coded choice,
the first call of a shape class times the candidates on a small slice of the real problem and keeps the
faster (`choose`); later calls look the choice up. The classes are coarse (the GEMM's inner and outer
sizes and a row bucket; the attention's dtype and key-length bucket), so a model calibrates a handful of
them, each in a few milliseconds.

Visible: every decision is logged at DEBUG ("roformer_rope dispatch: ...") and listed by `decisions()`
(the benchmarks print them). Overridable: `ROFORMER_ROPE_ONEDNN=0|1` / `ROFORMER_ROPE_ONEDNN_ATTENTION=0|1` /
`ROFORMER_ROPE_PACK=0|1`
force a path off or on (unset or `auto`: measure), and `force(...)` does the same in-process (tests run
every path this way).
"""

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_choices: dict[tuple, str] = {}
_timings: dict[tuple, dict[str, float]] = {}
_forced: dict[str, str | None] = {}


def force(kind: str, path: str | None) -> None:
    """Force the `kind` decision ("linear", "linear_backward", "linear_gelu", "linear_packed", "attention") to `path`;
    None = measure again."""
    _forced[kind] = path
    for key in [k for k in _choices if k[0] == kind]:
        del _choices[key]


def forced(kind: str) -> str | None:
    return _forced.get(kind)


def reset() -> None:
    _choices.clear()
    _timings.clear()


def _time(fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm-up: first-call allocations, oneDNN primitive creation
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def choose(key: tuple, candidates: dict[str, Callable[[], object]]) -> str:
    """The fastest candidate for `key` (measured on first use, then cached). key[0] names the decision kind."""
    path = forced(key[0])
    if path is not None:
        return path
    choice = _choices.get(key)
    if choice is None:
        times = {}
        with torch.no_grad():
            for name, fn in candidates.items():
                try:
                    times[name] = _time(fn)
                except RuntimeError as error:  # e.g. oneDNN has no bf16 kernel for a CPU without bf16 instructions
                    logger.debug("roformer_rope dispatch: %s: %s unavailable (%s)", key, name, str(error)[:80])
        if not times:
            raise RuntimeError(f"roformer_rope dispatch: no candidate runs for {key}")
        choice = min(times, key=times.get)
        _choices[key], _timings[key] = choice, times
        logger.debug(
            "roformer_rope dispatch: %s → %s (%s)",
            key,
            choice,
            ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in times.items()),
        )
    return choice


def decisions() -> list[dict]:
    """Every decision made in this process: the shape class, the choice and the measured times (ms)."""
    return [
        {"class": list(key), "choice": choice, "ms": {k: round(1e3 * v, 3) for k, v in _timings.get(key, {}).items()}}
        for key, choice in _choices.items()
    ]


def row_bucket(rows: int) -> int:
    """Rows of a GEMM grouped by powers of 4 (64, 256, 1024, ...): GEMM efficiency changes slowly with them."""
    bucket = 64
    while bucket < rows and bucket < 4096:
        bucket *= 4
    return bucket


def length_bucket(length: int) -> int:
    """Key lengths grouped by powers of 2 from 256 up."""
    bucket = 256
    while bucket < length:
        bucket *= 2
    return bucket


__all__ = ["choose", "decisions", "force", "forced", "length_bucket", "reset", "row_bucket"]
