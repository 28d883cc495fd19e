"""The calibration's choices kept on disk, so that the next process on the same machine looks them up.

Why: a process times the candidates of each shape class on first use (`calibration_roformer_rope.choose`). On a
2-core Cascade Lake, first forwards of a 4-layer model at 1, 16, 128 and 4×512 tokens spend ~0.7 s doing so
(`python bench/experiments.py --only calibration_cost`), and 40 review lengths at batch 1 through a 12-layer model ran
0.91× the built-in's speed in a fresh process's first pass, 1.15-1.19× in the next two, and 1.16× in the first pass of
a second process that read the first one's choices (`--only varied_lengths`). The answer depends on the machine
(CPU, ISA limits, torch build, thread count) and on this code, not on the process: the next process would time the
same candidates to the same answer.

Where: one JSON file per machine signature (`dispatch-<hash>.json`) in `$ROFORMER_ROPE_CACHE`, else
`$XDG_CACHE_HOME/roformer_rope`, else `~/.cache/roformer_rope`; `ROFORMER_ROPE_CACHE=0` (or `off`) switches it off.
The signature is the CPU's model, family/model/stepping and flags, the ISA-limiting environment variables, torch's
version, the thread count and a hash of this folder's source (a changed kernel is timed again). A CPU that changes
between sessions of a VM gets its own file.

Safe by construction: a stored choice is used only if it names one of its class's current candidates; a file that
cannot be read or parsed is ignored (and replaced on the next write); a write goes to a temporary file moved into
place, merged with what is on disk at that moment (several processes, e.g. DeepSpeed ranks, may write: an entry lost
in a race is timed again by a later process). A folder that cannot be made or written costs a debug log line.
Forced decisions (`ROFORMER_ROPE_FORCE`, `force`) are never stored.
"""

import hashlib
import json
import logging
import os
import pathlib
import platform
import tempfile

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
# environment variables that change which instructions the kernels use, hence their speed
_ISA_VARIABLES = (
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
    "ONEDNN_DEFAULT_FPMATH_MODE",
)  # fmt: skip
_OFF = ("0", "off", "false", "no")


_FOLDER_VARIABLES = ("ROFORMER_ROPE_CACHE", "XDG_CACHE_HOME", "HOME")  # what `folder` reads (HOME: through "~")


def folder() -> pathlib.Path | None:
    """Where the choices are stored, or None when switched off (`ROFORMER_ROPE_CACHE=0`)."""
    raw = os.environ.get("ROFORMER_ROPE_CACHE", "").strip()
    if raw.lower() in _OFF:
        return None
    if raw:
        return pathlib.Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "roformer_rope"


def _cpu() -> dict:
    """The CPU as /proc/cpuinfo names it (its first processor), or as `platform` does elsewhere."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block is enough: a VM's processors are alike
                name, _, value = (part.strip() for part in line.partition(":"))
                if name in ("vendor_id", "model name", "cpu family", "model", "stepping", "flags"):
                    fields[name] = " ".join(sorted(value.split())) if name == "flags" else value
    except OSError:
        pass
    return fields or {"processor": platform.processor(), "machine": platform.machine()}


def _source_hash() -> str:
    """A hash of this folder's Python files: a changed candidate or kernel invalidates what was timed before it."""
    digest = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_machine: list[dict] = []  # the thread-independent part of the signature, computed once per process


def signature() -> dict:
    """Everything a timing depends on beyond the shape class."""
    if not _machine:
        _machine.append(
            {
                "format": FORMAT,
                "cpu": _cpu(),
                "isa_limits": {name: os.environ[name] for name in _ISA_VARIABLES if name in os.environ},
                "torch": torch.__version__,
                "source": _source_hash(),
            }
        )
    return {**_machine[0], "threads": torch.get_num_threads()}


def _path(sig: dict) -> pathlib.Path | None:
    where = folder()
    if where is None:
        return None
    name = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:20]
    return where / f"dispatch-{name}.json"


_where: list = []  # [machine part, thread count and folder variables, signature, file]: `_here`'s last answer


def _here() -> tuple[dict, pathlib.Path | None]:
    """(`signature()`, its file), worked out again only when the machine part, the thread count or a variable the
    folder depends on changes: every open decision looks its key up on every call (`calibration_roformer_rope.
    pending`), and serialising and hashing the signature each time was most of a lookup's cost."""
    if not _machine:
        signature()  # fills _machine
    machine = _machine[0]
    key = (torch.get_num_threads(), *(os.environ.get(name) for name in _FOLDER_VARIABLES))
    if not (_where and _where[0] is machine and _where[1] == key):
        sig = signature()
        _where[:] = [machine, key, sig, _path(sig)]
    return _where[2], _where[3]


def file() -> pathlib.Path | None:
    """The file this process's choices are stored in and read from (its machine signature's), None when off."""
    return _here()[1]


def _read(path: pathlib.Path, sig: dict) -> dict[str, dict]:
    """The stored entries of `path` ({json key: {"choice", "ms"}}), {} when absent, unreadable or not this signature."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.debug("roformer_rope dispatch: ignoring unreadable %s (%s)", path, error)
        return {}
    if not isinstance(data, dict) or data.get("signature") != sig or not isinstance(data.get("choices"), dict):
        return {}
    return {k: v for k, v in data["choices"].items() if isinstance(v, dict) and isinstance(v.get("choice"), str)}


_loaded: dict[str, dict[str, dict]] = {}  # file path → its entries, read once per process (and per thread count)


_keys: dict[tuple, str] = {}  # decision key → its JSON form: an open decision is looked up on each of its calls


def _key(key: tuple) -> str:
    text = _keys.get(key)
    if text is None:
        text = _keys[key] = json.dumps(list(key), default=str)
    return text


def stored(key: tuple) -> tuple[str, dict[str, float]] | None:
    """(choice, its candidates' times in seconds) stored for `key` on this machine, or None."""
    sig, path = _here()
    if path is None:
        return None
    entries = _loaded.get(str(path))
    if entries is None:
        entries = _loaded[str(path)] = _read(path, sig)
    entry = entries.get(_key(key))
    if entry is None:
        return None
    times = entry.get("ms")
    times = times if isinstance(times, dict) else {}
    return entry["choice"], {name: float(ms) / 1e3 for name, ms in times.items() if isinstance(ms, (int, float))}


def store(key: tuple, choice: str, times: dict[str, float]) -> None:
    """Add `key`'s choice and its candidates' times (s) to this machine's file, merged with what is there now."""
    sig, path = _here()
    if path is None:
        return
    entry = {"choice": choice, "ms": {name: round(1e3 * t, 4) for name, t in times.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read(path, sig)
        entries[_key(key)] = entry
        handle, temporary = tempfile.mkstemp(prefix=".dispatch-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump({"signature": sig, "choices": entries}, out, indent=0, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as error:
        logger.debug("roformer_rope dispatch: cannot store choices in %s (%s)", path.parent, error)
        return
    _loaded[str(path)] = entries


def forget_loaded() -> None:
    """Read the file again on the next lookup (tests; another process may have written it)."""
    _loaded.clear()


__all__ = ["file", "folder", "forget_loaded", "signature", "store", "stored"]
