"""DeepSpeed plumbing for `pretrain`: process group, engine, learning rate, optimizer reset, atomic checkpoints.

On a machine without a GPU, DeepSpeed runs on its CPU accelerator with the gloo backend: `DS_ACCELERATOR=cpu`
is set before DeepSpeed is imported, its shared-memory communication op (a C++ build of ~40 s at every start,
of no use to gloo) is switched off unless `ROFORMER_ROPE_DS_SHM=1`, and the shipped configs' `torch_adam:
"auto"` picks torch's AdamW (no C++ build). Started without a launcher, the process makes itself rank 0 of 1
on a free local port (DeepSpeed would otherwise try MPI discovery and fail on `mpi4py`).

Checkpoints are atomic: DeepSpeed writes into a `.partial-TAG` folder; when every rank is done, rank 0 moves
the finished folder to `TAG` and only then points `latest` at it (written to a temp file and renamed). A run
killed mid-save leaves a `.partial-*` folder (removed at the next start) and the previous checkpoint intact.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

LATEST = "latest"
PARTIAL = ".partial-"


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    own_group: bool = False  # the process group was made here (with or without a launcher): teardown destroys it
    own_env: tuple[str, ...] = ()  # env variables set here for a launcher-less process: teardown removes them

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> Dist:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, nccl on GPU); works with or without a
    launcher (deepspeed, torchrun, or a plain `python`/`roformer-rope` process = 1 rank)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not on_gpu and os.environ.get("ROFORMER_ROPE_DS_SHM", "0") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "nccl" if on_gpu else "gloo"
    own_env: tuple[str, ...] = ()
    if "WORLD_SIZE" not in os.environ:  # no launcher: a single process group of one
        port = os.environ.get("MASTER_PORT") or str(_free_port())
        own = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        own_env = tuple(k for k in own if k not in os.environ)
        os.environ.update(own)
    own_group = not torch.distributed.is_initialized()
    if own_group:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return Dist(rank, world, local_rank, device, own_group, own_env)


def teardown_distributed(dist: Dist) -> None:
    """Undo what `setup_distributed` made: the process group it initialised, under a launcher too (torch asks a
    program to destroy its groups before it exits; a caller's own group is left alone) and, for a launcher-less
    process, the env variables it set, so later work in the same process (the quickstart's fine-tune) does not
    see a distributed run."""
    if dist.own_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key in dist.own_env:
        os.environ.pop(key, None)


MMAP_THRESHOLD = 1 << 20  # bytes


def release_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc serve allocations of ≥ `threshold` bytes with mmap, so freeing one returns it to the OS.

    ZeRO-3 gathers every layer's parameters before it runs and frees them after, forward and backward, every
    step. With glibc's default (a threshold that climbs to 32 MiB after the first large free) those buffers
    come from the heap and fragment it: a 2-rank CPU run of a 107M-parameter model kept ~850 MiB of freed
    heap per rank after 3 steps (released by `malloc_trim`), which made ZeRO-3's peak RSS higher than
    ZeRO-2's although its live tensors were not. Used for ZeRO-3 on CPU; left alone when the user set
    `MALLOC_MMAP_THRESHOLD_` or off Linux/glibc. Returns whether the setting was applied.
    """
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # -3 = M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        return False


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as BERT's recipe: biases and norm parameters get no weight decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # under ZeRO-3's zero.Init, `param` is an empty 1-D stand-in
        (no_decay if len(shape) < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_engine(model: torch.nn.Module, ds_config: dict, weight_decay: float):
    import deepspeed

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=param_groups(model, weight_decay)
    )
    return engine


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def _base_optimizer(engine):
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer


def reset_optimizer_state(engine) -> int:
    """Forget Adam's moments and step counts (a stage with `reset_optimizer: true`); returns tensors cleared.

    torch's AdamW (and DeepSpeed's Adam variants) create their state lazily when it is empty, so clearing it
    is a fresh optimizer over the same (possibly partitioned) parameters.
    """
    state = _base_optimizer(engine).state
    cleared = len(state)
    state.clear()
    return cleared


# ---- RNG ---------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- checkpoints -------------------------------------------------------------------------------------------


def checkpoint_tag(stage: int, stage_step: int) -> str:
    return f"stage{stage + 1}-step{stage_step}"


def latest_tag(root: Path) -> str | None:
    """The tag `latest` names, if it exists and is complete."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (root / tag / "run_state.json").is_file():
        raise ValueError(f"{pointer} names checkpoint {tag!r}, which is missing or incomplete in {root}")
    return tag


def remove_partials(root: Path) -> None:
    if root.is_dir():
        for leftover in root.glob(PARTIAL + "*"):
            logger.warning("removing %s, left by a run stopped while saving", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(engine, root: Path, tag: str, run_state: dict, files: dict[str, object], dist: Dist) -> Path:
    """Save engine + `run_state` (JSON) + `files` (name → bytes/str/tensor dict) atomically as `root/tag`."""
    partial = root / f"{PARTIAL}{tag}"
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    try:
        engine.save_checkpoint(str(partial), tag=tag, client_state={"run_state": run_state}, save_latest=False)
        folder = partial / tag
        torch.save(rng_state(), folder / f"rng_rank{dist.rank}.pt")
        if dist.is_main:
            for name, content in files.items():
                target = folder / name
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, (bytes, bytearray)):
                    target.write_bytes(content)
                elif isinstance(content, str):
                    target.write_text(content, encoding="utf-8")
                else:
                    torch.save(content, target)
            (folder / "run_state.json").write_text(json.dumps(run_state, indent=2, ensure_ascii=False))
        barrier()
        if dist.is_main:
            final = root / tag
            if final.exists():
                shutil.rmtree(final)
            os.replace(folder, final)
            shutil.rmtree(partial, ignore_errors=True)
            _write_atomically(root / LATEST, tag + "\n")
        barrier()
    except BaseException:
        if dist.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return root / tag


def prune_checkpoints(root: Path, keep: int, dist: Dist) -> None:
    """Keep the `keep` newest complete checkpoints (by modification time); never the one `latest` names."""
    if not dist.is_main or not root.is_dir():
        return
    current = latest_tag(root)
    tags = sorted(
        (p for p in root.iterdir() if p.is_dir() and (p / "run_state.json").is_file()),
        key=lambda p: p.stat().st_mtime,
    )
    for old in tags[: max(0, len(tags) - keep)]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def read_run_state(folder: Path) -> dict:
    path = folder / "run_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable pretraining checkpoint ({error})") from None


def load_checkpoint(engine, root: Path, tag: str, dist: Dist) -> dict:
    """Restore engine, optimizer and this rank's RNG from `root/tag`; returns the run state."""
    try:
        load_path, client = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    except ValueError as error:
        if "number of parameter groups" not in str(error):
            raise
        raise ValueError(
            f"--resume: checkpoint {root / tag}: its optimizer has another number of parameter groups than this "
            "version's two (weight decay, none); ZeRO-3 runs written before 2026-11-25 have one. Export it "
            f"(roformer-rope pretrain --export {root / tag} --out FOLDER) and continue from FOLDER with model.init_from"
        ) from None
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_file = root / tag / f"rng_rank{dist.rank}.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return client["run_state"]


__all__ = [
    "Dist",
    "barrier",
    "build_engine",
    "checkpoint_tag",
    "latest_tag",
    "load_checkpoint",
    "param_groups",
    "prune_checkpoints",
    "read_run_state",
    "remove_partials",
    "reset_optimizer_state",
    "save_checkpoint",
    "set_lr",
    "setup_distributed",
]
