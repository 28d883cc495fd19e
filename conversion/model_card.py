"""The model card (README.md) written into a converted folder, from a `model_cards/` template.

Templates use `string.Template` placeholders (`$name`), so the code braces in them stay as they are; a
placeholder without a value is an error, never a blank in the published card.
"""

from __future__ import annotations

import hashlib
import re
import string
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from .key_map import ConversionError
from .tf_weights import OPTIMIZER_SLOTS

TF_TEMPLATE = "roformer_tf.md"

_KIND_NAMES = {"v1": "RoFormer", "sim": "RoFormer-Sim", "gpt": "RoFormer-GPT", "v2": "RoFormerV2",
               "v2-sim": "RoFormerV2 with the UniLM mask", "v2-gpt": "RoFormerV2 causal LM"}  # fmt: skip
_KIND_NOTES = {
    "v1": "Post-LayerNorm BERT layout with rotary self-attention; MLM head tied to the word embeddings.",
    "sim": "UniLM attention mask built from `token_type_ids` (segment 0 bidirectional, segment 1 causal) "
    "and a linear pooler on [CLS]: `AutoModel` returns it as `pooler_output` (the MLM class ignores it).",
    "gpt": "Causal attention (`is_decoder=True`); generation starts from [CLS] and ends at [SEP].",
    "v2": "No biases, parameter-free RMS norm (eps 1e-7), relu feed-forward; MLM head = tied embeddings only.",
}
_KIND_NOTES["v2-sim"] = _KIND_NOTES["v2"] + " UniLM attention mask built from `token_type_ids` (seq2seq)."
_KIND_NOTES["v2-gpt"] = _KIND_NOTES["v2"] + " Causal attention (`is_decoder=True`)."
_SIM_NO_POOLER_NOTE = " The checkpoint has no pooler (a UniLM seq2seq model): `pooler_output` is not available."
_TANH_POOLER_NOTE = (
    " The checkpoint's BERT pooler (dense + tanh on [CLS]) is kept: `AutoModel` returns it as `pooler_output`."
)
_TAGS = {
    "v1": ["roformer", "rotary", "fill-mask"],
    "sim": ["roformer", "rotary", "roformer-sim", "sentence-similarity", "unilm"],
    "gpt": ["roformer", "rotary", "roformer-gpt", "causal-lm"],
    "v2": ["roformer", "rotary", "roformer-v2"],
    "v2-sim": ["roformer", "rotary", "roformer-v2", "unilm"],
    "v2-gpt": ["roformer", "rotary", "roformer-v2", "causal-lm"],
}
_POOLER_USAGE = (
    "\n# the pooler on [CLS] ($what), loaded by AutoModel\n"
    "from transformers import AutoModel\n"
    'encoder = AutoModel.from_pretrained("$repo_id", trust_remote_code=True).eval()\n'
    "sentence_vector = encoder(**inputs).pooler_output"
)
_GPT_USAGE = '\ngenerated = model.generate(inputs["input_ids"][:, :-1], max_new_tokens=32)  # drop [SEP], continue'


def render_model_card(values: dict[str, str], template: str = TF_TEMPLATE) -> str:
    """Fill a `model_cards/` template with `values`."""
    text = resources.files("roformer_rope.model_cards").joinpath(template).read_text(encoding="utf-8")
    try:
        return string.Template(text).substitute(values)
    except KeyError as error:
        raise ConversionError(f"model card template {template} needs a value for {error}") from None


_LICENSE_ID = re.compile(r"(?=[^a-z]*[a-z])[a-z0-9][a-z0-9.+_-]*")  # at least one letter: no bare number
_YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n", "nan", "inf"}  # YAML reads these as non-strings


def check_license(license: str) -> str:
    """`license` as a Hub license id (`apache-2.0`, `mit`, `cc-by-4.0`, `other`, ...): it goes into the card's
    YAML metadata verbatim, where a space, a colon or a newline would break or change the metadata."""
    if not isinstance(license, str) or not _LICENSE_ID.fullmatch(license) or license in _YAML_WORDS:
        raise ConversionError(
            f"--license {license!r} is not a license id (lowercase letters, digits and . + _ -, e.g. apache-2.0, "
            "mit, cc-by-4.0, other)"
        )
    return license


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def summarize_skipped(names: list[str]) -> str:
    """A short account of the skipped variables: a real checkpoint may carry hundreds of optimizer slots."""
    slots = [n for n in names if OPTIMIZER_SLOTS.search(n)]
    unused = [n for n in names if n not in slots]
    parts = [f"{len(slots)} optimizer slot(s)"] if slots else []
    parts += [f"`{n}` (unused)" for n in unused]
    return ", ".join(parts) or "none"


_USAGE_WITH_TOKENIZER = """from transformers import AutoTokenizer, $auto_class

tokenizer = AutoTokenizer.from_pretrained("$repo_id", trust_remote_code=True)
model = $auto_class.from_pretrained("$repo_id", trust_remote_code=True).eval()
inputs = tokenizer(["今天天气不错"], return_tensors="pt", return_token_type_ids=True)"""
_USAGE_WITHOUT_TOKENIZER = """import torch
from transformers import $auto_class

model = $auto_class.from_pretrained("$repo_id", trust_remote_code=True).eval()
input_ids = torch.tensor([[...]])  # (batch, length) ids of the release's own vocabulary: no tokenizer here
inputs = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}"""
_NO_TOKENIZER_NOTE = """
This folder holds **no tokenizer**: the converted release had no `vocab.txt`. Put the release's `vocab.txt` next
to the weights and save `RoFormerRopeTokenizer(vocab_file="vocab.txt")` there (`save_pretrained`) to get one.
"""


def _usage_extra(kind: str, pooler: bool, encoder_only: bool) -> str:
    if encoder_only:
        return ""
    if kind == "sim" and pooler:
        return string.Template(_POOLER_USAGE).safe_substitute(what="RoFormer-Sim's sentence vector, linear")
    extra = _GPT_USAGE if kind.endswith("gpt") else ""
    if pooler and kind in ("v1", "gpt"):
        extra += string.Template(_POOLER_USAGE).safe_substitute(what="BERT's tanh pooler")
    return extra


def tf_card_values(result, config, source: str, title: str, repo_id: str | None, license: str) -> dict[str, str]:
    """Everything the convert-tf card shows: metadata, usage and provenance (`result`: a ConversionResult)."""
    causal = result.architecture == "RoFormerRopeForCausalLM"
    encoder_only = result.architecture == "RoFormerRopeModel"
    pipeline = "text-generation" if causal else "feature-extraction" if encoder_only else "fill-mask"
    auto = {"RoFormerRopeForCausalLM": "AutoModelForCausalLM", "RoFormerRopeModel": "AutoModel"}.get(
        result.architecture, "AutoModelForMaskedLM"
    )
    tanh_pooler = result.pooler and result.kind in ("v1", "gpt")
    repo = repo_id or "PATH_OR_REPO_ID"
    if result.reference_max_abs_diff is None:
        reference = "not checked at conversion (no `--reference-outputs`)"
    else:
        reference = f"reproduced to max abs diff {result.reference_max_abs_diff:.3g} (`{result.reference_file}`)"
    usage = _USAGE_WITH_TOKENIZER if result.tokenizer else _USAGE_WITHOUT_TOKENIZER
    return {
        "usage_code": string.Template(usage).safe_substitute(repo_id=repo, auto_class=auto),
        "tokenizer_note": "" if result.tokenizer else _NO_TOKENIZER_NOTE,
        "usage_extra": string.Template(_usage_extra(result.kind, result.pooler, encoder_only)).safe_substitute(
            repo_id=repo
        ),
        "license": license,  # checked by `check_license` before the conversion
        "pipeline_tag": pipeline,
        "tags": "\n".join(f"- {tag}" for tag in _TAGS[result.kind]),
        "title": title,
        "kind": result.kind + (" + tanh pooler" if tanh_pooler else ""),
        "kind_name": _KIND_NAMES[result.kind],
        "kind_note": _KIND_NOTES[result.kind]
        + (_TANH_POOLER_NOTE if tanh_pooler else "")
        + (_SIM_NO_POOLER_NOTE if result.kind == "sim" and not result.pooler else ""),
        "repo_id": repo,
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
        "reference_check": reference,
    }
