"""Convert a built-in transformers RoFormer (`model_type: roformer`) into a `roformer_rope` model or folder.

    roformer-rope convert-hf --model IN_DIR --out OUT_DIR [--overwrite]

Weights are renamed by a declarative regex table (`KEY_MAP`, applied by `key_map`); the separate
query/key/value projections are concatenated into our fused `qkv` projection; the built-in's sinusoid
table is dropped (we compute the sinusoids on the fly) after checking it is the standard one. Loading is
strict, and a folder conversion checks the converted model's outputs against the built-in model on a
random batch before anything is written. `--out` may not be, contain or lie inside `--model`; the
folder is written beside `--out` and swapped in at the end (`roformer_rope.safe_write`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from roformer_rope.safe_write import OutputError, check_output, safe_output_folder

from .json_object import read_json_object
from .key_map import ConversionError, Rule, fuse_qkv, map_keys
from .sinusoids import check_sinusoid_table, standard_table
from .tokenizer_files import read_source_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

# Built-in key (after the regex) → our key. `None` drops the tensor (recomputed by our model).
KEY_MAP: list[Rule] = [
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
SINUSOID_KEY = "roformer.encoder.embed_positions.weight"
# Built-in key → the key its forward reads instead, when both map to one of ours. The LM head's
# `cls.predictions.bias` is tied to `cls.predictions.decoder.bias` only with tied word embeddings; untied,
# the two are separate tensors and only the decoder's bias reaches the logits (RoFormerLMPredictionHead),
# so an untied, trained checkpoint holds two different values and the unused one is dropped.
UNUSED_ALIASES = {"cls.predictions.bias": "cls.predictions.decoder.bias"}

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
    "id2label label2id problem_type return_dict output_hidden_states output_attentions"
).split()

__all__ = [
    "ARCHITECTURES",
    "KEY_MAP",
    "ConversionError",
    "add_arguments",
    "convert_config",
    "convert_folder",
    "convert_model",
    "convert_state_dict",
    "load_builtin_folder",
    "run",
    "verify_against_builtin",
]


def drop_unused_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without each `UNUSED_ALIASES` key whose value differs from the key the forward reads."""
    dropped = {}
    for alias, used in UNUSED_ALIASES.items():
        if alias in state_dict and used in state_dict and not torch.equal(state_dict[alias], state_dict[used]):
            logger.info("dropping %r: it differs from %r, which the built-in forward uses", alias, used)
            dropped[alias] = used
    return {key: tensor for key, tensor in state_dict.items() if key not in dropped}


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename every tensor, fuse query/key/value into `qkv` (rows ordered q, k, v), check duplicates agree.

    Only an unused alias (`UNUSED_ALIASES`) may disagree with the tensor it shadows; it is dropped.
    """
    state_dict = drop_unused_aliases(state_dict)
    renamed, sources = map_keys(state_dict, KEY_MAP, noun="built-in RoFormer weight")
    converted, _ = fuse_qkv(renamed, sources)
    return converted


def convert_config(builtin_config, class_name: str | None = None) -> RoFormerRopeConfig:  # noqa: F821
    """A `RoFormerRopeConfig` equivalent to a built-in `RoFormerConfig` (object or dict) of the built-in class
    `class_name` (default: the config's `architectures`)."""
    from modeling_roformer_rope import RoFormerRopeConfig

    source = builtin_config if isinstance(builtin_config, dict) else builtin_config.to_dict()
    if source.get("model_type", "roformer") != "roformer":
        raise ConversionError(
            f"expected a built-in RoFormer config (model_type 'roformer'), got {source['model_type']!r}"
        )
    fields = {key: source[key] for key in _CONFIG_FIELDS if key in source}
    if "RoFormerForMultipleChoice" in ([class_name] if class_name else source.get("architectures") or []):
        summary_dropout = _summary_dropout(source)
        if summary_dropout:
            fields["classifier_dropout"] = summary_dropout
    architectures = [ARCHITECTURES.get(a, a) for a in source.get("architectures") or []]
    return RoFormerRopeConfig(**fields, summary_type=_summary_type(source), architectures=architectures or None)


def _summary_dropout(source: dict) -> float:
    """The built-in multiple-choice summary's dropout as one rate: without a projection or activation between them,
    `summary_first_dropout` p1 then `summary_last_dropout` p2 keep an element with probability (1 - p1)(1 - p2)
    and scale it by the inverse, which is one dropout of rate 1 - (1 - p1)(1 - p2): our head's `classifier_dropout`."""
    keep = 1.0
    for key in ("summary_first_dropout", "summary_last_dropout"):
        rate = source.get(key) or 0.0
        if not 0.0 <= rate < 1.0:
            raise ConversionError(f"config {key}={rate!r}: a dropout rate must be in [0, 1)")
        keep *= 1.0 - rate
    return 1.0 - keep


def _summary_type(source: dict) -> str:
    """The token the built-in multiple-choice head scores: its `RoFormerSequenceSummary` reads `summary_type` from
    the config, "last" when unset (XLM-style); "first" and "last" map over, any other summary has no equivalent."""
    summary_type = source.get("summary_type") or "last"
    if summary_type not in ("first", "last"):
        raise ConversionError(
            f"config summary_type={summary_type!r}: only 'first' and 'last' have an equivalent here "
            "(RoFormerRopeForMultipleChoice scores one token)"
        )
    for extra in ("summary_use_proj", "summary_activation"):
        if source.get(extra):
            raise ConversionError(
                f"config {extra}={source[extra]!r}: the built-in multiple-choice summary would add a projection or "
                "activation that RoFormerRopeForMultipleChoice does not have"
            )
    return summary_type


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
    config = convert_config(builtin_model.config, type(builtin_model).__name__)
    config.architectures = [ARCHITECTURES.get(type(builtin_model).__name__, type(builtin_model).__name__)]
    ours = model_class_for(type(builtin_model).__name__)(config)
    if config.output_attentions:  # transformers v5 refuses to save it with sdpa; the built-in is eager-only anyway
        ours.set_attn_implementation("eager")
    state_dict = builtin_model.state_dict()
    is_base = builtin_model.base_model is builtin_model
    if is_base:  # the bare model's keys carry no `roformer.` prefix; the table is written with it
        state_dict = {f"roformer.{k}": v for k, v in state_dict.items()}
    if SINUSOID_KEY in state_dict:
        check_sinusoid_table(state_dict[SINUSOID_KEY], SINUSOID_KEY)
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


def float32_reference(builtin_model) -> torch.nn.Module:
    """The built-in model itself if it is float32, else a float32 copy whose sinusoid table is the exact standard one
    (a bf16/fp16 checkpoint stores it rounded; `check_sinusoid_table` accepted that rounding): the weight mapping
    is then checked in float32 against our model, which computes the exact sinusoids."""
    if next(builtin_model.parameters()).dtype == torch.float32:
        return builtin_model
    import copy

    reference = copy.deepcopy(builtin_model).float()
    table = reference.base_model.encoder.embed_positions.weight
    with torch.no_grad():
        table.copy_(standard_table(*table.shape))
    return reference


@torch.no_grad()
def verify_against_builtin(builtin_model, ours, seq_len: int = 16, atol: float = 1e-4) -> float:
    """Run both models on a random padded batch (at most `max_position_embeddings` long: the built-in has no
    row past its table) in float32; raise if any output differs by more than `atol`."""
    builtin_model = float32_reference(builtin_model).eval()
    ours.eval()
    config = builtin_model.config
    seq_len = min(seq_len, config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, seq_len) if "MultipleChoice" in type(builtin_model).__name__ else (2, seq_len)
    input_ids = torch.randint(1, config.vocab_size, shape, generator=generator)
    token_type_ids = torch.randint(0, config.type_vocab_size, shape, generator=generator)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[1, ..., max(1, seq_len // 2) :] = 0  # never a fully masked row (the built-in averages those)
    inputs = dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    # dict outputs whatever the configs say (`return_dict: false` makes both return tuples, with no keys to compare)
    expected, actual = builtin_model(**inputs, return_dict=True), ours(**inputs, return_dict=True)
    worst, compared = 0.0, []
    for key in ("last_hidden_state", "logits", "start_logits", "end_logits"):
        if key in expected and expected[key] is not None:
            diff = (expected[key] - actual[key]).abs().max().item()
            if not diff <= atol:
                raise ConversionError(f"verification failed: {key} differs from the built-in by {diff:.3g} > {atol}")
            worst, compared = max(worst, diff), compared + [key]
    if not compared:
        raise ConversionError(
            f"verification failed: the built-in {type(builtin_model).__name__} gave none of the outputs compared "
            f"(last_hidden_state, logits, start_logits, end_logits); it gave {sorted(expected.keys())}"
        )
    return worst


def read_builtin_config(folder: Path) -> dict:
    """`folder/config.json`, checked to be a built-in RoFormer config that transformers can build."""
    from transformers.activations import ACT2FN

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: not found (expected a transformers RoFormer folder)")
    config = read_json_object(config_file)
    if config.get("model_type") != "roformer":
        raise ConversionError(f"{config_file}: model_type is {config.get('model_type')!r}, expected 'roformer'")
    act = config.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACT2FN:
        raise ConversionError(f"{config_file}: hidden_act {act!r} is not an activation transformers knows")
    architectures = config.get("architectures") or ["RoFormerModel"]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConversionError(f"{config_file}: architectures must be a list of class names, got {architectures!r}")
    return config


def load_builtin_folder(folder: Path):
    """Load a built-in RoFormer folder with the class its config names."""
    import transformers
    from safetensors import SafetensorError

    config = read_builtin_config(folder)
    class_name = (config.get("architectures") or ["RoFormerModel"])[0]
    model_class_for(class_name)  # fail early on an unsupported head
    try:
        # mis-shaped tensors are reported in `info` (and refused below) instead of raising transformers' own error
        model, info = getattr(transformers, class_name).from_pretrained(
            folder, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except SafetensorError as error:
        raise ConversionError(f"{folder}: cannot read the safetensors weights ({error})") from None
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        if isinstance(error, ConversionError):
            raise
        raise ConversionError(f"{folder}: transformers cannot load it as {class_name} ({error})") from None
    # transformers fills missing tensors with fresh initial values and drops unknown ones: either would be converted
    # (and verified against) as if it were the checkpoint's
    problems = []
    for kind in ("missing", "unexpected", "mismatched"):
        # the sinusoid table is a function of its shape: transformers rebuilds a missing one exactly
        keys = sorted(
            str(key) for key in info.get(f"{kind}_keys") or () if not (kind == "missing" and key == SINUSOID_KEY)
        )
        if keys:
            problems.append(f"{len(keys)} {kind} ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})")
    if problems:
        raise ConversionError(f"{folder}: the weights do not fit {class_name}: {'; '.join(problems)}")
    return model


def convert_folder(
    in_dir: str | Path, out_dir: str | Path, overwrite: bool = False, word_segmentation: str = "auto"
) -> Path:
    """Convert a built-in RoFormer folder into a `roformer_rope` folder (code, safetensors, tokenizer files,
    the source's generation defaults).

    `out_dir` may not be, contain or lie inside `in_dir`. Writes into a temporary folder beside
    `out_dir` and swaps it in only after the converted model matched the built-in; on any error
    `out_dir` is as it was and no temporary is left. `word_segmentation` is the tokenizer's (see
    `RoFormerRopeTokenizer`): "auto" cuts with jieba only a vocabulary that holds words, as the original
    code did; "jieba" as the built-in RoFormerTokenizer cuts every vocabulary.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    try:
        check_output(out_dir, overwrite=overwrite, sources=[in_dir], what="--out")
    except OutputError as error:
        raise ConversionError(str(error)) from None
    builtin = load_builtin_folder(in_dir)
    ours = convert_model(builtin)
    diff = verify_against_builtin(builtin, ours)
    logger.info("converted %s: max |diff| vs built-in = %.2e", type(builtin).__name__, diff)
    dtype = next(builtin.parameters()).dtype
    if dtype != torch.float32:
        ours = ours.to(dtype)  # saved in the checkpoint's own precision (the rotary frequencies stay float32)
    if ours.can_generate():
        ours.generation_config = read_generation_config(in_dir, ours.generation_config)
    source = read_source_tokenizer(in_dir)
    with safe_output_folder(out_dir, overwrite=overwrite, sources=[in_dir], what="--out") as tmp:
        ours.save_pretrained(tmp)
        written = save_tokenizer(
            in_dir, tmp, added=source.added, word_segmentation=word_segmentation, **source.settings
        )
        saved = read_json_object(tmp / "tokenizer_config.json") if "tokenizer_config.json" in written else {}
        if (source.class_name or "").startswith("RoFormerTokenizer") and saved.get("word_segmentation") == "none":
            logger.warning(
                "%s: a character vocabulary, tokenized without jieba as the original code did, where the built-in "
                "RoFormerTokenizer cuts it with jieba (other ids on full-width digits, ...); convert with "
                "--word-segmentation jieba to keep the built-in's cut (e.g. for a model fine-tuned with it)",
                in_dir,
            )
    return out_dir


def read_generation_config(folder: Path, default):
    """The generation defaults saved in `folder/generation_config.json` (eos ids, penalties, lengths, ...), else
    `default` (the ones our config implies)."""
    from transformers import GenerationConfig

    path = folder / "generation_config.json"
    if not path.is_file():
        return default
    read_json_object(path)  # a ConversionError naming the file if it is no JSON object
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, TypeError, ValueError) as error:
        raise ConversionError(f"{path}: not a generation config transformers can load ({error})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="folder of a built-in transformers RoFormer (model_type roformer)"
    )
    parser.add_argument(
        "--out", required=True, help="output folder for the roformer_rope model (never --model or inside it)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists (only after success)")
    parser.add_argument(
        "--word-segmentation",
        choices=("auto", "jieba", "none"),
        default="auto",
        help="the tokenizer's jieba use: auto = only for a vocabulary holding words (the original code's cut), "
        "jieba = always (the built-in RoFormerTokenizer's cut, e.g. for a model fine-tuned with it)",
    )


def run(args: argparse.Namespace) -> int:
    out = convert_folder(args.model, args.out, overwrite=args.overwrite, word_segmentation=args.word_segmentation)
    print(f"wrote {out}")
    return 0
