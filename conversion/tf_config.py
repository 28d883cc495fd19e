"""A release's `bert_config.json` and `vocab.txt` → a `RoFormerRopeConfig` for one model kind."""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from .json_object import read_json_object
from .key_map import ConversionError

logger = logging.getLogger(__name__)

# bert4keras activation names → transformers ACT2FN names (bert4keras' "gelu" is already the erf form).
_ACTIVATIONS = {"gelu_erf": "gelu", "gelu_tanh": "gelu_new"}
# The names bert4keras 0.10 resolves: keras 2.3's activations and the ones bert4keras registers. A checkpoint whose
# config names another (`gelu_fast`, `silu`, ...) was not made by the original code: what function it meant is a guess.
_BERT4KERAS_ACTIVATIONS = frozenset(
    "softmax elu selu softplus softsign relu tanh sigmoid hard_sigmoid exponential linear "
    "gelu gelu_erf gelu_tanh swish leaky_relu".split()
)
# bert4keras fields that change the attention's shapes; transformers' RoFormer has neither (heads are hidden/heads wide)
_HEAD_SIZE_FIELDS = ("attention_head_size", "attention_key_size")
_REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act"
)  # bert4keras needs hidden_act too: guessing one would give a silently different model
_OPTIONAL_FIELDS = (
    "embedding_size hidden_dropout_prob attention_probs_dropout_prob max_position_embeddings "
    "type_vocab_size initializer_range"
).split()


def read_bert_config(folder: Path) -> dict:
    """The release's `bert_config.json`, checked for the fields every kind needs."""
    config_file = folder / "bert_config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: not found (every released checkpoint ships one next to the .ckpt)")
    config = read_json_object(config_file)
    missing = [name for name in _REQUIRED_FIELDS if name not in config]
    if missing:
        raise ConversionError(f"{config_file}: missing required field(s) {missing}")
    return config


def read_vocab(folder: Path) -> list[str] | None:
    """Tokens of `vocab.txt` (one per line), or None when the release has none. Read by the tokenizer's own reader:
    lines end at newlines only (`str.splitlines` would also cut a token holding U+0085, U+2028, ...)."""
    from modeling_roformer_rope.tokenization_roformer_rope import read_vocab_lines

    vocab_file = folder / "vocab.txt"
    if not vocab_file.is_file():
        return None
    try:
        return read_vocab_lines(str(vocab_file))
    except UnicodeDecodeError as error:
        raise ConversionError(f"{vocab_file}: not UTF-8 text ({error})") from None


def _activation(value: object, source: str) -> str:
    """bert4keras' activation name as a transformers one; unknown names are refused here, not at load."""
    from transformers.activations import ACT2FN

    if not isinstance(value, str):
        raise ConversionError(f"{source}: hidden_act must be a string, got {value!r}")
    if value not in _BERT4KERAS_ACTIVATIONS:
        raise ConversionError(
            f"{source}: hidden_act {value!r} is not an activation bert4keras knows (it knows "
            f"{', '.join(sorted(_BERT4KERAS_ACTIVATIONS))}): the original code cannot have made this checkpoint"
        )
    name = _ACTIVATIONS.get(value, value)
    if name not in ACT2FN:
        raise ConversionError(f"{source}: hidden_act {value!r} is not an activation transformers knows")
    if name == "leaky_relu":  # same name, other function: a silently different model
        raise ConversionError(
            f"{source}: hidden_act 'leaky_relu' is bert4keras' leaky ReLU of slope 0.2; transformers' has slope "
            "0.01: not convertible"
        )
    return name


def _check_head_sizes(bert_config: dict, source: str) -> None:
    """bert4keras reads `attention_head_size` (value width per head) and `attention_key_size` (query/key width),
    both hidden_size / num_attention_heads by default. Another value is a model this architecture cannot hold."""
    hidden, heads = bert_config.get("hidden_size"), bert_config.get("num_attention_heads")
    default = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    for name in _HEAD_SIZE_FIELDS:
        value = bert_config.get(name)
        if value and value != default:  # bert4keras reads `value or default`: 0, null, false are the default
            raise ConversionError(
                f"{source}: {name} {value!r} differs from hidden_size / num_attention_heads ({hidden} / {heads}): "
                "heads of another width than that are not convertible (transformers' RoFormer has no such field)"
            )


def build_config(
    bert_config: dict, kind: str, vocab: list[str] | None = None, pooler: bool = False, source: str = "bert_config.json"
):
    """A `RoFormerRopeConfig` for `kind` from the release's `bert_config.json` fields.

    `pooler` (a `bert/pooler/dense` in the checkpoint) adds BERT's tanh pooler to v1/gpt and a Sim's linear
    pooler to sim; v2-sim / v2-gpt are RoFormerV2 with the UniLM mask / causal mask.
    """
    from modeling_roformer_rope import RoFormerRopeConfig

    fields = {name: bert_config[name] for name in _REQUIRED_FIELDS + tuple(_OPTIONAL_FIELDS) if name in bert_config}
    _check_head_sizes(bert_config, source)
    if "hidden_act" in fields:
        fields["hidden_act"] = _activation(fields["hidden_act"], source)
    if not kind.startswith("v2") and fields.get("type_vocab_size", 2) != 2:
        # bert4keras' RoFormer (v1) class builds 2 segment rows whatever the config says.
        logger.info(
            "type_vocab_size %s in bert_config.json ignored: bert4keras RoFormer uses 2", fields["type_vocab_size"]
        )
        fields["type_vocab_size"] = 2
    application = kind.removeprefix("v2-")  # v1 / v2 / sim / gpt
    kind_fields = {
        "v1": dict(architectures=["RoFormerRopeForMaskedLM"]),
        "v2": dict(architectures=["RoFormerRopeForMaskedLM"]),
        "sim": dict(architectures=["RoFormerRopeForMaskedLM"], unilm_mask=True),
        "gpt": dict(architectures=["RoFormerRopeForCausalLM"], is_decoder=True, use_cache=True),
    }[application]
    if kind.startswith("v2"):
        kind_fields.update(norm_type="rms_norm", use_bias=False)
    if pooler and kind == "sim":
        kind_fields.update(add_pooler=True, pooler_activation="linear")  # RoFormer-Sim's sentence vector
    elif pooler and kind in ("v1", "gpt"):
        kind_fields.update(add_pooler=True, pooler_activation="tanh")  # bert4keras' with_pool=True
    if application == "gpt" and vocab:
        # RoFormer-GPT starts a text with [CLS] and ends it with [SEP] (bert4keras' lm application).
        ids = {token: i for i, token in enumerate(vocab)}
        kind_fields.update(bos_token_id=ids.get("[CLS]"), eos_token_id=ids.get("[SEP]"))
    try:
        return RoFormerRopeConfig(**fields, **kind_fields, pad_token_id=0)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as error:
        cause = error.__cause__ or error  # the strict-dataclass wrapper hides the one-line reason
        raise ConversionError(f"{source} does not describe a valid {kind} model: {cause}") from None


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
