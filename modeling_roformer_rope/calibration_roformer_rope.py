"""Pick each CPU fast path by measuring it on the running CPU, once per process and shape class.

Which kernel is fastest is a property of the CPU, not of the code: oneDNN's float32 GEMM is ~2.2× MKL's
sgemm on an AVX-512 EPYC and no faster on an AVX2-only one; its bf16 GEMM uses AMX on Sapphire Rapids and is
emulated (7× slower than float32) where the CPU has no bf16 instructions. So instead of a hard-coded choice,
the first call of a shape class times the candidates on a small slice of the real problem and keeps the
faster (`choose`); later calls look the choice up. A class that recurs on small inputs (an inference linear on ≤ 256
rows: every layer of a model runs it) is instead timed on its real calls, one candidate per call, whose result is
the call's (`run_timed`): the same rounds, without the slices' extra work, on calls of one size (a stream of varying
lengths falls back to the slices: `stalled`). The classes are coarse (the GEMM's inner and outer
sizes and a row bucket; the attention's dtype and key-length bucket), so a model calibrates a handful of
them per row bucket, each in 2-70 ms on a 2-core Cascade Lake (~0.7 s over a 4-layer model's first forwards at 1,
16, 128 and 4×512 tokens: `python bench/experiments.py --only calibration_cost`). The choices are kept on disk for
the next process on the same machine (`stored_choices_roformer_rope.py`; `ROFORMER_ROPE_CACHE=0` switches that off);
`warm_up(call)` decides the classes a forward uses ahead, and `roformer-rope calibrate` does so for a saved model.

Visible: every decision is logged at DEBUG ("roformer_rope dispatch: ...") and listed by `decisions()`
(the benchmarks print them). Overridable: `ROFORMER_ROPE_ONEDNN=0|1` / `ROFORMER_ROPE_ONEDNN_ATTENTION=0|1` /
`ROFORMER_ROPE_PACK=0|1` force a path off or on (unset or `auto`: measure); `ROFORMER_ROPE_FORCE=kind=path,...`
(e.g. `sdpa_layout=strided,linear=torch`) fixes any decision, and `force(...)` does the same in-process (tests
run every path this way).
"""

import logging
import os
import statistics
import threading
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
_trials: dict[tuple, "_Rounds"] = {}  # classes being timed on their real calls (`run_timed`)
_lock = threading.Lock()  # their rounds' bookkeeping, when several threads call one class
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


_trial_states: list[dict] = []


def trial_state() -> dict:
    """A new dict for what a caller keeps while classes are timed on their real calls, keyed by decision key (the
    packs made to time a packed candidate): emptied by `reset`, and of a kind's keys by `force`."""
    state: dict = {}
    _trial_states.append(state)
    return state


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
    for state in (_trials, _rents, *_trial_states):
        for key in [k for k in state if k[0] == kind]:
            del state[key]
    _waited.difference_update([k for k in _waited if k[0] == kind])
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
    for state in (_trials, _rents, _waited, *_trial_states):
        state.clear()
    _timings.clear()
    _from_store.clear()
    _costs.clear()
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


class _Rounds:
    """The interleaved rounds of one decision: every candidate once per round, an untimed warm-up round first,
    MIN_ROUNDS to ROUNDS timed rounds, the best time of each candidate kept (`waiting` names the candidates still to
    run in this round, `record` takes one's time). Run back to back on proxies (`_time_interleaved`, in order) or one
    candidate per real call of the shape class (`run_timed`: the first waiting one that can run on the call).

    Interleaving puts the candidates under the same conditions (a first forward also faults in fresh memory and
    wakes the thread pool; timed one after the other, the first candidate paid for that and lost ~1 decision in 4
    on Sapphire Rapids between GEMMs 6-18% apart); the best of the rounds drops the interruptions."""

    def __init__(self, names, size=None):
        self.size = size  # the problem size its calls are timed at (`run_timed`)
        self.misses = 0  # calls of another size, not timed
        self.order = list(names)
        self.best = dict.fromkeys(self.order, float("inf"))
        self.beaten: set[str] = set()
        self.round = 0  # 0: the untimed warm-up (first-call allocations, oneDNN primitives)
        self.ran: set[str] = set()  # the candidates that ran in this round
        self.done = False
        self.paid = 0.0  # seconds of the calls that ran the rounds (`run_timed`: preparations and warm-up included)
        self.calls = 0

    def cost(self) -> float:
        """What the rounds cost beyond running the winner on their calls (s): `paid` less `calls` times its best."""
        return self.paid - self.calls * min(self.best.values(), default=0.0) if self.calls else 0.0

    @property
    def position(self) -> int:
        """How many candidates ran in this round."""
        return len(self.ran)

    def waiting(self) -> list[str]:
        """The candidates still to run in this round, in order; [] once the decision is made (`best` then holds the
        times)."""
        while not self.done:
            skip = self.beaten | self.ran
            names = [name for name in self.order if name in self.best and name not in skip]
            if names:
                return names
            self._end_round()
        return []

    def next(self) -> str | None:
        """The candidate to run next in order, or None once the decision is made."""
        names = self.waiting()
        return names[0] if names else None

    def record(self, name: str, seconds: float | None) -> None:
        """`name` ran in `seconds` (None: it could not run here, e.g. oneDNN has no bf16 kernel for this CPU)."""
        if seconds is None:
            self.best.pop(name, None)
        elif self.round and name in self.best:
            self.best[name] = min(self.best[name], seconds)
        self.ran.add(name)

    def _end_round(self) -> None:
        if self.round >= MIN_ROUNDS and self.best:
            if _settled(self.best):
                self.done = True
                return
            leader = min(self.best.values())
            self.beaten.update(name for name, seconds in self.best.items() if seconds > FAR * leader)
        self.round, self.ran = self.round + 1, set()
        self.done = self.round > ROUNDS or not self.best


def _time_interleaved(candidates: dict[str, Callable[[], object]], key: tuple) -> dict[str, float]:
    """Best time (s) of each candidate over the interleaved rounds (`_Rounds`), run back to back."""
    rounds = _Rounds(candidates)
    while (name := rounds.next()) is not None:
        start = time.perf_counter()
        try:
            candidates[name]()
        except RuntimeError as error:  # e.g. oneDNN has no bf16 kernel for a CPU without bf16 instructions
            logger.debug("roformer_rope dispatch: %s: %s unavailable (%s)", key, name, str(error)[:80])
            rounds.record(name, None)
            continue
        rounds.record(name, time.perf_counter() - start)
    return rounds.best


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
        if not _take_stored(key, candidates):
            with torch.no_grad():
                times = _time_interleaved(candidates, key)
            _decide(key, times, "measured")
        _end_trial(key)  # if its real calls were being timed (`run_timed`)
        choice = _choices[key]
    return choice


def _decide(key: tuple, times: dict[str, float], how: str, choice: str | None = None) -> str:
    """Keep `choice` (default: the fastest of `times`) as key's choice, store it for the next process (unless it came
    from the store) and log it."""
    if choice is None:
        if not times:
            raise RuntimeError(f"roformer_rope dispatch: no candidate runs for {key}")
        choice = min(times, key=times.get)
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


def _take_stored(key: tuple, names) -> bool:
    """Decide key from the choice an earlier process on this machine timed (`stored_choices_roformer_rope.py`), if
    one is stored and still among `names`."""
    kept = stored(key)
    if kept is None or kept[0] not in names:
        return False
    _decide(key, kept[1], "stored", kept[0])
    _from_store.add(key)
    _end_trial(key)  # another process (a DeepSpeed rank) stored it while this one timed its real calls
    return True


def _end_trial(key: tuple, states: bool = True) -> None:
    """key is decided: drop its rounds on real calls and (`states`) what callers kept for them (`trial_state`), and
    the plans that were timing it give way to ones for the choice."""
    _rents.pop(key, None)
    if _trials.pop(key, None) is not None:
        for state in _trial_states if states else ():
            state.pop(key, None)
        _forget_derived()


# Timing on the real calls. A shape class recurs: a 12-layer model runs each of its four linear classes 12 times per
# forward. Instead of timing every candidate on a proxy before the first call (work whose results are thrown away:
# ~1.1 s of a 12-layer model's first 1×128 forward on a 2-core Zen 1 EPYC, 2.6× the forward itself), each call of an
# undecided class can run one candidate on its real input, timed, and return that candidate's result: the same
# interleaved rounds (`_Rounds`), spread over the calls, costing only the slower candidates' extra time.


def decided(key: tuple) -> bool:
    """Whether key's decision is made in this process or forced (one dict lookup; `pending` also reads the store)."""
    return _forced.get(key[0]) is not None or key in _choices


def pending(key: tuple, names) -> bool:
    """Whether key's decision is still open: not forced, not made in this process, none stored for it (a stored one
    is taken now). `names`: the candidates a decision would choose among."""
    return not decided(key) and not _take_stored(key, names)


# Calls of another size than the rounds' before a class gives up timing on its real calls (`stalled`): in a stream of
# varying lengths, a 12-layer model's one sentence gives 12 calls of one size, and the next sentence another.
STALL = 32

# When a class's rounds on real calls begin: ski rental. The rounds cost about the same whatever the class's size
# (oneDNN primitives and packs made, the slower candidates run: 1-3 ms a decision at 64 wide, 2-17 ms at 768, logged
# at DEBUG as "N calls costing X ms more"), so on a small class, a narrow model's GEMMs of 10-40 µs, they cost as
# much as a hundred of its calls and could win a few µs a call; timed at once, a 2-layer 64-wide model ran ~0.5-0.7×
# the built-in's speed over its calls 4-10 and ~1.1× after (`python bench/experiments.py --only
# small_models_first_calls`). So the caller of a class whose decision is open runs its default on the class's calls
# (`F.linear`, the GEMM decided before, or the GEMM then aten's GELU: `rent`) until what they may have lost by it,
# DEFAULT_LOSS of their time, reaches what a decision costs (`start_budget`), then starts the rounds. A class that
# recurs long enough to pay for its timing is timed, at worst for twice the loss of the better strategy in hindsight
# (the ski-rental bound) if DEFAULT_LOSS is right, and a base-width class (0.7-3 ms a call at 128 rows) starts within
# its first forward or two. The class's later decisions start at once after a paid wait: waiting for each, a 12-layer
# model's first 1×128 forwards ran 0.71-0.89× the built-in's over calls 3-12, against 0.80-1.09× so (`--only
# first_forwards --layers 12`, c8dd615 and 5ef6ee8).
START_BUDGET = 2e-3  # seconds, before this process has measured what a decision costs
# The share of a call's time the default may lose to the best candidate: the gaps the dispatch tables of the results
# READMEs show for an inference linear class are 1-67% (oneDNN vs `F.linear`, half within 6%), 3-8% for packs at
# 256-2048 rows and up to 2× at one row.
DEFAULT_LOSS = 0.25
_costs: list[float] = []  # what each decision timed on real calls cost beyond its winner's calls (`_Rounds.cost`)
_budget = [START_BUDGET]
_rents: dict[tuple, list] = {}  # decision key → [seconds, calls] its class ran on the default before its rounds
_waited: set[tuple] = set()  # decisions whose rounds began after their wait was paid (`rent`'s `after`)
_no_wait = threading.local()  # `.on` while this thread runs `warm_up`: a wait it meets is paid (`rent_paid`)


def start_budget() -> float:
    """Seconds a class's calls run its default before its rounds on real calls begin: the median cost of the decisions
    timed on real calls in this process so far (`_Rounds.cost`), START_BUDGET before the first."""
    return _budget[0] if _costs else START_BUDGET


def rent(key: tuple, after: tuple = ()) -> list:
    """[seconds, calls] that key's class has run on its default so far, while its decision is open; the caller adds
    to it each call it runs the default instead of the rounds, until `rent_paid`. `after`: the class's decisions that
    come before this one (`linear` before `linear_packed`, the producer's before its GELU's); if one of their waits was
    paid, the class has shown it recurs enough, and this one starts at once."""
    with _lock:
        spent = _rents.get(key)
        if spent is None:
            spent = _rents[key] = [float("inf") if any(k in _waited for k in after) else 0.0, 0]
        return spent


def rent_paid(spent: list) -> bool:
    """Whether a class that has run `spent` (`rent`) on its default may have lost what a decision costs."""
    if getattr(_no_wait, "on", False):
        spent[0] = float("inf")  # asked for by `warm_up`: paid for good, so its rounds, once begun, do not pause
    return spent[0] * DEFAULT_LOSS >= start_budget()


def run_waiting(spent: list, default: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """default(*args), timed and added to `spent` (`rent`): one call of a class that waits for its rounds."""
    start = time.perf_counter()
    result = default(*args)
    spent[0], spent[1] = spent[0] + time.perf_counter() - start, spent[1] + 1
    return result


def _count_cost(seconds: float) -> None:
    _costs.append(max(0.0, seconds))
    _budget[0] = statistics.median(_costs)


def run_timed(
    key: tuple, candidates: dict[str, Callable[[], Callable[[], object] | None]], otherwise=None, size=None
):
    """Run this call of key's shape class on one candidate and return its result: the next candidate of key's
    interleaved rounds, timed, or the choice once they are over (deciding it then, as `choose` would have).

    `size`: the call's problem size (its rows). A shape class spans sizes (a row bucket), and candidates timed on
    calls of different sizes would not compare, so the rounds time calls of the first call's size only; a call of
    another size runs `otherwise()`, untimed, and after STALL of them the caller decides the class on proxies
    (`stalled`).

    Each candidate is a preparation run untimed (making a weight's pack, say) that returns the timed call, or None
    when the candidate cannot be timed on this call (it is timed on a few weights of the class only): this call then
    runs the next candidate of the round that can, or `otherwise()`, untimed, if none can; the rounds wait for the
    others. All candidates compute the same result;
    one that raises RuntimeError is dropped and the next one runs."""
    choice = _forced.get(key[0]) or _choices.get(key)
    if choice is None:
        with _lock:
            rounds = _trials.get(key)
            if rounds is None:
                rounds = _trials[key] = _Rounds(candidates, size)
                if key in _rents:  # it waited (`rent`), and the wait is paid
                    _waited.add(key)
        if size != rounds.size:
            rounds.misses += 1
            return otherwise()
        while True:
            with _lock:  # threads calling one class share its rounds: one takes each step (the GEMMs run outside)
                waiting = rounds.waiting()
                missing = [name for name in waiting if name not in candidates]
                for name in missing:  # a call of the class without this candidate (it cannot run here)
                    rounds.record(name, None)
            if not waiting:
                break
            if missing:
                continue
            step = time.perf_counter()
            # the first candidate of the round that can be timed on this call (a packed one only on some weights)
            for name in waiting:
                call = candidates[name]()
                if call is not None:
                    break
            else:
                return otherwise()
            start = time.perf_counter()
            try:
                result = call()
            except RuntimeError as error:
                logger.debug("roformer_rope dispatch: %s: %s unavailable (%s)", key, name, str(error)[:80])
                with _lock:
                    rounds.record(name, None)
                continue
            with _lock:
                end = time.perf_counter()
                rounds.record(name, end - start)
                rounds.paid, rounds.calls = rounds.paid + end - step, rounds.calls + 1
            return result
        with _lock:
            choice = _choices.get(key)
            if choice is None:
                _count_cost(rounds.cost())
                rented = _rents.get(key, (0.0, 0))[1]
                choice = _decide(key, rounds.best, f"measured on real calls ({rounds.calls} calls costing "
                                 f"{1e3 * rounds.cost():.2f} ms more, after {rented} on the default)")  # fmt: skip
        _end_trial(key, states=False)  # the caller keeps what it made for the winner (`trial_state`), drops the rest
    call = candidates[choice]()
    return otherwise() if call is None else call()


def warm_up(call: Callable[[], object], limit: int = 64) -> int:
    """Run `call` (a forward at the shapes to come) until the classes its calls time on their real calls are decided,
    their rounds starting at once rather than after the wait of `rent` (the caller asks for them now; the waits its
    calls meet in this thread count as paid for good, so a class left open by `limit` or an exception starts its
    rounds at once later); the classes timed on proxies are decided on its first run. Returns the runs it took (1 to
    `limit`). What a timing loop or a server runs before its first timed or served call: its calls then run the
    choices from the first. The choices are stored for the next process, as any are (`stored_choices_roformer_rope.py`)."""
    previous, _no_wait.on = getattr(_no_wait, "on", False), True
    try:
        return run_until_still(call, limit)
    finally:
        _no_wait.on = previous


def run_until_still(call: Callable[[], object], limit: int) -> int:
    """Run `call` until a run decides nothing and moves no class timed on its real calls (`timing_on_calls`; those
    left, if any, are other shapes' or wait), at most `limit` (≥ 1) runs; returns the runs. A run that decides a class
    is followed by another: a decision may open the next one of its class (`linear`, then its packs, then its GELU)."""
    if limit < 1:
        raise ValueError(f"roformer_rope dispatch: limit {limit} is not a positive number of runs")
    runs, before = 0, (timing_on_calls(), len(_choices))
    while runs < limit:
        call()
        runs += 1
        after = (timing_on_calls(), len(_choices))
        if after[1] == before[1] and all(before[0].get(key) == progress for key, progress in after[0].items()):
            break
        before = after
    return runs


def stalled(key: tuple) -> bool:
    """Whether key's rounds on real calls have met STALL calls of other sizes: decide it on proxies (`choose`)."""
    rounds = _trials.get(key)
    return rounds is not None and rounds.misses >= STALL


def timing_on_calls() -> dict[tuple, tuple[int, int, int]]:
    """The classes being timed on their real calls now (`run_timed`), each with how far its rounds got: (round,
    candidate of the round, calls of another size); (-1, calls on `F.linear`, 0) while they wait for their rounds to
    begin (`rent`, `rent_paid`). A benchmark warms up until these stop moving, so that its timed
    calls run the choices rather than the rounds (`bench/common.py`, `interleaved`)."""
    with _lock:
        progress = {key: (-1, calls, 0) for key, (_, calls) in _rents.items() if key not in _choices}
        progress.update((key, (rounds.round, rounds.position, rounds.misses)) for key, rounds in _trials.items())
        return progress


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
    "KINDS", "choose", "decided", "decisions", "force", "force_default", "forced", "from_store", "length_bucket",
    "measured", "memo", "pending", "rent", "rent_paid", "reset", "row_bucket", "run_timed", "run_until_still",
    "run_waiting", "stalled", "start_budget", "timing_on_calls", "trial_state", "warm_up",
]  # fmt: skip
