"""Linear-attention RoFormers (attention_type "linear" = eq. 19, "performer" = FAVOR+) inside the model.

The kernels are checked against naive formulas in test_linear_attention.py; here the wiring is: which
features, which rotation where, masks, causality, the generation cache, saving the random projection.
The oracle recomputes layer 0 from its weights with an explicit N×N weight matrix in float64.
"""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import padded_batch, randomise_, tiny_config
from modeling_roformer_rope.cache_name_roformer_rope import output_cache


def model_of(cls=rr.RoFormerRopeModel, seed=0, **overrides):
    torch.manual_seed(seed)
    return randomise_(cls(tiny_config(**overrides)).eval(), seed)


def complex_rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Eq. 34 as a complex product over pairs of the last dim, θ_i = 10000^(-2i/F) (independent oracle)."""
    F = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, F, 2, dtype=torch.float64) / F)
    angles = positions.double()[:, None] * theta  # (T, F/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], F // 2, 2).contiguous()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.view_as_real(z).reshape(x.shape)


def naive_layer0(model, batch, kind, causal=False, placement="before_features", feature_map="elu"):
    """Layer 0's attention output from an explicit (T, T) weight matrix, float64."""
    emb = model.embeddings(batch["input_ids"], batch.get("token_type_ids"))
    attn = model.layers[0].attention
    B, T, _ = emb.shape
    H, D = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(emb).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).double().unbind(0)  # (B, H, T, D)
    pos = torch.arange(T)
    if kind == "linear":
        phi = (lambda x: torch.nn.functional.elu(x) + 1) if feature_map == "elu" else torch.relu  # noqa: E731
        qf, kf = phi(q), phi(k)
        num_w = complex_rotate(qf, pos) @ complex_rotate(kf, pos).transpose(-1, -2)  # (B, H, T, T) eq. 19 numerator
        den_w = qf @ kf.transpose(-1, -2)  # unrotated denominator
    else:
        W = attn.feature_projection.double()  # (M, D)
        M = W.shape[0]

        def phi(x):  # FAVOR+ positive features of x·D^-1/4 (Lemma 1), no stabiliser
            x = x * D**-0.25
            return torch.exp(x @ W.T - 0.5 * x.square().sum(-1, keepdim=True)) / math.sqrt(M)

        if placement == "before_features":
            qf, kf = phi(complex_rotate(q, pos)), phi(complex_rotate(k, pos))
            num_w = den_w = qf @ kf.transpose(-1, -2)
        else:
            qf, kf = phi(q), phi(k)
            num_w = complex_rotate(qf, pos) @ complex_rotate(kf, pos).transpose(-1, -2)
            den_w = qf @ kf.transpose(-1, -2)
    keep = batch["attention_mask"].bool()[:, None, None, :].expand(B, H, T, T)
    if causal:
        keep = keep & torch.ones(T, T, dtype=torch.bool).tril()
    num_w, den_w = num_w * keep, den_w * keep
    den = den_w.sum(-1, keepdim=True)
    out = torch.where(den > 0, (num_w @ v) / den, 0.0)  # (B, H, T, D); no weight at all → 0, as the kernels
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, H * D).to(emb.dtype))


CASES = [
    ("linear", {}),
    ("linear", {"linear_feature_map": "relu"}),
    ("performer", {"performer_nb_features": 64}),
    ("performer", {"performer_nb_features": 64, "performer_rope_placement": "numerator"}),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind, extra", CASES, ids=["linear-elu", "linear-relu", "performer", "performer-numerator"])
def test_layer_equals_the_naive_formula(kind, extra, causal):
    model = model_of(attention_type=kind, is_decoder=causal, **extra).double()
    batch = padded_batch()
    if causal:
        batch.pop("token_type_ids")
    emb = model.embeddings(batch["input_ids"], batch.get("token_type_ids"))
    attn = model.layers[0].attention
    with torch.no_grad():
        cos_sin = model.rotary_emb(torch.arange(emb.shape[1])[None])
        kwargs = {}
        if hasattr(model, "feature_rotary_emb"):
            kwargs["feature_position_embeddings"] = model.feature_rotary_emb(torch.arange(emb.shape[1])[None])
        got, _ = attn(emb, cos_sin, attention_mask=batch["attention_mask"].bool(), **kwargs)
        placement = extra.get("performer_rope_placement", "before_features")
        expected = naive_layer0(model, batch, kind, causal, placement, extra.get("linear_feature_map", "elu"))
    valid = batch["attention_mask"].bool()
    # float64 throughout, but the rotary angles are float32 by design (~1e-7 relative): within 1e-6
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind, extra", CASES[::2] + CASES[3:], ids=["linear", "performer", "performer-numerator"])
def test_padding_is_invisible_and_every_head_runs(kind, extra):
    batch = padded_batch()
    for cls in (rr.RoFormerRopeForMaskedLM, rr.RoFormerRopeForSequenceClassification, rr.RoFormerRopeForTokenClassification):
        model = model_of(cls, attention_type=kind, **extra)
        with torch.no_grad():
            out = model(**batch).logits
            alone = model(input_ids=batch["input_ids"][-1:, :6], token_type_ids=batch["token_type_ids"][-1:, :6]).logits
        assert torch.isfinite(out).all()
        if out.dim() == 3:
            torch.testing.assert_close(out[-1, :6], alone[0], atol=1e-5, rtol=1e-5)
    model = model_of(rr.RoFormerRopeForMaskedLM, attention_type=kind, **extra).train()
    labels = torch.where(torch.rand(batch["input_ids"].shape) < 0.3, batch["input_ids"], -100)
    model(**batch, labels=labels).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind, extra", CASES[::2] + [("linear", {"layer_types": ["full_attention", "linear_attention"]})],
                         ids=["linear", "performer", "mixed"])
def test_generate_equals_greedy_full_forwards_with_a_constant_state(kind, extra):
    model = model_of(rr.RoFormerRopeForCausalLM, attention_type=kind, is_decoder=True, **extra)
    ids = padded_batch()["input_ids"][:1, :5]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)
        sequence = ids
        for _ in range(12):
            step = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step], dim=1)
        assert torch.equal(generated, sequence)
        static = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
        assert torch.equal(static, sequence)
        out = model(ids, use_cache=True)
        layer = output_cache(out).layers[-1]
        sizes = [t.numel() for t in layer.state]
        for _ in range(20):
            out = model(out.logits[:, -1:].argmax(-1), cache=output_cache(out), use_cache=True)
        assert [t.numel() for t in layer.state] == sizes  # memory does not grow with length
        assert output_cache(out).get_seq_length() == 25


@pytest.mark.parametrize("layer_types", [["linear_attention", "full_attention"], ["full_attention", "linear_attention"]])
@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_a_static_cache_mixing_linear_and_softmax_layers_masks_its_unwritten_slots(kind, layer_types):
    """The static cache's key slots not yet written stay masked (transformers sizes masks only against its own layer
    classes, and skips one-token masks only for compileable caches), with and without left padding. float64 and
    large weights, so that attending to a zero slot would change the logits by far more than rounding."""
    from transformers import StaticCache

    model = model_of(rr.RoFormerRopeForCausalLM, attention_type=kind, is_decoder=True, layer_types=layer_types,
                     initializer_range=0.3).double()  # fmt: skip
    ids = torch.randint(2, 40, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=32)
        steps = [model(ids[:, :5], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(5, 9)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)
        dynamic = model.generate(ids[:, :3], max_new_tokens=10, do_sample=False)
        static = model.generate(ids[:, :3], max_new_tokens=10, do_sample=False, cache_implementation="static")
        assert torch.equal(static, dynamic)
        left = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])  # left-padded batch
        mask = (left != 0).long()
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(left, cache_implementation="static", **kwargs), model.generate(left, **kwargs))


def test_performer_projection_is_saved_and_redrawn_only_when_asked(tmp_path):
    model = model_of(rr.RoFormerRopeForMaskedLM, attention_type="performer", performer_nb_features=32)
    batch = padded_batch()
    with torch.no_grad():
        before = model(**batch).logits
        model.train()
        model.eval()
        assert torch.equal(model(**batch).logits, before)  # eval()/train() draw nothing
    model.save_pretrained(tmp_path)
    reloaded = rr.RoFormerRopeForMaskedLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.attention_type == "performer"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, before, atol=0, rtol=0)
        old = reloaded.roformer.layers[0].attention.feature_projection.clone()
        reloaded.redraw_features(torch.Generator().manual_seed(1))
        assert not torch.equal(reloaded.roformer.layers[0].attention.feature_projection, old)
        assert not torch.equal(reloaded(**batch).logits, before)


def test_a_softmax_checkpoint_loads_into_a_linear_model(tmp_path):
    softmax = model_of(rr.RoFormerRopeForMaskedLM)
    softmax.save_pretrained(tmp_path)
    performer = rr.RoFormerRopeForMaskedLM.from_pretrained(tmp_path, attention_type="performer").eval()
    projection = performer.roformer.layers[0].attention.feature_projection
    assert projection.shape == (256, 8) and projection.abs().sum() > 0  # drawn, not left empty
    for name, param in softmax.named_parameters():
        torch.testing.assert_close(performer.get_parameter(name), param, atol=0, rtol=0)


@pytest.mark.parametrize(
    "override, message",
    [({"attention_type": "bogus"}, "attention_type must be one of"), ({"linear_feature_map": "tanh"}, "linear_feature_map"),
     ({"linear_chunk_size": 0}, "linear_chunk_size must be >= 1"),
     ({"attention_type": "performer", "performer_nb_features": 7}, "performer_nb_features must be an even number")],
)  # fmt: skip
def test_load_time_overrides_and_assignments_are_checked_when_the_model_is_built(tmp_path, override, message):
    model_of(rr.RoFormerRopeForMaskedLM).save_pretrained(tmp_path)
    with pytest.raises(Exception, match=message):
        rr.RoFormerRopeForMaskedLM.from_pretrained(tmp_path, **override)
    config = tiny_config()
    for key, value in override.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        rr.RoFormerRopeModel(config)


def test_linear_layers_refuse_what_they_cannot_do():
    model = model_of(attention_type="linear")
    batch = padded_batch()
    with pytest.raises(ValueError, match="2-D .* padding mask; a 4-D attention_mask"):
        model(input_ids=batch["input_ids"], attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(Exception, match="unilm_mask needs softmax attention"):
        tiny_config(attention_type="linear", unilm_mask=True)


CHILD = textwrap.dedent(
    """
    import json, sys, torch, transformers
    model = transformers.AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    ids = torch.tensor(json.loads(sys.argv[2]))
    with torch.no_grad():
        print(json.dumps({"type": model.config.attention_type, "logits": model(input_ids=ids).logits.tolist()}))
    """
)


def test_saved_folder_keeps_its_type_in_a_fresh_process(tmp_path):
    model = model_of(rr.RoFormerRopeForMaskedLM, attention_type="performer", performer_nb_features=16)
    model.save_pretrained(tmp_path)
    ids = padded_batch()["input_ids"][:1]
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(ids.tolist())],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["type"] == "performer"
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(out["logits"]), model(input_ids=ids).logits, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_bf16_at_16k_tokens_stays_finite(kind):
    model = model_of(attention_type=kind, is_decoder=kind == "linear").to(torch.bfloat16)
    ids = torch.randint(1, 99, (1, 16384))
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
    assert torch.isfinite(out.float()).all()


def test_a_linear_attention_assistant_is_refused_by_name_and_its_cache_rows_can_be_selected():
    """transformers crops an `assistant_model`'s cache without asking whether it can be cropped: a running (S, z)
    state cannot forget tokens, and says so; repeating and selecting batch rows work on the state."""
    from modeling_roformer_rope.linear_attention_roformer_rope import LinearAttentionState
    from modeling_roformer_rope.linear_self_attention_roformer_rope import RoFormerRopeLinearAttentionCacheLayer

    main = randomise_(rr.RoFormerRopeForCausalLM(tiny_config(is_decoder=True))).eval()
    assistant = randomise_(rr.RoFormerRopeForCausalLM(tiny_config(is_decoder=True, attention_type="linear")), 1).eval()
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with pytest.raises(ValueError, match="cannot forget tokens, so it cannot be cropped: assisted decoding"):
        main.generate(ids, assistant_model=assistant, max_new_tokens=6, do_sample=False, pad_token_id=0)
    layer = RoFormerRopeLinearAttentionCacheLayer()
    state = LinearAttentionState(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), torch.randn(2, 3))
    layer.update_state(state, 7)
    layer.batch_repeat_interleave(2)
    assert all(torch.equal(got, want.repeat_interleave(2, dim=0)) for got, want in zip(layer.state, state))
    layer.batch_select_indices(torch.tensor([1, 2]))
    assert all(torch.equal(got, want[[0, 1]]) for got, want in zip(layer.state, state))
    assert layer.get_seq_length() == 7


@pytest.mark.parametrize("kind, shift_invariant", [("linear", True), ("performer", False)])
def test_a_left_padded_row_needs_position_ids_only_under_performer(kind, shift_invariant, capsys):
    """README: a left-padded causal row equals the same row unpadded when `position_ids` count from its first real
    token. Without them its positions shift by the padding: eq. 19 rotates the features in the numerator only,
    where a common shift cancels (Rᵀ_{m+s} R_{n+s} = Rᵀ_m R_n); Performer rotates q, k before the feature map,
    whose random features are not exactly shift-invariant, so the logits move. float64 weights (the rotary angles
stay float32, as in the original: eq. 19's shifted row is equal up to their rounding)."""
    model = model_of(rr.RoFormerRopeForCausalLM, attention_type=kind, is_decoder=True, initializer_range=0.3).double()
    row = torch.tensor([[5, 9, 13, 17, 21, 25]])
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)  # (1, 9): 3 pads on the left
    mask = (padded != 0).long()
    with torch.no_grad():
        alone = model(row).logits[0]
        counted = model(padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[0, 3:]
        shifted = model(padded, attention_mask=mask).logits[0, 3:]  # positions 3..8 instead of 0..5
    torch.testing.assert_close(counted, alone, atol=1e-9, rtol=0)
    gap = (shifted - alone).abs().max().item()
    with capsys.disabled():
        print(f"\n{kind}: left-padded row without position_ids, max |logit difference| {gap:.1e}")
    assert gap < 1e-5 if shift_invariant else gap > 1e-2  # eq. 19: up to the float32 rotary angles (as the original)
