"""The `roformer-rope` CLI: lazy command imports, the two module protocols, one-line errors, --debug."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from roformer_rope import cli

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


@pytest.fixture
def fake_commands(tmp_path, monkeypatch):
    """A package of fake command modules on sys.path, registered as CLI commands."""
    package = tmp_path / "fakecmds"
    package.mkdir()
    (package / "__init__.py").write_text("")
    modules = {
        "classic": '''
            """classic: add_arguments + run."""
            def add_arguments(parser):
                parser.add_argument("--n", type=int, required=True)
            def run(args):
                print("classic", args.n)
                return 0
        ''',
        "own_parser": '''
            """own_parser: parses its own flags (HfArgumentParser-style)."""
            def main(argv):
                print("argv", argv)
                return 3
        ''',
        "needs_dep": '''
            """needs_dep: imports an optional package at the top."""
            import deepspeed_not_installed_here  # noqa: F401
            def add_arguments(parser): ...
            def run(args): return 0
        ''',
        "needs_yaml": """
            import yaml_missing_for_test.sub  # noqa: F401
        """,
        "raises": '''
            """raises: each failure kind the CLI must turn into one line."""
            import errno, json
            def add_arguments(parser):
                parser.add_argument("kind")
            def run(args):
                if args.kind == "permission":
                    raise PermissionError(errno.EACCES, "Permission denied", "/data/model.safetensors")
                if args.kind == "rename":
                    raise OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")
                if args.kind == "memory":
                    raise MemoryError()
                if args.kind == "keyerror":
                    raise KeyError("nope")
                if args.kind == "attribute":
                    [].get("x")
                if args.kind == "value":
                    raise ValueError("config.json: hidden_act 'nope' is unknown\\nsecond line")
                if args.kind == "safetensors":
                    from safetensors import SafetensorError
                    raise SafetensorError("Error while deserializing header: MetadataIncompleteBuffer")
                if args.kind == "late-import":
                    import datasets_absent_here  # noqa: F401
                if args.kind == "interrupt":
                    raise KeyboardInterrupt
                return 0
        ''',
    }
    for name, code in modules.items():
        (package / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in modules:
        monkeypatch.setitem(cli.COMMANDS, name.replace("_", "-"), cli.Command(f"fakecmds.{name}", f"fake {name}"))
    monkeypatch.setitem(cli.COMMANDS, "not-shipped", cli.Command("fakecmds.absent", "a module that does not exist"))
    yield
    for name in list(sys.modules):
        if name.startswith("fakecmds"):
            del sys.modules[name]


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"roformer-rope {command}: error: "), lines[0]
    return lines[0]


# --- lazy imports ------------------------------------------------------------------------------


def test_help_lists_every_command_without_importing_any():
    code = """
import sys, json
from roformer_rope import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith("roformer_rope.") or m in ("torch", "transformers"))))
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    out, imported = done.stdout.rsplit("\n", 2)[0], json.loads(done.stdout.strip().splitlines()[-1])
    for command in cli.COMMANDS:
        assert command in out
    assert imported == ["roformer_rope.cli"], imported


def test_subcommand_help_imports_only_that_command():
    code = """
import sys, json
from roformer_rope import cli
try:
    cli.main(["build-vocab", "--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith("roformer_rope."))))
"""
    done = run_python(code)
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert "--min-char-count" in done.stdout
    assert "roformer_rope.tokenization.build_vocab" in imported
    assert not any("conversion" in m or "scripts" in m for m in imported), imported


def test_missing_optional_package_is_named_when_the_command_runs(fake_commands, capsys):
    assert cli.main(["needs-dep"]) == 2
    line = one_error_line(capsys.readouterr().err, "needs-dep")
    assert "deepspeed_not_installed_here" in line and "not installed" in line and "pip install" in line
    assert cli.main(["needs-yaml"]) == 2
    line = one_error_line(capsys.readouterr().err, "needs-yaml")
    assert "'yaml_missing_for_test'" in line
    # the other commands are unaffected
    assert cli.main(["classic", "--n", "4"]) == 0
    assert capsys.readouterr().out == "classic 4\n"


def test_known_optional_package_names_its_extra(monkeypatch, tmp_path, capsys):
    (tmp_path / "uses_deepspeed.py").write_text("import deepspeed.comm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "ds", cli.Command("uses_deepspeed", "x"))
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails as if not installed
    assert cli.main(["ds"]) == 2
    line = one_error_line(capsys.readouterr().err, "ds")
    assert "'deepspeed'" in line and "roformer-rope[train]" in line


def test_command_module_not_shipped_says_so(fake_commands, capsys):
    assert cli.main(["not-shipped"]) == 2
    assert "not part of this installation" in one_error_line(capsys.readouterr().err, "not-shipped")


def test_main_protocol_gets_every_argument_untouched(fake_commands, capsys):
    assert cli.main(["own-parser", "--output_dir", "x", "--help", "--debug", "--num_train_epochs=2"]) == 3
    assert capsys.readouterr().out == "argv ['--output_dir', 'x', '--help', '--num_train_epochs=2']\n"


# --- one-line errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, fragments",
    [
        ("permission", ["/data/model.safetensors: Permission denied"]),
        ("rename", ["/a -> /b: Invalid cross-device link"]),
        ("memory", ["out of memory"]),
        ("keyerror", ["KeyError: 'nope'", "--debug"]),
        ("attribute", ["AttributeError", "--debug"]),
        ("value", ["config.json: hidden_act 'nope' is unknown second line"]),
        ("safetensors", ["corrupt or truncated safetensors file", "MetadataIncompleteBuffer"]),
        ("late-import", ["needs the package 'datasets_absent_here'", "pip install datasets_absent_here"]),
    ],
)
def test_every_failure_is_one_line_with_exit_code_2(fake_commands, capsys, monkeypatch, kind, fragments):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["raises", kind]) == 2
    err = capsys.readouterr().err
    line = one_error_line(err, "raises")
    for fragment in fragments:
        assert fragment in line, line
    assert "Traceback" not in err


def test_debug_flag_and_env_show_the_traceback(fake_commands, capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    for argv in (["--debug", "raises", "keyerror"], ["raises", "keyerror", "--debug"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("roformer-rope raises: error:")
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    assert cli.main(["raises", "memory"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_interrupt_exits_130(fake_commands, capsys):
    assert cli.main(["raises", "interrupt"]) == 130
    assert "roformer-rope raises: interrupted" in capsys.readouterr().err


def test_usage_errors_are_one_line_with_exit_code_2(fake_commands, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["classic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("roformer-rope classic: error:") and "--n" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "\n" not in capsys.readouterr().err.strip()


# --- entry points ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["roformer_rope", "roformer_rope.cli"])
def test_python_dash_m_entry_points(module, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", module, "convert-tf", "--checkpoint", str(tmp_path / "none"), "--out", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    line = one_error_line(done.stderr, "convert-tf")
    assert "no such checkpoint" in line and str(tmp_path / "none") in line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv", [["finetune", "sentiment"], ["--debug", "finetune", "sentiment"]])
def test_finetune_command_builds_the_same_training_arguments_as_the_module(argv, tmp_path):
    """The CLI's own `--debug` switch must not leak into TrainingArguments.debug (a list in transformers:
    `Trainer.train` runs `... in args.debug`), with or without `--debug` given."""
    from roformer_rope.scripts.finetune import arguments_from_namespace, parse

    out = ["--output_dir", str(tmp_path / "ft")]
    namespace = cli.build_parser().parse_args(argv + out)
    *_, from_cli = arguments_from_namespace(namespace)
    *_, from_module = parse(["sentiment", *out])
    assert from_cli.debug == from_module.debug == []


def test_quickstart_keeps_the_old_out_when_the_reload_step_fails(tmp_path, monkeypatch):
    """README: the temporary folder replaces --out only when every step succeeded, the fresh-process reload
    included (the steps are stubbed here: only the orchestration is under test)."""
    import roformer_rope.scripts.finetune as finetune
    import roformer_rope.scripts.pretrain as pretrain
    import roformer_rope.scripts.quickstart as quickstart

    def fake_pretrain(args):
        model = Path(args.out) / "model"
        model.mkdir(parents=True)
        (model / "vocab.txt").write_text("[PAD]\n[UNK]\n中\n", encoding="utf-8")
        (Path(args.out) / "stage_table.json").write_text("[]")

    def failing_reload(folder, sentences):
        raise RuntimeError(f"reloading {folder} in a fresh process failed")

    monkeypatch.setattr(pretrain, "run", fake_pretrain)
    monkeypatch.setattr(finetune, "quick_sentiment", lambda *a: {"test": {"accuracy": 0.5}})
    monkeypatch.setattr(quickstart, "reload_and_fill", failing_reload)
    out = tmp_path / "qs-out"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier run")
    with pytest.raises(RuntimeError, match="fresh process failed"):
        quickstart.main(["--smoke", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qs-out"]  # no temporary folder left behind
