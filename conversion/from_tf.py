"""Convert an original RoFormer TensorFlow checkpoint (bert4keras) into a `roformer_rope` folder.

    roformer-rope convert-tf --checkpoint chinese_roformer_L-12_H-768_A-12 --out roformer-base
    roformer-rope convert-tf --checkpoint chinese_roformer-v2-char_L-24_H-1024_A-16/bert_model.ckpt --out v2-large
    roformer-rope convert-tf --checkpoint ckpt_dir --out gpt --model-kind gpt
    roformer-rope convert-tf --checkpoint ckpt_dir --out v1 --reference-outputs original_outputs.npz
    roformer-rope convert-tf --checkpoint ckpt_dir --out sim --push-to-hub me/roformer-sim --private --dry-run

`--checkpoint` is the release folder (holding `bert_model.ckpt.*`, `bert_config.json`, `vocab.txt`) or the
`bert_model.ckpt` prefix (the config and vocabulary are then read next to it). TensorFlow is not needed:
`tf_checkpoint` reads the variables with numpy.

Model kinds (`--model-kind auto` detects them, see `tf_kind`):
  v1   RoFormer (word or char vocabulary, any size, embedding_size != hidden_size too)  -> fill-mask
       a `bert/pooler/dense` without "sim" in the name is kept as BERT's tanh pooler (AutoModel)
  sim  RoFormer-Sim: pooler present AND "sim" in the folder/prefix name; UniLM mask, linear pooler
       (--model-kind sim also takes a UniLM seq2seq checkpoint without a pooler)
  gpt  RoFormer-GPT: causal LM. Its variables are exactly v1's, so `auto` picks gpt only when the
       checkpoint folder or prefix name contains "gpt"; otherwise pass --model-kind gpt -> text-generation
  v2   RoFormerV2: no bias and no LayerNorm variables (parameter-free RMS norm)         -> fill-mask
  v2-sim, v2-gpt  RoFormerV2 with the UniLM / causal mask: v2's variables and "sim" / "gpt" in the name
       (or --model-kind sim / gpt, which mean these for v2 variables)
A checkpoint without any `cls/predictions/*` variable (an encoder-only release) converts to the bare
encoder (`AutoModel`).

Variables are renamed by a declarative regex table (`tf_weights.KEY_MAP`), kernels transposed and
query/key/value fused. Optimizer slots and the unused next-sentence head are skipped on purpose; any
other unknown, missing, wrongly shaped or non-float variable is an error listing them all. With
`--reference-outputs FILE.npz` (outputs of the original code, format in `reference_outputs`) the
converted model must reproduce them (atol 1e-4): the check that catches a wrong model kind. The folder
is written beside `--out`, reloaded with `trust_remote_code=True` and checked against the converted
model, and only then swapped in (`roformer_rope.safe_write`): on any error `--out` is as it was.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from roformer_rope.safe_write import OutputError, check_output, safe_output_folder

from .key_map import ConversionError
from .model_card import check_license, render_model_card, sha256_file, tf_card_values
from .reference_outputs import compare_with_reference
from .tf_checkpoint import TFCheckpointError, TFCheckpointReader, resolve_prefix
from .tf_config import build_config, check_vocab, read_bert_config, read_vocab
from .tf_kind import MODEL_KINDS, describe, detect_kind, has_pooler, location_hint, with_family
from .tf_weights import OPTIMIZER_SLOTS, build_model, convert_variables, has_mlm_head, load_strict, rename_variable
from .tokenizer_files import save_tokenizer
from .verify import verify_folder

__all__ = [
    "MODEL_KINDS",
    "ConversionError",
    "ConversionResult",
    "add_arguments",
    "convert_checkpoint",
    "convert_to_model",
    "detect_kind",
    "resolve_checkpoint",
    "run",
    "sha256_file",
    "verify_folder",
]

logger = logging.getLogger(__name__)


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
    checkpoint: str = ""  # the prefix actually read
    pooler: bool = False  # the checkpoint's bert/pooler/dense was converted
    reference_file: str | None = None
    reference_max_abs_diff: float | None = None  # vs the original code's outputs (--reference-outputs)
    tokenizer: bool = True  # a tokenizer was written (the release had a vocab.txt)


def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """(checkpoint prefix, folder holding `bert_config.json` / `vocab.txt`) for a folder or a prefix."""
    path = Path(path)
    if not path.is_dir() and not Path(f"{path}.index").is_file() and not path.is_file():
        raise ConversionError(f"{path}: no such checkpoint folder or prefix (expected DIR or DIR/bert_model.ckpt)")
    try:
        prefix = resolve_prefix(path)
    except TFCheckpointError as error:
        raise ConversionError(str(error)) from None
    return prefix, Path(prefix).parent


def convert_to_model(
    checkpoint: str | Path, model_kind: str = "auto"
) -> tuple[torch.nn.Module, ConversionResult, Path]:
    """Read, map and strictly load a checkpoint; returns (model, partial result, release folder)."""
    if model_kind not in ("auto", *MODEL_KINDS):
        raise ConversionError(f"--model-kind must be auto or one of {MODEL_KINDS}, got {model_kind!r}")
    prefix, folder = resolve_checkpoint(checkpoint)
    try:
        reader = TFCheckpointReader(prefix)
        all_names = set(reader.entries)
        skipped = sorted(n for n in all_names if OPTIMIZER_SLOTS.search(n))
        names = all_names - set(skipped)
        pooler = has_pooler(names)
        kind = detect_kind(names, location_hint(prefix)) if model_kind == "auto" else with_family(model_kind, names)
        logger.info(
            "reading %s: %d variables (%d optimizer slots skipped), kind %s%s",
            reader.index_path,
            len(all_names),
            len(skipped),
            describe(kind, pooler),
            "" if model_kind == "auto" else " (--model-kind)",
        )
        bert_config = read_bert_config(folder)
        vocab = read_vocab(folder)
        config = build_config(bert_config, kind, vocab, pooler=pooler, source=str(folder / "bert_config.json"))
        check_vocab(vocab, config.vocab_size, folder)
        with_head = has_mlm_head(names, kind)
        if kind.endswith("gpt") and not with_head:
            raise ConversionError("a gpt checkpoint needs its LM head (cls/predictions/*), none found")
        state_dict, sources = convert_variables(reader.load_all(skip=OPTIMIZER_SLOTS))
        index_sha256 = sha256_file(reader.index_path)
    except TFCheckpointError as error:
        raise ConversionError(str(error)) from None
    model = build_model(config, with_head)
    load_strict(model, state_dict, sources)
    dropped = sorted(n for n in names if rename_variable(n) is None)
    result = ConversionResult(
        out_dir=Path(),
        kind=kind,
        architecture=type(model).__name__,
        num_variables=len(all_names),
        num_converted=len(names) - len(dropped),
        index_sha256=index_sha256,
        max_abs_diff=float("nan"),
        skipped=skipped + dropped,
        checkpoint=prefix,
        pooler=config.add_pooler,
    )
    return model, result, folder


def convert_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    model_kind: str = "auto",
    overwrite: bool = False,
    repo_id: str | None = None,
    license: str = "apache-2.0",
    reference_outputs: str | Path | None = None,
) -> ConversionResult:
    """Convert a bert4keras checkpoint into a verified `roformer_rope` folder at `out_dir`.

    `out_dir` may not be, contain or lie inside the checkpoint folder. Everything is written into a
    temporary sibling folder, reloaded and compared with the in-memory model (and with
    `reference_outputs`, if given, before anything is written), and swapped in only then; on any error
    `out_dir` is as it was and no temporary is left.
    """
    check_license(license)  # before the conversion: it only goes into the card at the end
    prefix, folder = resolve_checkpoint(checkpoint)
    sources = [checkpoint, folder]
    try:
        check_output(out_dir, overwrite=overwrite, sources=sources, what="--out")
    except OutputError as error:
        raise ConversionError(str(error)) from None
    model, result, folder = convert_to_model(prefix, model_kind)
    if reference_outputs is not None:
        result.reference_file = str(reference_outputs)
        result.reference_max_abs_diff = compare_with_reference(model, reference_outputs)
    with safe_output_folder(out_dir, overwrite=overwrite, sources=sources, what="--out") as tmp:
        model.save_pretrained(tmp)
        result.tokenizer = bool(save_tokenizer(folder, tmp, model_max_length=model.config.max_position_embeddings))
        result.max_abs_diff = verify_folder(model, tmp)
        # `--checkpoint .` names no release: its folder does (made absolute, symlinks kept as the user named them).
        # The card is published with --push-to-hub: it names the release (and the prefix file), never the local path.
        name = Path(os.path.abspath(folder)).name
        given = Path(os.path.abspath(checkpoint))
        source = name if given.is_dir() else f"{name}/{given.name}"
        values = tf_card_values(result, model.config, source, name, repo_id, license)
        (tmp / "README.md").write_text(render_model_card(values), encoding="utf-8")
    result.out_dir = Path(out_dir)
    return result


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
    parser.add_argument(
        "--out", required=True, help="output folder (must not exist unless --overwrite; never the checkpoint folder)"
    )
    parser.add_argument(
        "--model-kind",
        default="auto",
        choices=("auto", *MODEL_KINDS),
        help="auto: v2 if no bias/LayerNorm variables (v2-sim / v2-gpt with 'sim' / 'gpt' in the name); sim if "
        "bert/pooler/* exists AND the folder/prefix name has the word 'sim' (a pooler without it is v1 + BERT's "
        "tanh pooler); gpt when the name contains 'gpt' (gpt and v1 store identical variables: pass gpt explicitly "
        "for a renamed GPT checkpoint); else v1. sim also takes a UniLM checkpoint without a pooler; sim / gpt for "
        "v2 variables mean v2-sim / v2-gpt",
    )
    parser.add_argument(
        "--reference-outputs",
        metavar="FILE.npz",
        help="outputs of the original code on this checkpoint (input_ids + hidden_states/mlm_logits/lm_logits/"
        "pooler); the converted model must reproduce them (atol 1e-4) or nothing is written",
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
    if args.push_to_hub:
        from .hub import check_repo_id

        check_repo_id(args.push_to_hub)
    result = convert_checkpoint(
        args.checkpoint,
        args.out,
        model_kind=args.model_kind,
        overwrite=args.overwrite,
        repo_id=args.push_to_hub,
        license=args.license,
        reference_outputs=getattr(args, "reference_outputs", None),
    )
    reference = (
        ""
        if result.reference_max_abs_diff is None
        else f", original outputs max |diff| {result.reference_max_abs_diff:.2g}"
    )
    print(
        f"wrote {result.out_dir} from {result.checkpoint} ({describe(result.kind, result.pooler)}, "
        f"{result.architecture}, {result.num_converted}/{result.num_variables} variables, "
        f"reload max |diff| {result.max_abs_diff:.2g}{reference})"
    )
    if args.push_to_hub:
        from .hub import push_folder

        push_folder(
            result.out_dir, args.push_to_hub, private=args.private, revision=args.revision, dry_run=args.dry_run
        )
    return 0
