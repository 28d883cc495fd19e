"""The saved folder, reloaded the way users load it, must equal the in-memory converted model.

This proves the save/reload round trip (Auto class, `trust_remote_code`, tied weights, the pooler). It
cannot see a wrong conversion *choice* (a model kind, a mapping both sides share): that is what the
original code's outputs are for (`reference_outputs`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .key_map import ConversionError

logger = logging.getLogger(__name__)


def sample_batch(config, seq_len: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of random non-pad ids (the second right-padded), two segments: what the card's usage shows."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (2, seq_len), generator=generator)
    input_ids[1, seq_len // 2 :] = 0
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq_len // 4 :] = 1
    token_type_ids[input_ids == 0] = 0
    return dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=(input_ids != 0).long())


def auto_class_name(model: torch.nn.Module) -> str:
    from modeling_roformer_rope.modeling_roformer_rope import AUTO_CLASSES

    return next(auto for auto, cls in AUTO_CLASSES.items() if type(model) is cls)


def max_diff(reference: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor, what: str) -> float:
    """Max |diff| over positions where `mask` is true; raises on non-finite outputs."""
    keep = mask.bool()
    reference, actual = reference[keep], actual[keep]
    if not torch.isfinite(actual).all():
        raise ConversionError(f"verification failed: the converted model's {what} are not finite")
    return (reference - actual).abs().max().item()


def _quiet_from_pretrained(auto_class, folder: Path) -> torch.nn.Module:
    """Load with trust_remote_code; the load report is silenced because a folder with a pooler *by design*
    holds weights one class does not use (the pooler for the MLM class, the MLM head for AutoModel)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return auto_class.from_pretrained(folder, trust_remote_code=True).eval()
    finally:
        hf_logging.set_verbosity(level)


@torch.no_grad()
def verify_folder(model: torch.nn.Module, folder: Path, atol: float = 1e-5) -> float:
    """Reload `folder` the way users will (Auto class, trust_remote_code) and compare with `model`.

    Checks the head's output and the last hidden state at non-padding positions, and for a model with a
    pooler also the pooler through `AutoModel`. Returns the largest difference.
    """
    import transformers

    batch = sample_batch(model.config)
    per_token = batch["attention_mask"]
    auto_name = auto_class_name(model)
    reloaded = _quiet_from_pretrained(getattr(transformers, auto_name), folder)
    expected = model(**batch, output_hidden_states=True)
    actual = reloaded(**batch, output_hidden_states=True)
    diffs = {
        "last_hidden_state": max_diff(expected.hidden_states[-1], actual.hidden_states[-1], per_token, "hidden states")
    }
    if auto_name != "AutoModel":
        diffs["logits"] = max_diff(expected.logits, actual.logits, per_token, "logits")
    base = model if auto_name == "AutoModel" else model.roformer
    if base.pooler is not None:
        encoder = reloaded if auto_name == "AutoModel" else _quiet_from_pretrained(transformers.AutoModel, folder)
        if encoder.pooler is None:
            raise ConversionError("verification failed: AutoModel reloaded the folder without its pooler")
        diffs["pooler_output"] = max_diff(
            base.pooler(base(**batch).last_hidden_state),  # a task model's encoder carries its pooler, unrun
            encoder(**batch).pooler_output,
            torch.ones(2, dtype=torch.bool),
            "pooler outputs",
        )
    worst = max(diffs.values())
    if not worst <= atol:
        raise ConversionError(f"verification failed: reloaded folder differs from the converted model: {diffs}")
    logger.info("verified %s reload: max |diff| %.2e %s", auto_name, worst, diffs)
    return worst
