"""The DeepSpeed matrix (slow): ZeRO 1/2/3 (+ CPU offload) × 1/2 processes × fp32/bf16 each train and export.

Every run must lower the training loss and export a folder whose consolidated weights reproduce the live
model's logits (checked by the export itself against the probe stored at the last checkpoint, and here again
in a fresh process) with the MLM decoder tied to the word embedding — the `zero_to_fp32` tied-weight trap.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TINY = textwrap.dedent(
    """
    model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64}
    data: {held_out_lines: 60, vocab_words: 300, eval_sequences: 8, num_proc: 1}
    train: {seed: 0, micro_batch: 2, checkpoint_every: 100, log_every: 1, eval_batch: 8}
    stages:
      - {name: short, max_length: 32, global_batch: 8, steps: 12, lr: 3.0e-3, warmup_steps: 2}
      - {name: long, max_length: 64, global_batch: 4, steps: 4, lr: 1.0e-3, warmup_steps: 1, reset_optimizer: true}
    """
)
CHILD = textwrap.dedent(
    """
    import json, sys, torch, transformers
    folder, probe_file = sys.argv[1], sys.argv[2]
    model = transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    probe = torch.load(probe_file, weights_only=True)
    model.to(getattr(torch, probe["dtype"]))
    with torch.no_grad():
        logits = model(**probe["batch"]).logits.float()
    keep = probe["batch"]["attention_mask"].bool()
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    print(json.dumps({"diff": (logits[keep] - probe["logits"][keep]).abs().max().item(), "tied": tied}))
    """
)


@pytest.mark.parametrize(
    "zero, procs, precision",
    [
        ("zero1", 1, "fp32"), ("zero2", 1, "fp32"), ("zero3", 1, "fp32"),
        ("zero1", 2, "fp32"), ("zero2", 2, "fp32"), ("zero3", 2, "fp32"),
        ("zero1", 1, "bf16"), ("zero2", 1, "bf16"), ("zero3", 2, "bf16"),
        ("zero3_offload", 2, "fp32"),
    ],
)  # fmt: skip
def test_zero_stage_trains_and_exports(tmp_path, zero, procs, precision):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    run = tmp_path / "run"
    args = ["--config", str(config), "--deepspeed", zero, "--precision", precision, "--out", str(run), "--corpus-lines", "700"]
    if procs == 1:
        cmd = [sys.executable, "-m", "roformer_rope.scripts.pretrain", *args]
    else:
        with socket.socket() as s:  # torchrun's static rendezvous needs a real port (0 hangs)
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", port,
               "-m", "roformer_rope.scripts.pretrain", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], min(r["loss"] for r in records[-4:])
    assert last < first - 0.1, (first, last)
    table = json.loads((run / "stage_table.json").read_text())
    assert [row["steps"] for row in table] == [12, 4]
    probe = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "probe.pt"
    child = subprocess.run([sys.executable, "-c", CHILD, str(run / "model"), str(probe)], capture_output=True,
                           text=True, cwd=tmp_path, env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["tied"]
    assert out["diff"] < (1e-4 if precision == "fp32" else 2e-2), out


SAME_START = textwrap.dedent(
    """
    import json, os, sys, torch, deepspeed
    from roformer_rope.scripts.pretrain_engine import setup_distributed, teardown_distributed
    from roformer_rope.scripts.pretrain_export import build_model
    dist = setup_distributed()
    config = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  attention_type="performer", performer_nb_features=16)
    zero3 = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    plain = build_model(dict(config), "roformer").state_dict()
    torch.manual_seed(0)
    model = build_model(dict(config), "roformer", zero3)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        partitioned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    diffs = {k: (plain[k] - partitioned[k]).abs().max().item() for k in plain}
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:  # not stdout: the ranks' lines interleave there
        json.dump(diffs, f)
    teardown_distributed(dist)
    # Under pytest, ~1 run in 5 had a rank abort after this point, in a C++ destructor at interpreter exit
    # ("terminate called without an active exception", after both ranks had written and torn down; 0 in 60 runs
    # of the same script outside pytest). The result is written: leave without the destructors.
    os._exit(0)
    """
)


def test_zero3_ranks_start_from_the_plain_model_with_its_buffers(tmp_path):
    """2 ranks: every rank's ZeRO-3 model, parameters and buffers (a Performer's projection, which transformers'
    rank-0 initialisation does not hand out), equals the plain model built from the same seed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "same_start.py"
    script.write_text(SAME_START)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, str(script),
           str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for diffs in ranks:
        assert any("feature_projection" in k for k in diffs) and max(diffs.values()) == 0, diffs


def test_two_rank_zero2_and_zero3_runs_follow_the_same_curve(tmp_path):
    """Same seed, 2 processes, fp32, dropout on: the same initial weights and, re-seeded per rank after the build,
    the same dropout draws under ZeRO-2 and ZeRO-3, so the logged losses agree step by step."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    curves = {}
    for zero in ("zero2", "zero3"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        run = tmp_path / zero
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
               "-m", "roformer_rope.scripts.pretrain", "--config", str(config), "--deepspeed", zero, "--out", str(run),
               "--corpus-lines", "700", "--no-export"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        curves[zero] = {r["global_step"]: r["loss"] for r in records}
    assert sorted(curves["zero2"]) == sorted(curves["zero3"]) == list(range(1, 17))
    for step, loss in curves["zero2"].items():
        assert curves["zero3"][step] == pytest.approx(loss, abs=1e-4), step
