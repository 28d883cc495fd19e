"""Convert an original RoFormer TensorFlow checkpoint (bert4keras) into a `roformer_rope` folder.

    roformer-rope convert-tf --checkpoint chinese_roformer_L-12_H-768_A-12 --out roformer-base
    roformer-rope convert-tf --checkpoint chinese_roformer-v2-char_L-24_H-1024_A-16/bert_model.ckpt --out v2-large
    roformer-rope convert-tf --checkpoint ckpt_dir --out gpt --model-kind gpt
    roformer-rope convert-tf --checkpoint ckpt_dir --out sim --push-to-hub me/roformer-sim --private --dry-run

`--checkpoint` is the release folder (holding `bert_model.ckpt.*`, `bert_config.json`, `vocab.txt`) or the
`bert_model.ckpt` prefix (the config and vocabulary are then read next to it). TensorFlow is not needed:
`tf_checkpoint` reads the variables with numpy.

Model kinds (`--model-kind auto` detects them from the variables):
  v1   RoFormer (word or char vocabulary, any size, embedding_size != hidden_size too)  -> fill-mask
  sim  RoFormer-Sim: `bert/pooler/dense` present; UniLM mask, linear pooler            -> fill-mask
  gpt  RoFormer-GPT: causal LM. Its variables are exactly v1's, so `auto` picks gpt only when the
       checkpoint folder or prefix name contains "gpt"; otherwise pass --model-kind gpt -> text-generation
  v2   RoFormerV2: no bias and no LayerNorm variables (parameter-free RMS norm)         -> fill-mask
A checkpoint without any `cls/predictions/*` variable (an encoder-only release) converts to the bare
encoder (`AutoModel`).

Variables are renamed by a declarative regex table (`KEY_MAP`), kernels transposed ([in, out] -> torch
[out, in]) and query/key/value fused into one `qkv` projection. Optimizer slots (`OPTIMIZER_SLOTS`) and the
unused next-sentence head are skipped on purpose; any other unknown, missing or wrongly shaped variable is
an error listing them all. The folder is written to a temporary sibling of `--out`, reloaded with
`AutoModelFor*.from_pretrained(..., trust_remote_code=True)` and checked against the in-memory model, and
only then moved to `--out`: on any error nothing is left there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import string
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError

from .tf_checkpoint import TFCheckpointError, TFCheckpointReader, resolve_prefix

logger = logging.getLogger(__name__)

MODEL_KINDS = ("v1", "v2", "sim", "gpt")

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
KEY_MAP: list[tuple[str, str | None]] = [
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
_QKV = re.compile(r"^(roformer\.layers\.\d+\.attention)\.(query|key|value)\.(weight|bias)$")
_TIED_KEYS = ("lm_head.decoder.weight",)  # filled from the word embeddings, never stored

# bert4keras activation names → transformers ACT2FN names (bert4keras' "gelu" is already the erf form).
_ACTIVATIONS = {"gelu_erf": "gelu", "gelu_tanh": "gelu_new"}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_FIELDS = (
    "embedding_size hidden_act hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings "
    "type_vocab_size initializer_range"
).split()

CARD_TEMPLATE = "roformer_tf.md"
_CARD_TAGS = {
    "v1": ["roformer", "rotary", "fill-mask"],
    "sim": ["roformer", "rotary", "roformer-sim", "sentence-similarity", "unilm"],
    "gpt": ["roformer", "rotary", "roformer-gpt", "causal-lm"],
    "v2": ["roformer", "rotary", "roformer-v2"],
}


class ConversionError(ValueError):
    """The checkpoint cannot be converted; the message names the variables, file or fields at fault."""


@dataclass
class ConversionResult:
    """What `convert_checkpoint` did: where, which kind, and the numbers recorded in the model card."""

    out_dir: Path
    kind: str
    architecture: str
    num_variables: int  # every variable in the checkpoint index
    num_converted: int  # variables that became weights (the rest: optimizer slots, unused heads)
    index_sha256: str
    max_abs_diff: float  # reloaded folder vs the in-memory converted model
    skipped: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# inputs: checkpoint, config, kind
# ---------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """(checkpoint prefix, folder holding `bert_config.json` / `vocab.txt`) for a folder or a prefix."""
    path = Path(path)
    if not path.is_dir() and not Path(f"{path}.index").is_file() and not path.is_file():
        raise ConversionError(f"{path}: no such checkpoint folder or prefix (expected DIR or DIR/bert_model.ckpt)")
    prefix = resolve_prefix(path)
    return prefix, Path(prefix).parent


def read_bert_config(folder: Path) -> dict:
    """The release's `bert_config.json`, checked for the fields every kind needs."""
    config_file = folder / "bert_config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: not found (every released checkpoint ships one next to the .ckpt)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{config_file}: expected a JSON object")
    missing = [name for name in _REQUIRED_FIELDS if name not in config]
    if missing:
        raise ConversionError(f"{config_file}: missing required field(s) {missing}")
    return config


def read_vocab(folder: Path) -> list[str] | None:
    """Tokens of `vocab.txt` (one per line), or None when the release has none."""
    vocab_file = folder / "vocab.txt"
    if not vocab_file.is_file():
        return None
    return vocab_file.read_text(encoding="utf-8").splitlines()


def detect_kind(names: set[str], location: str = "") -> str:
    """Model kind from the variable names; `location` (folder/prefix name) is the only hint for gpt.

    A pooler exists only in RoFormer-Sim; RoFormerV2 stores neither biases nor LayerNorm parameters. GPT
    and v1 store the same variables, so a checkpoint without pooler is v1 unless its name says "gpt".
    """
    has_pooler = any(n.startswith("bert/pooler/") for n in names)
    has_norm = any("/LayerNorm/" in n for n in names)
    has_bias = any(n.endswith("/bias") for n in names)
    if not has_norm and not has_bias:
        if has_pooler:
            raise ConversionError("cannot detect the model kind: a pooler but no bias/LayerNorm variables")
        return "v2"
    if not has_norm or not has_bias:
        what = "bias but no LayerNorm" if has_bias else "LayerNorm but no bias"
        raise ConversionError(f"cannot detect the model kind: {what} variables (neither v1 nor v2); pass --model-kind")
    if has_pooler:
        return "sim"
    return "gpt" if "gpt" in location.lower() else "v1"


def _location_hint(prefix: str) -> str:
    """The names auto-detection may read a "gpt" hint from: the checkpoint folder and the prefix file."""
    path = Path(prefix)
    return f"{path.parent.name}/{path.name}"


def build_config(bert_config: dict, kind: str, vocab: list[str] | None = None):
    """A `RoFormerRopeConfig` for `kind` from the release's `bert_config.json` fields."""
    from modeling_roformer_rope import RoFormerRopeConfig

    fields = {name: bert_config[name] for name in _REQUIRED_FIELDS + tuple(_OPTIONAL_FIELDS) if name in bert_config}
    if "hidden_act" in fields:
        fields["hidden_act"] = _ACTIVATIONS.get(fields["hidden_act"], fields["hidden_act"])
    if kind != "v2" and fields.get("type_vocab_size", 2) != 2:
        # bert4keras' RoFormer (v1) class builds 2 segment rows whatever the config says.
        logger.info(
            "type_vocab_size %s in bert_config.json ignored: bert4keras RoFormer uses 2", fields["type_vocab_size"]
        )
        fields["type_vocab_size"] = 2
    kind_fields = {
        "v1": dict(architectures=["RoFormerRopeForMaskedLM"]),
        "sim": dict(
            architectures=["RoFormerRopeForMaskedLM"], add_pooler=True, pooler_activation="linear", unilm_mask=True
        ),
        "gpt": dict(architectures=["RoFormerRopeForCausalLM"], is_decoder=True, use_cache=True),
        "v2": dict(architectures=["RoFormerRopeForMaskedLM"], norm_type="rms_norm", use_bias=False),
    }[kind]
    if kind == "gpt" and vocab:
        # RoFormer-GPT starts a text with [CLS] and ends it with [SEP] (bert4keras' lm application).
        ids = {token: i for i, token in enumerate(vocab)}
        kind_fields.update(bos_token_id=ids.get("[CLS]"), eos_token_id=ids.get("[SEP]"))
    try:
        return RoFormerRopeConfig(**fields, **kind_fields, pad_token_id=0)
    except (TypeError, ValueError, StrictDataclassError) as error:
        cause = error.__cause__ or error  # the strict-dataclass wrapper hides the one-line reason
        raise ConversionError(f"bert_config.json does not describe a valid {kind} model: {cause}") from None


def check_vocab(vocab: list[str] | None, vocab_size: int, folder: Path) -> None:
    """vocab.txt must fit the embedding table: an id past it would crash at the first lookup."""
    if vocab is None:
        logger.warning("%s has no vocab.txt: the converted folder will have no tokenizer", folder)
        return
    if len(vocab) > vocab_size:
        raise ConversionError(
            f"{folder / 'vocab.txt'} has {len(vocab)} tokens but bert_config.json vocab_size is {vocab_size}"
        )
    if len(vocab) < vocab_size:
        logger.warning("vocab.txt has %d tokens, fewer than vocab_size %d", len(vocab), vocab_size)


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def rename_variable(name: str) -> str | None:
    """Our key for one TF variable (None = dropped on purpose); raises KeyError when no rule matches."""
    for pattern, replacement in KEY_MAP:
        if re.search(pattern, name):
            return None if replacement is None else _rename_leaf(re.sub(pattern, replacement, name))
    raise KeyError(name)


def _rename_leaf(key: str) -> str:
    return _LEAF.sub(lambda m: "." + _LEAF_NAMES[m.group(1)], key)


def convert_variables(variables: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rename, transpose kernels and fuse q/k/v; returns (state dict, our key → TF source name).

    Raises a ConversionError naming every variable no rule knows, instead of skipping them.
    """
    converted: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    unknown = []
    for name, array in variables.items():
        try:
            key = rename_variable(name)
        except KeyError:
            unknown.append(name)
            continue
        if key is None:
            continue
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if name.endswith("/kernel"):
            tensor = tensor.T.contiguous()  # TF dense kernels are [in, out]; torch Linear wants [out, in]
        converted[key] = tensor
        sources[key] = name
    if unknown:
        raise ConversionError(f"{len(unknown)} unknown variable(s), no rule in KEY_MAP: {sorted(unknown)}")
    return fuse_qkv(converted, sources)


def fuse_qkv(
    state_dict: dict[str, torch.Tensor], sources: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Concatenate each layer's query/key/value rows (in that order) into our fused `qkv` projection."""
    parts: dict[tuple[str, str], dict[str, tuple[torch.Tensor, str]]] = {}
    fused, fused_sources = {}, {}
    for key, tensor in state_dict.items():
        match = _QKV.match(key)
        if match:
            prefix, which, leaf = match.groups()
            parts.setdefault((prefix, leaf), {})[which] = (tensor, sources[key])
        else:
            fused[key], fused_sources[key] = tensor, sources[key]
    missing = []
    for (prefix, leaf), pieces in sorted(parts.items()):
        absent = [w for w in ("query", "key", "value") if w not in pieces]
        if absent:
            source = next(iter(pieces.values()))[1]
            missing += [re.sub(r"/(query|key|value)/", f"/{w}/", source) for w in absent]
            continue
        shapes = {w: tuple(pieces[w][0].shape) for w in ("query", "key", "value")}
        if len(set(shapes.values())) != 1:
            raise ConversionError(f"{prefix}: query/key/value {leaf}s differ in shape: {shapes}")
        key = f"{prefix}.qkv.{leaf}"
        fused[key] = torch.cat([pieces[w][0] for w in ("query", "key", "value")], dim=0)
        fused_sources[key] = re.sub(r"/(query|key|value)/", "/{query,key,value}/", pieces["query"][1])
    if missing:
        raise ConversionError(f"checkpoint is missing {len(missing)} variable(s): {missing}")
    return fused, fused_sources


def has_mlm_head(names: set[str], kind: str) -> bool:
    """V2's head is the tied embedding alone (always there); v1/sim/gpt store `cls/predictions/*`."""
    return kind == "v2" or any(n.startswith("cls/predictions/") for n in names)


def build_model(config, with_head: bool) -> torch.nn.Module:
    """The model the folder is saved from: MLM/LM head (+ the Sim pooler) or the bare encoder."""
    import modeling_roformer_rope as rr
    from modeling_roformer_rope.modeling_roformer_rope import RoFormerRopePooler

    if not with_head:
        config.architectures = ["RoFormerRopeModel"]
        return rr.RoFormerRopeModel(config)
    model_class = rr.RoFormerRopeForCausalLM if config.is_decoder else rr.RoFormerRopeForMaskedLM
    model = model_class(config)
    if config.add_pooler:
        # The MLM class builds its encoder without pooler; attach RoFormer-Sim's so its weights are saved
        # in the same file. AutoModelForMaskedLM then ignores them (reported as unexpected keys) and
        # AutoModel (config.add_pooler=True) loads them together with the encoder.
        model.roformer.pooler = RoFormerRopePooler(config)
    return model


def load_strict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], sources: dict[str, str]) -> None:
    """Load every weight or fail listing all missing, unexpected and wrongly shaped ones."""
    if model.base_model is model:  # the bare encoder's keys carry no `roformer.` prefix; KEY_MAP writes it
        state_dict = {k.removeprefix("roformer."): v for k, v in state_dict.items()}
        sources = {k.removeprefix("roformer."): v for k, v in sources.items()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in _TIED_KEYS}
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
    for key in _TIED_KEYS:
        if key in model.state_dict():
            full[key] = state_dict["roformer.embeddings.word_embeddings.weight"]
    model.load_state_dict(full, strict=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()


# ---------------------------------------------------------------------------------------------
# verification, tokenizer, model card
# ---------------------------------------------------------------------------------------------


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


def _max_diff(reference: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor, what: str) -> float:
    """Max |diff| over non-padding positions; raises on non-finite outputs."""
    keep = mask.bool()
    reference, actual = reference[keep], actual[keep]
    if not torch.isfinite(actual).all():
        raise ConversionError(f"verification failed: the reloaded model's {what} are not finite")
    return (reference - actual).abs().max().item()


def _quiet_from_pretrained(auto_class, folder: Path) -> torch.nn.Module:
    """Load with trust_remote_code; the load report is silenced because the Sim folder *by design* holds
    weights one class does not use (the pooler for the MLM class, the MLM head for AutoModel)."""
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

    Checks the head's output and the last hidden state at non-padding positions, and for RoFormer-Sim also
    the pooler through `AutoModel`. Returns the largest difference.
    """
    import transformers

    batch = sample_batch(model.config)
    per_token = batch["attention_mask"]
    auto_name = auto_class_name(model)
    reloaded = _quiet_from_pretrained(getattr(transformers, auto_name), folder)
    expected = model(**batch, output_hidden_states=True)
    actual = reloaded(**batch, output_hidden_states=True)
    diffs = {
        "last_hidden_state": _max_diff(expected.hidden_states[-1], actual.hidden_states[-1], per_token, "hidden states")
    }
    if auto_name != "AutoModel":
        diffs["logits"] = _max_diff(expected.logits, actual.logits, per_token, "logits")
    base = model if auto_name == "AutoModel" else model.roformer
    if base.pooler is not None:
        encoder = reloaded if auto_name == "AutoModel" else _quiet_from_pretrained(transformers.AutoModel, folder)
        if encoder.pooler is None:
            raise ConversionError("verification failed: AutoModel reloaded the folder without its pooler")
        diffs["pooler_output"] = _max_diff(
            base(**batch).pooler_output,
            encoder(**batch).pooler_output,
            torch.ones(2, dtype=torch.bool),
            "pooler outputs",
        )
    worst = max(diffs.values())
    if not worst <= atol:
        raise ConversionError(f"verification failed: reloaded folder differs from the converted model: {diffs}")
    logger.info("verified %s reload: max |diff| %.2e %s", auto_name, worst, diffs)
    return worst


def save_tokenizer(folder: Path, out_dir: Path, max_length: int) -> list[str]:
    """Our jieba + WordPiece tokenizer over the release's vocab.txt (falls back to copying vocab.txt)."""
    vocab = folder / "vocab.txt"
    if not vocab.is_file():
        return []
    try:
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    except ImportError as error:  # the tokenizer is optional for conversion; the vocabulary is not
        logger.warning("RoFormerRopeTokenizer unavailable (%s): copying vocab.txt only", error)
        shutil.copyfile(vocab, out_dir / "vocab.txt")
        return ["vocab.txt"]
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(vocab), model_max_length=max_length)
    return [Path(p).name for p in tokenizer.save_pretrained(out_dir)]


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def render_model_card(values: dict[str, str], template: str = CARD_TEMPLATE) -> str:
    """Fill a `model_cards/` template (`string.Template`: `$name` placeholders, so code braces stay as-is)."""
    text = resources.files("roformer_rope.model_cards").joinpath(template).read_text(encoding="utf-8")
    try:
        return string.Template(text).substitute(values)
    except KeyError as error:
        raise ConversionError(f"model card template {template} needs a value for {error}") from None


def summarize_skipped(names: list[str]) -> str:
    """A short account of the skipped variables: a real checkpoint may carry hundreds of optimizer slots."""
    slots = [n for n in names if OPTIMIZER_SLOTS.search(n)]
    unused = [n for n in names if n not in slots]
    parts = [f"{len(slots)} optimizer slot(s)"] if slots else []
    parts += [f"`{n}` (unused)" for n in unused]
    return ", ".join(parts) or "none"


def card_values(
    result: ConversionResult, config, source: str, title: str, repo_id: str | None, license: str
) -> dict[str, str]:
    """Everything the card template shows: metadata, usage and provenance."""
    causal = result.architecture == "RoFormerRopeForCausalLM"
    encoder_only = result.architecture == "RoFormerRopeModel"
    pipeline = "text-generation" if causal else "feature-extraction" if encoder_only else "fill-mask"
    auto = {"RoFormerRopeForCausalLM": "AutoModelForCausalLM", "RoFormerRopeModel": "AutoModel"}.get(
        result.architecture, "AutoModelForMaskedLM"
    )
    kind_names = {"v1": "RoFormer", "sim": "RoFormer-Sim", "gpt": "RoFormer-GPT", "v2": "RoFormerV2"}
    notes = {
        "v1": "Post-LayerNorm BERT layout with rotary self-attention; MLM head tied to the word embeddings.",
        "sim": "UniLM attention mask built from `token_type_ids` (segment 0 bidirectional, segment 1 causal) "
        "and a linear pooler on [CLS]: `AutoModel` returns it as `pooler_output` (the MLM class ignores it).",
        "gpt": "Causal attention (`is_decoder=True`); generation starts from [CLS] and ends at [SEP].",
        "v2": "No biases, parameter-free RMS norm (eps 1e-7), relu feed-forward; MLM head = tied embeddings only.",
    }
    usage_extra = {
        "sim": "\n# RoFormer-Sim's sentence vector: the linear pooler on [CLS], loaded by AutoModel\n"
        "from transformers import AutoModel\n"
        'encoder = AutoModel.from_pretrained("$repo_id", trust_remote_code=True).eval()\n'
        "sentence_vector = encoder(**inputs).pooler_output",
        "gpt": '\ngenerated = model.generate(inputs["input_ids"][:, :-1], max_new_tokens=32)  # drop [SEP], continue',
    }.get(result.kind, "")
    if encoder_only:
        usage_extra = ""
    return {
        "usage_extra": string.Template(usage_extra).safe_substitute(repo_id=repo_id or "PATH_OR_REPO_ID"),
        "license": license,
        "pipeline_tag": pipeline,
        "tags": "\n".join(f"- {tag}" for tag in _CARD_TAGS[result.kind]),
        "title": title,
        "kind": result.kind,
        "kind_name": kind_names[result.kind],
        "kind_note": notes[result.kind],
        "repo_id": repo_id or "PATH_OR_REPO_ID",
        "auto_class": auto,
        "architecture": result.architecture,
        "layers": str(config.num_hidden_layers),
        "hidden": str(config.hidden_size),
        "heads": str(config.num_attention_heads),
        "embedding_size": str(config.embedding_size),
        "vocab_size": str(config.vocab_size),
        "source": source,
        "num_variables": str(result.num_variables),
        "num_converted": str(result.num_converted),
        "skipped": summarize_skipped(result.skipped),
        "index_sha256": result.index_sha256,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "max_abs_diff": f"{result.max_abs_diff:.3g}",
    }


# ---------------------------------------------------------------------------------------------
# the conversion
# ---------------------------------------------------------------------------------------------


def convert_to_model(
    checkpoint: str | Path, model_kind: str = "auto"
) -> tuple[torch.nn.Module, ConversionResult, Path]:
    """Read, map and strictly load a checkpoint; returns (model, partial result, release folder)."""
    if model_kind not in ("auto", *MODEL_KINDS):
        raise ConversionError(f"--model-kind must be auto or one of {MODEL_KINDS}, got {model_kind!r}")
    prefix, folder = resolve_checkpoint(checkpoint)
    reader = TFCheckpointReader(prefix)
    all_names = set(reader.entries)
    skipped = sorted(n for n in all_names if OPTIMIZER_SLOTS.search(n))
    names = all_names - set(skipped)
    kind = detect_kind(names, _location_hint(prefix)) if model_kind == "auto" else model_kind
    logger.info("%s: %d variables (%d optimizer slots skipped), kind %s", prefix, len(all_names), len(skipped), kind)

    bert_config = read_bert_config(folder)
    vocab = read_vocab(folder)
    config = build_config(bert_config, kind, vocab)
    check_vocab(vocab, config.vocab_size, folder)
    with_head = has_mlm_head(names, kind)
    if kind == "gpt" and not with_head:
        raise ConversionError("a gpt checkpoint needs its LM head (cls/predictions/*), none found")

    state_dict, sources = convert_variables(reader.load_all(skip=OPTIMIZER_SLOTS))
    model = build_model(config, with_head)
    load_strict(model, state_dict, sources)
    dropped = sorted(n for n in names if rename_variable(n) is None)
    result = ConversionResult(
        out_dir=Path(),
        kind=kind,
        architecture=type(model).__name__,
        num_variables=len(all_names),
        num_converted=len(names) - len(dropped),
        index_sha256=sha256_file(reader.index_path),
        max_abs_diff=float("nan"),
        skipped=skipped + dropped,
    )
    return model, result, folder


def convert_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    model_kind: str = "auto",
    overwrite: bool = False,
    repo_id: str | None = None,
    license: str = "apache-2.0",
) -> ConversionResult:
    """Convert a bert4keras checkpoint into a verified `roformer_rope` folder at `out_dir`.

    Everything is written into a temporary sibling folder, reloaded and compared with the in-memory
    model, and moved to `out_dir` only then; on any error neither `out_dir` nor the temporary folder
    is left behind (an existing `out_dir` replaced with `overwrite=True` stays untouched).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ConversionError(f"{out_dir}: already exists (pass --overwrite to replace it)")
    try:
        model, result, folder = convert_to_model(checkpoint, model_kind)
    except TFCheckpointError as error:
        raise ConversionError(str(error)) from None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        save_tokenizer(folder, tmp, model.config.max_position_embeddings)
        _make_shareable(tmp)
        result.max_abs_diff = verify_folder(model, tmp)
        card = render_model_card(card_values(result, model.config, str(checkpoint), folder.name, repo_id, license))
        (tmp / "README.md").write_text(card, encoding="utf-8")
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out_dir = out_dir
    return result


def _make_shareable(folder: Path) -> None:
    """mkdtemp (and the safetensors writer) create owner-only files; a model folder is meant to be shared."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`; an existing `out_dir` is set aside first and removed only afterwards."""
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="release folder (bert_model.ckpt.*, bert_config.json, vocab.txt) or the bert_model.ckpt prefix",
    )
    parser.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    parser.add_argument(
        "--model-kind",
        default="auto",
        choices=("auto", *MODEL_KINDS),
        help="auto: sim if bert/pooler/* exists, v2 if no bias/LayerNorm variables, else v1 -- or gpt when the "
        "checkpoint folder/prefix name contains 'gpt' (gpt and v1 store identical variables: pass gpt explicitly "
        "for a renamed GPT checkpoint)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists (only after success)")
    parser.add_argument("--license", default="apache-2.0", help="license id written in the model card metadata")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the converted folder to this Hub repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--revision", metavar="BRANCH", help="upload to this branch (created if missing)")
    parser.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list files and sizes, no network")


def run(args: argparse.Namespace) -> int:
    if (args.private or args.revision or args.dry_run) and not args.push_to_hub:
        raise ConversionError("--private, --revision and --dry-run only apply with --push-to-hub")
    result = convert_checkpoint(
        args.checkpoint,
        args.out,
        model_kind=args.model_kind,
        overwrite=args.overwrite,
        repo_id=args.push_to_hub,
        license=args.license,
    )
    print(
        f"wrote {result.out_dir} ({result.kind}, {result.architecture}, {result.num_converted}/{result.num_variables} "
        f"variables, reload max |diff| {result.max_abs_diff:.2g})"
    )
    if args.push_to_hub:
        from .hub import push_folder

        push_folder(
            result.out_dir, args.push_to_hub, private=args.private, revision=args.revision, dry_run=args.dry_run
        )
    return 0
