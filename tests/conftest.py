"""Shared fixtures: tiny configs and randomised built-in RoFormer models (the independent oracle)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

# Every test process times its own calibration choices (tests count and force them): none are read from, or written
# to, the user's store (`stored_choices_roformer_rope.py`); tests/test_stored_choices.py turns it on in a tmp folder.
os.environ["ROFORMER_ROPE_CACHE"] = "0"

import modeling_roformer_rope as rr  # noqa: E402

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def tiny_config(**overrides) -> rr.RoFormerRopeConfig:
    return rr.RoFormerRopeConfig(**{**TINY, **overrides})


SHARPEN = 15.0  # query/key weight scale: attention logits of std ~2-3 instead of ~0.01


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial norm gains and biases, so a mapping mistake on them cannot hide behind ones/zeros, and query/key
    weights scaled by SHARPEN: at the 0.02 initialiser range attention is nearly uniform, and a position
    (rotary) mistake would move the outputs by only ~1e-5."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "LayerNorm" in name or ".norm." in name or name.endswith("_norm.weight") or name.endswith("_norm.bias"):
            center = 1.0 if name.endswith("weight") else 0.0
            param.copy_(center + 0.2 * torch.randn(param.shape, generator=generator))
        elif name.endswith("bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
        if name.endswith(("self.query.weight", "self.key.weight")):  # built-in layout
            param.mul_(SHARPEN)
        elif name.endswith("attention.qkv.weight"):  # ours: rows [query; key; value]
            param[: 2 * param.shape[0] // 3].mul_(SHARPEN)
    return model


def builtin_model(class_name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random built-in transformers `RoFormer*` model (eager, its only backend)."""
    torch.manual_seed(seed)
    fields = {**TINY, "num_labels": 3, **overrides}
    if class_name == "RoFormerForCausalLM":
        fields.setdefault("is_decoder", True)
    config = transformers.RoFormerConfig(**fields)
    return randomise_(getattr(transformers, class_name)(config).eval(), seed)


def padded_batch(vocab_size: int = 99, batch: int = 2, seq_len: int = 12, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    attention_mask[-1, seq_len // 2 :] = 0
    input_ids[attention_mask == 0] = 0
    token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    token_type_ids[:, seq_len // 3 :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def decoder_or_unilm_outputs(unilm: bool, padded: bool, seq_len: int, dtype: torch.dtype = torch.float32):
    """A tiny causal LM (or a UniLM-masked encoder) on a padded batch (every mask 1 unless `padded`): its outputs with
    the configured attention and with the eager implementation, the valid positions, and its config."""
    config = tiny_config(**(dict(unilm_mask=True) if unilm else dict(is_decoder=True)))
    torch.manual_seed(0)
    model = (rr.RoFormerRopeModel if unilm else rr.RoFormerRopeForCausalLM)(config).eval().to(dtype)
    batch = padded_batch(seq_len=seq_len)
    if not unilm:
        batch.pop("token_type_ids")
    if not padded:
        batch["attention_mask"].fill_(1)
    with torch.no_grad():
        fast = model(**batch)[0]
        model.config._attn_implementation = "eager"
        eager = model(**batch)[0]
    return fast, eager, batch["attention_mask"].bool(), config


def spy_last_layer(model: torch.nn.Module) -> list:
    """The shapes the last encoder layer returns, one per call (a forward hook)."""
    shapes = []
    model.base_model.layers[-1].register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    return shapes


def backward_both(builtin: torch.nn.Module, ours: torch.nn.Module, **inputs) -> None:
    """One forward + backward of each model on the same inputs; asserts the losses equal (atol 1e-6)."""
    expected = builtin(**inputs).loss
    expected.backward()
    loss = ours(**inputs).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)


def spy(monkeypatch, owner, name: str) -> list:
    """Wrap `owner.name` for this test so that every call's result is appended to the list returned."""
    results = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: results.append(real(*args, **kwargs)) or results[-1])
    return results


def assert_bf16_autocast_linear_matches_f_linear(module: torch.nn.Module) -> torch.Tensor:
    """`module` (64 → 96, MLM-decoder-like: 2 of 100 rows carry a gradient) under CPU bf16 autocast against
    autocast's F.linear on copies of its parameters: a bf16 output and float32 gradients, equal to bf16 noise.
    Returns the output (its grad_fn tells which node ran)."""
    from torch.nn import functional as F

    torch.manual_seed(0)
    x = torch.randn(2, 50, 64, requires_grad=True)
    grad = torch.zeros(2, 50, 96)
    grad[0, 3], grad[1, 7] = torch.randn(96), torch.randn(96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    out.backward(grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, module.weight, module.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x2, w2, b2)
    ref.backward(grad)
    assert out.dtype == ref.dtype == torch.bfloat16 and module.weight.grad.dtype == torch.float32
    for got, want in zip((out, x.grad, module.weight.grad, module.bias.grad), (ref, x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    return out


def assert_bf16_autocast_mlm_step_matches_builtin() -> None:
    """A dense-head MLM step under CPU bf16 autocast, ours and the built-in on the same weights: the losses and the
    tied embeddings' gradients agree to bf16 noise."""
    from roformer_rope.conversion.from_transformers import convert_model

    builtin = builtin_model("RoFormerForMaskedLM").train()
    ours = convert_model(builtin).train()
    batch = padded_batch(seq_len=40)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, ::7] = batch["input_ids"][:, ::7]
    losses, grads = [], []
    for model in (ours, builtin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.get_input_embeddings().weight.grad)
    torch.testing.assert_close(losses[0], losses[1], atol=2e-2, rtol=2e-2)
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 3e-2


@pytest.fixture(autouse=True)
def _classes_wait(monkeypatch):
    """An inference linear class whose decision is open runs `F.linear` on its real calls for the whole test
    (`calibration_roformer_rope.rent`, START_BUDGET infinite): its switch to the rounds would otherwise fall on a call
    that depends on the host's speed and on what earlier tests ran, and two calls of one input that a test compares
    bit for bit could straddle it. The rounds' own tests start them at once (`timed_at_once`) or set a budget."""
    from modeling_roformer_rope import calibration_roformer_rope as calibration

    monkeypatch.setattr(calibration, "START_BUDGET", float("inf"))
    calibration._rents.clear()
    calibration._costs.clear()
    calibration._waited.clear()  # an earlier test's paid wait would let a later decision start at once here
    calibration._forget_derived()  # the plans holding earlier tests' waits


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture
def on_proxies(monkeypatch):
    """Every inference linear class decided on proxies before its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=0`),
    not over its real calls: for tests of what a decided plan does from its first call on."""
    from modeling_roformer_rope import onednn_roformer_rope as fast

    monkeypatch.setattr(fast, "settings", dataclasses.replace(fast.settings, calibrate_on_calls="off"))


@pytest.fixture
def timed_at_once(monkeypatch):
    """The rounds of a linear class on its real calls start on its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=1`),
    not once waiting may have cost what a decision costs (`calibration_roformer_rope.rent_paid`): for tests of the
    rounds themselves."""
    from modeling_roformer_rope import onednn_roformer_rope as fast

    monkeypatch.setattr(fast, "settings", dataclasses.replace(fast.settings, calibrate_on_calls="on"))


def probe_json(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter whose environment is only `env` (the payload reads its switches at
    import); its last line of output is JSON, returned parsed."""
    env = {"ROFORMER_ROPE_CACHE": "0", **env, "PATH": ""}  # no stored choices unless `env` names a folder
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
