"""`roformer-rope`: one command, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert-hf": ("roformer_rope.conversion.from_transformers", "convert a built-in transformers RoFormer folder"),
    "convert-tf": ("roformer_rope.conversion.from_tf", "convert an original TensorFlow (bert4keras) checkpoint"),
    "build-vocab": ("roformer_rope.tokenization.build_vocab", "build a WoBERT-style jieba word + char vocabulary"),
    "pretrain": ("roformer_rope.scripts.pretrain", "multi-stage Chinese MLM pretraining (DeepSpeed ZeRO)"),
    "finetune": ("roformer_rope.scripts.finetune", "fine-tune a RoFormerRope model with the Trainer"),
    "quickstart": ("roformer_rope.scripts.quickstart", "the `make quickstart` job on the embedded defaults"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roformer-rope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:  # the module exists but one of its imports is missing
                raise
            continue  # not part of this version yet
        command = sub.add_parser(
            name, help=help_text, description=(module.__doc__ or help_text).strip(), formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"roformer-rope {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
