"""Model behaviour: backends agree, masks, KV cache, long inputs, V2/Sim variants, bad configs."""

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import padded_batch, randomise_, tiny_config
from modeling_roformer_rope.cache_name_roformer_rope import output_cache, take_cache
from modeling_roformer_rope.modeling_roformer_rope import RoFormerRopeRMSNorm


def model_of(cls=rr.RoFormerRopeModel, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return randomise_(cls(tiny_config(**overrides)).eval(), seed)


def run(model, attn: str, **inputs):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(**inputs)


BACKENDS = ["sdpa", "flex_attention"]


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize(
    "variant",
    [{}, {"is_decoder": True}, {"unilm_mask": True}, {"rotary_value": True}, {"norm_type": "rms_norm", "use_bias": False}],
    ids=["encoder", "decoder", "unilm", "rotary_value", "v2"],
)
def test_backends_equal_eager(variant, attn):
    model = model_of(**variant)
    batch = padded_batch()
    expected = run(model, "eager", **batch).last_hidden_state
    actual = run(model, attn, **batch).last_hidden_state
    valid = batch["attention_mask"].bool()  # padded query rows are don't-care
    torch.testing.assert_close(actual[valid], expected[valid], atol=1e-5, rtol=1e-5)


def naive_attention_probs(model, batch, mask_rule):
    """Recompute layer 0's attention probabilities from its weights with an explicit boolean mask."""
    emb = model.embeddings(batch["input_ids"], batch["token_type_ids"])
    attn = model.layers[0].attention
    B, T, C = emb.shape
    qkv = attn.qkv(emb).view(B, T, 3, attn.num_heads, attn.head_dim)
    from modeling_roformer_rope.rotary_roformer_rope import apply_rotary

    q, k, _ = apply_rotary(qkv, *model.rotary_emb(torch.arange(T)[None])).transpose(1, 3).unbind(2)  # (B, H, T, D)
    scores = q @ k.transpose(-1, -2) * attn.scaling
    allowed = mask_rule(batch)  # (B, T, T) bool
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1)


def test_unilm_mask_follows_segment_cumsum_rule():
    model = model_of(unilm_mask=True)
    batch = padded_batch()

    def rule(b):
        rank = b["token_type_ids"].cumsum(-1)
        seen = rank[:, None, :] <= rank[:, :, None]  # (B, Tq, Tk): key rank <= query rank
        return seen & b["attention_mask"].bool()[:, None, :]

    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(**batch, output_attentions=True).attentions[0]
        expected = naive_attention_probs(model, batch, rule)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(probs[valid.nonzero(as_tuple=True)[0], :, valid.nonzero(as_tuple=True)[1]],
                               expected[valid.nonzero(as_tuple=True)[0], :, valid.nonzero(as_tuple=True)[1]],
                               atol=1e-6, rtol=1e-5)
    # Segment-0 queries never see segment-1 keys; segment-1 queries see everything before them.
    first_seg1 = int((batch["token_type_ids"][0] == 1).nonzero()[0])
    assert probs[0, :, :first_seg1, first_seg1:].abs().max() == 0
    assert probs[0, :, first_seg1 + 1, : first_seg1 + 1].min() > 0


def test_decoder_is_causal():
    model = model_of(is_decoder=True)
    batch = padded_batch()
    full = run(model, "sdpa", **batch).last_hidden_state
    prefix = {k: v[:, :5] for k, v in batch.items()}
    torch.testing.assert_close(run(model, "sdpa", **prefix).last_hidden_state, full[:, :5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_kv_cache_matches_full_forward(attn, name):
    """The cache works under the current name (`cache`, transformers ≥ 5.24) and the old one."""
    model = model_of(rr.RoFormerRopeForCausalLM, is_decoder=True)
    model.set_attn_implementation(attn)
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], use_cache=True)
        cache = output_cache(first)
        assert cache.get_seq_length() == 6
        step = model(ids[:, 6:], use_cache=True, **{name: cache})
        assert output_cache(step) is cache and cache.get_seq_length() == 10
    torch.testing.assert_close(step.logits, full[:, 6:], atol=1e-5, rtol=1e-5)


def test_cache_under_both_names_is_refused():
    model = model_of(rr.RoFormerRopeForCausalLM, is_decoder=True)
    ids = torch.randint(1, 99, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first, other = (output_cache(model(ids, use_cache=True)) for _ in range(2))
        with pytest.raises(ValueError, match="both `cache` and `past_key_values`"):
            model(ids, cache=first, past_key_values=other, use_cache=True)


def test_greedy_generate_with_cache_equals_full_forwards():
    """generate() feeds one token per step with the cache it got back: the cache must reach the model under the
    name this transformers passes (a model that misses it restarts from an empty cache and drifts)."""
    model = model_of(rr.RoFormerRopeForCausalLM, is_decoder=True)
    prompt = torch.randint(1, 99, (1, 4), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    seen = []  # (new tokens, cached tokens) at each call of the base model

    def record(module, args, kwargs):
        cache = take_cache(kwargs.get("cache"), dict(kwargs))  # whichever name reached the model
        seen.append((args[0].shape[1], 0 if cache is None else cache.get_seq_length()))

    hook = model.roformer.register_forward_pre_hook(record, with_kwargs=True)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    hook.remove()
    assert seen == [(4, 0)] + [(1, 4 + i) for i in range(29)]
    without = model.generate(prompt, use_cache=False, **kwargs)
    greedy = prompt
    with torch.no_grad():
        for _ in range(30):
            greedy = torch.cat([greedy, model(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert with_cache.shape == (1, 34) and torch.equal(with_cache, greedy) and torch.equal(without, greedy)


def test_explicit_position_ids_shift_is_invisible_to_an_encoder():
    """RoPE is relative: shifting all positions by a constant leaves encoder outputs unchanged."""
    model = model_of()
    with torch.no_grad():  # peaked attention, so positions visibly matter
        for layer in model.layers:
            layer.attention.qkv.weight.mul_(20)
    batch = padded_batch()
    T = batch["input_ids"].shape[1]
    base = run(model, "sdpa", **batch).last_hidden_state
    shifted = run(model, "sdpa", **batch, position_ids=torch.arange(100, 100 + T)[None]).last_hidden_state
    torch.testing.assert_close(shifted, base, atol=2e-4, rtol=1e-4)
    reversed_positions = run(model, "sdpa", **batch, position_ids=torch.arange(T).flip(0)[None]).last_hidden_state
    assert (reversed_positions - base).abs().max() > 1e-2


def test_long_sequence_4096_runs_past_max_position_embeddings():
    model = model_of(rr.RoFormerRopeForMaskedLM)  # max_position_embeddings = 64
    ids = torch.randint(1, 99, (1, 4096), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4096, 99) and torch.isfinite(logits).all()
    # Token 0's output in a long sequence equals an eager recomputation on the same input (no table limit).
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids[:, :1024]).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids[:, :1024]).logits
    torch.testing.assert_close(sdpa, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_low_precision_fully_masked_rows_are_finite(dtype, attn):
    model = model_of(rr.RoFormerRopeForMaskedLM).to(dtype)
    batch = padded_batch()
    batch["attention_mask"][0] = 0  # a row with every key masked
    out = run(model, attn, **batch).logits
    assert torch.isfinite(out).all()
    fp32 = run(model_of(rr.RoFormerRopeForMaskedLM), attn, **batch).logits
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(out.float()[valid], fp32[valid], atol=0.15, rtol=0.05)


@pytest.mark.parametrize("length", [12, 400])
@pytest.mark.parametrize("form", ["2-D", "4-D float", "4-D -inf"])
def test_a_fully_masked_row_means_one_thing_on_every_backend(form, length):
    """Its attention gives zeros on eager, sdpa (at 400 keys: our kernel, forced) and flex, whether the mask is a
    2-D padding mask or a 4-D float mask at the dtype's minimum (the built-in averages every value there)."""
    from modeling_roformer_rope import calibration_roformer_rope as calibration

    model = model_of()
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(5, 99, (2, length), generator=generator), "attention_mask": torch.ones(2, length)}
    batch["attention_mask"][0] = 0  # a row with every key masked
    batch["attention_mask"][1, length // 2 :] = 0
    backends = ["eager", "sdpa", "flex_attention"]
    if form.startswith("4-D"):
        keep = batch["attention_mask"][:, None, None, :].bool()  # (B, 1, 1, S)
        fill = torch.finfo(torch.float32).min if form == "4-D float" else float("-inf")
        batch["attention_mask"] = torch.zeros(keep.shape).masked_fill(~keep, fill).expand(-1, 1, length, -1)
        backends.remove("flex_attention")  # transformers' flex path takes 2-D masks only
    calibration.force("attention", "onednn")
    try:
        outs = {attn: run(model, attn, **batch).last_hidden_state for attn in backends}
    finally:
        calibration.force("attention", None)
    for attn in backends[1:]:
        torch.testing.assert_close(outs[attn], outs["eager"], atol=1e-4, rtol=1e-4, msg=attn)


@pytest.mark.parametrize("variant", [{"attn_implementation": "eager"}, {"attention_type": "linear"},
                                     {"norm_type": "rms_norm", "use_bias": False, "attn_implementation": "eager"}],
                         ids=["softmax", "linear", "v2"])  # fmt: skip
def test_float64_models_compute_in_float64(variant):
    """Rotations, softmax and norms of a float64 model stay float64 (gradcheck needs it), and a left-padded eager
    decoder gives finite outputs (float64's mask minimum is -inf in float32)."""
    model = model_of(hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **variant).double()  # fmt: skip
    embeds = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda e: model(inputs_embeds=e).last_hidden_state, (embeds,))
    decoder = model_of(rr.RoFormerRopeForCausalLM, is_decoder=True, **variant).double()
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        logits = decoder(ids, attention_mask=mask).logits
        assert torch.isfinite(logits[:, 2:]).all()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (2, 4): the padded row's tokens at 0, 1
        padded = decoder(ids, attention_mask=mask, position_ids=positions).logits[1:, 2:]
        torch.testing.assert_close(padded, decoder(ids[1:, 2:]).logits)  # the row alone, unpadded


@pytest.mark.parametrize("head", [rr.RoFormerRopeForMaskedLM, rr.RoFormerRopeForTokenClassification])
@pytest.mark.parametrize("sparse", [False, True])
def test_float64_token_losses_stay_float64(head, sparse):
    """transformers' MLM and token-classification losses call `.float()`; a float64 model's loss stays float64 (as
    the built-in's, which calls `CrossEntropyLoss` itself), so `gradcheck` of the loss passes."""
    model = model_of(head, hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1, vocab_size=20,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, sparse_prediction=sparse).double()  # fmt: skip
    labels = torch.tensor([[1, -100, 0, -100, 1]])
    embeds = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert model(inputs_embeds=embeds, labels=labels).loss.dtype == torch.float64
    assert torch.autograd.gradcheck(lambda e: model(inputs_embeds=e, labels=labels).loss, (embeds,))


@pytest.mark.parametrize("head", [rr.RoFormerRopeForMaskedLM, rr.RoFormerRopeForCausalLM, rr.RoFormerRopeForSequenceClassification,
                                  rr.RoFormerRopeForTokenClassification, rr.RoFormerRopeForQuestionAnswering,
                                  rr.RoFormerRopeForMultipleChoice])  # fmt: skip
def test_a_config_with_return_dict_false_gets_tuples_from_every_head(head):
    """`from_pretrained(..., return_dict=False)` sets the config: every head returns its output's tuple (the base
    model inside still hands the head its fields), as the built-in heads do."""
    extra = {"is_decoder": True} if head is rr.RoFormerRopeForCausalLM else {}
    model = model_of(head, **extra)
    ids = torch.randint(5, 90, (2, 7))
    inputs = ids[:, None].expand(2, 3, 7) if head is rr.RoFormerRopeForMultipleChoice else ids
    with torch.no_grad():
        want = model(inputs).to_tuple()
        model.config.return_dict = False
        got = model(inputs)
    assert type(got) is tuple and len(got) == len(want)
    # the same computation; not asked to be bit-equal: a class timed on its real calls may run two kernels in two
    # calls, and even with every class decided before the first call two calls differed in the last bits once in a
    # while (the BLAS/oneDNN kernels do not promise the same bits from one call to the next)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_gradient_checkpointing_gives_same_gradients():
    def grads(checkpointing: bool):
        model = model_of(rr.RoFormerRopeForMaskedLM)
        model.train()
        if checkpointing:
            # renamed activation_checkpointing_enable in transformers 5.24; the old name warns there
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        batch = padded_batch()
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_roformer_v2_layout():
    model = model_of(rr.RoFormerRopeForMaskedLM, norm_type="rms_norm", use_bias=False, hidden_act="relu")
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("bias") for n in names), names
    assert not any("norm" in n for n in names), names  # parameter-free norms
    assert not hasattr(model.lm_head, "dense")  # MLM head = tied embedding only
    assert model.lm_head.decoder.weight is model.roformer.embeddings.word_embeddings.weight
    assert model.config.layer_norm_eps == 1e-7
    x = torch.randn(2, 3, 32)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-7)
    torch.testing.assert_close(RoFormerRopeRMSNorm(1e-7)(x), expected)
    batch = padded_batch()
    with torch.no_grad():
        hidden = model.roformer(**batch).last_hidden_state
        logits = model(**batch).logits
    torch.testing.assert_close(logits, hidden @ model.roformer.embeddings.word_embeddings.weight.T)


def test_pooler_linear_and_tanh():
    for activation in ("linear", "tanh"):
        model = model_of(add_pooler=True, pooler_activation=activation)
        with torch.no_grad():
            out = model(**padded_batch())
        dense = model.pooler.dense(out.last_hidden_state[:, 0])
        expected = dense if activation == "linear" else torch.tanh(dense)
        torch.testing.assert_close(out.pooler_output, expected)


TASK_HEADS = [
    rr.RoFormerRopeForMaskedLM,
    rr.RoFormerRopeForCausalLM,
    rr.RoFormerRopeForSequenceClassification,
    rr.RoFormerRopeForTokenClassification,
    rr.RoFormerRopeForQuestionAnswering,
    rr.RoFormerRopeForMultipleChoice,
]


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("head", TASK_HEADS, ids=lambda c: c.__name__.removeprefix("RoFormerRopeFor"))
def test_a_task_model_carries_the_pooler_through_a_training_step_and_save(tmp_path, head, use_bias):
    """A RoFormer-Sim folder (`add_pooler`) loaded into a task model, trained a step (AdamW, weight decay) and
    saved still gives AutoModel the pooler's sentence vectors: the task model carries the pooler's weights
    untouched (it used to drop them, and the reloaded pooler was drawn at random)."""
    config = tiny_config(add_pooler=True, pooler_activation="linear", use_bias=use_bias, is_decoder=head is rr.RoFormerRopeForCausalLM)
    encoder = randomise_(rr.RoFormerRopeModel(config)).eval()
    encoder.save_pretrained(tmp_path / "sim")
    batch = padded_batch()
    task = head.from_pretrained(tmp_path / "sim").train()
    assert not any("pooler" in name for name, _ in task.named_parameters())  # no optimizer sees it
    inputs = {k: v.unsqueeze(1).expand(-1, 2, -1) for k, v in batch.items()} if head is rr.RoFormerRopeForMultipleChoice else batch
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-2, weight_decay=0.5)
    output = task(**inputs)
    first = output.logits if hasattr(output, "logits") else output.start_logits
    first.float().pow(2).mean().backward()
    optimizer.step()
    task.save_pretrained(tmp_path / "tuned")

    reloaded = rr.RoFormerRopeModel.from_pretrained(tmp_path / "tuned").eval()
    with torch.no_grad():
        torch.testing.assert_close(task.roformer.pooler(task.roformer(**batch).last_hidden_state), reloaded(**batch).pooler_output)
    torch.testing.assert_close(reloaded.pooler.dense.weight, encoder.pooler.dense.weight, atol=0, rtol=0)
    assert not torch.equal(reloaded.layers[0].mlp.up_proj.weight, encoder.layers[0].mlp.up_proj.weight)  # it trained


def test_a_carried_pooler_a_checkpoint_lacks_is_drawn_like_the_pooler(tmp_path):
    """Built from a config, or loaded from a folder without pooler weights, a task model's carried pooler is drawn
    as the pooler's linear layer is (it was left as `torch.empty` gave it: NaN or 1e35 at times, which a save then
    handed to AutoModel)."""
    config = tiny_config(add_pooler=True, initializer_range=0.5)
    fresh = rr.RoFormerRopeForMaskedLM(config)
    rr.RoFormerRopeModel(config, add_pooling_layer=False).save_pretrained(tmp_path)  # no pooler weights
    loaded = rr.RoFormerRopeForSequenceClassification.from_pretrained(tmp_path)
    for model in (fresh, loaded):
        weight, bias = model.roformer.pooler.dense.weight, model.roformer.pooler.dense.bias
        assert torch.isfinite(weight).all() and 0.4 < weight.std().item() < 0.6  # initializer_range
        assert torch.equal(bias, torch.zeros_like(bias))


def test_sequence_classification_problem_types():
    batch = padded_batch()
    model = model_of(rr.RoFormerRopeForSequenceClassification, num_labels=3)
    logits = model(**batch).logits
    out = model(**batch, labels=torch.tensor([0, 2]))
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2])))
    multi = model_of(rr.RoFormerRopeForSequenceClassification, num_labels=3)
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    loss = multi(**batch, labels=targets).loss
    torch.testing.assert_close(loss, torch.nn.functional.binary_cross_entropy_with_logits(multi(**batch).logits, targets))
    reg = model_of(rr.RoFormerRopeForSequenceClassification, num_labels=1)
    y = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(reg(**batch, labels=y).loss, torch.nn.functional.mse_loss(reg(**batch).logits.squeeze(-1), y))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 30, "num_attention_heads": 4}, "multiple of num_attention_heads"),
        ({"hidden_size": 36, "num_attention_heads": 4}, "must be even"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling type"),
        ({"rope_scaling": {"type": "linear", "factor": 0.5}}, "factor must be a number >= 1"),
        ({"unilm_mask": True, "is_decoder": True}, "exclusive"),
        ({"attention_type": "sparse"}, "attention_type"),
        ({"norm_type": "rms_norm", "embedding_size": 16}, "no embedding-to-hidden mapping"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
        ({"rope_theta": -1.0}, "rope_theta"),
    ],
)
def test_bad_configs_raise(overrides, message):
    with pytest.raises(Exception, match=message):
        tiny_config(**overrides)


def test_bad_inputs_raise_clearly():
    model = model_of()
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()
    with pytest.raises(ValueError, match="token_type_ids shape"):
        model(torch.ones(2, 5, dtype=torch.long), token_type_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq_len\)"):
        model(torch.ones(5, dtype=torch.long))


def test_torch_compile_fullgraph_matches_eager():
    """No graph breaks (fullgraph=True) and the compiled (real-valued rotary) path equals eager (complex)."""
    model = model_of(rr.RoFormerRopeForMaskedLM)
    batch = padded_batch()
    with torch.no_grad():
        expected = model(**batch).logits
        compiled = torch.compile(model, fullgraph=True)(**batch).logits
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)


def test_sparse_prediction_gives_the_dense_loss_and_gradients():
    batch = padded_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, 1::4] = batch["input_ids"][:, 1::4]

    def loss_and_grads(sparse: bool):
        model = model_of(rr.RoFormerRopeForMaskedLM, sparse_prediction=sparse)
        out = model(**batch, labels=labels)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (dense, dense_grads), (sparse, sparse_grads) = loss_and_grads(False), loss_and_grads(True)
    assert dense.logits.shape == (2, 12, 99) and sparse.logits.shape == (int((labels != -100).sum()), 99)
    torch.testing.assert_close(sparse.loss, dense.loss)
    torch.testing.assert_close(sparse.logits, dense.logits[labels != -100])
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_inference_gelu_in_place_equals_and_spares_hooked_outputs():
    """Under no_grad the MLP applies GELU in place; a hook on up_proj must still see pre-activations."""
    torch.manual_seed(0)
    mlp = rr.modeling_roformer_rope.RoFormerRopeMLP(tiny_config()).eval()
    x = torch.randn(2, 5, 32)
    expected = mlp.down_proj(torch.nn.functional.gelu(mlp.up_proj(x)))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)
        seen = []
        handle = mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out))
        mlp(x)
        handle.remove()
    torch.testing.assert_close(seen[0], mlp.up_proj(x))  # not GELU'd behind the hook's back


def test_a_hook_on_a_wrapped_base_layer_counts_as_a_hook_on_the_wrapper():
    """PEFT's LoRA wrappers hold the replaced linear as `base_layer` and may return its output tensor itself: a hook
    there must keep the GELU and the rotation out of place (a wrapper without hooks below it lets them run in place)."""
    from modeling_roformer_rope.onednn_roformer_rope import hooked, may_modify_in_place

    class Wrapper(torch.nn.Module):  # the shape of a LoRA layer: base_layer + adapter
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.lora_A = base, torch.nn.Identity()

        def forward(self, x):
            return self.base_layer(x)

    wrapper = Wrapper(torch.nn.Linear(4, 4))
    with torch.no_grad():
        assert not hooked(wrapper) and may_modify_in_place(wrapper)
        handle = wrapper.base_layer.register_forward_hook(lambda *args: None)
        assert hooked(wrapper) and not may_modify_in_place(wrapper)
        handle.remove()
        assert not hooked(wrapper)
        handle = wrapper.lora_A.register_forward_pre_hook(lambda *args: None)  # not the base layer: no output kept
        assert not hooked(wrapper)
        handle.remove()


def test_inference_rotates_in_place_unless_the_projection_is_hooked():
    torch.manual_seed(0)
    model = rr.RoFormerRopeModel(tiny_config()).eval()
    batch = padded_batch()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        qkv = model.layers[0].attention.qkv
        seen = []
        handle = qkv.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
        hooked_run = model(**batch).last_hidden_state
        handle.remove()
    torch.testing.assert_close(hooked_run, expected, atol=0, rtol=0)
    torch.testing.assert_close(seen[0][1], qkv(seen[0][0]))  # the hook kept the un-rotated projection
    with torch.enable_grad():  # training path: out-of-place rotation, same numbers
        torch.testing.assert_close(model(**batch).last_hidden_state, expected, atol=1e-6, rtol=1e-6)
