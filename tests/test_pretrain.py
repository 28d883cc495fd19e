"""`roformer-rope pretrain` end to end on a tiny model: stages, export, kill-and-resume, bad input, atomic saves.

Runs go through the real command in subprocesses (DeepSpeed ZeRO on CPU, gloo). Commands refused before training
starts run `main` in this process (`refused_here`): a fresh interpreter per refusal spent ~8 s importing. The ZeRO
1/2/3 × 1/2-process matrix is in the slow suite.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import builtin_model

TINY = textwrap.dedent(
    """
    model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64}
    data: {held_out_lines: 60, vocab_words: 300, eval_sequences: 8, num_proc: 1}
    train: {seed: 0, micro_batch: 4, checkpoint_every: 4, keep_checkpoints: 2, log_every: 1, eval_batch: 8}
    stages:
      - {name: short, max_length: 32, global_batch: 8, steps: 10, lr: 2.0e-3, warmup_steps: 2}
      - {name: long, max_length: 64, global_batch: 4, steps: 6, lr: 1.0e-3, warmup_steps: 1}
    """
)
LINES = ["--corpus-lines", "700"]


def pretrain(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "roformer_rope.scripts.pretrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", **(env or {})},
    )


@pytest.fixture
def refused_here(capsys, monkeypatch):
    """`pretrain(*args)` for a command refused before DeepSpeed starts, run as `main(args)` in this process: the same
    exit code and stderr, without the ~8 s a fresh interpreter spends importing torch, transformers and DeepSpeed.
    A refusal that came only after the engine started would leave torch.distributed initialised here for the tests
    that follow: that fails, so move such a command to `pretrain`."""
    from roformer_rope.scripts.pretrain import main

    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))  # main sets it: restored after

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()  # drop what came before
        code = main(list(args))
        out, err = capsys.readouterr()
        assert not torch.distributed.is_initialized(), "this command started DeepSpeed: run it with pretrain()"
        return subprocess.CompletedProcess(["roformer-rope pretrain", *args], code, out, err)

    return run


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return {r["global_step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, config) -> Path:
    run = tmp_path_factory.mktemp("runs") / "full"
    result = pretrain("--config", str(config), "--out", str(run), *LINES)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_stages_run_and_write_the_stage_table(finished):
    table = json.loads((finished / "stage_table.json").read_text())
    assert [row["max_length"] for row in table] == [32, 64] and [row["steps"] for row in table] == [10, 6]
    assert all(0 < row["mlm_loss"] < 10 and 0 <= row["mlm_accuracy"] <= 1 for row in table)
    assert "| short | 32 | 8 | 10 |" in (finished / "stage_table.md").read_text()
    steps = losses(finished)
    assert sorted(steps) == list(range(1, 17))
    assert steps[16] < steps[1]  # it learns something on real text
    assert (finished / "checkpoints" / "latest").read_text().strip() == "stage3-step0"
    kept = sorted(p.name for p in (finished / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["stage2-step2", "stage3-step0"]  # every 4 global steps, keep_checkpoints: 2, no .partial


CHILD = textwrap.dedent(
    """
    import json, sys, torch, transformers
    folder, probe_file = sys.argv[1], sys.argv[2]
    model = transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    probe = torch.load(probe_file, weights_only=True)
    with torch.no_grad():
        logits = model(**probe["batch"]).logits
    keep = probe["batch"]["attention_mask"].bool()
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    print(json.dumps({"class": type(model).__name__, "diff": (logits[keep] - probe["logits"][keep]).abs().max().item(),
                      "tied": tied, "mask": tok.mask_token, "sparse": model.config.sparse_prediction}))
    """
)


def test_export_loads_with_trust_remote_code_in_a_fresh_process(finished, tmp_path):
    """The exported folder reproduces the live model's logits (stored at the last checkpoint)."""
    model = finished / "model"
    for name in ("config.json", "model.safetensors", "vocab.txt", "modeling_roformer_rope.py", "README.md"):
        assert (model / name).is_file(), name
    assert "| long | 64 | 4 | 6 |" in (model / "README.md").read_text()
    probe = finished / "checkpoints" / "stage3-step0" / "probe.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", CHILD, str(model), str(probe)], capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["class"] == "RoFormerRopeForMaskedLM" and out["tied"] and out["mask"] == "[MASK]"
    assert out["diff"] < 1e-4 and out["sparse"] is False


def test_export_on_demand_refuses_to_overwrite(finished, tmp_path, refused_here):
    out = tmp_path / "exported"
    assert pretrain("--export", str(finished), "--out", str(out)).returncode == 0
    assert (out / "model.safetensors").is_file()
    again = refused_here("--export", str(finished / "checkpoints"), "--out", str(out))
    assert again.returncode == 2 and "already exists (pass --overwrite" in again.stderr
    # --overwrite never replaces training output: another checkpoint (a resume's state), a run folder
    live = finished / "checkpoints" / "stage2-step2"
    before = sorted(p.name for p in live.iterdir())
    onto = refused_here("--export", str(finished / "checkpoints" / "stage3-step0"), "--out", str(live), "--overwrite")
    assert onto.returncode == 2 and "is a pretraining checkpoint: an export never replaces training output" in onto.stderr
    assert sorted(p.name for p in live.iterdir()) == before
    (tmp_path / "other-run" / "checkpoints").mkdir(parents=True)
    onto = refused_here("--export", str(finished), "--out", str(tmp_path / "other-run"), "--overwrite")
    assert onto.returncode == 2 and "is a pretraining run folder" in onto.stderr
    early = tmp_path / "early-run"  # stopped before its first checkpoint: its marker and data/ only
    (early / "data").mkdir(parents=True)
    (early / ".roformer_rope_run").write_text("a run\n")
    onto = refused_here("--export", str(finished), "--out", str(early), "--overwrite")
    assert onto.returncode == 2 and "is a pretraining run folder" in onto.stderr and (early / "data").is_dir()
    onto = refused_here("--export", str(finished), "--out", str(tmp_path), "--overwrite")  # runs inside it
    assert onto.returncode == 2 and "is a folder holding pretraining output" in onto.stderr


def test_kill_mid_stage_and_resume_joins_the_loss_curve_exactly(finished, config, tmp_path):
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "roformer_rope.scripts.pretrain", "--config", str(config), "--out", str(run), *LINES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    log = run / "train_log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:  # kill mid-stage, after the step-4 checkpoint
        if log.is_file() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (run / "checkpoints" / "latest").read_text().strip() in ("stage1-step4", "stage1-step8")
    assert not (run / "stage_table.json").exists()  # killed mid-stage 1
    # `--resume` alone: the run's own stages, --corpus-lines and DeepSpeed file come from its checkpoint.
    resumed = pretrain("--out", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--resume: the run's own --config {config}, --deepspeed zero2, --corpus-lines 700" in resumed.stderr
    want, got = losses(finished), losses(run)
    for step in range(1, 17):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    # The steps logged between the checkpoint and the kill were dropped from the log before training them again.
    logged = [json.loads(line)["global_step"] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 17))
    table, full = (json.loads((folder / "stage_table.json").read_text()) for folder in (run, finished))
    assert table[-1]["mlm_loss"] == pytest.approx(full[-1]["mlm_loss"], abs=1e-5)
    # The resumed stage's row counts its tokens from the stage start (restored from the checkpoint).
    assert [row["tokens"] for row in table] == [row["tokens"] for row in full]


@pytest.mark.parametrize(
    "make, args, message",
    [
        (None, ["--corpus", "/nonexistent/texts"], "no such file or directory"),
        ("empty", [], "corpus is empty"),
        ("bad_yaml", [], "not valid YAML"),
        ("too_long", [], "max_length 4096 is longer than the model allows"),
        ("uneven", [], "not divisible by the micro batch"),
        ("resume_nothing", ["--resume"], "holds no checkpoints/ folder"),
        ("lamb", [], "ds.json: DeepSpeed could not start the engine: "),  # DeepSpeed's Lamb needs a GPU kernel
        ("held_out_tokenless", [], "the held-out lines (the corpus's last lines) hold no token"),
        ("vocab_uncovered", [], "every training token is a special token ([UNK] and the like): nothing to predict"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, config, make, args, message, refused_here):
    cfg = config
    if make == "bad_yaml":
        cfg = tmp_path / "bad.yaml"
        cfg.write_text("stages: [{max_length: 32\n")
    elif make == "too_long":
        cfg = tmp_path / "long.yaml"
        limited = TINY.replace("intermediate_size: 64}", "intermediate_size: 64, max_position_embeddings: 512}")
        cfg.write_text(limited.replace("max_length: 64", "max_length: 4096"))
    elif make == "uneven":
        cfg = tmp_path / "uneven.yaml"
        cfg.write_text(TINY.replace("micro_batch: 4", "micro_batch: 3"))
    elif make == "lamb":
        (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}}))
        args = ["--deepspeed", str(tmp_path / "ds.json")]
    if make == "empty":
        corpus = tmp_path / "empty.txt"
        corpus.write_text("\n\n   \n")
        args = ["--corpus", str(corpus)]
    elif make == "held_out_tokenless":  # lines not blank to str.strip that tokenize to nothing
        corpus = tmp_path / "tail.txt"
        corpus.write_text("今天天气非常好，我们去公园散步吧。\n" * 300 + "\u200b\n" * 100, encoding="utf-8")
        args = ["--corpus", str(corpus)]
    elif make == "vocab_uncovered":  # a Latin vocabulary for Chinese text: every piece is [UNK], the loss NaN
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghij"]) + "\n", encoding="utf-8")
        args = ["--vocab", str(vocab)]
    # the real command for one case, and for Lamb, which DeepSpeed refuses only while starting its engine
    command = pretrain if make in (None, "lamb") else refused_here
    result = command("--config", str(cfg), "--out", str(tmp_path / "run"), *LINES, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("roformer-rope pretrain: error:") and message in last, last
    assert not (tmp_path / "run" / "checkpoints").exists()


def _blocked(module: str) -> list[str]:
    """A `pretrain` command line run with `module` not importable (as if it were not installed)."""
    code = f"import sys; sys.modules[{module!r}] = None; import roformer_rope.scripts.pretrain as p; sys.exit(p.main())"
    return ["-c", code]


# fmt: off
@pytest.mark.parametrize(
    "change, args, message",
    [
        (("max_length: 64", "max_length: 128"), [], "long: max_length 128 is longer than the model allows (max_position_embeddings = 64)"),
        (("embeddings: 64}", "embeddings: 64, hidden_sizes: 48}"), [], "model: unknown field(s) ['hidden_sizes']"),
        (("num_attention_heads: 4", "num_attention_heads: 3"), [], "hidden_size (32) must be a multiple of num_attention_heads (3)"),
        (("vocab_words: 300", "vocab_words: -5"), [], "data.vocab_words must be >= 1, got -5"),
        (("micro_batch: 4", "micro_batch: 0"), [], "train.micro_batch must be >= 1, got 0"),
        (None, ["--deepspeed", "batch7"], 'sets train_batch_size=7, but the stages need 8: use "auto"'),
        (None, ["--deepspeed", "stage5"], "DeepSpeed refuses it: zero_optimization.stage: Input should be 0, 1, 2, 3"),
        (None, ["--deepspeed", "typo"], "DeepSpeed refuses it: zero_optimization.overlap_comms: Extra inputs are not permitted"),
        (None, ["--deepspeed", "scheduler"], "ds.json: scheduler: the stages set the learning rate"),
        (None, ["--deepspeed", "fixed"], "stage long: DeepSpeed config sets train_batch_size=8, but the stages need 4"),
        (None, ["--deepspeed", "stage0"], "ZeRO stage 0: the run saves and exports ZeRO checkpoints; use"),
        (None, ["--deepspeed", "bf16_off", "--precision", "bf16"], "bf16.enabled is false, but --precision is bf16"),
        (None, ["--deepspeed", "trainer_lr"], "optimizer.params.lr=5e-05, but the stage's lr is"),
        (("embeddings: 64}", "embeddings: 64, tie_word_embeddings: false}"), [], "model.tie_word_embeddings must stay true"),
        (("model: {", "architecture: bert\nmodel: {"), ["--attention-type", "linear"], "architecture 'bert' has only its own softmax"),
        (None, ["--precision", "fp16"], "fp16 needs a GPU"),
        (None, ["--vocab", "nosuch-vocab.txt"], "--vocab nosuch-vocab.txt: no such file"),
        (None, ["--tensorboard", "BLOCK"], "--tensorboard needs the tensorboard package"),
    ],
)
# fmt: on
def test_checks_that_need_no_data_fail_before_anything_is_written(tmp_path, monkeypatch, refused_here, change, args, message):
    """Bad input that needs no data ends before --out exists, so the corrected command can simply be rerun."""
    text = TINY.replace("intermediate_size: 64}", "intermediate_size: 64, max_position_embeddings: 64}")
    if change:
        assert change[0] in text
        text = text.replace(*change)
    cfg = tmp_path / "stages.yaml"
    cfg.write_text(text)
    if "--deepspeed" in args:
        zero = {"stage": 2}
        ds = {"batch7": {"train_batch_size": 7, "zero_optimization": zero}, "stage5": {"zero_optimization": {"stage": 5}},
              "typo": {"zero_optimization": {**zero, "overlap_comms": True}},
              "scheduler": {"zero_optimization": zero, "scheduler": {"type": "WarmupLR", "params": {}}},
              "fixed": {"zero_optimization": zero, "train_batch_size": 8}, "stage0": {"zero_optimization": {"stage": 0}},
              "bf16_off": {"zero_optimization": zero, "bf16": {"enabled": False}},
              "trainer_lr": {"zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}}}}[args[1]]  # fmt: skip
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        args = ["--deepspeed", str(tmp_path / "ds.json"), *args[2:]]
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # relative paths (--vocab) are read from here
    if "BLOCK" in args:  # the real command, in an interpreter where tensorboard cannot be imported
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        result = subprocess.run(
            [sys.executable, *_blocked("tensorboard"), "--config", str(cfg), "--out", str(run), *LINES, "--tensorboard"],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
    else:
        result = refused_here("--config", str(cfg), "--out", str(run), *LINES, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("roformer-rope pretrain: error:") and message in last, last
    assert not run.exists()


def test_an_empty_corpus_file_is_named(tmp_path, config, refused_here):
    corpus = tmp_path / "empty.txt"
    corpus.write_bytes(b"")
    result = refused_here("--config", str(config), "--out", str(tmp_path / "run"), "--corpus", str(corpus))
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"roformer-rope pretrain: error: --corpus: the corpus {corpus} is empty (0 bytes)", last


def test_a_refused_resume_leaves_the_run_untouched(finished, config, tmp_path, refused_here):
    """Resuming with another corpus is refused before the run's token streams are replaced."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    result = refused_here("--config", str(config), "--out", str(run), "--resume", "--corpus-lines", "650")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "--resume: checkpoint stage3-step0 was made from other data" in last, last
    after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert sorted(after) == sorted(before) and all(after[p] == before[p] for p in before)


def test_resume_alone_keeps_the_run_options_and_names_config_when_it_cannot(finished, config, tmp_path, refused_here):
    """`--resume` alone takes the options the run started with; a given option still wins (and is checked). A
    checkpoint from before the options were saved falls back to the defaults, and the refusal names --config."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    result = refused_here("--out", str(run), "--resume", "--corpus-lines", "650")  # its --config, another corpus
    assert result.returncode == 2 and "was made from other data" in result.stderr, result.stderr[-2000:]
    state_file = run / "checkpoints" / "stage3-step0" / "run_state.json"
    state = json.loads(state_file.read_text())
    assert state["options"]["config"] == str(config) and state["options"]["corpus_lines"] == 700
    assert state["options"]["config_data"]["stages"][0]["steps"] == 10
    del state["options"]
    state_file.write_text(json.dumps(state))
    result = refused_here("--out", str(run), "--resume")  # quickstart's stages and held-out lines: other data
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "was made from other data" in last, last
    assert "resume with the same --config, --corpus, --corpus-lines and --text-column" in last, last


MISALIGNED = TINY.replace("micro_batch: 4, checkpoint_every: 4, keep_checkpoints: 2", "micro_batch: 2, checkpoint_every: 100, keep_checkpoints: 5").replace(
    "{name: short, max_length: 32, global_batch: 8, steps: 10", "{name: short, max_length: 32, global_batch: 6, steps: 5"
)  # stage 1: 5 steps × 3 micro-batches = 15; stage 2 accumulates 2: DeepSpeed's own count would step mid-step


def test_accumulation_steps_end_with_each_step_across_stages_and_resumes(tmp_path):
    """A stage whose accumulation steps do not divide the micro-batches before it still steps the optimizer at the
    end of each of its steps: a resume from the stage start (a fresh engine, counting from 0) gives the same run."""
    import shutil

    assert MISALIGNED.count("global_batch: 6, steps: 5") == 1 and "micro_batch: 2," in MISALIGNED
    config = tmp_path / "misaligned.yaml"
    config.write_text(MISALIGNED)
    full = tmp_path / "full"
    result = pretrain("--config", str(config), "--out", str(full), *LINES, "--no-export")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    (resumed / "checkpoints" / "latest").write_text("stage2-step0")
    result = pretrain("--config", str(config), "--out", str(resumed), "--resume", *LINES, "--no-export")
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = losses(full), losses(resumed)
    assert sorted(got) == list(range(1, 12))
    for step in range(6, 12):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step


def test_a_given_vocab_with_a_repeated_token_sizes_the_model_by_its_largest_id(finished, config, tmp_path):
    """`--vocab` whose last line repeats an earlier token: that id is `len(tokenizer)`, one past a
    `len(tokenizer)`-row embedding; the model is sized by the largest id and trains."""
    lines = (finished / "tokenizer" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "vocab.txt").write_text("\n".join([*lines, lines[10]]) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    result = pretrain(
        "--config", str(config), "--out", str(run), "--vocab", str(tmp_path / "vocab.txt"), *LINES, "--no-export"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 repeated token(s)" in result.stderr
    spec = json.loads(next((run / "checkpoints").glob("*/model_config.json")).read_text())
    assert spec["config"]["vocab_size"] == len(lines) + 1


def test_resume_refuses_another_zero_stage_or_precision(finished, config, tmp_path, refused_here):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for args, message in ((["--deepspeed", "zero3"], "was written with ZeRO stage 2, this run has 3; resume with the same --deepspeed"),
                          (["--precision", "bf16"], "was written with precision fp32, this run has bf16")):  # fmt: skip
        result = refused_here("--config", str(config), "--out", str(run), "--resume", *LINES, *args)
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]


def test_a_checkpoint_with_one_parameter_group_is_refused_with_the_way_out(config, tmp_path):
    """ZeRO-3 checkpoints written before weight decay was grouped by `ds_shape` hold one parameter group (a
    run with `param_groups` merged into one writes the same); resuming names the checkpoint and the export path."""
    old_version = (
        "import sys; from roformer_rope.scripts import pretrain, pretrain_engine as e; grouped = e.param_groups; "
        "e.param_groups = lambda m, wd: [{'params': [p for g in grouped(m, wd) for p in g['params']], "
        "'weight_decay': 0.0}]; sys.argv[0] = 'roformer-rope pretrain'; sys.exit(pretrain.main())"
    )
    run = tmp_path / "run"
    args = ["--config", str(config), "--out", str(run), *LINES, "--deepspeed", "zero3", "--no-export"]
    result = subprocess.run(
        [sys.executable, "-c", old_version, *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run / "checkpoints" / "latest").write_text("stage2-step2")
    result = pretrain(*args, "--resume")
    assert result.returncode == 2, result.stderr[-3000:]
    tag = run / "checkpoints" / "stage2-step2"
    assert f"error: --resume: checkpoint {tag}: its optimizer has another number of parameter groups" in result.stderr
    assert f"roformer-rope pretrain --export {tag} --out FOLDER" in result.stderr


def test_zero3_starts_from_the_same_weights_and_follows_the_same_curve_as_zero2(finished, config, tmp_path):
    """Same seed, same model: ZeRO-3 builds it partitioned under `zero.Init`, ZeRO-2 whole, and both draw the same
    initial weights, so the first loss is the same number and the curves stay together (fp32, one process)."""
    run = tmp_path / "zero3"
    result = pretrain("--config", str(config), "--out", str(run), *LINES, "--deepspeed", "zero3", "--no-export")
    assert result.returncode == 0, result.stderr[-3000:]
    zero2, zero3 = losses(finished), losses(run)
    assert sorted(zero3) == sorted(zero2) == list(range(1, 17))
    assert zero3[1] == pytest.approx(zero2[1], abs=1e-5)
    for step in zero2:
        assert zero3[step] == pytest.approx(zero2[step], abs=1e-4), step


def test_zero3_stand_ins_are_grouped_by_their_real_shape():
    """Under zero.Init a weight is an empty 1-D stand-in carrying `ds_shape`: it still gets weight decay."""
    from roformer_rope.scripts.pretrain_engine import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)  # what ZeRO-3 leaves on the module
    decay, no_decay = param_groups(model, 0.01)
    assert [p.ds_shape for p in decay["params"]] == [torch.Size([4, 4])] and decay["weight_decay"] == 0.01
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_a_run_stopped_before_its_first_checkpoint_starts_over(config, tmp_path, refused_here):
    """What a run interrupted (or failed on its data) before its first checkpoint left is not a run to resume:
    the same command starts it over instead of refusing a non-empty --out."""
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / ".roformer_rope_run").write_text("")  # what a run writes first
    (run / "tokenizer" / "vocab.txt").write_text("[PAD]\n")  # a stale tokenizer: rebuilt
    (run / "checkpoints" / ".partial-stage1-step4").mkdir(parents=True)
    (run / "train_log.jsonl").write_text('{"global_step": 1, "loss": 99.0}\n{"global_step": 2, "lo')
    resumed = refused_here("--config", str(config), "--out", str(run), "--resume", *LINES)
    assert resumed.returncode == 2 and "holds no complete checkpoint to resume from" in resumed.stderr
    assert "without --resume to start it over" in resumed.stderr
    result = pretrain("--config", str(config), "--out", str(run), *LINES, "--max-steps", "1", "--no-export")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(run)) == [1, 2] and 99.0 not in losses(run).values()
    assert len((run / "tokenizer" / "vocab.txt").read_text().splitlines()) > 300
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "stage2-step0", "stage3-step0"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "tokenizer").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")  # anything else: refused as before
    refused = refused_here("--config", str(config), "--out", str(tmp_path / "mine"), *LINES)
    assert refused.returncode == 2 and "exists and is not empty" in refused.stderr
    # a user's folder shaped like a run (no marker) and a run whose checkpoint finished without its
    # `latest` pointer (killed in between) are never cleared
    (tmp_path / "mine" / "notes.txt").unlink()
    (tmp_path / "mine" / "tokenizer" / "vocab.txt").write_text("[PAD]\n")
    refused = refused_here("--config", str(config), "--out", str(tmp_path / "mine"), *LINES)
    assert refused.returncode == 2 and (tmp_path / "mine" / "tokenizer" / "vocab.txt").exists()
    killed = tmp_path / "killed"
    (killed / "checkpoints" / "stage1-step4").mkdir(parents=True)
    (killed / ".roformer_rope_run").write_text("")
    (killed / "checkpoints" / "stage1-step4" / "run_state.json").write_text("{}")
    refused = refused_here("--config", str(config), "--out", str(killed), *LINES)
    assert refused.returncode == 2 and (killed / "checkpoints" / "stage1-step4" / "run_state.json").exists()
    inside = refused_here("--config", str(config), "--out", str(run), "--vocab", str(run / "tokenizer" / "vocab.txt"), *LINES)
    assert inside.returncode == 2 and "lies inside --out" in inside.stderr


def test_an_existing_run_is_never_restarted_over(finished, config, refused_here):
    result = refused_here("--config", str(config), "--out", str(finished), *LINES)
    assert result.returncode == 2 and "already holds a run; pass --resume" in result.stderr
    assert (finished / "checkpoints" / "stage3-step0").is_dir()


class _FailingEngine:
    """Writes part of a checkpoint like DeepSpeed, then fails (a full disk, a kill)."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"half")
        raise OSError(28, "No space left on device")


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    from roformer_rope.scripts.pretrain_engine import Dist, latest_tag, save_checkpoint

    root = tmp_path / "checkpoints"
    previous = root / "stage1-step4"
    previous.mkdir(parents=True)
    (previous / "run_state.json").write_text("{}")
    (root / "latest").write_text("stage1-step4\n")
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(_FailingEngine(), root, "stage1-step8", {}, {}, dist)
    assert latest_tag(root) == "stage1-step4" and (previous / "run_state.json").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "stage1-step4"]  # no partial folder left


ZERO3_BUILD = textwrap.dedent(
    """
    import json
    import deepspeed, torch
    from roformer_rope.scripts.pretrain import read_deepspeed_config
    from roformer_rope.scripts.pretrain_config import fill_deepspeed_config
    from roformer_rope.scripts.pretrain_engine import setup_distributed
    from roformer_rope.scripts.pretrain_export import build_model

    setup_distributed()
    _, template = read_deepspeed_config("zero3")
    ds = fill_deepspeed_config(template, micro_batch=1, global_batch=1, world_size=1, precision="fp32", lr=1e-3,
                               weight_decay=0.0, on_cpu=True, hidden_size=32)
    spec = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64}
    model = build_model(spec, "roformer", ds)
    params = list(model.parameters())
    plain = build_model(spec, "roformer")
    local = sum(p.numel() for p in params)  # partitioned: nothing held outside a gather on 1 rank
    with deepspeed.zero.GatheredParameters(params):
        word = model.get_input_embeddings().weight
        out = {"local": local, "total": sum(p.ds_numel for p in params),
               "plain": sum(p.numel() for p in plain.parameters()), "std": word.std().item(),
               "tied": model.get_output_embeddings().weight is word,
               "plain_partitioned": any(hasattr(p, "ds_numel") for p in plain.parameters())}
    print(json.dumps(out))
    """
)


def test_zero3_builds_the_model_partitioned_and_initialised():
    """Under ZeRO-3 the model is built inside `deepspeed.zero.Init` (no rank holds the full model), with the
    usual initialisation and the decoder still tied; models built afterwards (export, reload) are normal."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-c", ZERO3_BUILD], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["local"] == 0 and out["total"] == out["plain"] > 20_000, out
    assert 0.015 < out["std"] < 0.025 and out["tied"] and not out["plain_partitioned"], out


def test_commands_that_would_fail_late_are_refused_before_anything_runs(config, refused_here, tmp_path, monkeypatch):
    """Three commands that used to run (or train) and fail later: an --out inside a --corpus folder (its vocab.txt and
    logs read as training text on the next start); a model.init_from that is not a roformer_rope checkpoint (trained to
    the end, then could not be exported); a folder in the working directory named like a shipped config."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("今天天气很好。\n" * 20, encoding="utf-8")
    inside = refused_here("--config", str(config), "--corpus", str(corpus), "--out", str(corpus / "run"))
    assert inside.returncode == 2 and "lies inside --corpus" in inside.stderr and not (corpus / "run").exists()
    builtin = tmp_path / "builtin"
    builtin_model("RoFormerForMaskedLM").save_pretrained(builtin)
    init = tmp_path / "init.yaml"
    init.write_text(TINY.replace(TINY.splitlines()[1], f"model: {{init_from: {builtin}}}"))
    refused = refused_here("--config", str(init), "--out", str(tmp_path / "from_builtin"), *LINES)
    assert refused.returncode == 2 and not (tmp_path / "from_builtin").exists()
    assert "a 'roformer' checkpoint; pretraining continues roformer_rope checkpoints only (convert it first" in refused.stderr
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").mkdir()  # a folder named like the shipped config
    from roformer_rope.scripts.pretrain import _shipped

    assert _shipped("quickstart", (".yaml", ".yml", ".json")).is_file()


def test_a_run_killed_before_pointing_latest_at_its_checkpoint_resumes_from_it(config, refused_here, tmp_path):
    """A kill between moving a checkpoint into place and writing `latest`: without --resume the run is kept (never
    cleared), and --resume used to refuse too ("holds no complete checkpoint"); it now takes the newest complete
    checkpoint and writes the pointer. Here that checkpoint was written by 99 processes, so the resume then stops at
    the world-size check: proof it was picked, without starting DeepSpeed."""
    killed = tmp_path / "killed"
    for tag in ("stage1-step4", "stage1-step8"):
        (killed / "checkpoints" / tag).mkdir(parents=True)
        (killed / "checkpoints" / tag / "run_state.json").write_text(json.dumps({"world_size": 99}))
        time.sleep(0.01)  # the newer one by modification time
    (killed / ".roformer_rope_run").write_text("")
    resumed = refused_here("--config", str(config), "--out", str(killed), "--resume", *LINES)
    assert resumed.returncode == 2 and "checkpoint stage1-step8 was written by 99 process(es)" in resumed.stderr
    assert (killed / "checkpoints" / "latest").read_text().strip() == "stage1-step8"


def test_a_resume_on_other_lines_with_as_many_tokens_is_refused(finished):
    """The checkpoint records its token streams' content digests: a corpus with lines changed or reordered but as many
    tokens (which the token counts alone let through) is refused before `data/` is replaced."""
    from types import SimpleNamespace

    from roformer_rope.scripts.mlm_data import TokenStream
    from roformer_rope.scripts.pretrain import Run

    latest = (finished / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((finished / "checkpoints" / latest / "run_state.json").read_text())
    streams = {split: TokenStream.load(finished / "data" / split) for split in ("train", "held_out")}
    assert saved["data_digest"] == {split: stream.digest() for split, stream in streams.items()}
    counts = saved["data_tokens"]["train"], saved["data_tokens"]["held_out"]
    run = SimpleNamespace(saved=saved, resume_tag=latest)
    Run.check_resumed_data(run, *counts, dict(saved["data_digest"]))  # the same data: accepted
    swapped = TokenStream(*(np.array(getattr(streams["train"], name)) for name in ("tokens", "words", "line_starts")))
    swapped.tokens[[0, 1]] = swapped.tokens[[1, 0]]  # two tokens trade places: as many tokens, other content
    with pytest.raises(ValueError, match=r"made from other data \(as many tokens, .* but other ones"):
        Run.check_resumed_data(run, *counts, {"train": swapped.digest(), "held_out": saved["data_digest"]["held_out"]})


def test_a_resume_with_another_word_cut_warns_that_its_masks_differ(finished, caplog):
    """The checkpoint records its streams' word-cut digests: the same tokens cut into other jieba words (another
    dictionary, a new word-cut version) resume, since the data is the same, but with a warning that whole-word masks
    now differ from an uninterrupted run's. The same cut resumes silently; a checkpoint without the digest too."""
    import logging
    from types import SimpleNamespace

    from roformer_rope.scripts.mlm_data import TokenStream
    from roformer_rope.scripts.pretrain import Run

    latest = (finished / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((finished / "checkpoints" / latest / "run_state.json").read_text())
    streams = {split: TokenStream.load(finished / "data" / split) for split in ("train", "held_out")}
    assert saved["word_digest"] == {split: stream.words_digest() for split, stream in streams.items()}
    counts = saved["data_tokens"]["train"], saved["data_tokens"]["held_out"]
    recut = TokenStream(*(np.array(getattr(streams["train"], name)) for name in ("tokens", "words", "line_starts")))
    recut.words[1:] = recut.words[:-1].copy()  # the first two tokens one word: same tokens, another cut
    recut.words[0] = recut.words[1]
    assert recut.digest() == streams["train"].digest() and recut.words_digest() != streams["train"].words_digest()
    renumbered = TokenStream(streams["train"].tokens, np.array(streams["train"].words) * 3 + 7, streams["train"].line_starts)
    assert renumbered.words_digest() == streams["train"].words_digest()  # the same grouping: the same masks
    assert recut.words_digest(block=8) == recut.words_digest()  # read in blocks of a memory map: the same digest
    run = SimpleNamespace(saved=saved, resume_tag=latest)
    with caplog.at_level(logging.WARNING, logger="roformer_rope.pretrain"):
        Run.check_resumed_data(run, *counts, dict(saved["data_digest"]), dict(saved["word_digest"]))
        assert not caplog.records  # the same cut: silent
        other = {"train": recut.words_digest(), "held_out": saved["word_digest"]["held_out"]}
        Run.check_resumed_data(SimpleNamespace(saved={**saved, "word_digest": None}, resume_tag=latest), *counts,
                               dict(saved["data_digest"]), other)  # fmt: skip
        assert not caplog.records  # a checkpoint from before the word digest: nothing to compare
        Run.check_resumed_data(run, *counts, dict(saved["data_digest"]), other)
        assert len(caplog.records) == 1 and "another jieba word cut" in caplog.text and latest in caplog.text
        caplog.clear()
        other_data = {"train": "0" * 16, "held_out": saved["data_digest"]["held_out"]}
        with pytest.raises(ValueError, match="made from other data"):  # other data: refused, no word-cut warning first
            Run.check_resumed_data(run, *counts, other_data, other)
        with pytest.raises(ValueError, match="made from other data"):
            Run.check_resumed_data(run, counts[0] + 1, counts[1], dict(saved["data_digest"]), other)
        assert not caplog.records


def test_init_from_a_bf16_folder_trains_in_the_run_precision(finished, tmp_path):
    """model.init_from a folder saved in bf16, default precision: the run trains (and exports) float32 under ZeRO-2
    as under ZeRO-3 (transformers' from_pretrained keeps a folder's dtype: ZeRO-1/2 trained it in bf16 while the
    run reported fp32)."""
    import torch
    import transformers
    from safetensors import safe_open

    source = tmp_path / "bf16"
    transformers.AutoModelForMaskedLM.from_pretrained(finished / "model", trust_remote_code=True).to(torch.bfloat16).save_pretrained(source)
    transformers.AutoTokenizer.from_pretrained(finished / "model", trust_remote_code=True).save_pretrained(source)
    cfg = tmp_path / "init.yaml"
    cfg.write_text(
        f"model: {{init_from: {source}}}\ndata: {{held_out_lines: 60, eval_sequences: 8, num_proc: 1}}\n"
        "train: {micro_batch: 2, checkpoint_every: 100}\nstages:\n  - {max_length: 32, global_batch: 4, steps: 2, lr: 1.0e-3}\n"
    )
    result = pretrain("--config", str(cfg), "--out", str(tmp_path / "run"), "--deepspeed", "zero2", *LINES)
    assert result.returncode == 0, result.stderr[-3000:]
    with safe_open(str(tmp_path / "run" / "model" / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"F32"} and "export check: logits within 0 of the live model's (float32)" in result.stderr


def test_a_run_on_the_default_corpus_trains_before_the_fine_tuning_dev_text(config, tmp_path):
    """Without --corpus the run trains on People's Daily up to `fine_tuning_text_start()` and holds out the last
    lines: no line of the ner / long dev or test text is trained on."""
    from roformer_rope.scripts.mlm_data import TokenStream, fine_tuning_text_start

    run = tmp_path / "run"
    result = pretrain("--config", str(config), "--out", str(run), "--max-steps", "1", "--no-export")
    assert result.returncode == 0, result.stderr[-3000:]
    start = fine_tuning_text_start()
    assert f"corpus: {start} training lines, 60 held out" in result.stderr
    assert TokenStream.load(run / "data" / "train").num_lines == start


class _RecordingWriter:
    """Stands in for tensorboard's SummaryWriter: records how it was opened and closed."""

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step, self.closed = log_dir, purge_step, False

    def close(self) -> None:
        self.closed = True


def test_a_resume_reopens_tensorboard_purging_the_steps_past_the_checkpoint():
    """A killed run logged steps past its checkpoint; they are trained again after --resume, so TensorBoard must hide
    the first ones (a writer reopened with purge_step = the first step trained again), as train_log.jsonl drops them."""
    from roformer_rope.scripts.pretrain import Run

    run = Run.__new__(Run)
    first = run.writer = _RecordingWriter("out/tensorboard")
    run.purge_tensorboard(4)
    assert first.closed and (run.writer.log_dir, run.writer.purge_step) == ("out/tensorboard", 5)


@pytest.mark.slow
def test_tensorboard_shows_each_step_once_after_a_kill_and_resume(config, tmp_path):
    """The real writer, killed after the step-4 checkpoint and resumed: every train/loss step once (steps 5-7 were
    shown twice before)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "roformer_rope.scripts.pretrain", "--config", str(config), "--out", str(run), *LINES, "--tensorboard"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    log = run / "train_log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= 7:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert pretrain("--config", str(config), "--out", str(run), *LINES, "--tensorboard", "--resume").returncode == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, 17))
