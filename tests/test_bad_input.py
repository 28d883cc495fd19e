"""Issue 15's matrix for the tools: every bad input gives exit code 2 and one line naming the file/field
and the problem; the old output and the sources stay byte-identical after every failure (including an
interrupt injected between the steps of the swap); outputs are shareable under umask 022.

Each case builds its own tiny inputs (a built-in RoFormer folder, a copy of a TF fixture release) and
runs the real CLI entry point in-process (`roformer_rope.cli.main`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
from test_convert_tf import FIXTURES, release_folder, tf_variables, write_checkpoint

from conftest import builtin_model
from roformer_rope import cli, safe_write
from roformer_rope.conversion import from_transformers

# --- helpers -----------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Mode and bytes of every path at and under `root` (a file or a folder)."""
    paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): (p.lstat().st_mode, None if p.is_dir() else p.read_bytes()) for p in paths}


def cli_error(capsys, argv: list[str], command: str, code: int = 2) -> str:
    """Run the CLI; assert the exit code and exactly one `roformer-rope CMD: error:` line; return it."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "error:" in line or "interrupted" in line]
    assert len(lines) == 1, err
    prefix = f"roformer-rope {command}: " + ("interrupted" if code == 130 else "error: ")
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(autouse=True)
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


@pytest.fixture(scope="module")
def builtin_source(tmp_path_factory) -> Path:
    """A built-in transformers RoFormer folder (model_type roformer) with a vocab.txt; never modified."""
    folder = tmp_path_factory.mktemp("builtin") / "builtin"
    builtin_model("RoFormerForMaskedLM").save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "今", "天"]) + "\n")
    return folder


@pytest.fixture
def builtin_copy(tmp_path, builtin_source) -> Path:
    return Path(shutil.copytree(builtin_source, tmp_path / "builtin"))


@pytest.fixture
def old_out(tmp_path) -> Path:
    """An existing output folder a failed --overwrite must leave exactly as it is."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"the old weights")
    (out / "sub" / "notes.txt").write_text("old notes")
    return out


def argv_for(command: str, source: Path, out: Path | str) -> list[str]:
    flag = "--model" if command == "convert-hf" else "--checkpoint"
    return [command, flag, str(source), "--out", str(out)]


@pytest.fixture(params=["convert-hf", "convert-tf"])
def converter(request, tmp_path, builtin_source) -> tuple[str, Path]:
    """(command, its source folder inside tmp_path)."""
    if request.param == "convert-hf":
        return request.param, Path(shutil.copytree(builtin_source, tmp_path / "builtin"))
    return request.param, release_folder(tmp_path, "v1")


# --- 2. --out . --overwrite --------------------------------------------------------------------


@pytest.mark.parametrize("out", [".", "..", "./"])
def test_out_dot_with_overwrite_refused_before_touching_anything(tmp_path, capsys, monkeypatch, converter, out):
    command, source = converter
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("user data")
    monkeypatch.chdir(work)
    before, before_source = snapshot(tmp_path), snapshot(source)
    line = cli_error(capsys, [*argv_for(command, source, out), "--overwrite"], command)
    assert "current directory" in line and f"--out {out.rstrip('/')}" in line
    assert snapshot(tmp_path) == before and snapshot(source) == before_source


# --- 3. atomic replace: failure or interrupt at every step keeps the old output -----------------


@pytest.mark.parametrize(
    "step, error, code",
    [
        (1, OSError(errno.EIO, "Input/output error", "injected"), 2),
        (2, OSError(errno.EIO, "Input/output error", "injected"), 2),
        (1, KeyboardInterrupt(), 130),
        (2, KeyboardInterrupt(), 130),
    ],
    ids=["set-aside-oserror", "swap-in-oserror", "set-aside-interrupt", "swap-in-interrupt"],
)
def test_failed_swap_keeps_the_old_output_byte_identical(
    tmp_path, capsys, monkeypatch, converter, old_out, step, error, code
):
    command, source = converter
    calls = []
    real = safe_write._rename

    def rename(a, b):
        calls.append(b)
        if len(calls) == step:
            raise error
        real(a, b)

    monkeypatch.setattr(safe_write, "_rename", rename)
    before, before_source = snapshot(old_out), snapshot(source)
    line = cli_error(capsys, [*argv_for(command, source, old_out), "--overwrite"], command, code)
    if code == 2:
        assert "injected: Input/output error" in line
    assert snapshot(old_out) == before and snapshot(source) == before_source
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, "out"])


def test_failed_verification_keeps_the_old_output(tmp_path, capsys, monkeypatch, builtin_copy, old_out):
    def differs(*args, **kwargs):
        raise from_transformers.ConversionError("verification failed: logits differs from the built-in by 1")

    monkeypatch.setattr(from_transformers, "verify_against_builtin", differs)
    before = snapshot(old_out)
    line = cli_error(capsys, [*argv_for("convert-hf", builtin_copy, old_out), "--overwrite"], "convert-hf")
    assert "verification failed" in line
    assert snapshot(old_out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builtin", "out"]


def test_old_output_with_a_read_only_subfolder_is_replaced_completely(tmp_path, capsys, converter, old_out):
    command, source = converter
    (old_out / "sub").chmod(0o500)
    assert cli.main([*argv_for(command, source, old_out), "--overwrite"]) == 0
    assert (old_out / "config.json").is_file() and not (old_out / "sub").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, "out"])


# --- 4. --out equal to, inside, or containing the input ----------------------------------------


@pytest.mark.parametrize("where", ["input", "inside", "parent"])
def test_out_overlapping_the_input_is_refused(tmp_path, capsys, converter, where):
    command, source = converter
    out = {"input": source, "inside": source / "converted", "parent": tmp_path}[where]
    before = snapshot(tmp_path)
    line = cli_error(capsys, [*argv_for(command, source, out), "--overwrite"], command)
    assert "the input" in line and str(out) in line
    assert snapshot(tmp_path) == before


def test_out_equal_to_the_checkpoint_folder_given_as_a_prefix(tmp_path, capsys):
    release = release_folder(tmp_path, "v1")
    before = snapshot(release)
    line = cli_error(
        capsys,
        ["convert-tf", "--checkpoint", str(release / "bert_model.ckpt"), "--out", str(release), "--overwrite"],
        "convert-tf",
    )
    assert "the input" in line
    assert snapshot(release) == before


# --- 5. a pooler is not a Sim; reference outputs catch a wrong kind ----------------------------


def test_v1_pool_auto_reproduces_the_original_and_forced_sim_is_caught(tmp_path, capsys):
    reference = FIXTURES / "v1_pool" / "expected.npz"
    args = ["convert-tf", "--checkpoint", str(FIXTURES / "v1_pool"), "--reference-outputs", str(reference)]
    assert cli.main([*args, "--out", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    assert "v1 + tanh pooler" in out and "original outputs max |diff|" in out
    line = cli_error(capsys, [*args, "--out", str(tmp_path / "sim"), "--model-kind", "sim"], "convert-tf")
    assert str(reference) in line and "does not reproduce the original outputs" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto"]


# --- 6. outputs other users can read ------------------------------------------------------------


def modes(root: Path) -> set[tuple[str, int]]:
    return {("d" if p.is_dir() else "f", stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


def test_converted_folders_are_shareable_under_umask_022(tmp_path, converter):
    command, source = converter
    assert cli.main(argv_for(command, source, tmp_path / "out")) == 0
    assert modes(tmp_path / "out") == {("d", 0o755), ("f", 0o644)}


def test_vocabulary_is_shareable_under_umask_022(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("我们喜欢北京。\n北京欢迎你们！\n", encoding="utf-8")
    argv = ["build-vocab", "--corpus", str(corpus), "--out", str(tmp_path / "v" / "vocab.txt"), "--no-progress"]
    assert cli.main([*argv, "--held-out-every", "1000"]) == 0
    assert stat.S_IMODE((tmp_path / "v" / "vocab.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "v").stat().st_mode) == 0o755


# --- 7. every failure is one line with exit code 2 ---------------------------------------------


@pytest.mark.parametrize(
    "error_number, text", [(errno.EACCES, "Permission denied"), (errno.ENOSPC, "No space left on device")]
)
def test_os_errors_while_writing(tmp_path, capsys, monkeypatch, converter, old_out, error_number, text):
    """As root, permissions cannot be denied for real: the first write beside --out fails instead."""
    command, source = converter
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, *args, **kwargs):
        if Path(path).parent == tmp_path and Path(path).name.startswith(".out.tmp-"):
            raise OSError(error_number, os.strerror(error_number), str(path))
        return real_mkdir(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    before = snapshot(old_out)
    line = cli_error(capsys, [*argv_for(command, source, old_out), "--overwrite"], command)
    assert text in line and str(tmp_path / ".out.tmp-") in line
    assert snapshot(old_out) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes regardless of permissions")
def test_real_permission_denied(tmp_path, capsys, builtin_copy):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = cli_error(capsys, argv_for("convert-hf", builtin_copy, locked / "out"), "convert-hf")
    assert "Permission denied" in line and str(locked) in line


def test_truncated_safetensors(tmp_path, capsys, builtin_copy):
    weights = builtin_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    before = snapshot(builtin_copy)
    line = cli_error(capsys, argv_for("convert-hf", builtin_copy, tmp_path / "out"), "convert-hf")
    assert "safetensors" in line and str(builtin_copy) in line
    assert snapshot(builtin_copy) == before and not (tmp_path / "out").exists()


def test_crafted_index_claiming_terabytes_is_not_a_memory_error(tmp_path, capsys):
    release = release_folder(tmp_path, "v1")
    name = "bert/embeddings/word_embeddings"
    write_checkpoint(release / "bert_model.ckpt", tf_variables("v1"), claimed_shapes={name: (1 << 20, 1 << 20)})
    line = cli_error(capsys, argv_for("convert-tf", release, tmp_path / "out"), "convert-tf")
    assert name in line and "truncated" in line and "bert_model.ckpt.data-00000-of-00001" in line
    assert not (tmp_path / "out").exists()


def edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda c: {**c, "hidden_act": "nope"}, "hidden_act 'nope' is not an activation"),
        (lambda c: {**c, "hidden_act": ["gelu"]}, "hidden_act"),
        (lambda c: list(c.items()), "expected a JSON object, got a list"),
        (lambda c: "text", "expected a JSON object, got a str"),
    ],
    ids=["unknown-act", "list-act", "list-config", "string-config"],
)
def test_bad_configs_name_the_file_and_field(tmp_path, capsys, converter, edit, fragment):
    command, source = converter
    config = source / ("config.json" if command == "convert-hf" else "bert_config.json")
    edit_json(config, edit)
    before = snapshot(source)
    line = cli_error(capsys, argv_for(command, source, tmp_path / "out"), command)
    assert fragment in line and str(config) in line
    assert snapshot(source) == before and not (tmp_path / "out").exists()


# --- 9. smaller ones ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_non_float_tf_weight_is_refused(tmp_path, capsys, dtype):
    variables = tf_variables("v1")
    name = "bert/encoder/layer_0/output/LayerNorm/gamma"
    variables[name] = np.ones_like(variables[name], dtype=dtype)
    release = release_folder(tmp_path, "v1", variables)
    line = cli_error(capsys, argv_for("convert-tf", release, tmp_path / "out"), "convert-tf")
    assert f"{name} ({dtype})" in line and "should be float weights" in line
    assert not (tmp_path / "out").exists()


def test_out_file_with_overwrite_is_refused_without_a_stray(tmp_path, capsys, converter):
    command, source = converter
    out = tmp_path / "model.bin"
    out.write_bytes(b"a file, not a folder")
    line = cli_error(capsys, [*argv_for(command, source, out), "--overwrite"], command)
    assert "not a folder" in line and str(out) in line
    assert out.read_bytes() == b"a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, "model.bin"])


def test_state_file_pointing_outside_the_release_is_refused(tmp_path, capsys):
    release = release_folder(tmp_path, "v1")
    other = tmp_path / "other"
    other.mkdir()
    for file in (FIXTURES / "v1_emb").glob("bert_model.ckpt.*"):
        shutil.copyfile(file, other / file.name.replace("bert_model", "other_model"))
    (release / "checkpoint").write_text(f'model_checkpoint_path: "{other / "other_model.ckpt"}"\n')
    before = snapshot(release)
    line = cli_error(capsys, argv_for("convert-tf", release, tmp_path / "out"), "convert-tf")
    assert str(release / "checkpoint") in line and "outside" in line and str(other / "other_model.ckpt") in line
    assert snapshot(release) == before and not (tmp_path / "out").exists()


def test_state_file_inside_the_release_is_named_in_the_output(tmp_path, capsys):
    release = release_folder(tmp_path, "v1")
    (release / "checkpoint").write_text('model_checkpoint_path: "bert_model.ckpt"\n')
    assert cli.main(argv_for("convert-tf", release, tmp_path / "out")) == 0
    assert f"from {release / 'bert_model.ckpt'}" in capsys.readouterr().out


def test_non_standard_sinusoid_table_is_named(tmp_path, capsys, builtin_copy):
    weights = builtin_copy / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    tensors["roformer.encoder.embed_positions.weight"][7, 3] += 0.05
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    line = cli_error(capsys, argv_for("convert-hf", builtin_copy, tmp_path / "out"), "convert-hf")
    assert "not the standard RoFormer sinusoid table" in line and "position 7" in line
    assert not (tmp_path / "out").exists()


def test_build_vocab_refuses_to_write_over_its_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("我们喜欢北京。\n", encoding="utf-8")
    assert cli.main(["build-vocab", "--corpus", str(corpus), "--out", str(corpus), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is the input" in err and str(corpus) in err
    assert corpus.read_text(encoding="utf-8") == "我们喜欢北京。\n"
    assert os.listdir(tmp_path) == ["corpus.txt"]
