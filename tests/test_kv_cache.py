"""The key/value cache layer that appends in place (`kv_cache_roformer_rope.py`) against transformers' own
`DynamicLayer`, which concatenates: the same keys and values after every operation a cache layer meets, tensors
handed out earlier never changed, buffers reused between steps, and the built-in's logits and tokens when our
model generates with it."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from conftest import builtin_model, randomise_, tiny_config
from modeling_roformer_rope import RoFormerRopeForCausalLM
from modeling_roformer_rope import kv_cache_roformer_rope as kv
from modeling_roformer_rope.kv_cache_roformer_rope import RoFormerRopeKeyValueCacheLayer
from roformer_rope.conversion.from_transformers import convert_model


def states(tokens: int, seed: int, batch: int = 2, heads: int = 3, dim: int = 4, value_dim: int = 5):
    """(B, H, T, D) keys and (B, H, T, Dv) values, as strided views of a fused projection (like the model's)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, tokens, heads, dim + value_dim, generator=g)  # (B, T, H, D + Dv)
    return fused[..., :dim].transpose(1, 2), fused[..., dim:].transpose(1, 2)


def assert_same(ours: RoFormerRopeKeyValueCacheLayer, theirs: DynamicLayer) -> None:
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.fixture(autouse=True)
def _no_grad():
    """As `generate()` and inference run (with grad enabled the layer concatenates: a test below enables it)."""
    with torch.no_grad():
        yield


@pytest.fixture
def small_room(monkeypatch):
    """Buffers with one spare slot at least, so that a few steps cross their capacity."""
    monkeypatch.setattr(kv, "MIN_ROOM", 1)


def test_updates_give_dynamic_layers_keys_and_values_and_never_change_earlier_ones(small_room):
    ours, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    handed, pointers = [], []
    for step, tokens in enumerate([5, 1, 1, 1, 3, 1, 1, 1, 1, 7, 1]):
        key, value = states(tokens, seed=step)
        got = ours.update(key, value)
        want = theirs.update(key, value)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0] is ours.keys and got[1] is ours.values
        handed.append((got, tuple(t.clone() for t in got)))
        pointers.append(ours.keys.data_ptr())
    for tensors, copies in handed:  # every tensor handed out still holds what it held then
        assert all(torch.equal(t, c) for t, c in zip(tensors, copies))
    # buffers of 5 + 2 = 7 slots, then 8 + 4 = 12, 13 + 6 = 19, 22 + 11 = 33 (`capacity_for`, MIN_ROOM 1): a new
    # buffer at the first step and at each step that outgrew the last one (steps 3, 6, 9), the same memory between
    assert [kv.capacity_for(n) for n in (5, 8, 13, 22)] == [7, 12, 19, 33]
    assert [pointers.index(p) for p in pointers] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9]
    assert ours._buffers[0].shape == (2, 3, 33, 4) and ours._buffers[1].shape == (2, 3, 33, 5)
    assert ours.keys.shape == (2, 3, 23, 4) and ours.values.shape == (2, 3, 23, 5)


@pytest.mark.parametrize(
    "operation",
    [
        lambda layer: layer.crop(-3),
        lambda layer: layer.reorder_cache(torch.tensor([1, 0])),
        lambda layer: layer.batch_select_indices(torch.tensor([1])),
        lambda layer: layer.batch_repeat_interleave(2),
        lambda layer: layer.reset(),
    ],
    ids=["crop", "reorder_cache", "batch_select_indices", "batch_repeat_interleave", "reset"],
)
def test_after_each_operation_transformers_calls_the_layer_matches_dynamic_layer(operation, small_room):
    """crop (assisted decoding), reorder_cache (beam search), batch selection and repetition (contrastive search,
    `num_return_sequences`), reset: each replaces the views, and the next update starts from what they left."""
    ours, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    for step, tokens in enumerate([6, 1, 1]):
        ours.update(*states(tokens, seed=step))
        theirs.update(*states(tokens, seed=step))
    before = (ours.keys, ours.keys.clone())
    operation(ours)
    operation(theirs)
    batch = theirs.keys.shape[0] if theirs.is_initialized else 2
    for step in range(3, 6):
        key, value = states(1, seed=step, batch=batch)
        ours.update(key, value)
        theirs.update(key, value)
        assert_same(ours, theirs)
    assert torch.equal(*before)  # the views handed out before the operation kept their values


def test_beam_reordering_keeps_writing_in_place():
    """Beam search reorders every step: the buffers are reordered (room included), so the next steps write in place,
    and the views handed out before keep their values."""
    ours, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    for step, tokens in enumerate([6, 1]):
        ours.update(*states(tokens, seed=step, batch=3))
        theirs.update(*states(tokens, seed=step, batch=3))
    before = (ours.keys, ours.keys.clone())
    for step in range(2, 6):
        beams = torch.tensor([[2, 0, 0], [1, 1, 2], [0, 2, 1], [2, 2, 2]][step - 2])
        ours.reorder_cache(beams)
        theirs.reorder_cache(beams)
        buffer = ours._buffers[0].data_ptr()
        ours.update(*states(1, seed=step, batch=3))
        theirs.update(*states(1, seed=step, batch=3))
        assert_same(ours, theirs)
        assert ours._buffers[0].data_ptr() == buffer  # written in place after the reorder
    assert torch.equal(*before)


def test_a_deep_copy_grows_on_its_own_buffers():
    """A copied cache (a prompt cache reused for two continuations) continues apart from the original."""
    ours, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    ours.update(*states(4, seed=0))
    theirs.update(*states(4, seed=0))
    twin = copy.deepcopy(ours)
    ours.update(*states(1, seed=1))
    twin.update(*states(2, seed=2))
    theirs_twin = copy.deepcopy(theirs)
    theirs.update(*states(1, seed=1))
    theirs_twin.update(*states(2, seed=2))
    assert_same(ours, theirs)
    assert_same(twin, theirs_twin)
    assert twin._buffers[0].data_ptr() != ours._buffers[0].data_ptr()


def test_a_shallow_copy_writes_into_buffers_of_its_own():
    """Both layers would otherwise write their next token into the same free slot of one buffer."""
    ours, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    ours.update(*states(4, seed=0))
    theirs.update(*states(4, seed=0))
    twin, theirs_twin = copy.copy(ours), copy.copy(theirs)
    ours.update(*states(1, seed=1))
    twin.update(*states(1, seed=2))
    theirs.update(*states(1, seed=1))
    theirs_twin.update(*states(1, seed=2))
    assert_same(ours, theirs)
    assert_same(twin, theirs_twin)
    assert twin._buffers[0].data_ptr() != ours._buffers[0].data_ptr()


def test_states_of_another_shape_are_refused_by_name(small_room):
    layer = RoFormerRopeKeyValueCacheLayer()
    layer.update(*states(3, seed=0))
    with pytest.raises(ValueError, match=r"cache layer holds states of shape \(2, 3, 3, 4\).*\(2, 2, 1, 4\)"):
        layer.update(*states(1, seed=1, heads=2))


def test_under_tracing_the_layer_concatenates(monkeypatch):
    layer, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    layer.update(*states(4, seed=0))
    theirs.update(*states(4, seed=0))
    monkeypatch.setattr(kv, "tracing", lambda: True)
    key, value = layer.update(*states(1, seed=1))
    theirs.update(*states(1, seed=1))
    assert_same(layer, theirs)
    assert key.is_contiguous() and value.is_contiguous() and layer._buffers is None


def test_with_grad_enabled_the_layer_concatenates_and_gradients_flow_through_every_step():
    """Written into a buffer, a tracked state (a new one, or one held from an earlier step: a trainable soft prompt
    before untracked decode steps) would be saved by autograd and overwritten by a later step's write."""
    layer, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    with torch.enable_grad():
        tracked = [t.clone().requires_grad_() for t in states(3, seed=0)]
        for key, value in (tracked, states(1, seed=1), states(1, seed=2)):
            got = layer.update(key, value)
            theirs.update(key, value)
        assert layer._buffers is None and got[0].is_contiguous()
        assert_same(layer, theirs)
        (layer.keys.sum() + 2 * layer.values.sum()).backward()
    assert torch.equal(tracked[0].grad, torch.ones_like(tracked[0]))
    assert torch.equal(tracked[1].grad, torch.full_like(tracked[1], 2.0))


def test_a_cache_filled_under_inference_mode_continues_outside_it(small_room):
    layer, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    with torch.inference_mode():
        layer.update(*states(3, seed=0))
        theirs.update(*states(3, seed=0))
    with torch.no_grad():
        for step in (1, 2):
            layer.update(*states(1, seed=step))
            theirs.update(*states(1, seed=step))
    assert_same(layer, theirs)
    assert not layer._buffers[0].is_inference()


def test_a_state_of_a_wider_dtype_promotes_the_cache_as_concatenation_does(small_room):
    layer, theirs = RoFormerRopeKeyValueCacheLayer(), DynamicLayer()
    for step, dtype in enumerate((torch.bfloat16, torch.float32, torch.bfloat16)):
        key, value = (t.to(dtype) for t in states(2, seed=step))
        layer.update(key, value)
        theirs.update(key, value)
        assert layer.keys.dtype == theirs.keys.dtype
        assert_same(layer, theirs)


def test_plain_layers_hands_a_filled_cache_to_torch_export():
    """transformers' export support for `DynamicCache` takes its own layer classes only: `plain_layers` turns ours
    back into `DynamicLayer`s with the same keys and values, and the exported step gives the eager step's logits."""
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    _, ours = causal_pair()
    prompt = torch.randint(1, 99, (1, 6), generator=torch.Generator().manual_seed(2))

    class Step(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, cache):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True).logits

    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(prompt, cache=cache, use_cache=True)
        held = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        assert kv.plain_layers(cache) is cache
        assert all(type(layer) is DynamicLayer for layer in cache.layers)
        assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v) for layer, (k, v) in zip(cache.layers, held))
        step = dict(input_ids=prompt[:, :1], attention_mask=torch.ones(1, 7, dtype=torch.long))
        program = torch.export.export(Step(ours).eval(), (), dict(step, cache=copy.deepcopy(cache)), strict=False)
        torch.testing.assert_close(program.module()(**step, cache=copy.deepcopy(cache)), Step(ours)(**step, cache=cache))


def test_a_cache_made_without_a_config_serves_a_model_mixing_softmax_and_linear_layers():
    """A bare `DynamicCache()` grows its layers as the model calls them; the linear-attention layer's install used to
    put a linear-attention layer in the softmax layer's slot before it (a `TypeError` at its first update)."""
    layer_types = ["full_attention", "linear_attention", "full_attention"]
    config = tiny_config(is_decoder=True, num_hidden_layers=3, attention_type="linear", layer_types=layer_types)
    ours = randomise_(RoFormerRopeForCausalLM(config)).eval()
    prompt = torch.randint(1, 99, (1, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=6, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    want = ours.generate(prompt, cache=DynamicCache(config=ours.config), **settings)
    bare = DynamicCache()
    assert torch.equal(ours.generate(prompt, cache=bare, **settings), want)
    assert [type(layer).__name__ for layer in bare.layers] == [
        "RoFormerRopeKeyValueCacheLayer", "RoFormerRopeLinearAttentionCacheLayer", "RoFormerRopeKeyValueCacheLayer"
    ]


def causal_pair(**overrides):
    builtin = builtin_model("RoFormerForCausalLM", max_position_embeddings=128, **overrides)
    return builtin, convert_model(builtin)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_model_installs_the_layer_and_its_steps_give_the_builtins_logits(attn, small_room):
    builtin, ours = causal_pair()
    ours.set_attn_implementation(attn)
    prompt = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(3))  # (B, T)
    mine, theirs = DynamicCache(config=ours.config), DynamicCache()
    ids, past = prompt, 0
    with torch.no_grad():
        for _ in range(12):  # new buffers at 6 tokens (9 slots), 10 (15) and 16 (24): `capacity_for`, MIN_ROOM 1
            mask = torch.ones(2, past + ids.shape[1], dtype=torch.long)  # (B, past + T)
            got = ours(ids, attention_mask=mask, cache=mine, use_cache=True)
            want = builtin(ids, attention_mask=mask, cache=theirs, use_cache=True)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
            past += ids.shape[1]
            ids = want.logits[:, -1:].argmax(-1)  # (B, 1)
    assert all(type(layer) is RoFormerRopeKeyValueCacheLayer for layer in mine.layers)
    assert mine.get_seq_length() == past


def test_generate_with_beams_and_samples_gives_the_builtins_tokens(small_room):
    builtin, ours = causal_pair()
    prompt = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(1))
    for kwargs in (dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, top_k=10)):
        settings = dict(max_new_tokens=10, min_new_tokens=10, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        torch.manual_seed(0)
        want = builtin.generate(prompt, **settings, **kwargs)
        torch.manual_seed(0)
        assert torch.equal(ours.generate(prompt, **settings, **kwargs), want), kwargs


def test_which_caches_and_layers_get_the_layer():
    """Plain empty `DynamicLayer`s of softmax layers only: not linear-attention layers, not a layer already holding
    states, not another layer class, not an offloading cache; a cache made without a config replicates ours."""
    _, ours = causal_pair(num_hidden_layers=3)
    ours.config.attention_type = "linear"  # the kind of the layers `layer_types` does not name "full_attention"
    ours.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    held = DynamicLayer()
    held.update(*states(2, seed=0))

    class Other(DynamicLayer):
        pass

    cache = DynamicCache(config=ours.config)
    cache.layers = [DynamicLayer(), DynamicLayer(), Other()]
    kv.install_key_value_layers(cache, ours.config)
    assert [type(layer) for layer in cache.layers] == [RoFormerRopeKeyValueCacheLayer, DynamicLayer, Other]
    cache.layers[0] = held
    kv.install_key_value_layers(cache, ours.config)
    assert cache.layers[0] is held
    offloading = DynamicCache(config=ours.config, offloading=True)
    kv.install_key_value_layers(offloading, ours.config)
    assert not any(isinstance(layer, RoFormerRopeKeyValueCacheLayer) for layer in offloading.layers)
    bare = DynamicCache()
    kv.install_key_value_layers(bare, ours.config)
    assert bare.layer_class_to_replicate is RoFormerRopeKeyValueCacheLayer
