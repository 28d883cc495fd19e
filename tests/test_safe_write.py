"""roformer_rope.safe_write: refusals before anything is touched, swap/restore at every step, modes, no strays."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from roformer_rope import safe_write
from roformer_rope.safe_write import OutputError, check_output, safe_output_file, safe_output_folder


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under `root` (and `root` itself) with its mode and, for files, its bytes."""
    paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): (p.lstat().st_mode, None if p.is_dir() else p.read_bytes()) for p in paths}


@pytest.fixture(autouse=True)
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def old_out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "weights.bin").write_bytes(b"old weights")
    (out / "sub" / "note.txt").write_text("old note")
    return out


def write_new(folder: Path) -> None:
    (folder / "weights.bin").write_bytes(b"new weights")
    (folder / "nested").mkdir()
    (folder / "nested" / "a.txt").write_text("a")


# --- success -----------------------------------------------------------------------------------


def test_new_folder_is_created_with_shareable_modes(tmp_path):
    out = tmp_path / "deep" / "out"
    with safe_output_folder(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.tmp-") and not any(tmp.iterdir())
        write_new(tmp)
        os.chmod(tmp / "weights.bin", 0o600)  # a writer that creates owner-only files (mkstemp-style)
        os.chmod(tmp / "nested", 0o700)
    assert (out / "weights.bin").read_bytes() == b"new weights"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {"out": 0o755, "weights.bin": 0o644, "nested": 0o755, "a.txt": 0o644}
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_modes_follow_the_umask(tmp_path):
    os.umask(0o027)
    with safe_output_folder(tmp_path / "out") as tmp:
        (tmp / "f").write_text("x")
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "out" / "f").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "out" / "run.sh").stat().st_mode) == 0o750


def test_overwrite_replaces_and_leaves_no_old_copy(tmp_path, old_out):
    with safe_output_folder(old_out, overwrite=True) as tmp:
        write_new(tmp)
    assert (old_out / "weights.bin").read_bytes() == b"new weights" and not (old_out / "sub").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_read_only_subfolder_of_the_old_output_is_still_removed(tmp_path, old_out):
    (old_out / "sub").chmod(0o555)
    with safe_output_folder(old_out, overwrite=True) as tmp:
        write_new(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (old_out / "weights.bin").read_bytes() == b"new weights"


def test_symlinked_output_is_replaced_by_a_folder_and_its_target_kept(tmp_path, old_out):
    link = tmp_path / "link"
    link.symlink_to(old_out)
    before = snapshot(old_out)
    with safe_output_folder(link, overwrite=True) as tmp:
        write_new(tmp)
    assert not link.is_symlink() and (link / "weights.bin").read_bytes() == b"new weights"
    assert snapshot(old_out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


# --- failures keep the old output byte-identical and leave nothing -----------------------------


def test_exception_in_the_block_keeps_the_old_output(tmp_path, old_out):
    before = snapshot(old_out)
    with pytest.raises(RuntimeError, match="verification"):
        with safe_output_folder(old_out, overwrite=True) as tmp:
            write_new(tmp)
            raise RuntimeError("verification failed")
    assert snapshot(old_out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_removes_the_parent_folders_it_created(tmp_path):
    with pytest.raises(RuntimeError):
        with safe_output_folder(tmp_path / "new" / "deep" / "out") as tmp:
            write_new(tmp)
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        with safe_output_file(tmp_path / "a" / "vocab.txt") as tmp:
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("failing_call", [1, 2], ids=["set-aside", "swap-in"])
def test_failure_or_interrupt_at_each_rename_restores_the_old_output(
    tmp_path, old_out, monkeypatch, error, failing_call
):
    """Rename 1 sets the old output aside, rename 2 puts the new one in place: fail at either."""
    calls = []
    real = safe_write._rename

    def rename(source, target):
        calls.append((Path(source).name, Path(target).name))
        if len(calls) == failing_call:
            raise error("injected")
        real(source, target)

    monkeypatch.setattr(safe_write, "_rename", rename)
    before = snapshot(old_out)
    with pytest.raises(error):
        with safe_output_folder(old_out, overwrite=True) as tmp:
            write_new(tmp)
    assert snapshot(old_out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    if failing_call == 2:  # the restore rename ran: old name back to out
        assert calls[-1][1] == "out" and calls[-1][0].startswith(".out.old-")


def test_interrupt_after_the_swap_before_cleanup_keeps_the_new_output(tmp_path, old_out, monkeypatch):
    real = safe_write._remove_leftover

    def interrupted(path, what):
        real(path, what)
        raise KeyboardInterrupt

    monkeypatch.setattr(safe_write, "_remove_leftover", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with safe_output_folder(old_out, overwrite=True) as tmp:
            write_new(tmp)
    # the swap had completed: the new output stays, nothing else (the failure path cleans the temp name)
    assert (old_out / "weights.bin").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for the test: a process started in the background by a non-interactive
    shell (nohup, `cmd &`) inherits SIGINT ignored, and then a real Ctrl-C never reaches Python at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_real_ctrl_c_during_the_swap_is_held_until_it_is_complete(tmp_path, old_out, monkeypatch, ctrl_c_raises):
    real = safe_write._rename
    calls = []

    def rename(source, target):
        calls.append(target)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # arrives between "set aside" and "swap in"
        real(source, target)

    monkeypatch.setattr(safe_write, "_rename", rename)
    with pytest.raises(KeyboardInterrupt):
        with safe_output_folder(old_out, overwrite=True) as tmp:
            write_new(tmp)
    assert len(calls) == 2  # both renames ran before the interrupt was delivered
    assert (old_out / "weights.bin").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --- refusals, before anything is touched ------------------------------------------------------


def refused(out, match: str, **kwargs) -> None:
    with pytest.raises(OutputError, match=match):
        with safe_output_folder(out, **kwargs):
            raise AssertionError("the block must not run")


def test_existing_output_needs_overwrite(tmp_path, old_out):
    before = snapshot(old_out)
    refused(old_out, "already exists")
    assert snapshot(old_out) == before


def test_current_directory_and_its_parents_are_refused(tmp_path, old_out, monkeypatch):
    monkeypatch.chdir(old_out)
    before = snapshot(old_out)
    refused(".", "is the current directory", overwrite=True)
    refused("..", "contains the current directory", overwrite=True)
    refused(old_out / "sub" / "..", "is the current directory", overwrite=True)
    refused("", "empty path", overwrite=True)
    assert snapshot(old_out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    "out, match",
    [
        ("src", "is the input"),
        ("src/inner", "is inside the input"),
        (".", "contains the input"),
        ("link_to_src", "is the input"),
        ("link_to_src/inner", "is inside the input"),
    ],
)
def test_outputs_overlapping_a_source_are_refused(tmp_path, monkeypatch, out, match):
    root = tmp_path / "work"
    (root / "src" / "inner").mkdir(parents=True)
    (root / "src" / "inner" / "model.bin").write_bytes(b"precious")
    (root / "link_to_src").symlink_to(root / "src")
    monkeypatch.chdir(tmp_path)  # so "." below means `root` through the relative path, not the cwd
    before = snapshot(root)
    target = root if out == "." else root / out
    refused(target, match, overwrite=True, sources=[root / "src"])
    assert snapshot(root) == before


def test_a_file_where_a_folder_goes_and_the_reverse(tmp_path):
    (tmp_path / "file").write_text("keep")
    (tmp_path / "dir").mkdir()
    refused(tmp_path / "file", "not a folder", overwrite=True)
    refused(tmp_path / "file" / "out", "is not a folder")
    with pytest.raises(OutputError, match="is a folder"):
        with safe_output_file(tmp_path / "dir", overwrite=True):
            pass
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]


def test_check_output_returns_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_output("a/b", what="--out") == tmp_path / "a" / "b"


# --- single files ------------------------------------------------------------------------------


def test_file_write_replace_and_modes(tmp_path):
    out = tmp_path / "vocab.txt"
    with safe_output_file(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".vocab.txt.tmp-")
        tmp.write_text("one\n")
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    with safe_output_file(out, overwrite=True) as tmp:
        tmp.write_text("two\n")
    assert out.read_text() == "two\n" and os.listdir(tmp_path) == ["vocab.txt"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_file_failure_keeps_the_old_file_and_leaves_nothing(tmp_path, monkeypatch, error):
    out = tmp_path / "vocab.txt"
    out.write_text("old\n")

    def replace(source, target):
        raise error("injected")

    monkeypatch.setattr(safe_write, "_replace", replace)
    with pytest.raises(error):
        with safe_output_file(out, overwrite=True) as tmp:
            tmp.write_text("new\n")
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["vocab.txt"]


def test_file_equal_to_a_source_is_refused(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text")
    with pytest.raises(OutputError, match="is the input"):
        with safe_output_file(corpus, overwrite=True, sources=[corpus]):
            pass
    assert corpus.read_text() == "text"
