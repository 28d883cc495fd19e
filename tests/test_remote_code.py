"""trust_remote_code round trip in a fresh process that cannot import the repo, and fill-mask on the result."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import randomise_, tiny_config

CHARS = list("今天天气非常好我们去公园散步吧人民日报新闻北京上海的了是在有")
WORDS = ["今天", "天气", "非常", "公园", "散步", "人民", "日报", "北京"]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory):
    """A tiny MLM model + our tokenizer saved with save_pretrained (which copies the payload code)."""
    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer

    folder = tmp_path_factory.mktemp("saved")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(CHARS), *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(folder / "vocab.txt"))
    torch.manual_seed(0)
    model = randomise_(rr.RoFormerRopeForMaskedLM(tiny_config(vocab_size=len(vocab))).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys
    # The repo is installed editable in this venv: drop its import hooks so only the saved folder's code can load.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "").lower()]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "").lower()]
    sys.path_importer_cache.clear()
    assert importlib.util.find_spec("modeling_roformer_rope") is None, "repo code is importable"
    assert not any("roformer" in p for p in sys.path if "site-packages" not in p), sys.path
    import torch, transformers
    folder = sys.argv[1]
    results = {}
    for auto in ["AutoModel", "AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                 "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModelForMultipleChoice"]:
        model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True)
        results[auto] = [type(model).__name__, type(model).__module__]
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    enc = tok(["今天天气非常好", "我们去公园散步吧"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = mlm(**enc).logits
    results["input_ids"] = enc["input_ids"].tolist()
    results["logits"] = logits.tolist()
    fill = transformers.pipeline("fill-mask", model=mlm, tokenizer=tok)
    results["fill"] = fill("今天天气" + tok.mask_token + "常好", top_k=3)
    results["loaded_modules"] = sorted(m for m in sys.modules if "roformer" in m and "editable" not in m)
    print(json.dumps(results, ensure_ascii=False))
    """
)


def test_round_trip_in_fresh_process(saved_folder, tmp_path):
    folder, model, tokenizer = saved_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "roformer_rope"
    assert set(config["auto_map"]) >= {
        "AutoConfig",
        "AutoModel",
        "AutoModelForMaskedLM",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering",
        "AutoModelForMultipleChoice",
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])

    for auto, (class_name, module) in ((k, v) for k, v in child.items() if k.startswith("Auto")):
        assert class_name.startswith("RoFormerRope"), (auto, class_name)
        assert module.startswith("transformers_modules."), (auto, module)  # the folder's copy, not the repo
    assert all(m.startswith("transformers_modules") for m in child["loaded_modules"]), child["loaded_modules"]

    # Same ids and logits as the in-process model and tokenizer.
    enc = tokenizer(["今天天气非常好", "我们去公园散步吧"], padding=True, return_tensors="pt")
    assert child["input_ids"] == enc["input_ids"].tolist()
    with torch.no_grad():
        expected = model(**enc).logits
    torch.testing.assert_close(torch.tensor(child["logits"]), expected, atol=1e-5, rtol=1e-5)

    # fill-mask: the pipeline's top token is the argmax of our own logits at the mask position.
    masked = tokenizer("今天天气" + tokenizer.mask_token + "常好", return_tensors="pt")
    position = int((masked["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0])
    with torch.no_grad():
        scores = model(**masked).logits[0, position].softmax(-1)
    top = scores.topk(3)
    assert [f["token"] for f in child["fill"]] == top.indices.tolist()
    for f, p in zip(child["fill"], top.values.tolist()):
        assert f["score"] == pytest.approx(p, abs=1e-5)
