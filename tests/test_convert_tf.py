"""`roformer-rope convert-tf` against the original code's outputs, recorded in tests/fixtures.

Each fixture folder holds a bert4keras checkpoint and `expected.npz`, the outputs of the original keras
model (see tests/fixtures/README.md). A converted folder, loaded with the Auto classes and
`trust_remote_code=True`, must reproduce them to ATOL at non-padding positions (bert4keras never masks
position 0 and computes garbage for padded query rows, so only `input_ids != 0` is compared). Broken
checkpoints are written with a small TF tensor-bundle writer below, read back by our reader as a check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from roformer_rope.conversion import from_tf, hub
from roformer_rope.conversion.from_tf import ConversionError, convert_checkpoint, detect_kind
from roformer_rope.conversion.tf_checkpoint import TABLE_MAGIC, crc32c, list_variables, load_all, mask_crc

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
PYTHON = sys.executable
ATOL = 1e-4
KINDS = ["v1", "v1_emb", "sim", "gpt", "v2", "v1_pool", "unilm", "v2_sim", "v2_gpt"]
# v1_pool stores the same variables as sim (a pooler): without "sim" in its name it is v1 + tanh pooler; unilm
# (a seq2seq UniLM without a pooler) stores exactly v1's, so it needs `--model-kind sim`.
DETECTED = {"v1": "v1", "v1_emb": "v1", "sim": "sim", "gpt": "gpt", "v2": "v2", "v1_pool": "v1", "unilm": "v1",
            "v2_sim": "v2-sim", "v2_gpt": "v2-gpt"}  # fmt: skip
GIVEN_KIND = {"unilm": "sim"}  # conversions that need --model-kind
LM_KINDS = ("gpt", "v2_gpt")
MAX_DIFFS: dict[str, dict[str, float]] = {}  # filled by the parity tests, printed at the end (-s)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def expected_of(kind: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / kind / "expected.npz") as data:
        return {name: data[name] for name in data.files}


def tf_variables(kind: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / kind / "tf_variables.npz") as data:
        return {name: data[name] for name in data.files}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _pb_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _pb_bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """An SSTable block without prefix compression: one restart point at offset 0."""
    body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in entries)
    return body + struct.pack("<II", 0, 1)


_TF_DTYPES = {np.dtype("int32"): (3, "<i4"), np.dtype("int64"): (9, "<i8"), np.dtype("bool"): (10, "?")}


def write_checkpoint(
    prefix: Path, variables: dict[str, np.ndarray], claimed_shapes: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Write `variables` as a one-shard TF V2 checkpoint (tensor bundle), as tf.train.Saver lays it out.

    Floats are written as float32, int32/int64/bool as themselves. `claimed_shapes` makes the index
    claim another shape (and the matching byte size) than the data holds: a crafted index.
    """
    data, entries = bytearray(), []
    claimed_shapes = claimed_shapes or {}
    for name in sorted(variables):
        value = np.asarray(variables[name])
        dtype_enum, layout = _TF_DTYPES.get(value.dtype, (1, "<f4"))  # 1 = DT_FLOAT
        raw = np.ascontiguousarray(value, dtype=layout).tobytes()
        dims = claimed_shapes.get(name, np.shape(value))
        size = int(np.prod(dims, dtype=object)) * np.dtype(layout).itemsize if name in claimed_shapes else len(raw)
        shape = b"".join(_pb_bytes(2, _pb_varint(1, d)) for d in dims)
        entry = (
            _pb_varint(1, dtype_enum)
            + _pb_bytes(2, shape)
            + _pb_varint(4, len(data))
            + _pb_varint(5, size)
            + _varint(6 << 3 | 5)
            + struct.pack("<I", mask_crc(crc32c(raw)))
        )
        entries.append((name.encode(), entry))
        data += raw
    header = _pb_varint(1, 1) + _pb_bytes(3, _pb_varint(1, 1))  # one shard, version producer 1
    table = bytearray()

    def append_block(contents: bytes) -> bytes:
        handle = _varint(len(table)) + _varint(len(contents))
        table.extend(contents + b"\0" + struct.pack("<I", mask_crc(crc32c(contents + b"\0"))))
        return handle

    data_handle = append_block(_block([(b"", header), *entries]))
    meta_handle = append_block(_block([]))
    index_handle = append_block(_block([(entries[-1][0], data_handle)]))
    footer = (meta_handle + index_handle).ljust(40, b"\0") + struct.pack("<Q", TABLE_MAGIC)
    Path(f"{prefix}.index").write_bytes(bytes(table) + footer)
    Path(f"{prefix}.data-00000-of-00001").write_bytes(bytes(data))


def release_folder(
    tmp_path: Path, kind: str, variables: dict[str, np.ndarray] | None = None, name: str = "release"
) -> Path:
    """A copy of a fixture release folder whose checkpoint holds `variables` (default: the original ones)."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("bert_config.json", "vocab.txt"):
        shutil.copyfile(FIXTURES / kind / file, folder / file)
    if variables is None:
        for file in (FIXTURES / kind).glob("bert_model.ckpt.*"):
            shutil.copyfile(file, folder / file.name)
    else:
        write_checkpoint(folder / "bert_model.ckpt", variables)
    return folder


def assert_nothing_left(parent: Path, keep: set[str]) -> None:
    """Neither the output folder nor any temporary sibling survived a failed conversion."""
    assert {p.name for p in parent.iterdir()} == keep


@torch.no_grad()
def compare_with_original(folder: Path, kind: str) -> dict[str, float]:
    """Max |diff| per output between the converted folder (Auto classes) and the original code."""
    expected = expected_of(kind)
    lm = kind in LM_KINDS
    auto = transformers.AutoModelForCausalLM if lm else transformers.AutoModelForMaskedLM
    model = auto.from_pretrained(folder, trust_remote_code=True).eval()
    pooled = "pooler" in expected  # sim (linear) and v1_pool (tanh)
    encoder = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True).eval() if pooled else None
    head = "lm" if lm else "mlm"
    diffs = {}
    for prefix in ("", "long_"):
        ids = torch.from_numpy(expected[f"{prefix}input_ids"]).long()
        if ids.dim() == 1:
            ids = ids[None]
        segments = torch.from_numpy(expected[f"{prefix}token_type_ids"]).long().reshape(ids.shape)
        keep = ids != 0
        batch = dict(input_ids=ids, token_type_ids=segments, attention_mask=keep.long())
        outputs = model(**batch, output_hidden_states=True)
        hidden = expected[f"{prefix}hidden_states"].reshape(*ids.shape, -1)
        logits = expected[f"{prefix}{head}_logits"].reshape(*ids.shape, -1)
        probs = expected[f"{prefix}{head}_probs"].reshape(*ids.shape, -1)
        checks = {
            "hidden_states": (outputs.hidden_states[-1][keep], torch.from_numpy(hidden)[keep]),
            f"{head}_logits": (outputs.logits[keep], torch.from_numpy(logits)[keep]),
            f"{head}_probs": (outputs.logits.softmax(-1)[keep], torch.from_numpy(probs)[keep]),
        }
        if encoder is not None:
            pooled = encoder(**batch).pooler_output
            checks["pooler"] = (pooled, torch.from_numpy(expected[f"{prefix}pooler"].reshape(pooled.shape)))
            checks["encoder_hidden_states"] = (encoder(**batch).last_hidden_state[keep], torch.from_numpy(hidden)[keep])
        for name, (actual, reference) in checks.items():
            where = f"{kind} {prefix}{name}"
            torch.testing.assert_close(actual, reference, atol=ATOL, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
            diffs[f"{prefix}{name}"] = (actual - reference).abs().max().item()
    return diffs


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """Every fixture converted once with the Python API and `model_kind="auto"`."""
    root = tmp_path_factory.mktemp("converted")
    return {
        kind: convert_checkpoint(FIXTURES / kind, root / kind, model_kind=GIVEN_KIND.get(kind, "auto")).out_dir
        for kind in KINDS
    }


# ---------------------------------------------------------------------------------------------
# parity with the original code
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_converted_folder_reproduces_the_original(converted, kind):
    MAX_DIFFS[kind] = compare_with_original(converted[kind], kind)


def test_sim_folder_holds_pooler_and_mlm_head_in_one_file(converted):
    from safetensors import safe_open

    with safe_open(converted["sim"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"roformer.pooler.dense.weight", "lm_head.dense.weight", "lm_head.decoder.bias"} <= keys
    config = json.loads((converted["sim"] / "config.json").read_text())
    assert config["add_pooler"] and config["unilm_mask"] and config["pooler_activation"] == "linear"


def test_unilm_without_pooler_and_v2_applications(converted, tmp_path):
    """A UniLM seq2seq checkpoint (no pooler) converts with --model-kind sim; RoFormerV2 with the UniLM or LM
    application is detected from the name (or from sim/gpt given for v2 variables); a v2 kind for v1 variables is
    refused. The outputs are checked against the original code in test_converted_folder_reproduces_the_original."""
    config = json.loads((converted["unilm"] / "config.json").read_text())
    assert config["unilm_mask"] and not config.get("add_pooler")
    assert "no pooler" in (converted["unilm"] / "README.md").read_text()
    v2_sim = json.loads((converted["v2_sim"] / "config.json").read_text())
    assert v2_sim["unilm_mask"] and v2_sim["norm_type"] == "rms_norm" and not v2_sim["use_bias"]
    v2_gpt = json.loads((converted["v2_gpt"] / "config.json").read_text())
    assert v2_gpt["is_decoder"] and v2_gpt["architectures"] == ["RoFormerRopeForCausalLM"]
    assert v2_gpt["norm_type"] == "rms_norm"
    renamed = release_folder(tmp_path, "v2_gpt", name="renamed")  # no hint in the name: plain v2 unless told
    assert convert_checkpoint(renamed, tmp_path / "auto").kind == "v2"
    assert convert_checkpoint(renamed, tmp_path / "given", model_kind="gpt").kind == "v2-gpt"
    with pytest.raises(ConversionError, match="--model-kind v2-sim does not fit the checkpoint: it has bias and"):
        convert_checkpoint(FIXTURES / "v1", tmp_path / "wrong", model_kind="v2-sim")


@pytest.mark.parametrize("license", ["apache 2.0", "mit\ntags: [x]", "MIT", "cc: by", "", "null", "no", "1.0"])
def test_a_license_that_is_no_license_id_is_refused_before_anything_is_written(tmp_path, license):
    """The id goes verbatim into the card's YAML metadata: a space, colon, newline or capital is refused, and so is a
    word or number YAML reads as something else than a string."""
    with pytest.raises(ConversionError, match="--license .* is not a license id"):
        convert_checkpoint(FIXTURES / "v1", tmp_path / "out", license=license)
    assert not (tmp_path / "out").exists()


def test_folder_contents_and_model_card(converted):
    folder = converted["gpt"]
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_roformer_rope.py",
        "configuration_roformer_rope.py",
        "vocab.txt",
        "tokenizer_config.json",
        "README.md",
    } <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_roformer_rope.RoFormerRopeForCausalLM"
    assert config["is_decoder"] and config["architectures"] == ["RoFormerRopeForCausalLM"]
    card = (folder / "README.md").read_text()
    meta = card.split("---")[1]
    for line in ("- zh", "library_name: transformers", "pipeline_tag: text-generation", "- roformer", "- rotary"):
        assert line in meta
    assert "trust_remote_code=True" in card and "$" not in card
    assert from_tf.sha256_file(FIXTURES / "gpt" / "bert_model.ckpt.index") in card
    assert "41 (41 converted)" in card
    assert "pipeline_tag: fill-mask" in (converted["v2"] / "README.md").read_text()


def test_tokenizer_is_saved_with_the_release_vocabulary(converted):
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    # In-process with our class: an AutoTokenizer remote-code load would copy code into ~/.cache; the fresh
    # process test below covers AutoTokenizer.
    tokenizer = RoFormerRopeTokenizer.from_pretrained(converted["v1"])
    vocab = (FIXTURES / "v1" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert tokenizer.convert_tokens_to_ids(vocab) == list(range(len(vocab)))
    # jieba keeps in-vocabulary words whole (WoBERT); the rest falls back to characters / WordPiece.
    assert tokenizer("我们喜欢")["input_ids"] == [2, vocab.index("我们"), vocab.index("喜欢"), 3]
    direct = RoFormerRopeTokenizer(vocab_file=str(FIXTURES / "v1" / "vocab.txt"))
    text = "今天天气不错，我们学习自然语言 abcs"
    assert tokenizer(text)["input_ids"] == direct(text)["input_ids"]
    assert tokenizer.model_max_length == 64  # the release's max_position_embeddings


def test_cli_subprocess_and_fresh_process_trust_remote_code(tmp_path):
    """The installed CLI converts; a process that never imports our package loads the folder by its payload."""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = tmp_path / "sim-converted"
    done = subprocess.run(
        [
            PYTHON,
            "-m",
            "roformer_rope.cli",
            "convert-tf",
            "--checkpoint",
            str(FIXTURES / "sim" / "bert_model.ckpt"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "sim" in done.stdout
    check = f"""
import json, sys, numpy as np, torch, transformers
e = np.load({str(FIXTURES / "sim" / "expected.npz")!r})
ids = torch.from_numpy(e['input_ids']).long(); tt = torch.from_numpy(e['token_type_ids']).long(); keep = ids != 0
batch = dict(input_ids=ids, token_type_ids=tt, attention_mask=keep.long())
mlm = transformers.AutoModelForMaskedLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
enc = transformers.AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
tok = transformers.AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
with torch.no_grad():
    logits = mlm(**batch).logits[keep]; pooled = enc(**batch).pooler_output
print(json.dumps(dict(
    modules=[type(mlm).__module__, type(enc).__module__, type(tok).__module__],
    cls_sep=tok("x")["input_ids"][::2],
    ours_imported='modeling_roformer_rope' in sys.modules,
    logits=(logits - torch.from_numpy(e['mlm_logits'])[keep]).abs().max().item(),
    pooler=(pooled - torch.from_numpy(e['pooler'])).abs().max().item())))
"""
    loaded = subprocess.run([PYTHON, "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert all(m.startswith("transformers_modules.") for m in result["modules"]), result
    assert not result["ours_imported"]
    assert result["cls_sep"] == [2, 3]
    assert result["logits"] <= ATOL and result["pooler"] <= ATOL, result


# ---------------------------------------------------------------------------------------------
# kind detection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_auto_detects_each_kind(kind):
    names = set(list_variables(FIXTURES / kind))
    # The fixture folders are named after their kind: "gpt" is the documented name hint.
    assert detect_kind(names, f"{kind}/bert_model.ckpt") == DETECTED[kind]


def test_gpt_without_name_hint_is_v1_and_explicit_kind_wins(tmp_path):
    names = set(list_variables(FIXTURES / "gpt"))
    assert detect_kind(names, "chinese_roformer-char_L-12/bert_model.ckpt") == "v1"
    assert detect_kind(names, "chinese_roformer-gpt-char_L-12_H-768_A-12/bert_model.ckpt") == "gpt"
    folder = release_folder(tmp_path, "gpt", name="renamed")
    result = convert_checkpoint(folder, tmp_path / "out", model_kind="gpt")
    assert result.architecture == "RoFormerRopeForCausalLM"


@pytest.mark.parametrize(
    "location, kind",
    [
        ("chinese_roformer-sim-char_L-12_H-768_A-12/bert_model.ckpt", "sim"),
        ("chinese_roformer-sim-char-ft_L-6_H-384_A-6/bert_model.ckpt", "sim"),
        ("roformer_sim/model.ckpt", "sim"),
        ("release/bert_model.ckpt", "v1"),
        ("simple_encoder/bert_model.ckpt", "v1"),
        ("roformer-simcse/bert_model.ckpt", "v1"),
        ("roformer-gpt-pool/bert_model.ckpt", "gpt"),
    ],
)
def test_a_pooler_is_sim_only_when_the_name_says_so(location, kind, caplog):
    names = set(list_variables(FIXTURES / "sim"))
    with caplog.at_level("WARNING"):
        assert detect_kind(names, location) == kind
    assert ("tanh pooler" in caplog.text) == (kind != "sim")  # the decision is logged


def test_pooler_without_sim_name_converts_to_v1_with_tanh_pooler(converted):
    config = json.loads((converted["v1_pool"] / "config.json").read_text())
    assert config["add_pooler"] and config["pooler_activation"] == "tanh" and not config["unilm_mask"]
    card = (converted["v1_pool"] / "README.md").read_text()
    assert "kind `v1 + tanh pooler`" in card and "pooler_output" in card


def test_v1_pool_converted_as_sim_is_caught_by_the_reference_outputs(tmp_path):
    """The old auto decision (pooler => sim) gives a self-consistent but wrong model: only the original
    code's outputs can tell, so --reference-outputs must refuse it before anything is written."""
    with pytest.raises(AssertionError):
        folder = convert_checkpoint(FIXTURES / "v1_pool", tmp_path / "as-sim", model_kind="sim").out_dir
        compare_with_original(folder, "v1_pool")
    reference = FIXTURES / "v1_pool" / "expected.npz"
    with pytest.raises(ConversionError, match="does not reproduce the original outputs") as info:
        convert_checkpoint(FIXTURES / "v1_pool", tmp_path / "out", model_kind="sim", reference_outputs=reference)
    assert str(reference) in str(info.value) and "--model-kind" in str(info.value)
    assert_nothing_left(tmp_path, {"as-sim"})


@pytest.mark.parametrize("kind", ["v1_pool", "sim", "gpt"])
def test_reference_outputs_reproduced_with_auto_are_recorded_in_the_card(tmp_path, kind):
    reference = FIXTURES / kind / "expected.npz"
    result = convert_checkpoint(FIXTURES / kind, tmp_path / "out", reference_outputs=reference)
    assert result.reference_max_abs_diff <= ATOL
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"reproduced to max abs diff {result.reference_max_abs_diff:.3g}" in card and "$" not in card


def test_bad_reference_outputs_file_is_named(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    np.savez(tmp_path / "no_ids.npz", hidden_states=np.zeros((1, 2, 32), np.float32))
    np.savez(tmp_path / "no_outputs.npz", input_ids=np.ones((1, 2), np.int32))
    np.savez(tmp_path / "wrong_shape.npz", input_ids=np.ones((1, 2), np.int32), pooler=np.zeros((1, 5), np.float32))
    cases = {
        tmp_path / "missing.npz": "not found",
        bad: "not a readable .npz",
        tmp_path / "no_ids.npz": "no input_ids",
        tmp_path / "no_outputs.npz": "no output to compare",
        tmp_path / "wrong_shape.npz": "pooler has shape [1, 5]",
    }
    for path, fragment in cases.items():
        with pytest.raises(ConversionError, match=re.escape(fragment)) as info:
            convert_checkpoint(FIXTURES / "v1_pool", tmp_path / "out", reference_outputs=path)
        assert str(path) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_ambiguous_variables_are_refused():
    with pytest.raises(ConversionError, match="bias but no LayerNorm"):
        detect_kind({"bert/embeddings/word_embeddings", "bert/encoder/layer_0/output/dense/bias"})


# ---------------------------------------------------------------------------------------------
# variables the table skips on purpose; encoder-only releases
# ---------------------------------------------------------------------------------------------


def test_writer_round_trips_through_our_reader(tmp_path):
    variables = tf_variables("v1")
    write_checkpoint(tmp_path / "model.ckpt", variables)
    loaded = load_all(tmp_path / "model.ckpt")
    assert loaded.keys() == variables.keys()
    for name in variables:
        np.testing.assert_array_equal(loaded[name], variables[name])


def test_optimizer_slots_and_next_sentence_head_are_skipped(tmp_path):
    variables = tf_variables("v1")
    extra = {f"{name}/adam_m": v for name, v in list(variables.items())[:3]}
    extra |= {f"{name}/adam_v": v for name, v in list(variables.items())[:3]}
    extra |= {"global_step": np.zeros(()), "bad_steps": np.zeros(()), "loss_scale": np.ones(())}
    extra |= {"cls/seq_relationship/output_weights": np.ones((2, 32)), "cls/seq_relationship/output_bias": np.ones(2)}
    folder = release_folder(tmp_path, "v1", {**variables, **extra})
    result = convert_checkpoint(folder, tmp_path / "out")
    assert result.num_variables == len(variables) + len(extra)
    assert result.num_converted == len(variables)
    assert set(result.skipped) == set(extra)
    compare_with_original(tmp_path / "out", "v1")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "9 optimizer slot(s), `cls/seq_relationship/output_bias` (unused)" in card


@pytest.mark.parametrize("kind", ["v1", "gpt", "sim"])
def test_a_release_without_vocab_txt_gets_a_card_that_loads_no_tokenizer(tmp_path, kind):
    """No vocab.txt: no tokenizer is written, so the card's usage must not call AutoTokenizer. Its code, with the
    fixture's ids for the `...` placeholder, runs and reproduces the original code's outputs."""
    folder = release_folder(tmp_path, kind, name=f"roformer-{kind}-release")
    (folder / "vocab.txt").unlink()
    result = convert_checkpoint(folder, tmp_path / "out")
    assert not result.tokenizer and not (tmp_path / "out" / "tokenizer_config.json").exists()
    card = (tmp_path / "out" / "README.md").read_text(encoding="utf-8")
    assert "AutoTokenizer" not in card and "no tokenizer" in card and "$" not in card
    expected = expected_of(kind)
    code = card.split("```python\n")[1].split("```")[0].replace('"PATH_OR_REPO_ID"', repr(str(tmp_path / "out")))
    code = code.replace("[[...]]", repr(expected["long_input_ids"].astype(int).tolist()))
    head, tail = code.split("outputs = model(**inputs)")
    scope: dict = {}
    exec(head, scope)
    scope["inputs"]["token_type_ids"] = torch.from_numpy(expected["long_token_type_ids"]).long()  # the fixture's segments
    exec("outputs = model(**inputs)" + tail.split("generated =")[0], scope)  # generation is not checked here
    keep = torch.from_numpy(expected["long_input_ids"] != 0)
    reference = torch.from_numpy(expected["long_lm_logits" if kind == "gpt" else "long_mlm_logits"])
    torch.testing.assert_close(scope["outputs"].logits.detach()[keep], reference[keep], atol=ATOL, rtol=0)
    if kind == "sim":  # the card's pooler lines
        pooled = torch.from_numpy(expected["long_pooler"].reshape(scope["sentence_vector"].shape))
        torch.testing.assert_close(scope["sentence_vector"].detach(), pooled, atol=ATOL, rtol=0)


def test_encoder_only_release_converts_to_the_bare_model(tmp_path):
    variables = {k: v for k, v in tf_variables("sim").items() if not k.startswith("cls/")}
    # named like the Sim releases: a pooler alone is v1 + tanh pooler (test_pooler_without_sim_name_...)
    folder = release_folder(tmp_path, "sim", variables, name="roformer-sim-release")
    result = convert_checkpoint(folder, tmp_path / "out")
    assert result.architecture == "RoFormerRopeModel"
    expected = expected_of("sim")
    model = transformers.AutoModel.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = torch.from_numpy(expected["input_ids"]).long()
    with torch.no_grad():
        out = model(
            input_ids=ids,
            token_type_ids=torch.from_numpy(expected["token_type_ids"]).long(),
            attention_mask=(ids != 0).long(),
        )
    torch.testing.assert_close(out.pooler_output, torch.from_numpy(expected["pooler"]), atol=ATOL, rtol=0)
    assert "pipeline_tag: feature-extraction" in (tmp_path / "out" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# broken inputs: a clear error, nothing left behind
# ---------------------------------------------------------------------------------------------


def _broken(tmp_path: Path, kind: str, edit) -> Path:
    variables = tf_variables(kind)
    edit(variables)
    return release_folder(tmp_path, kind, variables)


BROKEN_CHECKPOINTS = {
    "wrong shape": (
        lambda v: v.update({"bert/encoder/layer_1/intermediate/dense/kernel": np.zeros((32, 65), np.float32)}),
        ["wrong shapes", "bert/encoder/layer_1/intermediate/dense/kernel [65, 32]", "[64, 32]"],
    ),
    "unknown variable": (
        lambda v: v.update({"bert/encoder/layer_0/attention/self/relative_bias": np.zeros(4, np.float32)}),
        ["unknown variable", "bert/encoder/layer_0/attention/self/relative_bias"],
    ),
    "missing variable": (
        lambda v: v.pop("bert/encoder/layer_1/output/LayerNorm/beta"),
        ["missing weights", "roformer.layers.1.mlp_norm.bias"],
    ),
    "missing query kernel": (
        lambda v: v.pop("bert/encoder/layer_0/attention/self/query/kernel"),
        ["missing 1 variable", "bert/encoder/layer_0/attention/self/query/kernel"],
    ),
    "extra layer": (
        lambda v: v.update({k.replace("layer_1", "layer_2"): x for k, x in list(v.items()) if "layer_1/" in k}),
        ["no place for", "bert/encoder/layer_2/output/dense/kernel"],
    ),
    "partial mlm head": (
        lambda v: v.pop("cls/predictions/output_bias"),
        ["missing weights", "lm_head.decoder.bias"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_CHECKPOINTS))
def test_broken_checkpoint_is_named_and_leaves_nothing(tmp_path, case):
    edit, fragments = BROKEN_CHECKPOINTS[case]
    folder = _broken(tmp_path, "v1", edit)
    with pytest.raises(ConversionError) as info:
        convert_checkpoint(folder, tmp_path / "out")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_nothing_left(tmp_path, {"release"})


def test_truncated_data_file(tmp_path):
    folder = release_folder(tmp_path, "v1")
    data = folder / "bert_model.ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ConversionError, match="truncated"):
        convert_checkpoint(folder, tmp_path / "out")
    assert_nothing_left(tmp_path, {"release"})


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="no such checkpoint"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    assert_nothing_left(tmp_path, set())


@pytest.mark.parametrize(
    "edit, fragment",
    [
        ({"hidden_size": 64}, "wrong shapes"),
        ({"num_hidden_layers": 3}, "missing weights"),
        ({"num_hidden_layers": 1}, "no place for"),
        ({"vocab_size": 100}, "vocab.txt has 120 tokens"),
        ({"num_attention_heads": 5}, "does not describe a valid v1 model"),
        ({"vocab_size": None}, "missing required field"),
    ],
)
def test_mismatching_bert_config(tmp_path, edit, fragment):
    folder = release_folder(tmp_path, "v1")
    config = json.loads((folder / "bert_config.json").read_text())
    config.update(edit)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=fragment):
        convert_checkpoint(folder, tmp_path / "out")
    assert_nothing_left(tmp_path, {"release"})


def test_missing_or_invalid_bert_config(tmp_path):
    folder = release_folder(tmp_path, "v2")
    (folder / "bert_config.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        convert_checkpoint(folder, tmp_path / "out")
    (folder / "bert_config.json").unlink()
    with pytest.raises(ConversionError, match="bert_config.json: not found"):
        convert_checkpoint(folder / "bert_model.ckpt", tmp_path / "out")
    assert_nothing_left(tmp_path, {"release"})


def test_failed_verification_removes_the_temporary_folder(tmp_path, monkeypatch):
    def fail(model, folder, atol=1e-5):
        assert folder.parent == tmp_path and folder.name.startswith(".out.tmp-") and (folder / "config.json").is_file()
        raise ConversionError("verification failed: simulated")

    monkeypatch.setattr(from_tf, "verify_folder", fail)
    folder = release_folder(tmp_path, "v1")
    with pytest.raises(ConversionError, match="simulated"):
        convert_checkpoint(folder, tmp_path / "out")
    assert_nothing_left(tmp_path, {"release"})


def test_existing_out_is_refused_or_replaced_only_after_success(tmp_path, monkeypatch):
    folder = release_folder(tmp_path, "v1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(folder, out)

    def fail(*args, **kwargs):
        raise ConversionError("boom")

    monkeypatch.setattr(from_tf, "verify_folder", fail)
    with pytest.raises(ConversionError, match="boom"):
        convert_checkpoint(folder, out, overwrite=True)
    assert (out / "old.txt").read_text() == "keep me"
    monkeypatch.undo()
    convert_checkpoint(folder, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert_nothing_left(tmp_path, {"release", "out"})


def test_cli_reports_one_line_and_exit_code_2(tmp_path, capsys):
    from roformer_rope.cli import main

    folder = _broken(tmp_path, "v1", BROKEN_CHECKPOINTS["unknown variable"][0])
    assert main(["convert-tf", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("roformer-rope convert-tf: error:") and "relative_bias" in err[0]
    assert_nothing_left(tmp_path, {"release"})


def test_help_documents_the_gpt_hint(capsys):
    from roformer_rope.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert-tf", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'gpt'" in text and "--push-to-hub" in text and "--dry-run" in text


# ---------------------------------------------------------------------------------------------
# --push-to-hub (the Hub is unreachable here: HfApi is replaced)
# ---------------------------------------------------------------------------------------------


class FakeHfApi:
    calls: list[tuple[str, tuple, dict]] = []

    def __init__(self, *args, **kwargs):
        FakeHfApi.calls.append(("init", args, kwargs))

    def create_repo(self, repo_id, **kwargs):
        FakeHfApi.calls.append(("create_repo", (repo_id,), kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        FakeHfApi.calls.append(("create_branch", (repo_id,), kwargs))

    def upload_folder(self, **kwargs):
        FakeHfApi.calls.append(("upload_folder", (), kwargs))
        assert {p.name for p in Path(kwargs["folder_path"]).iterdir()} >= {
            "config.json",
            "model.safetensors",
            "README.md",
        }


def _args(tmp_path: Path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    from_tf.add_arguments(parser)
    argv = ["--checkpoint", str(FIXTURES / "v2"), "--out", str(tmp_path / "out")]
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, value]
    return parser.parse_args(argv)


def test_push_to_hub_creates_repo_branch_and_uploads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hub, "HfApi", FakeHfApi)
    FakeHfApi.calls = []
    assert from_tf.run(_args(tmp_path, push_to_hub="me/roformer-v2", private=True, revision="conv")) == 0
    names = [c[0] for c in FakeHfApi.calls]
    assert names == ["init", "create_repo", "create_branch", "upload_folder"]
    assert FakeHfApi.calls[1][2]["private"] is True
    assert FakeHfApi.calls[2][2]["branch"] == "conv"
    upload = FakeHfApi.calls[3][2]
    assert upload["repo_id"] == "me/roformer-v2" and upload["revision"] == "conv"
    assert Path(upload["folder_path"]) == tmp_path / "out"
    assert "https://huggingface.co/me/roformer-v2/tree/conv" in capsys.readouterr().out
    assert 'from_pretrained("me/roformer-v2"' in (tmp_path / "out" / "README.md").read_text()


def test_dry_run_lists_files_and_sizes_without_network(tmp_path, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise AssertionError("dry run must not create an HfApi")

    monkeypatch.setattr(hub, "HfApi", no_network)
    assert from_tf.run(_args(tmp_path, push_to_hub="me/x", dry_run=True)) == 0
    out = capsys.readouterr().out
    size = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert "would upload" in out and "model.safetensors" in out and f"{size / 1024:.1f} KB" in out
    listed = dict(hub.list_upload(tmp_path / "out"))
    assert listed["model.safetensors"] == size and "README.md" in listed


def test_push_options_need_push_to_hub(tmp_path):
    with pytest.raises(ConversionError, match="only apply with --push-to-hub"):
        from_tf.run(_args(tmp_path, dry_run=True))
    assert not (tmp_path / "out").exists()


def test_invalid_repo_id_is_refused_before_converting(tmp_path):
    with pytest.raises(ConversionError, match="--push-to-hub 'bad repo id!!': not a Hub repo id"):
        from_tf.run(_args(tmp_path, push_to_hub="bad repo id!!", dry_run=True))
    assert not (tmp_path / "out").exists()


def test_report_max_differences():
    """Printed with `pytest -s`: the numbers quoted in reports and model cards."""
    for kind, diffs in MAX_DIFFS.items():
        print(kind, {k: f"{v:.2e}" for k, v in diffs.items()})


def test_checkpoint_given_as_dot_is_named_by_its_folder_in_the_card(tmp_path, monkeypatch):
    """`cd release && convert-tf --checkpoint . --out ../x`: the card's title and source name the release
    folder, never an empty name or `.`."""
    release = tmp_path / "chinese_roformer-gpt-char_tiny"
    shutil.copytree(FIXTURES / "gpt", release)
    monkeypatch.chdir(release)
    out = convert_checkpoint(Path("."), tmp_path / "x").out_dir
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "# chinese_roformer-gpt-char_tiny (RoFormer-GPT, converted)" in card
    assert "`.`" not in card and "#  (" not in card


@pytest.mark.parametrize("given", ["folder", "prefix"])
def test_the_card_names_the_release_not_the_local_path(tmp_path, given):
    """The card goes to the Hub with --push-to-hub: its provenance names the release folder (and prefix file),
    not where it sat on the converting machine."""
    release = tmp_path / "private" / "chinese_roformer-char_tiny"
    shutil.copytree(FIXTURES / "v1", release)
    checkpoint = release if given == "folder" else release / "bert_model.ckpt"
    card = (convert_checkpoint(checkpoint, tmp_path / "x").out_dir / "README.md").read_text(encoding="utf-8")
    expected = "chinese_roformer-char_tiny" + ("/bert_model.ckpt" if given == "prefix" else "")
    assert f"| original checkpoint | `{expected}` |" in card and str(tmp_path) not in card


@pytest.mark.parametrize("given", [".", "bert_model.ckpt"])
@pytest.mark.parametrize("name, kind", [("sim", "sim"), ("gpt", "gpt")])
def test_a_relative_checkpoint_inside_its_release_folder_keeps_the_folder_name_hint(tmp_path, monkeypatch, given, name, kind):
    """Sim and GPT checkpoints hold the same variables as v1 (+ pooler): only the release folder's name tells them
    apart, also when the checkpoint is given relative to it (`cd release && convert-tf --checkpoint .`). Read as v1
    they would convert without error to another model (a Sim 1.6 off the original's hidden states)."""
    release = tmp_path / f"chinese_roformer-{name}-char_tiny"
    shutil.copytree(FIXTURES / name, release)
    monkeypatch.chdir(release)
    result = convert_checkpoint(Path(given), tmp_path / "x", reference_outputs=release / "expected.npz")
    assert result.kind == kind


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {**c, "hidden_act": "leaky_relu"}, "hidden_act 'leaky_relu' is bert4keras' leaky ReLU of slope 0.2"),
        (lambda c: {k: v for k, v in c.items() if k != "hidden_act"}, "missing required field(s) ['hidden_act']"),
        (lambda c: {**c, "hidden_act": "gelu_fast"}, "hidden_act 'gelu_fast' is not an activation bert4keras knows"),
        (lambda c: {**c, "attention_key_size": 32}, "attention_key_size 32 differs from hidden_size / num_attention_heads"),
        (lambda c: {**c, "attention_head_size": 16}, "attention_head_size 16 differs from hidden_size / num_attention_heads"),
    ],
    ids=["leaky-relu", "no-act", "unknown-act", "key-size", "head-size"],
)
def test_configs_bert4keras_reads_otherwise_are_refused(tmp_path, edit, message):
    """bert4keras' leaky_relu has slope 0.2 (transformers' 0.01), and it has no default activation: converting
    either would give a silently different model. An activation bert4keras does not know (`gelu_fast` is
    transformers') means a config the original did not make. bert4keras reads `attention_key_size` /
    `attention_head_size` (query/key and value widths per head): a value other than hidden / heads used to be
    dropped, so a 32-wide key config converted a 64-wide checkpoint without a word."""
    folder = release_folder(tmp_path, "v1")
    config = json.loads((folder / "bert_config.json").read_text())
    (folder / "bert_config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_head_size_fields_at_their_default_are_accepted(tmp_path):
    """`attention_key_size` / `attention_head_size` equal to hidden / heads, or 0, are bert4keras' defaults."""
    folder = release_folder(tmp_path, "v1")
    config = json.loads((folder / "bert_config.json").read_text())
    size = config["hidden_size"] // config["num_attention_heads"]
    (folder / "bert_config.json").write_text(json.dumps({**config, "attention_key_size": size, "attention_head_size": 0}))
    assert convert_checkpoint(folder, tmp_path / "out").kind == "v1"  # 0 (or null): bert4keras' `or` default


def test_vocab_lines_end_at_newlines_only(tmp_path):
    """A token holding U+0085 or U+2028 is one vocab.txt line, as the tokenizer (and bert4keras) read it:
    `str.splitlines` would count two, refuse the release as larger than its vocab_size and shift the ids it reads."""
    folder = release_folder(tmp_path, "v1")
    lines = (folder / "vocab.txt").read_text(encoding="utf-8").split("\n")
    lines[50], lines[51] = "x\x85y", "a\u2028b"
    (folder / "vocab.txt").write_text("\n".join(lines), encoding="utf-8")
    out = convert_checkpoint(folder, tmp_path / "x").out_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tokenizer.convert_ids_to_tokens([50, 51]) == ["x\x85y", "a\u2028b"]
