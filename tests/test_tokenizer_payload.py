"""The tokenizer's payload files (tokenizer + added-token, jieba and offsets siblings) travel with every saved folder.

transformers' `custom_object_save` copies the saved class's module and every file it reaches through
`from .name import` lines; the Hub loader copies the same closure back. A sibling missing from a saved
folder, or one importing an optional package at top level, breaks `trust_remote_code` loading.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("modeling_roformer_rope") is None:
    sys.path.insert(0, str(REPO))

from transformers.dynamic_module_utils import get_imports, get_relative_import_files  # noqa: E402

import modeling_roformer_rope as rr  # noqa: E402
from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402

pytest.importorskip("rjieba")

PAYLOAD = Path(rr.__file__).parent
TOKENIZER_FILES = {
    "tokenization_roformer_rope.py",
    "added_tokens_roformer_rope.py",
    "jieba_roformer_rope.py",
    "offsets_roformer_rope.py",
}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"今天天气非常好我们去公园散步吧", "今天", "非常", "非常好"]


def test_tokenizer_module_reaches_its_siblings():
    reached = {Path(f).name for f in get_relative_import_files(PAYLOAD / "tokenization_roformer_rope.py")}
    assert reached == TOKENIZER_FILES - {"tokenization_roformer_rope.py"}


@pytest.mark.parametrize("name", sorted(TOKENIZER_FILES - {"tokenization_roformer_rope.py"}))
def test_siblings_import_only_the_stdlib(name):
    """jieba/rjieba are optional: imported inside functions, never where the Hub loader checks."""
    assert set(get_imports(PAYLOAD / name)) <= set(sys.stdlib_module_names)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """What every tool writes: `model.save_pretrained` + `tokenizer.save_pretrained`, nothing copied by hand."""
    from conftest import tiny_config

    folder = tmp_path_factory.mktemp("model")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(folder / "vocab.txt"), jieba_words=[("非常好", 10**6)])
    rr.RoFormerRopeForMaskedLM(tiny_config(vocab_size=len(VOCAB))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_saved_folder_holds_every_payload_file_it_names(model_folder):
    """Every module in an `auto_map` and everything it imports is in the folder, byte-identical."""
    auto_maps = [
        json.loads((model_folder / name).read_text())["auto_map"] for name in ("config.json", "tokenizer_config.json")
    ]
    entries = [e for m in auto_maps for v in m.values() for e in (v if isinstance(v, list) else [v]) if e]
    assert "tokenization_roformer_rope.RoFormerRopeTokenizer" in entries
    needed = set()
    for module in {e.split(".")[0] + ".py" for e in entries}:
        needed |= {module, *(Path(f).name for f in get_relative_import_files(PAYLOAD / module))}
    assert needed >= TOKENIZER_FILES
    for name in needed:
        assert (model_folder / name).read_bytes() == (PAYLOAD / name).read_bytes(), name


CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys
    # the repo is installed editable: drop its import hooks so only the saved folder's code loads
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "").lower()]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "").lower()]
    sys.path_importer_cache.clear()
    assert importlib.util.find_spec("modeling_roformer_rope") is None, "repo code is importable"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
    enc = tok(["今天天气非常好", "我们去公园散步吧"], ["非常好", "今天"], return_offsets_mapping=True)
    modules = {m.rpartition(".")[2]: m for m in sys.modules if m.endswith("_roformer_rope")}
    print(json.dumps({"ids": enc["input_ids"], "offsets": enc["offset_mapping"], "words": tok.jieba_words,
                      "modules": modules}))
    """
)


def test_saved_folder_loads_in_a_fresh_process(model_folder, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_folder)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    child = json.loads(run.stdout.strip().splitlines()[-1])
    tokenizer = RoFormerRopeTokenizer.from_pretrained(model_folder)
    want = tokenizer(["今天天气非常好", "我们去公园散步吧"], ["非常好", "今天"], return_offsets_mapping=True)
    assert child["ids"] == want["input_ids"]
    assert [[tuple(o) for o in row] for row in child["offsets"]] == want["offset_mapping"]
    assert child["words"] == [["非常好", 1000000]]
    assert "非常好" in tokenizer.convert_ids_to_tokens(child["ids"][0])  # the jieba word made it through
    for name in TOKENIZER_FILES:
        assert child["modules"][name.removesuffix(".py")].startswith("transformers_modules."), child["modules"]
