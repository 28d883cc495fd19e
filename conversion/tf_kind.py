"""Which RoFormer a bert4keras checkpoint holds, from its variable names and its release name.

| kind   | variables                                  | name hint      | model                          |
|--------|--------------------------------------------|----------------|--------------------------------|
| v2     | no bias and no LayerNorm variables         | –              | RoFormerV2 (RMS norm, no bias) |
| v2-sim | v2's set                                   | the word "sim" | RoFormerV2 + UniLM mask        |
| v2-gpt | v2's set                                   | "gpt"          | RoFormerV2 causal LM           |
| sim    | v1's set + `bert/pooler/dense`             | the word "sim" | UniLM mask + linear pooler     |
| gpt    | exactly v1's set                           | "gpt"          | causal LM                      |
| v1     | LayerNorm and bias variables (+ a pooler)  | –              | BERT layout, bidirectional     |

The variables alone cannot tell a RoFormer-Sim from a v1 encoder saved with bert4keras' default tanh
pooler (`with_pool=True`), nor a GPT from a v1: both pairs store identical names and shapes, and
guessing wrong gives silently wrong outputs. So the name decides, as the released folders spell it
(`chinese_roformer-sim-char_L-12_H-768_A-12`, `chinese_roformer-gpt-char_L-12_H-768_A-12`): a pooler
without "sim" in the name is v1 with BERT's tanh pooler, and the decision is logged. `--model-kind`
overrides the detection: `sim` also converts a UniLM (seq2seq) checkpoint without a pooler (bert4keras'
`application='unilm'`), and `sim` / `gpt` given for a checkpoint with v2's variables mean `v2-sim` / `v2-gpt`
(bert4keras' `model='roformer_v2'` with the UniLM or LM application).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from .key_map import ConversionError

logger = logging.getLogger(__name__)

MODEL_KINDS = ("v1", "v2", "sim", "gpt", "v2-sim", "v2-gpt")
POOLER_PREFIX = "bert/pooler/"


def location_hint(prefix: str | Path) -> str:
    """The names detection reads hints from: the checkpoint folder and the prefix file (an absolute path first, so a
    relative prefix like `bert_model.ckpt`, given from inside the release folder, still names that folder)."""
    path = Path(os.path.abspath(prefix))
    return f"{path.parent.name}/{path.name}"


def says_sim(location: str) -> bool:
    """ "sim" as a word of the name (`roformer-sim-char`, `roformer_sim`), not inside `simple`/`simcse`."""
    return "sim" in re.split(r"[^a-z]+", location.lower())


def says_gpt(location: str) -> bool:
    return "gpt" in location.lower()


def has_pooler(names: set[str]) -> bool:
    return any(n.startswith(POOLER_PREFIX) for n in names)


def is_v2(names: set[str]) -> bool:
    """RoFormerV2's variables: no bias and no LayerNorm anywhere."""
    return not any("/LayerNorm/" in n or n.endswith("/bias") for n in names)


def with_family(kind: str, names: set[str]) -> str:
    """A `--model-kind` given as sim/gpt for a checkpoint with v2's variables means v2-sim/v2-gpt; a v2 kind for
    v1 variables (or the reverse) is refused here, naming what the variables say."""
    if kind in ("sim", "gpt") and is_v2(names):
        return f"v2-{kind}"
    if kind.startswith("v2") != is_v2(names):
        found = "no bias/LayerNorm variables (v2)" if is_v2(names) else "bias and LayerNorm variables (v1)"
        raise ConversionError(f"--model-kind {kind} does not fit the checkpoint: it has {found}")
    return kind


def detect_kind(names: set[str], location: str = "") -> str:
    """Model kind from the variable names and the folder/prefix name `location` (see the module doc)."""
    pooler = has_pooler(names)
    has_norm = any("/LayerNorm/" in n for n in names)
    has_bias = any(n.endswith("/bias") for n in names)
    if not has_norm and not has_bias:
        if pooler:
            raise ConversionError("cannot detect the model kind: a pooler but no bias/LayerNorm variables")
        return "v2-sim" if says_sim(location) else "v2-gpt" if says_gpt(location) else "v2"
    if not has_norm or not has_bias:
        what = "bias but no LayerNorm" if has_bias else "LayerNorm but no bias"
        raise ConversionError(f"cannot detect the model kind: {what} variables (neither v1 nor v2); pass --model-kind")
    if pooler and says_sim(location):
        return "sim"
    kind = "gpt" if says_gpt(location) else "v1"
    if pooler:
        logger.warning(
            "%s: bert/pooler/dense present but the name does not say 'sim': converting as %s with BERT's tanh "
            "pooler (pass --model-kind sim for a RoFormer-Sim: UniLM mask, linear pooler)",
            location or "checkpoint",
            kind,
        )
    return kind


def describe(kind: str, pooler: bool) -> str:
    """How the CLI and the logs name a decision: `v1`, `v1 + tanh pooler`, `sim`, ..."""
    return f"{kind} + tanh pooler" if pooler and kind in ("v1", "gpt") else kind
