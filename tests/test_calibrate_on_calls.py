"""Inference linear classes timed on their real calls (`calibration_roformer_rope.run_timed`, `onednn_roformer_rope.
_TimedLinear`): each call runs one candidate and returns its result, the rounds are those timed on proxies, and the
model's outputs equal the built-in's on every call, while a class is timed and after."""

import dataclasses
import statistics

import pytest
import torch

from conftest import builtin_model, padded_batch, probe_json
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_roformer_rope as fast
from modeling_roformer_rope import prepack_roformer_rope as prepack
from roformer_rope.conversion.from_transformers import convert_model

needs_onednn = pytest.mark.skipif(fast._LINEAR_POINTWISE is None, reason="this torch build has no oneDNN linear op")
LINEAR_KINDS = ("linear", "linear_packed", "linear_gelu")
# the rounds start on a class's first call, except in the tests of when they start (`auto`, below)
pytestmark = pytest.mark.usefixtures("timed_at_once")


class Clock:
    """A fake `time.perf_counter` that candidates advance by their cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def candidate(self, name: str, seconds: float, ran: list):
        def call():
            self.now += seconds
            ran.append(name)
            return name

        return call


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(calibration.time, "perf_counter", fake)
    monkeypatch.setitem(calibration._forced, "linear", None)  # measured, whatever ROFORMER_ROPE_FORCE/_ONEDNN say
    calibration.reset()
    yield fake
    calibration.reset()


@pytest.mark.parametrize("costs", [{"fast": 1.0, "slow": 2.0}, {"a": 1.0, "b": 1.05, "c": 1.01, "far": 9.0}])
def test_each_call_runs_one_candidate_and_the_rounds_are_the_proxies(clock, costs):
    """Every call runs exactly one candidate and returns its result; the preparation is not timed; the calls it
    takes and the times kept are those `_time_interleaved` measures back to back; then every call runs the choice."""
    key = ("linear", "test", 1, 2, 3)
    proxy_ran: list[str] = []
    expected = calibration._time_interleaved(
        {name: clock.candidate(name, cost, proxy_ran) for name, cost in costs.items()}, key
    )
    ran: list[str] = []

    def prepared(name, cost):
        clock.now += 100.0  # e.g. making a pack: untimed
        return clock.candidate(name, cost, ran)

    candidates = {name: (lambda name=name, cost=cost: prepared(name, cost)) for name, cost in costs.items()}
    results = []
    while calibration.pending(key, candidates):
        assert len(results) < 100
        results.append(calibration.run_timed(key, candidates))
    assert results == ran[: len(results)]  # each call returned what the one candidate it ran returned
    # the deciding call runs the choice too: one call more than the proxies' candidate runs
    assert ran[:-1] == proxy_ran and len(results) == len(proxy_ran) + 1
    assert calibration.measured(key) == pytest.approx(expected)
    choice = min(costs, key=costs.get)
    assert ran[-1] == choice and calibration.choose(key, candidates) == choice
    assert [calibration.run_timed(key, candidates) for _ in range(3)] == [choice] * 3
    assert not calibration._trials


def test_a_candidate_that_cannot_run_is_dropped_and_the_call_still_answers(clock):
    key = ("linear", "test", 4, 5, 6)
    ran: list[str] = []

    def broken():
        raise RuntimeError("no kernel for this CPU")

    candidates = {"broken": lambda: broken, "works": lambda: clock.candidate("works", 1.0, ran)}
    assert calibration.run_timed(key, candidates) == "works"  # the broken one was first
    while calibration.pending(key, candidates):
        assert calibration.run_timed(key, candidates) == "works"
    assert calibration.decisions() == [{"class": list(key), "choice": "works", "ms": {"works": 1000.0}}]


def test_a_candidate_timed_on_some_calls_only_lets_the_others_run_otherwise(clock):
    """A candidate whose preparation returns None (a packed candidate on a weight other than its trial weight) is not
    timed on that call: the call runs `otherwise`, and the rounds go on where they were."""
    key = ("linear", "test", 10, 11, 12)
    ran: list[str] = []
    calls = {"n": 0}

    def picky():  # can be timed on every third call only
        calls["n"] += 1
        return clock.candidate("picky", 1.0, ran) if calls["n"] % 3 == 0 else None

    candidates = {"any": lambda: clock.candidate("any", 2.0, ran), "picky": picky}
    results = []
    while calibration.pending(key, candidates):
        results.append(calibration.run_timed(key, candidates, otherwise=lambda: "otherwise"))
    assert ran[:6] == ["any", "picky"] * 3 and "otherwise" in results  # warm-up and two timed rounds each
    assert [r for r in results if r != "otherwise"] == ran
    assert calibration.measured(key) == {"any": 2.0, "picky": 1.0}
    calls["n"] = 1  # the choice can run on this call only through `otherwise`
    assert calibration.run_timed(key, candidates, otherwise=lambda: "otherwise") == "otherwise"


def test_a_call_that_cannot_time_the_next_candidate_times_another_of_the_round(clock):
    """Within a round, a call on which the next candidate cannot be timed times the next one that can: the round
    still runs every candidate once, and the call does not fall back to `otherwise` while one of the round can run."""
    key = ("linear", "test", 16, 17, 18)
    ran: list[str] = []
    calls = {"n": 0}

    def picky():  # can be timed on odd calls only
        return clock.candidate("picky", 1.0, ran) if calls["n"] % 2 else None

    candidates = {"picky": picky, "a": lambda: clock.candidate("a", 2.0, ran), "b": lambda: clock.candidate("b", 3.0, ran)}
    results = []
    while calibration.pending(key, candidates):
        calls["n"] += 1
        results.append(calibration.run_timed(key, candidates, otherwise=lambda: "otherwise"))
    # call 1 picky; 2 a (picky ran, a next); 3 b; round 1: 4 a (picky cannot), 5 picky, 6 b; round 2: 7 picky, ...
    assert ran[:9] == ["picky", "a", "b", "a", "picky", "b", "picky", "a", "b"]
    assert "otherwise" not in results[:9]
    assert calibration.measured(key) == {"picky": 1.0, "a": 2.0, "b": 3.0}


@pytest.mark.skipif(not any(prepack.available(kind) for kind in prepack.KINDS), reason="no packed GEMM in this build")
@torch.no_grad()
def test_packed_candidates_are_timed_on_a_few_weights_each_from_its_second_call(monkeypatch):
    """A packed candidate's trial weights: the first TRIAL_WEIGHTS weights of the class it meets. The kind's first
    pack runs on the call that makes it (the rounds' untimed warm-up); a later one is made on one call and timed from
    the weight's next (just made, it would sit in cache); the longest idle one gives way after _TRIAL_PATIENCE calls
    of other weights; once decided, the winner's packs become their weights' packs."""
    kind = next(kind for kind in prepack.KINDS if prepack.available(kind))
    monkeypatch.setattr(fast, "_trial_packs", {})
    key = ("linear_packed", "test", 8, 16, 4)
    weights = [fast.RoFormerRopeLinear(8, 16).weight for _ in range(fast.TRIAL_WEIGHTS + 2)]
    first = fast._trial_pack(key, weights[0], kind, 4)
    assert first is not None  # the warm-up call's
    assert [fast._trial_pack(key, w, kind, 4) for w in weights[1:]] == [None] * (len(weights) - 1)
    def trial_weights():
        return [id(entry[0]()) for entry in fast._trial_packs[key][kind]]

    assert trial_weights() == [id(w) for w in weights[: fast.TRIAL_WEIGHTS]]  # the first ones met; not the rest
    again = [fast._trial_pack(key, w, kind, 4) for w in weights[: fast.TRIAL_WEIGHTS]]
    assert again[0] is first and all(pack is not None for pack in again)
    x = torch.randn(4, 8)
    for w, pack in zip(weights, again):
        torch.testing.assert_close(prepack.trial_linear(x, pack, w, None, kind), x @ w.T, atol=1e-5, rtol=1e-5)
    late = weights[-1]
    for _ in range(fast._TRIAL_PATIENCE - 1):
        assert fast._trial_pack(key, late, kind, 4) is None
    assert id(late) not in trial_weights()
    assert fast._trial_pack(key, late, kind, 4) is None  # the idle one gave way: made now, timed from the next call
    assert fast._trial_pack(key, late, kind, 4) is not None
    kept = trial_weights()
    assert id(late) in kept and len(kept) == fast.TRIAL_WEIGHTS
    fast._keep_trial_packs(key, {kind})
    assert [prepack.held(w, kind) is not None for w in weights] == [id(w) in kept for w in weights]
    assert key not in fast._trial_packs


def test_calls_of_another_size_are_not_timed_and_a_stream_of_them_stalls_the_rounds(clock):
    """Candidates timed on calls of different sizes would not compare: only calls of the first call's size are
    timed; the others run `otherwise`, and after STALL of them the class is left to the proxies."""
    key = ("linear", "test", 13, 14, 15)
    ran: list[str] = []
    candidates = {"a": lambda: clock.candidate("a", 1.0, ran), "b": lambda: clock.candidate("b", 2.0, ran)}
    assert calibration.run_timed(key, candidates, lambda: "otherwise", size=16) == "a"  # the rounds' size: 16
    results = [calibration.run_timed(key, candidates, lambda: "otherwise", size=n) for n in (16, 20, 16, 9)]
    assert results == ["b", "otherwise", "a", "otherwise"] and ran == ["a", "b", "a"]
    assert not calibration.stalled(key)
    for _ in range(calibration.STALL):
        assert calibration.run_timed(key, candidates, lambda: "otherwise", size=17) == "otherwise"
    assert calibration.stalled(key) and calibration.pending(key, candidates)
    assert calibration.choose(key, {"a": clock.candidate("a", 1.0, []), "b": clock.candidate("b", 2.0, [])}) == "a"
    assert not calibration.stalled(key) and key not in calibration._trials


@needs_onednn
@torch.no_grad()
def test_a_stream_of_varying_lengths_is_decided_on_proxies_and_equals_f_linear(monkeypatch):
    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)
    calibration.reset()
    layer = fast.RoFormerRopeLinear(48, 40)
    torch.manual_seed(0)
    for rows in [17 + (7 * i) % 48 for i in range(4 * calibration.STALL)]:  # 17-64 rows: one row bucket
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    made = {tuple(d["class"])[0] for d in calibration.decisions()}
    assert "linear" in made and not calibration._trials and not fast._trial_packs


def test_a_class_decided_on_proxies_meanwhile_ends_its_rounds(clock):
    """A training call decides the class on proxies while inference calls were timing it: the rounds stop."""
    key = ("linear", "test", 7, 8, 9)
    ran: list[str] = []
    real = {name: (lambda name=name: clock.candidate(name, 1.0, ran)) for name in ("a", "b")}
    calibration.run_timed(key, real)
    assert key in calibration._trials
    chosen = calibration.choose(key, {name: clock.candidate(name, cost, []) for name, cost in (("a", 2.0), ("b", 1.0))})
    assert chosen == "b" and key not in calibration._trials and not calibration.pending(key, real)
    assert [calibration.run_timed(key, real) for _ in range(2)] == ["b", "b"]


@needs_onednn
@torch.no_grad()
def test_a_model_times_its_linear_classes_on_its_real_calls_and_equals_the_builtin(monkeypatch):
    """Nothing of a linear class is timed on proxies at ≤ 256 rows; every forward, while classes are timed and after,
    equals the built-in's; each class ends decided with every candidate timed; packs made to time a candidate stay
    only on weights whose plan uses their kind."""
    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)  # measured, whatever the environment forces
    calibration.reset()
    on_proxies, packed = [], []
    inner = calibration._time_interleaved
    monkeypatch.setattr(calibration, "_time_interleaved", lambda c, key: on_proxies.append(key) or inner(c, key))
    trial = fast._trial_pack

    def trial_pack(key, weight, kind, rows):
        made = trial(key, weight, kind, rows)
        packed.extend((key, kind, id(entry[0]())) for entry in fast._trial_packs.get(key, {}).get(kind, []))
        return made

    monkeypatch.setattr(fast, "_trial_pack", trial_pack)
    builtin = builtin_model("RoFormerModel", hidden_size=64, intermediate_size=96, num_hidden_layers=5)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=20)
    valid = batch["attention_mask"].bool()
    expected = builtin(**batch).last_hidden_state[valid]
    open_after = []
    for _ in range(40):  # 5 layers: each decision needs ~2-6 forwards
        torch.testing.assert_close(ours(**batch).last_hidden_state[valid], expected, atol=1e-5, rtol=1e-5)
        open_after.append(len(calibration._trials))
    assert open_after[0] > 0 and open_after[-1] == 0, open_after
    assert not [key for key in on_proxies if key[0] in LINEAR_KINDS]
    trial_weights: dict[tuple, set] = {}
    for key, kind, weight in packed:
        trial_weights.setdefault((key, kind), set()).add(weight)
    # a few of the 5 weights packed per kind
    assert all(1 <= len(weights) <= fast.TRIAL_WEIGHTS < 5 for weights in trial_weights.values()), trial_weights
    made = {tuple(d["class"]): d for d in calibration.decisions()}
    x, weight = torch.ones(40, 64), ours.layers[0].attention.qkv.weight
    linear = [key for key in made if key[0] == "linear"]
    assert {(key[2], key[3]) for key in linear} == {(64, 192), (64, 64), (64, 96), (96, 64)}
    assert all(set(made[key]["ms"]) == {"onednn", "torch"} for key in linear)
    packs = {"unpacked"} | ({"packed"} if fast._packing_applies(x, weight) else set())
    packs |= {"onednn_packed"} if fast._onednn_packing_applies(x, weight, True) else set()
    if len(packs) > 1:
        assert packed
        assert {key for key in made if key[0] == "linear_packed"} == {("linear_packed", *key[1:]) for key in linear}
        assert all(set(made[key]["ms"]) == packs for key in made if key[0] == "linear_packed")
    (gelu,) = [key for key in made if key[0] == "linear_gelu"]
    gelu_paths = {"fused", "separate", "separate_native"} | ({"fused_packed"} if "onednn_packed" in packs else set())
    assert set(made[gelu]["ms"]) == gelu_paths
    assert not fast._trial_packs
    for name, param in ours.named_parameters():
        if param.dim() == 2 and "embed" not in name:
            rows = torch.ones(40, param.shape[1])
            gemm, kind = fast._inference_choice(rows, param, None)
            uses = {"mkl", "onednn"} if kind == fast.MKL_OR_ONEDNN else {kind}
            if "mlp.up_proj" in name:  # the GELU path may pack it for itself ("fused_packed")
                uses.add("onednn")
            assert set(prepack.pack_kinds(param)) <= uses, (name, kind, prepack.pack_kinds(param))


@needs_onednn
def test_threads_sharing_a_model_while_its_classes_are_timed_get_the_builtins_outputs(monkeypatch):
    """Four threads run one model at once while its classes are timed on their calls: they share the rounds and the
    trial weights, every output equals the built-in's, and the classes get decided."""
    import threading

    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)
    calibration.reset()
    builtin = builtin_model("RoFormerModel", hidden_size=64, intermediate_size=96, num_hidden_layers=4)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=20)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = builtin(**batch).last_hidden_state[valid]
    errors = []

    def work():
        try:
            with torch.no_grad():  # grad mode is per thread
                for _ in range(20):
                    got = ours(**batch).last_hidden_state[valid]
                    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        except Exception as error:  # noqa: BLE001 - reported below, with the thread's traceback lost but its message kept
            errors.append(repr(error))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors, errors[:2]
        kinds = {d["class"][0] for d in calibration.decisions()}
        assert {"linear", "linear_gelu"} <= kinds, kinds
    finally:
        calibration.reset()


@pytest.fixture
def ticking(monkeypatch):
    """`time.perf_counter` advancing by one second per reading: a call timed between two readings takes 1 s."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: float(next(ticks)))


@needs_onednn
@torch.no_grad()
def test_a_class_runs_f_linear_until_its_calls_have_cost_a_decision_then_its_rounds_start(monkeypatch, ticking):
    """`auto`: a linear class whose decision is open runs `F.linear` on its calls, no candidate timed, until DEFAULT_LOSS
    of their seconds reaches `start_budget()` (START_BUDGET before any decision was measured); its rounds start on
    the next call."""
    monkeypatch.setattr(fast, "settings", dataclasses.replace(fast.settings, calibrate_on_calls="auto"))
    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)
    monkeypatch.setattr(calibration, "DEFAULT_LOSS", 0.5)
    monkeypatch.setattr(calibration, "START_BUDGET", 2.5)  # five calls of the ticking clock
    calibration.reset()
    linear_calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(fast.F, "linear", lambda *args: linear_calls.append(1) or real_linear(*args))
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    key = fast._linear_key(x, layer.weight)
    try:
        for call in range(1, 6):
            torch.testing.assert_close(layer(x), real_linear(x, layer.weight, layer.bias))
            assert not calibration._trials and len(linear_calls) == call
            assert calibration.timing_on_calls() == {key: (-1, call, 0)}
        layer(x)  # the calls took 5 s, half of which reaches the budget: the rounds begin (the warm-up's first call)
        assert key in calibration._trials and calibration.timing_on_calls()[key][0] == 0
    finally:
        calibration.reset()


def test_the_budget_is_what_the_decisions_timed_on_calls_have_cost(clock):
    """`start_budget()` is START_BUDGET until a decision on real calls is made, then the median of what each cost:
    the seconds of its calls beyond as many calls of the winner."""
    assert calibration.start_budget() == calibration.START_BUDGET
    costs = []
    for key, seconds in ((("linear", "a"), {"fast": 1.0, "slow": 2.0}), (("linear", "b"), {"x": 1.0, "y": 4.0}),
                         (("linear", "c"), {"p": 2.0, "q": 2.5})):  # fmt: skip
        ran: list[str] = []
        real = {name: (lambda name=name, cost=cost, ran=ran: clock.candidate(name, cost, ran)) for name, cost in seconds.items()}
        while calibration.pending(key, real):
            calibration.run_timed(key, real)
        best = min(seconds.values())
        costs.append(sum(seconds[name] for name in ran) - len(ran) * best)
        assert costs[-1] > 0 and calibration.start_budget() == pytest.approx(statistics.median(costs))
    calibration.reset()
    assert calibration.start_budget() == calibration.START_BUDGET


def test_a_later_decision_of_a_class_whose_wait_was_paid_starts_at_once(clock, monkeypatch):
    """A class's first decision waits (`rent`); once that wait was paid and its rounds began, the class's next
    decision (`after` it) starts at once, while one after a decision that never waited (decided another way) waits."""
    first, later = ("linear", "test", 1), ("linear_packed", "test", 1)
    elsewhere, its_later = ("linear", "test", 2), ("linear_packed", "test", 2)
    assert not calibration.rent_paid(calibration.rent(first))  # START_BUDGET is infinite in tests (conftest)
    calibration.run_timed(first, {name: (lambda name=name: clock.candidate(name, 1.0, [])) for name in ("a", "b")})
    assert calibration.rent_paid(calibration.rent(later, (first,)))
    assert not calibration.rent_paid(calibration.rent(its_later, (elsewhere,)))
    monkeypatch.setitem(calibration._forced, "linear", calibration.forced("linear"))  # restored after the test
    calibration.force("linear", None)  # measure the kind again: its paid waits are forgotten with its rounds
    calibration._rents.pop(later)
    assert not calibration.rent_paid(calibration.rent(later, (first,)))


@needs_onednn
@pytest.mark.parametrize("value", ["0", "", "1"])
def test_the_environment_switches_timing_on_real_calls_off(value):
    probe = (
        "import json, torch; from modeling_roformer_rope import onednn_roformer_rope as f\n"
        "from modeling_roformer_rope import calibration_roformer_rope as c\n"
        "l = f.RoFormerRopeLinear(16, 8); x = torch.randn(4, 16)\n"
        "with torch.no_grad(): y = l(x)\n"
        "ok = torch.allclose(y, torch.nn.functional.linear(x, l.weight, l.bias), atol=1e-6)\n"
        "print(json.dumps({'ok': ok, 'decided': sorted(d['class'][0] for d in c.decisions()),\n"
        "                  'timing': sorted(k[0] for k in c._trials),\n"
        "                  'progress': [list(p) for p in c.timing_on_calls().values()]}))"
    )
    out = probe_json(probe, ROFORMER_ROPE_CALIBRATE_ON_CALLS=value)
    assert out["ok"]
    if value == "0":  # decided on proxies before the first call
        assert "linear" in out["decided"] and out["timing"] == [] and out["progress"] == []
    elif value == "1":  # one call: the first candidate's warm-up, nothing decided yet
        assert out == {"ok": True, "decided": [], "timing": ["linear"], "progress": [[0, 1, 0]]}
    else:  # one call of a 4×16×8 GEMM, far below a decision's cost: it ran F.linear, nothing timed yet
        assert out == {"ok": True, "decided": [], "timing": [], "progress": [[-1, 1, 0]]}


@needs_onednn
@torch.no_grad()
def test_deterministic_algorithms_time_on_proxies_so_repeated_calls_are_bit_equal(monkeypatch):
    """Under `torch.use_deterministic_algorithms(True)` no class is timed on its real calls (two of them could run two
    kernels): every call of a class runs its choice, so the same input gives the same bits."""
    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)
    calibration.reset()
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    torch.use_deterministic_algorithms(True)
    try:
        outputs = [layer(x) for _ in range(8)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert not calibration._trials and not fast._trial_packs
    assert ("linear", "torch.float32", 48, 40, 16) in {tuple(d["class"]) for d in calibration.decisions()}
    # from the third call on: a packed choice runs unpacked on call 1 and makes its pack on call 2
    assert all(torch.equal(out, outputs[2]) for out in outputs[2:])
