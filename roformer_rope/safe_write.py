"""Write a command's output so that no failure loses the old output or leaves half a new one.

    with safe_output_folder(args.out, overwrite=args.overwrite, sources=[args.model], what="--out") as tmp:
        model.save_pretrained(tmp)      # write everything into `tmp`
        check(tmp)                      # raise to abandon: `out` stays as it was
    # `out` is now the new folder; the previous one is gone

    with safe_output_file("vocab.txt", overwrite=True) as tmp:
        tmp.write_text(...)

The promise, for folders and single files alike:

- **Refused before anything is touched** (`OutputError`): `out` exists and `overwrite` is false; `out` is
  the current directory or one of its parents; `out` equals, contains or lies inside one of `sources`
  (symlinks resolved: `--out` pointing at the input cannot delete it); a folder output that exists as a
  file or a file output that exists as a folder; a parent that is not a folder.
- **Written beside, swapped in at the end.** The new output goes to a temporary sibling
  `.NAME.tmp-XXXXXXXX` (same filesystem, so the swap is a rename). A folder swap renames the old `out`
  to `.NAME.old-XXXXXXXX`, renames the new one to `out`, then deletes the old; if the second rename
  fails for any reason (KeyboardInterrupt included) the old folder is renamed back. A file swap is one
  atomic `os.replace`. The old output is never deleted before the new one is in place. Ctrl-C arriving
  during the swap (main thread) is held until the swap is complete, then raised.
- **Nothing left behind**: the temporary (and any parent folder created for `out`) is removed on
  failure, the set-aside old output after success.
- **Shareable**: the output gets the modes a plain `mkdir`/`open` would give under the current umask
  (0755 folders, 0644 files under umask 022), not `mkdtemp`'s owner-only 0700/0600 — also for files the
  caller's writer created owner-only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["OutputError", "check_output", "safe_output_file", "safe_output_folder"]

logger = logging.getLogger(__name__)

StrPath = str | os.PathLike


class OutputError(ValueError):
    """The output path cannot be used: exists without overwrite, is or overlaps a source, the cwd, ..."""


# ---------------------------------------------------------------------------------------------
# checks, before anything is touched
# ---------------------------------------------------------------------------------------------


def _overlap(out: Path, source: Path) -> str | None:
    """How `out` and `source` (both resolved) overlap, or None."""
    if out == source:
        return "is"
    if out in source.parents:
        return "contains"
    if source in out.parents:
        return "is inside"
    return None


def check_output(
    out: StrPath, *, overwrite: bool = False, sources: Iterable[StrPath] = (), what: str = "output", folder: bool = True
) -> Path:
    """Raise `OutputError` if writing `out` (a folder, or a file with `folder=False`) is unsafe; returns
    `out` as an absolute path. `safe_output_folder`/`safe_output_file` call it first; call it yourself
    to fail before expensive work."""
    if not str(out).strip():
        raise OutputError(f"{what}: empty path")
    path = Path(os.path.abspath(out))
    label = f"{what} {out}"
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        relation = "is" if resolved == cwd else "contains"
        raise OutputError(f"{label}: {relation} the current directory; write to a new folder instead")
    for source in sources:
        relation = _overlap(resolved, Path(os.path.abspath(source)).resolve())
        if relation:
            raise OutputError(f"{label}: {relation} the input {source}; writing there could destroy it")
    if os.path.lexists(path):
        if not overwrite:
            raise OutputError(f"{label}: already exists (pass --overwrite to replace it)")
        if folder and not path.is_dir():
            raise OutputError(f"{label}: exists and is not a folder; remove it or choose another path")
        if not folder and path.is_dir():
            raise OutputError(f"{label}: is a folder; expected a file path")
    parent = next((p for p in path.parents if os.path.lexists(p)), None)
    if parent is not None and not parent.is_dir():
        raise OutputError(f"{label}: {parent} is not a folder")
    return path


# ---------------------------------------------------------------------------------------------
# modes, names, removal, interrupts
# ---------------------------------------------------------------------------------------------


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask is process-global)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _share(root: Path) -> None:
    """Give `root` and everything below it the modes a plain mkdir/open would (umask applied)."""
    mask = _umask()
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        executable = stat.S_ISDIR(mode) or mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        path.chmod((0o777 if executable else 0o666) & ~mask)


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; returns the folders it created, outermost first (removed again on failure)."""
    missing = [p for p in [folder, *folder.parents] if not os.path.lexists(p)][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _sibling(out: Path, tag: str) -> Path:
    """An unused hidden name next to `out` (`.NAME.tmp-XXXXXXXX`), not created."""
    while True:
        candidate = out.with_name(f".{out.name}.{tag}-{secrets.token_hex(4)}")
        if not os.path.lexists(candidate):
            return candidate


def _remove(path: Path) -> None:
    """Delete a file, symlink or folder tree; read-only subfolders are made writable and retried."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return

    def retry(function, name, _error):
        parent = os.path.dirname(name)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        with contextlib.suppress(FileNotFoundError):
            if not os.path.islink(name):
                os.chmod(name, os.lstat(name).st_mode | stat.S_IRWXU)
        function(name)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def _remove_leftover(path: Path, what: str) -> None:
    """Best-effort removal that never masks the error being handled; says what it had to leave."""
    try:
        if os.path.lexists(path):
            _remove(path)
    except OSError as error:
        logger.warning("could not delete the %s %s (%s); delete it by hand", what, path, error)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT back for the duration of the block (main thread only), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous == signal.SIG_IGN:  # installed outside Python, or ignored anyway
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:  # deliver it now, to the handler that was in place (KeyboardInterrupt by default)
            signal.raise_signal(signal.SIGINT)


# Indirections so tests can inject a failure or an interrupt at a precise step of the swap.
def _rename(source: Path, target: Path) -> None:
    os.rename(source, target)


def _replace(source: Path, target: Path) -> None:
    os.replace(source, target)


def _swap_folder(tmp: Path, out: Path) -> None:
    """Put `tmp` at `out`; an existing `out` is set aside first, restored on failure, removed last."""
    if not os.path.lexists(out):
        _rename(tmp, out)
        return
    old = _sibling(out, "old")
    _rename(out, old)
    try:
        _rename(tmp, out)
    except BaseException:
        try:
            _rename(old, out)
        except OSError as error:
            logger.error("could not restore the previous output: it is at %s (%s)", old, error)
        raise
    _remove_leftover(old, "previous output")


# ---------------------------------------------------------------------------------------------
# the writers
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def safe_output_folder(
    out: StrPath, *, overwrite: bool = False, sources: Iterable[StrPath] = (), what: str = "output"
) -> Iterator[Path]:
    """Yield an empty temp folder next to `out`; on success swap it in as `out` atomically.

    On any exception in the block (or during the swap) the temp folder is removed and an existing
    `out` is left exactly as it was. See the module docstring for the checks and the modes.
    """
    path = check_output(out, overwrite=overwrite, sources=sources, what=what, folder=True)
    created = _make_parents(path.parent)
    tmp = _sibling(path, "tmp")
    try:
        tmp.mkdir()  # mode 0777 & ~umask, like any mkdir
        yield tmp
        _share(tmp)
        with _interrupts_held():
            _swap_folder(tmp, path)
    except BaseException:
        with _interrupts_held():
            _remove_leftover(tmp, "temporary folder")
            _remove_empty(created)
        raise


@contextlib.contextmanager
def safe_output_file(
    out: StrPath, *, overwrite: bool = False, sources: Iterable[StrPath] = (), what: str = "output"
) -> Iterator[Path]:
    """Yield the path of an empty temp file next to `out`; on success it atomically replaces `out`.

    On any exception the temp file is removed and an existing `out` is untouched.
    """
    path = check_output(out, overwrite=overwrite, sources=sources, what=what, folder=False)
    created = _make_parents(path.parent)
    tmp = _sibling(path, "tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # 0666 & ~umask, like open()
        yield tmp
        _share(tmp)
        with _interrupts_held():
            _replace(tmp, path)
    except BaseException:
        with _interrupts_held():
            _remove_leftover(tmp, "temporary file")
            _remove_empty(created)
        raise
