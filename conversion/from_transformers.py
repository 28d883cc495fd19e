"""Convert a built-in transformers RoFormer (`model_type: roformer`) into a `roformer_rope` model or folder.

    roformer-rope convert-hf --model IN_DIR --out OUT_DIR

Weights are renamed by a declarative regex table (`KEY_MAP`); the separate query/key/value projections
are concatenated into our fused `qkv` projection; the built-in's sinusoid table is dropped (we compute the
sinusoids on the fly). Loading is strict, and a folder conversion checks the converted model's outputs
against the built-in model on a random batch before anything is written to `OUT_DIR`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Built-in key (after the regex) → our key. `None` drops the tensor (recomputed by our model).
KEY_MAP: list[tuple[str, str | None]] = [
    (r"^roformer\.encoder\.embed_positions\.weight$", None),
    (r"^roformer\.embeddings\.LayerNorm\.", "roformer.embeddings.norm."),
    (r"^roformer\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"roformer.layers.\1.attention.\2."),
    (r"^roformer\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"roformer.layers.\1.attention.o_proj."),
    (r"^roformer\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"roformer.layers.\1.attention_norm."),
    (r"^roformer\.encoder\.layer\.(\d+)\.intermediate\.dense\.", r"roformer.layers.\1.mlp.up_proj."),
    (r"^roformer\.encoder\.layer\.(\d+)\.output\.dense\.", r"roformer.layers.\1.mlp.down_proj."),
    (r"^roformer\.encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"roformer.layers.\1.mlp_norm."),
    (r"^cls\.predictions\.transform\.dense\.", "lm_head.dense."),
    (r"^cls\.predictions\.transform\.LayerNorm\.", "lm_head.norm."),
    (r"^cls\.predictions\.decoder\.", "lm_head.decoder."),
    (r"^cls\.predictions\.bias$", "lm_head.decoder.bias"),
    # Unchanged names: embeddings, embeddings_project and the task heads.
    (r"^(roformer\.embeddings\.(word|token_type)_embeddings\.weight)$", r"\1"),
    (r"^(roformer\.embeddings_project\.(weight|bias))$", r"\1"),
    (r"^((classifier|qa_outputs)(\.(dense|out_proj))?\.(weight|bias))$", r"\1"),
]
_QKV = re.compile(r"^(roformer\.layers\.\d+\.attention)\.(query|key|value)\.(weight|bias)$")

# Built-in class name → ours.
ARCHITECTURES = {
    "RoFormerModel": "RoFormerRopeModel",
    "RoFormerForMaskedLM": "RoFormerRopeForMaskedLM",
    "RoFormerForCausalLM": "RoFormerRopeForCausalLM",
    "RoFormerForSequenceClassification": "RoFormerRopeForSequenceClassification",
    "RoFormerForTokenClassification": "RoFormerRopeForTokenClassification",
    "RoFormerForQuestionAnswering": "RoFormerRopeForQuestionAnswering",
    "RoFormerForMultipleChoice": "RoFormerRopeForMultipleChoice",
}
_CONFIG_FIELDS = (
    "vocab_size embedding_size hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act "
    "hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings type_vocab_size initializer_range "
    "layer_norm_eps pad_token_id bos_token_id eos_token_id rotary_value is_decoder use_cache tie_word_embeddings "
    "id2label label2id problem_type"
).split()
# Tokenizer files worth carrying over. The built-in `tokenizer.json` is left behind on purpose: its
# pre-tokenizer is a placeholder that generic loaders silently mis-use.
_TOKENIZER_FILES = ("vocab.txt", "special_tokens_map.json", "tokenizer_config.json")


class ConversionError(ValueError):
    """The input cannot be converted; the message names the key, file or shape at fault."""


def rename_key(name: str) -> str | None:
    """Map one built-in state-dict key to ours (None = dropped); unknown keys raise."""
    for pattern, replacement in KEY_MAP:
        if re.search(pattern, name):
            return None if replacement is None else re.sub(pattern, replacement, name)
    raise ConversionError(f"unknown built-in RoFormer weight {name!r}: no rule in KEY_MAP")


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename every tensor, fuse query/key/value into `qkv` (rows ordered q, k, v), check duplicates agree."""
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        target = rename_key(name)
        if target is None:
            continue
        if target in renamed:
            # Tied aliases (cls.predictions.bias / decoder.bias) must hold the same values.
            if not torch.equal(renamed[target], tensor):
                raise ConversionError(f"{name!r} and another key both map to {target!r} with different values")
            continue
        renamed[target] = tensor

    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in renamed.items():
        match = _QKV.match(name)
        if match:
            prefix, which, kind = match.groups()
            parts.setdefault((prefix, kind), {})[which] = tensor
        else:
            converted[name] = tensor
    for (prefix, kind), pieces in parts.items():
        missing = {"query", "key", "value"} - pieces.keys()
        if missing:
            raise ConversionError(f"{prefix}: missing {sorted(missing)} {kind} for the fused qkv projection")
        converted[f"{prefix}.qkv.{kind}"] = torch.cat([pieces["query"], pieces["key"], pieces["value"]], dim=0)
    return converted


def convert_config(builtin_config) -> "RoFormerRopeConfig":  # noqa: F821
    """A `RoFormerRopeConfig` equivalent to a built-in `RoFormerConfig` (object or dict)."""
    from modeling_roformer_rope import RoFormerRopeConfig

    source = builtin_config if isinstance(builtin_config, dict) else builtin_config.to_dict()
    if source.get("model_type", "roformer") != "roformer":
        raise ConversionError(f"expected a built-in RoFormer config (model_type 'roformer'), got {source['model_type']!r}")
    fields = {key: source[key] for key in _CONFIG_FIELDS if key in source}
    architectures = [ARCHITECTURES.get(a, a) for a in source.get("architectures") or []]
    # The built-in multiple-choice head scores the last token (XLM-style summary); keep that for parity.
    return RoFormerRopeConfig(**fields, summary_type="last", architectures=architectures or None)


def model_class_for(builtin_class_name: str):
    import modeling_roformer_rope

    try:
        return getattr(modeling_roformer_rope, ARCHITECTURES[builtin_class_name])
    except KeyError:
        raise ConversionError(
            f"unsupported built-in class {builtin_class_name!r}; expected one of {sorted(ARCHITECTURES)}"
        ) from None


def convert_model(builtin_model: torch.nn.Module) -> torch.nn.Module:
    """Convert an in-memory built-in `RoFormer*` model to the matching `RoFormerRope*` model (strict load)."""
    config = convert_config(builtin_model.config)
    config.architectures = [ARCHITECTURES.get(type(builtin_model).__name__, type(builtin_model).__name__)]
    ours = model_class_for(type(builtin_model).__name__)(config)
    state_dict = builtin_model.state_dict()
    is_base = builtin_model.base_model is builtin_model
    if is_base:  # the bare model's keys carry no `roformer.` prefix; the table is written with it
        state_dict = {f"roformer.{k}": v for k, v in state_dict.items()}
    state_dict = convert_state_dict(state_dict)
    if is_base:
        state_dict = {k.removeprefix("roformer."): v for k, v in state_dict.items()}
    if config.tie_word_embeddings and "lm_head.decoder.weight" in state_dict:
        state_dict.pop("lm_head.decoder.weight")  # tied to the word embeddings
    result = ours.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.decoder.weight"]
    if missing or result.unexpected_keys:
        raise ConversionError(f"weights do not fit: missing {missing}, unexpected {result.unexpected_keys}")
    ours.tie_weights()
    return ours.eval()


@torch.no_grad()
def verify_against_builtin(builtin_model, ours, seq_len: int = 16, atol: float = 1e-4) -> float:
    """Run both models on a random padded batch; raise if any output differs by more than `atol`."""
    builtin_model.eval()
    ours.eval()
    config = builtin_model.config
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, seq_len) if "MultipleChoice" in type(builtin_model).__name__ else (2, seq_len)
    input_ids = torch.randint(1, config.vocab_size, shape, generator=generator)
    token_type_ids = torch.randint(0, config.type_vocab_size, shape, generator=generator)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[1, ..., seq_len // 2 :] = 0
    inputs = dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    expected, actual = builtin_model(**inputs), ours(**inputs)
    worst = 0.0
    for key in ("last_hidden_state", "logits", "start_logits", "end_logits"):
        if key in expected and expected[key] is not None:
            diff = (expected[key] - actual[key]).abs().max().item()
            if not diff <= atol:
                raise ConversionError(f"verification failed: {key} differs from the built-in by {diff:.3g} > {atol}")
            worst = max(worst, diff)
    return worst


def load_builtin_folder(folder: Path):
    """Load a built-in RoFormer folder with the class its config names."""
    import transformers

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: not found (expected a transformers RoFormer folder)")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "roformer":
        raise ConversionError(f"{config_file}: model_type is {config.get('model_type')!r}, expected 'roformer'")
    class_name = (config.get("architectures") or ["RoFormerModel"])[0]
    model_class_for(class_name)  # fail early on an unsupported head
    return getattr(transformers, class_name).from_pretrained(folder)


def convert_folder(in_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert a built-in RoFormer folder into a `roformer_rope` folder (code, safetensors, tokenizer files).

    Writes into a temporary folder next to `out_dir` and moves it into place only after the converted
    model matched the built-in; on any error nothing is left at `out_dir`.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ConversionError(f"{out_dir}: already exists (pass --overwrite to replace it)")
    builtin = load_builtin_folder(in_dir)
    ours = convert_model(builtin)
    diff = verify_against_builtin(builtin, ours)
    logger.info("converted %s: max |diff| vs built-in = %.2e", type(builtin).__name__, diff)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        ours.save_pretrained(tmp)
        copy_tokenizer_files(in_dir, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def copy_tokenizer_files(in_dir: Path, out_dir: Path) -> None:
    """Save our tokenizer (jieba words + WordPiece) from the built-in's vocab, or carry the files over."""
    vocab = in_dir / "vocab.txt"
    if not vocab.is_file():
        logger.warning("%s has no vocab.txt: the converted folder has no tokenizer", in_dir)
        return
    try:
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    except ImportError:
        RoFormerRopeTokenizer = None
    if RoFormerRopeTokenizer is not None:
        settings = {}
        config_file = in_dir / "tokenizer_config.json"
        if config_file.is_file():
            source = json.loads(config_file.read_text())
            settings = {k: source[k] for k in ("do_lower_case", "model_max_length") if k in source}
        RoFormerRopeTokenizer(vocab_file=str(vocab), **settings).save_pretrained(out_dir)
        return
    for name in _TOKENIZER_FILES:
        if (in_dir / name).is_file():
            shutil.copyfile(in_dir / name, out_dir / name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="folder of a built-in transformers RoFormer (model_type roformer)")
    parser.add_argument("--out", required=True, help="output folder for the roformer_rope model")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    out = convert_folder(args.model, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
