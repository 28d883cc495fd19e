"""Calibrating ahead: `calibration_roformer_rope.warm_up` decides what a forward's calls time without the wait of
`rent`, and `roformer-rope calibrate` stores those choices where a user's later process (the folder's code,
`trust_remote_code=True`) reads every one of them from its first call."""

import json
import os
import subprocess
import sys

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import builtin_model, padded_batch, randomise_, tiny_config
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_roformer_rope as fast
from roformer_rope import cli
from roformer_rope.conversion.from_transformers import convert_model
from roformer_rope.scripts import calibrate

needs_onednn = pytest.mark.skipif(fast._LINEAR_POINTWISE is None, reason="this torch build has no oneDNN linear op")


def _waiting(progress: dict) -> set:
    return {key for key, (round_, _, _) in progress.items() if round_ == -1}


@needs_onednn
@torch.no_grad()
def test_warm_up_decides_what_a_forward_times_without_waiting_and_outputs_stay_the_builtins(monkeypatch):
    calibration.reset()
    builtin = builtin_model("RoFormerForMaskedLM")
    ours = convert_model(builtin).eval()
    inputs = padded_batch(batch=1, seq_len=8)
    expected = builtin(**inputs).logits
    for _ in range(3):  # the suite's wait is infinite (conftest): the classes run F.linear and wait
        torch.testing.assert_close(ours(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
    waiting = _waiting(calibration.timing_on_calls())
    assert {key[0] for key in waiting} == {"linear"} and {key[-1] for key in waiting} == {16}, waiting

    calls = []
    runs = calibration.warm_up(lambda: calls.append(ours(**inputs).logits))
    assert runs == len(calls) and 2 <= runs < 64
    assert calibration.timing_on_calls() == {}
    decided = {tuple(d["class"]) for d in calibration.decisions()}
    for key in waiting:  # each waiting class: its GEMM, then its packs, decided
        assert key in decided and ("linear_packed", *key[1:]) in decided
    assert any(key[0] == "linear_gelu" for key in decided)
    for logits in calls:  # every call of the rounds, each on one candidate, and the choices after them
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(**inputs).logits, expected, atol=1e-5, rtol=1e-5)

    # 160 rows: other classes, which wait again after `warm_up`. The decisions above set this process's start
    # budget to their cost (ms), which two calls on a loaded CPU can exceed; an infinite one leaves only a wait
    # paid for good by `warm_up` (its leak to other classes, which this checks) to start their rounds.
    monkeypatch.setattr(calibration, "start_budget", lambda: float("inf"))
    other = padded_batch(batch=4, seq_len=40)
    ours(**other), ours(**other)
    progress = calibration.timing_on_calls()
    assert progress and set(progress) == _waiting(progress), progress
    calibration.reset()


def test_run_until_still_stops_once_nothing_moves(monkeypatch):
    states = iter([{}, {"a": (0, 0, 0)}, {"a": (0, 1, 0)}, {"a": (0, 1, 0)}, {"a": (9, 9, 9)}])
    monkeypatch.setattr(calibration, "timing_on_calls", lambda: next(states))
    calls = []
    assert calibration.run_until_still(lambda: calls.append(1), limit=10) == 3 == len(calls)
    monkeypatch.setattr(calibration, "timing_on_calls", lambda: {"a": (0, len(calls), 0)})  # always moving
    calls.clear()
    assert calibration.run_until_still(lambda: calls.append(1), limit=5) == 5
    monkeypatch.setattr(calibration, "timing_on_calls", dict)  # nothing open: one run
    assert calibration.run_until_still(lambda: None, limit=5) == 1
    # nothing open after a run that decided a class: once more (the decision may open the next of its class)
    decide = iter([lambda: calibration._choices.__setitem__(("linear", "test"), "torch"), lambda: None])
    assert calibration.run_until_still(lambda: next(decide)(), limit=5) == 2
    calibration.reset()
    with pytest.raises(ValueError, match="limit 0"):
        calibration.run_until_still(lambda: None, limit=0)


@pytest.mark.parametrize(
    "text, shapes",
    [("1x32", [(1, 32)]), ("1x32, 8X128,", [(1, 32), (8, 128)])],
)
def test_shapes_parse(text, shapes):
    assert calibrate.parse_shapes(text) == shapes


def test_the_auto_class_follows_the_first_architecture():
    config = {"architectures": ["RoFormerRopeForSequenceClassification"],
              "auto_map": {"AutoConfig": "configuration_roformer_rope.RoFormerRopeConfig",
                           "AutoModel": "modeling_roformer_rope.RoFormerRopeModel",
                           "AutoModelForSequenceClassification":
                               "modeling_roformer_rope.RoFormerRopeForSequenceClassification"}}  # fmt: skip
    assert calibrate.auto_class_name(config) == "AutoModelForSequenceClassification"
    assert calibrate.auto_class_name({"architectures": ["Other"]}) == "AutoModel"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    randomise_(rr.RoFormerRopeForMaskedLM(tiny_config()).eval()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shapes", "8"], "--shapes: '8' is not BATCHxLENGTH"),
        (["--shapes", "2x0"], "--shapes: '2x0' is not BATCHxLENGTH"),
        (["--shapes", ","], "--shapes: no shape given"),
        (["--shapes", "1x8", "--threads", "0"], "--threads: 0"),
        (["--shapes", "1x8,1x65"], "--shapes: length 65 > the model's max_position_embeddings (64)"),
        (["--shapes", "1x²"], "--shapes: '1x²' is not BATCHxLENGTH"),
        (["--shapes", "1x8", "--installed-code"], "ROFORMER_ROPE_CACHE switches stored choices off"),
        (["--shapes", "1x8", "--auto", "AutoTokenizer"], "--auto: 'AutoTokenizer' is not a transformers AutoModel class"),
    ],
)
def test_bad_input_is_one_line_naming_it(saved, capsys, args, message):
    assert cli.main(["calibrate", str(saved), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("roformer-rope calibrate: error: ") and message in err, err


def test_a_folder_that_is_not_ours_is_refused(tmp_path, capsys):
    assert cli.main(["calibrate", str(tmp_path / "absent")]) == 2
    assert "absent: not a folder" in capsys.readouterr().err
    assert cli.main(["calibrate", str(tmp_path)]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roformer"}))
    assert cli.main(["calibrate", str(tmp_path)]) == 2
    assert "model_type is 'roformer', not 'roformer_rope'" in capsys.readouterr().err
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    assert cli.main(["calibrate", str(tmp_path)]) == 2
    assert "config.json: not valid UTF-8 JSON" in capsys.readouterr().err


# A user's later process: the folder's code (trust_remote_code), the same thread count, `{auto}` running `{work}`;
# how many of its decisions were read from the store, and how many classes are still open after it.
LATER = """
import importlib, json, sys, torch, transformers
torch.set_num_threads(1)
model = transformers.{auto}.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
calibration = importlib.import_module(type(model).__module__.rpartition(".")[0] + ".calibration_roformer_rope")
ids = torch.randint(0, model.config.vocab_size, ({batch}, {length}))
with torch.no_grad():
    {work}
keys = [tuple(d["class"]) for d in calibration.decisions()]
print(json.dumps({{"module": type(model).__module__, "decisions": len(keys),
                  "stored": sum(calibration.from_store(k) for k in keys), "open": len(calibration.timing_on_calls()),
                  "rows": sorted({{k[-1] for k in keys}})}}))
"""
FORWARDS = LATER.format(auto="AutoModelForMaskedLM", batch=2, length=16,
                        work="for _ in range(4): model(input_ids=ids, attention_mask=torch.ones_like(ids))")  # fmt: skip
GENERATE = LATER.format(auto="AutoModelForCausalLM", batch=1, length=8,
                        work="model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)")  # fmt: skip


def _calibrated(folder, tmp_path, shapes: str) -> tuple[dict, str]:
    """`roformer-rope calibrate folder --shapes shapes --threads 1` in a fresh process storing in tmp_path/cache:
    (the environment later processes share with it, its output)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), ROFORMER_ROPE_CACHE=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "roformer_rope", "calibrate", str(folder), "--shapes", shapes, "--threads", "1"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return env, done.stdout


def _later(code: str, folder, env: dict, cwd) -> dict:
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env, cwd=cwd)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_onednn
def test_a_later_process_reads_every_choice_the_command_stored(saved, tmp_path):
    env, out = _calibrated(saved, tmp_path, "1x8,2x16")
    stored_in = out.strip().splitlines()[-1].removeprefix("stored in ")
    choices = json.loads(open(stored_in, encoding="utf-8").read())["choices"]
    rows = {json.loads(key)[-1] for key in choices if json.loads(key)[0] == "linear"}
    assert rows == {16, 64}, choices  # the row buckets of 1×8 and 2×16 tokens
    assert "| ('linear_gelu', 'torch.float32', 32, 37, 64) |" in out

    later = _later(FORWARDS, saved, env, tmp_path)
    assert later["module"].startswith("transformers_modules."), later  # the folder's code, as the command ran
    assert later["open"] == 0 and later["decisions"] == later["stored"] > 0, later
    # the control: without the command's file, the classes are still timed
    elsewhere = _later(FORWARDS, saved, {**env, "ROFORMER_ROPE_CACHE": str(tmp_path / "empty")}, tmp_path)
    assert elsewhere["open"] > 0 and elsewhere["stored"] == 0, elsewhere


@needs_onednn
def test_a_prompt_and_1x1_cover_greedy_generation(tmp_path):
    """README: for generation add 1x1 (the decode steps' one-row GEMMs): every decision a later process's greedy
    generation makes, prompt and decode steps, is then read from the store."""
    folder = tmp_path / "causal"
    torch.manual_seed(0)
    randomise_(rr.RoFormerRopeForCausalLM(tiny_config(is_decoder=True)).eval()).save_pretrained(folder)
    env, _ = _calibrated(folder, tmp_path, "1x1,1x8")
    later = _later(GENERATE, folder, env, tmp_path)
    assert later["rows"] == [1, 16] and later["open"] == 0 and later["decisions"] == later["stored"], later
