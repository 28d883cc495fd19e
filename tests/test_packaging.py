"""The distribution claims only our two import names, and the console command lists its subcommands."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_top_level_names_are_namespaced(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("roformer_rope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"modeling_roformer_rope", "roformer_rope"}, top_level
    for expected in (
        "roformer_rope/conversion/from_tf.py",
        "roformer_rope/tokenization/build_vocab.py",
        "roformer_rope/scripts/quickstart.py",
        "roformer_rope/model_cards/roformer_tf.md",
        "roformer_rope/scripts/finetune_ds_zero2.json",  # README's `finetune --deepspeed` example
        "roformer_rope/conversion/json_object.py",
        "modeling_roformer_rope/tokenization_roformer_rope.py",
    ):
        assert expected in names, expected


def test_cli_help_lists_subcommands():
    result = subprocess.run([sys.executable, "-m", "roformer_rope.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for command in ("convert-hf", "convert-tf", "build-vocab", "quickstart"):
        assert command in result.stdout
