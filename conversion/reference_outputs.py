"""Check a converted model against outputs recorded from the original code (`--reference-outputs`).

The reload check (`verify.verify_folder`) compares the saved folder with the in-memory model, so it
cannot see a wrong conversion choice: a v1 encoder converted as RoFormer-Sim is self-consistent and
wrong. Outputs of the original code on the same weights can see it. Record them once where TensorFlow
and bert4keras run (as tests/fixtures/generate_tf_fixtures.py does) in a numpy `.npz`:

    input_ids        int [B, T], 0 = padding           required
    token_type_ids   int [B, T]                        optional (zeros)
    hidden_states    float [B, T, H]  last layer       \\
    mlm_logits       float [B, T, V]  pre-softmax       | at least one
    lm_logits        float [B, T, V]  (RoFormer-GPT)    |
    pooler           float [B, H]                      /
    long_*           the same keys for a second batch  optional

Outputs are compared where `input_ids != 0` (bert4keras computes meaningless values at padded query
rows), to `atol` (default 1e-4: float32 TF vs torch).
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import numpy as np
import torch

from .key_map import ConversionError
from .verify import max_diff

logger = logging.getLogger(__name__)

ATOL = 1e-4
OUTPUTS = ("hidden_states", "mlm_logits", "lm_logits", "pooler")


def load_reference(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of a reference `.npz`, checked for the keys above."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise ConversionError(f"{path}: reference outputs file not found") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise ConversionError(f"{path}: not a readable .npz of reference outputs ({error})") from None
    if "input_ids" not in arrays:
        raise ConversionError(f"{path}: no input_ids array (see --help for the reference file format)")
    if not any(name in arrays for name in OUTPUTS):
        raise ConversionError(f"{path}: no output to compare, expected one of {list(OUTPUTS)}")
    return arrays


def _batch(arrays: dict[str, np.ndarray], prefix: str, path: str | Path, vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.from_numpy(np.asarray(arrays[f"{prefix}input_ids"])).long()
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise ConversionError(f"{path}: {prefix}input_ids must be a non-empty [B, T] array of ids < {vocab_size}")
    segments = arrays.get(f"{prefix}token_type_ids")
    segments = torch.zeros_like(ids) if segments is None else torch.from_numpy(np.asarray(segments)).long()
    if segments.numel() != ids.numel():
        raise ConversionError(f"{path}: {prefix}token_type_ids does not match {prefix}input_ids in shape")
    return dict(input_ids=ids, token_type_ids=segments.reshape(ids.shape), attention_mask=(ids != 0).long())


@torch.no_grad()
def compare_with_reference(model: torch.nn.Module, path: str | Path, atol: float = ATOL) -> float:
    """Max |diff| between `model` and the recorded outputs; ConversionError if any exceeds `atol`."""
    arrays = load_reference(path)
    base = model.base_model
    diffs: dict[str, float] = {}
    for prefix in ("", "long_"):
        if f"{prefix}input_ids" not in arrays:
            continue
        batch = _batch(arrays, prefix, path, model.config.vocab_size)
        keep = batch["input_ids"] != 0
        shape = batch["input_ids"].shape
        outputs = model(**batch, output_hidden_states=True)
        actual = {"hidden_states": outputs.hidden_states[-1]}
        if hasattr(outputs, "logits"):
            actual["mlm_logits"] = actual["lm_logits"] = outputs.logits
        if base.pooler is not None:
            actual["pooler"] = base.pooler(base(**batch).last_hidden_state)  # a task model's encoder does not run it
        for name in OUTPUTS:
            reference = arrays.get(prefix + name)
            if reference is None:
                continue
            if name not in actual:
                raise ConversionError(f"{path}: has {prefix}{name} but the converted model has no such output")
            mask = torch.ones(shape[0], dtype=torch.bool) if name == "pooler" else keep
            try:
                expected = torch.from_numpy(np.asarray(reference, dtype=np.float32)).reshape(actual[name].shape)
            except RuntimeError:
                raise ConversionError(
                    f"{path}: {prefix}{name} has shape {list(reference.shape)}, the model gives "
                    f"{list(actual[name].shape)}"
                ) from None
            diffs[prefix + name] = max_diff(expected, actual[name], mask, name)
    worst = max(diffs.values(), default=0.0)
    if not worst <= atol:
        bad = {k: f"{v:.3g}" for k, v in diffs.items() if not v <= atol}
        raise ConversionError(
            f"{path}: the converted model does not reproduce the original outputs (max |diff| {bad} > {atol}); "
            "a wrong --model-kind (e.g. sim vs v1 with a tanh pooler) or a config that does not fit the weights"
        )
    logger.info("reference outputs %s reproduced: max |diff| %.2e %s", path, worst, diffs)
    return worst
