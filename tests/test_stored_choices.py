"""The calibration's choices kept on disk (`stored_choices_roformer_rope.py`): a later process on the same machine
looks them up instead of timing them, and nothing stored can make a choice that is not a current candidate."""

import json

import pytest
import torch

from conftest import probe_json
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import stored_choices_roformer_rope as stored

KEY = ("linear", "torch.float32", 48, 64, 16)


@pytest.fixture
def store(monkeypatch, tmp_path):
    """The store on, in a tmp folder, with nothing decided or read in this process yet."""
    monkeypatch.setenv("ROFORMER_ROPE_CACHE", str(tmp_path / "store"))
    calibration.reset()
    stored.forget_loaded()
    yield tmp_path / "store"
    calibration.reset()
    stored.forget_loaded()


def counted(costs: dict[str, int], calls: dict[str, int]):
    """Candidates that count their calls in `calls`; `costs`: how many 64×64 matmuls each runs per call."""
    x = torch.randn(64, 64)

    def candidate(name):
        def run():
            calls[name] += 1
            for _ in range(costs[name]):
                x @ x

        return run

    return {name: candidate(name) for name in costs}


def test_a_choice_is_timed_once_then_read_back(store):
    calls = {"fast": 0, "slow": 0}
    choice = calibration.choose(KEY, counted({"fast": 1, "slow": 40}, calls))
    assert choice == "fast" and calls["fast"] >= 3 and not calibration.from_store(KEY)
    files = list(store.glob("dispatch-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["signature"] == stored.signature()
    assert data["choices"][json.dumps(list(KEY))]["choice"] == "fast"

    calibration.reset()  # as a new process: nothing decided in memory
    stored.forget_loaded()
    calls = {"fast": 0, "slow": 0}
    assert calibration.choose(KEY, counted({"fast": 40, "slow": 1}, calls)) == "fast"  # read, not timed again
    assert calls == {"fast": 0, "slow": 0} and calibration.from_store(KEY)
    made = [d for d in calibration.decisions() if tuple(d["class"]) == KEY]
    assert made[0]["choice"] == "fast" and set(made[0]["ms"]) == {"fast", "slow"}
    assert made[0]["ms"]["fast"] < made[0]["ms"]["slow"]  # the times measured by the process that stored it


def test_a_stored_choice_that_is_no_longer_a_candidate_is_timed_again(store):
    calibration.choose(KEY, counted({"gone": 1, "slow": 40}, {"gone": 0, "slow": 0}))
    calibration.reset()
    stored.forget_loaded()
    calls = {"new": 0, "slow": 0}
    assert calibration.choose(KEY, counted({"new": 1, "slow": 40}, calls)) == "new"
    assert calls["new"] >= 3 and not calibration.from_store(KEY)
    stored.forget_loaded()
    assert stored.stored(KEY)[0] == "new"  # and the file now says so


def test_another_thread_count_or_source_is_another_machine(store, monkeypatch):
    calibration.choose(KEY, counted({"fast": 1, "slow": 40}, {"fast": 0, "slow": 0}))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert stored.stored(KEY) is None
    finally:
        torch.set_num_threads(threads)
    assert stored.stored(KEY)[0] == "fast"
    machine = stored.signature()
    monkeypatch.setattr(stored, "_machine", [{**machine, "source": "edited"}])
    assert stored.stored(KEY) is None  # a changed payload times its candidates again
    monkeypatch.setattr(stored, "_machine", [{**machine, "isa_limits": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}])
    assert stored.stored(KEY) is None


def test_the_signature_names_this_cpu_and_build():
    sig = stored.signature()
    assert sig["torch"] == torch.__version__ and sig["threads"] == torch.get_num_threads()
    assert len(sig["source"]) == 16 and sig["cpu"]
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    if names:
        assert sig["cpu"]["model name"] == names[0]


def test_an_unreadable_file_is_ignored_and_replaced(store):
    calibration.choose(KEY, counted({"fast": 1, "slow": 40}, {"fast": 0, "slow": 0}))
    (path,) = store.glob("dispatch-*.json")
    path.write_text("{not json")
    calibration.reset()
    stored.forget_loaded()
    calls = {"fast": 0, "slow": 0}
    assert calibration.choose(KEY, counted({"fast": 1, "slow": 40}, calls)) == "fast" and calls["fast"] >= 3
    assert json.loads(path.read_text())["choices"][json.dumps(list(KEY))]["choice"] == "fast"
    assert not list(store.glob(".dispatch-*"))  # no temporary file left behind


def test_an_unwritable_folder_costs_nothing_but_the_store(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ROFORMER_ROPE_CACHE", str(blocker / "store"))  # under a file: cannot be made
    calibration.reset()
    stored.forget_loaded()
    try:
        assert calibration.choose(KEY, counted({"fast": 1, "slow": 40}, {"fast": 0, "slow": 0})) == "fast"
        assert stored.stored(KEY) is None
    finally:
        calibration.reset()


@pytest.mark.parametrize("value", ["0", "off"])
def test_switched_off_nothing_is_written(monkeypatch, tmp_path, value):
    monkeypatch.setenv("ROFORMER_ROPE_CACHE", value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    calibration.reset()
    try:
        calibration.choose(KEY, counted({"fast": 1, "slow": 40}, {"fast": 0, "slow": 0}))
    finally:
        calibration.reset()
    assert stored.folder() is None and list(tmp_path.rglob("*")) == []


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("ROFORMER_ROPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert stored.folder() == tmp_path / "roformer_rope"


def test_forced_decisions_are_not_stored(store):
    calibration.force("linear", "torch")
    try:
        assert calibration.choose(KEY, counted({"onednn": 1, "torch": 1}, {"onednn": 0, "torch": 0})) == "torch"
    finally:
        calibration.force("linear", None)
    assert not store.exists() or not list(store.glob("dispatch-*.json"))


PROBE = """
import json, torch
from modeling_roformer_rope import RoFormerRopeConfig, RoFormerRopeModel
from modeling_roformer_rope import calibration_roformer_rope as c
torch.manual_seed(0)
config = RoFormerRopeConfig(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=64)
model = RoFormerRopeModel(config).eval()
timed = []  # every decision timed, on proxies or on its real calls (`_Rounds`)
Rounds = c._Rounds
c._Rounds = lambda names, *size: timed.append(sorted(names)) or Rounds(names, *size)
with torch.no_grad():
    for _ in range(40):  # until the classes timed on their real calls are decided (2 calls per forward)
        out = model(input_ids=torch.arange(1, 41).view(2, 20)).last_hidden_state
assert not c._trials
made = c.decisions()
print(json.dumps({"timed": len(timed), "made": len(made), "stored": sum(c.from_store(tuple(d["class"])) for d in made),
                  "choices": {json.dumps(d["class"]): d["choice"] for d in made}, "out": out.flatten()[:64].tolist()}))
"""


def test_a_second_process_reads_every_choice_and_computes_the_same_bits(tmp_path):
    """The first process times every class its forward meets and stores it; a second one times none, makes the same
    choices, and so computes bit-identical outputs (measured choices alone need not: two kernels for one GEMM
    differ in the last bits)."""
    # the rounds on real calls start at a class's first call (not once it has cost a decision): all end in 40 forwards
    first = probe_json(PROBE, ROFORMER_ROPE_CACHE=str(tmp_path), ROFORMER_ROPE_CALIBRATE_ON_CALLS="1")
    second = probe_json(PROBE, ROFORMER_ROPE_CACHE=str(tmp_path), ROFORMER_ROPE_CALIBRATE_ON_CALLS="1")
    assert first["timed"] >= 3 and first["stored"] == 0 and first["made"] >= first["timed"]
    # (the second may need fewer classes: a GELU class stored as fused never asks for its separate GEMM's classes)
    assert second["timed"] == 0 and second["stored"] == second["made"] >= 3
    assert second["choices"] == {key: first["choices"][key] for key in second["choices"]}
    assert second["out"] == first["out"]


def test_entries_of_the_wrong_shape_are_skipped(store):
    """A hand-edited or truncated entry (no choice, times not a mapping) is not used; the class is timed again."""
    calibration.choose(KEY, counted({"fast": 1, "slow": 40}, {"fast": 0, "slow": 0}))
    (path,) = store.glob("dispatch-*.json")
    data = json.loads(path.read_text())
    other = ("linear", "torch.float32", 48, 64, 64)
    data["choices"][json.dumps(list(KEY))] = {"ms": {"fast": 1.0}}  # no choice
    data["choices"][json.dumps(list(other))] = {"choice": "fast", "ms": "garbled"}
    path.write_text(json.dumps(data))
    stored.forget_loaded()
    assert stored.stored(KEY) is None
    assert stored.stored(other) == ("fast", {})
