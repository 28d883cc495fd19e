"""bert4keras variables → our state dict (declarative table), and the strict load into a model.

Kernels are stored [in, out] and transposed for `torch.nn.Linear`; TF leaf names (kernel/gamma/beta)
become weight/bias; query/key/value fuse into one `qkv` projection (`key_map.fuse_qkv`). Optimizer slots
are skipped before renaming; everything else must match `KEY_MAP`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from .key_map import ConversionError, Rule, fuse_qkv, map_key, map_keys

# Training state, never weights: Google BERT's AdamWeightDecay slots, Keras/TF optimizer slots, step
# counters and loss-scaling state. Skipped before renaming; everything else must match KEY_MAP.
OPTIMIZER_SLOTS = re.compile(
    r"/(adam_[mv]|Adam(_\d+)?|AdamWeightDecay(_\d+)?|Momentum|RMSProp(_\d+)?|ExponentialMovingAverage|"
    r"accumulator|accum_grad)$"
    r"|^(global_step|bad_steps|good_steps|loss_scale|current_loss_scale|beta[12]_power|learning_rate|iterations)$"
    r"|^(training|optimizer|Adam|AdamW|AdamWeightDecay)(_\d+)?/"
)

# TF variable name → our state-dict key, before the leaf rename below. `None` drops the variable.
# The leaf (kernel/bias/gamma/beta) is kept so `_rename_leaf` knows which tensors to transpose.
KEY_MAP: list[Rule] = [
    (r"^bert/embeddings/(word|token_type)_embeddings$", r"roformer.embeddings.\1_embeddings.weight"),
    (r"^bert/embeddings/LayerNorm/(gamma|beta)$", r"roformer.embeddings.norm.\1"),
    (r"^bert/encoder/embedding_hidden_mapping_in/(kernel|bias)$", r"roformer.embeddings_project.\1"),
    (
        r"^bert/encoder/layer_(\d+)/attention/self/(query|key|value)/(kernel|bias)$",
        r"roformer.layers.\1.attention.\2.\3",
    ),
    (r"^bert/encoder/layer_(\d+)/attention/output/dense/(kernel|bias)$", r"roformer.layers.\1.attention.o_proj.\2"),
    (r"^bert/encoder/layer_(\d+)/attention/output/LayerNorm/(gamma|beta)$", r"roformer.layers.\1.attention_norm.\2"),
    (r"^bert/encoder/layer_(\d+)/intermediate/dense/(kernel|bias)$", r"roformer.layers.\1.mlp.up_proj.\2"),
    (r"^bert/encoder/layer_(\d+)/output/dense/(kernel|bias)$", r"roformer.layers.\1.mlp.down_proj.\2"),
    (r"^bert/encoder/layer_(\d+)/output/LayerNorm/(gamma|beta)$", r"roformer.layers.\1.mlp_norm.\2"),
    (r"^bert/pooler/dense/(kernel|bias)$", r"roformer.pooler.dense.\1"),
    (r"^cls/predictions/transform/dense/(kernel|bias)$", r"lm_head.dense.\1"),
    (r"^cls/predictions/transform/LayerNorm/(gamma|beta)$", r"lm_head.norm.\1"),
    # The MLM decoder weight is the word embedding table (tied); only its bias is stored.
    (r"^cls/predictions/output_bias$", "lm_head.decoder.bias"),
    # BERT's next-sentence head: some releases carry it, no RoFormer model uses it.
    (r"^cls/seq_relationship/(output_weights|output_bias)$", None),
]
_LEAF = re.compile(r"\.(kernel|gamma|beta)$")
_LEAF_NAMES = {"kernel": "weight", "gamma": "weight", "beta": "bias"}
TIED_KEYS = ("lm_head.decoder.weight",)  # filled from the word embeddings, never stored


def _rename_leaf(key: str) -> str:
    return _LEAF.sub(lambda m: "." + _LEAF_NAMES[m.group(1)], key)


def rename_variable(name: str) -> str | None:
    """Our key for one TF variable (None = dropped on purpose); raises KeyError when no rule matches."""
    key = map_key(name, KEY_MAP)
    return None if key is None else _rename_leaf(key)


def _as_weight(name: str, array: np.ndarray) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if name.endswith("/kernel"):
        tensor = tensor.T.contiguous()  # TF dense kernels are [in, out]; torch Linear wants [out, in]
    return tensor


def convert_variables(variables: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rename, transpose kernels and fuse q/k/v; returns (state dict, our key → TF source name).

    Raises a ConversionError naming every variable no rule knows instead of skipping it, and every
    variable that should be a weight but is not floating point (int/bool would be cast silently).
    """
    arrays, sources = map_keys(variables, KEY_MAP, noun="variable")
    arrays = {_rename_leaf(key): array for key, array in arrays.items()}
    sources = {_rename_leaf(key): name for key, name in sources.items()}
    not_float = sorted(f"{sources[k]} ({a.dtype})" for k, a in arrays.items() if a.dtype.kind != "f")
    if not_float:
        raise ConversionError(
            f"{len(not_float)} variable(s) that should be float weights are not: {', '.join(not_float)}"
        )
    tensors = {key: _as_weight(sources[key], array) for key, array in arrays.items()}
    return fuse_qkv(tensors, sources, noun="variable")


def has_mlm_head(names: set[str], kind: str) -> bool:
    """V2's head is the tied embedding alone (always there); v1/sim/gpt store `cls/predictions/*`."""
    return kind.startswith("v2") or any(n.startswith("cls/predictions/") for n in names)


def build_model(config, with_head: bool) -> torch.nn.Module:
    """The model the folder is saved from: MLM/LM head (with the pooler, when the checkpoint has one, carried by its
    encoder: saved in the same file, loaded by AutoModel with the encoder) or the bare encoder."""
    import modeling_roformer_rope as rr

    if not with_head:
        config.architectures = ["RoFormerRopeModel"]
        return rr.RoFormerRopeModel(config)
    model_class = rr.RoFormerRopeForCausalLM if config.is_decoder else rr.RoFormerRopeForMaskedLM
    return model_class(config)


def load_strict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], sources: dict[str, str]) -> None:
    """Load every weight or fail listing all missing, unexpected and wrongly shaped ones."""
    if model.base_model is model:  # the bare encoder's keys carry no `roformer.` prefix; KEY_MAP writes it
        state_dict = {k.removeprefix("roformer."): v for k, v in state_dict.items()}
        sources = {k.removeprefix("roformer."): v for k, v in sources.items()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in TIED_KEYS}
    missing = sorted(k for k in expected if k not in state_dict)
    unexpected = sorted(sources[k] for k in state_dict if k not in expected)
    wrong = [
        f"{sources[k]} {list(t.shape)} (config expects {list(expected[k])} for {k})"
        for k, t in state_dict.items()
        if k in expected and tuple(t.shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing weights {missing}")
    if unexpected:
        problems.append(f"variables the config has no place for {unexpected}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong)}")
    if problems:
        raise ConversionError("checkpoint and bert_config.json do not match: " + " | ".join(problems))
    full = dict(state_dict)
    for key in TIED_KEYS:
        if key in model.state_dict():
            full[key] = state_dict["roformer.embeddings.word_embeddings.weight"]
    model.load_state_dict(full, strict=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()
