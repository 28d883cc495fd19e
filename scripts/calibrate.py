"""Decide this CPU's fast paths for a model at the input shapes it will run, and store them for later processes.

    roformer-rope calibrate MODEL_DIR --shapes 1x32,8x128 [--dtype bfloat16] [--threads 2] [--auto AutoModel]

The model's code measures which kernel is fastest for each shape class on the running CPU (oneDNN or `F.linear`,
packed weights or not, GELU fused or not, SDPA or our attention kernel), and keeps the choices on disk for the next
process on the same machine. A process that finds none times the candidates over its first calls, which run
slower meanwhile (a 4-layer, 768-wide model on 1×32 tokens: 0.68-0.72× the built-in's speed over its calls 4-10 on
an Emerald Rapids Xeon, `python bench/experiments.py --only small_models_first_calls`). This command pays that
once, ahead: it loads MODEL_DIR as a user's process does
(`AutoModelFor*.from_pretrained(MODEL_DIR, trust_remote_code=True)`: the folder's code, whose choices are stored
under a hash of that code), runs forwards of random token ids at each batch×length until every class those calls
use is decided (`calibration_roformer_rope.warm_up`), prints the decisions and the file they are stored in
(`$ROFORMER_ROPE_CACHE`, else `$XDG_CACHE_HOME/roformer_rope`, else `~/.cache/roformer_rope`). Run it with the
thread count, dtype and code (`--installed-code`: a process that imports `modeling_roformer_rope` runs the installed
copy) of the processes to come: a choice is stored for one of each.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="a roformer_rope model folder (config.json, weights, payload code)")
    parser.add_argument(
        "--shapes",
        default="1x32,1x128,8x128",
        help="BATCHxLENGTH of the inputs to come, comma-separated (1x1 for generation: a decode step's one-row GEMMs)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype the model will run in")
    parser.add_argument("--threads", type=int, help="torch threads of the processes to come (default: torch's)")
    parser.add_argument(
        "--auto", help="the Auto class to load with (default: the one config.json's first architecture is mapped to)"
    )
    parser.add_argument(
        "--installed-code",
        action="store_true",
        help="run the installed modeling_roformer_rope instead of the folder's code (choices stored apart)",
    )
    parser.add_argument("--max-runs", type=int, default=64, help="forwards per shape at most (default 64)")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x32,8x128' → [(1, 32), (8, 128)]; a clear error naming --shapes otherwise."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, sep, length = part.lower().partition("x")
        if not (sep and batch.isdecimal() and length.isdecimal() and int(batch) > 0 and int(length) > 0):
            raise ValueError(f"--shapes: {part!r} is not BATCHxLENGTH with positive integers (e.g. 1x32,8x128)")
        shapes.append((int(batch), int(length)))
    if not shapes:
        raise ValueError("--shapes: no shape given (e.g. 1x32,8x128)")
    return shapes


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (MODEL_DIR must be a saved model folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid UTF-8 JSON ({error})") from None
    if not isinstance(config, dict) or config.get("model_type") != "roformer_rope":
        found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path}: model_type is {found!r}, not 'roformer_rope' (convert it first: roformer-rope convert-hf)")
    return config


def auto_class_name(config: dict) -> str:
    """The Auto class config.json's first architecture is mapped to in its `auto_map`, else AutoModel."""
    architecture = (config.get("architectures") or [None])[0]
    for auto_name, target in (config.get("auto_map") or {}).items():
        if auto_name != "AutoConfig" and isinstance(target, str) and target.rsplit(".", 1)[-1] == architecture:
            return auto_name
    return "AutoModel"


def load(folder: Path, auto_name: str, dtype: str, installed_code: bool):
    """The model as a user's process loads it, in eval mode."""
    import torch
    import transformers

    if not auto_name.startswith("AutoModel") or not hasattr(transformers, auto_name):
        raise ValueError(f"--auto: {auto_name!r} is not a transformers AutoModel class")
    if auto_name == "AutoModelForMultipleChoice":
        raise ValueError("--auto: a multiple-choice model takes (batch, choices, length) inputs; calibrate its "
                         "encoder instead: --auto AutoModel --shapes (BATCH*CHOICES)xLENGTH")  # fmt: skip
    if installed_code:
        import modeling_roformer_rope  # noqa: F401 - registers the installed classes with the Auto classes
    model = getattr(transformers, auto_name).from_pretrained(
        folder, trust_remote_code=not installed_code, dtype=getattr(torch, dtype)
    )
    return model.eval()


def payload_module(model, name: str):
    """The payload module `name` of the code `model` runs (the folder's copy or the installed one)."""
    package = type(model).__module__.rpartition(".")[0]
    return importlib.import_module(f"{package}.{name}" if package else name)


def calibrate(model, shapes: list[tuple[int, int]], max_runs: int, seed: int = 0) -> list[dict]:
    """Warm `model` up at each shape (`warm_up`); one row per shape: forwards it took, their seconds, and the
    seconds of one forward afterwards (the choices running)."""
    import torch

    calibration = payload_module(model, "calibration_roformer_rope")
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for batch, length in shapes:
        input_ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)  # (B, T)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        with torch.no_grad():
            start = time.perf_counter()
            runs = calibration.warm_up(lambda inputs=inputs: model(**inputs), max_runs)
            spent = time.perf_counter() - start
            start = time.perf_counter()
            model(**inputs)
            after = time.perf_counter() - start
        still = len(calibration.timing_on_calls())
        logger.info("%dx%d: decided in %s (%.2f s); a forward now takes %.1f ms%s", batch, length, _forwards(runs),
                    spent, 1e3 * after, f"; {still} classes still open" if still else "")  # fmt: skip
        rows.append({"shape": f"{batch}x{length}", "forwards": runs, "seconds": spent, "forward_ms": 1e3 * after})
    return rows


def _forwards(runs: int) -> str:
    return f"{runs} forward" + "s" * (runs != 1)


def decisions_table(model) -> str:
    """Every decision of this process, as a markdown table: class, choice, each candidate's time."""
    lines = ["| class | choice | candidates (ms) |", "|---|---|---|"]
    for decision in payload_module(model, "calibration_roformer_rope").decisions():
        times = ", ".join(f"{name} {ms:.3f}" for name, ms in decision["ms"].items())
        lines.append(f"| {tuple(decision['class'])} | {decision['choice']} | {times} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    shapes = parse_shapes(args.shapes)
    config = _read_config(args.model)
    positions = config.get("max_position_embeddings")
    for _, length in shapes:  # before anything is loaded or stored
        if isinstance(positions, int) and length > positions:
            raise ValueError(f"--shapes: length {length} > the model's max_position_embeddings ({positions})")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is not a positive thread count")
        torch.set_num_threads(args.threads)
    if args.max_runs < 1:
        raise ValueError(f"--max-runs: {args.max_runs} is not a positive count")
    auto_name = args.auto or auto_class_name(config)
    logger.info("loading %s with %s (%s, %s code, %d threads)", args.model, auto_name, args.dtype,
                "installed" if args.installed_code else "the folder's", torch.get_num_threads())  # fmt: skip
    model = load(args.model, auto_name, args.dtype, args.installed_code)
    where = payload_module(model, "stored_choices_roformer_rope").file()
    if where is None:
        raise ValueError("ROFORMER_ROPE_CACHE switches stored choices off: nothing would be kept for the next "
                         f"process (it is {os.environ.get('ROFORMER_ROPE_CACHE')!r})")  # fmt: skip
    rows = calibrate(model, shapes, args.max_runs)
    print(decisions_table(model))
    for row in rows:
        print(f"{row['shape']}: {_forwards(row['forwards'])}, {row['seconds']:.2f} s; then {row['forward_ms']:.1f} ms a "
              "forward")  # fmt: skip
    print(f"stored in {where}")
    return 0
