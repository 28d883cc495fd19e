"""MKL-packed float32 weights at inference: equal to `F.linear`, made only when a shape repeats, never stale."""

import copy
import gc
import pickle

import pytest
import torch
from torch.nn import functional as F

from conftest import builtin_model, padded_batch, probe_json
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_roformer_rope as fast
from modeling_roformer_rope import prepack_roformer_rope as prepack
from roformer_rope.conversion.from_transformers import convert_model

pytestmark = pytest.mark.skipif(not prepack.available(), reason="this torch build has no MKL packed GEMM")


@pytest.fixture
def packing():
    calibration.force("linear_packed", "packed")
    calls = []
    original = prepack._OPS
    prepack._OPS = (original[0], lambda *args: calls.append(args[-1]) or original[1](*args))
    yield calls  # the row counts the packed GEMM ran with
    prepack._OPS = original
    calibration.force("linear_packed", None)


def _close(got, layer, x):
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_packed_only_when_the_row_count_repeats_and_equal_to_f_linear(packing):
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40)
    x, other = torch.randn(2, 37, 48), torch.randn(5, 48)
    _close(layer(x), layer, x)
    assert packing == [] and prepack.pack_rows(layer.weight) is None  # first call at 74 rows: not packed
    _close(layer(x), layer, x)
    assert packing == [74] and prepack.pack_rows(layer.weight) == 74  # second call in a row: packed and used
    _close(layer(other), layer, other)  # another row count once: unpacked, the pack kept
    _close(layer(x), layer, x)
    assert packing == [74, 74] and prepack.pack_rows(layer.weight) == 74
    _close(layer(other), layer, other)
    _close(layer(other), layer, other)  # the other count repeats: it replaces the pack
    assert packing == [74, 74, 5] and prepack.pack_rows(layer.weight) == 5


@torch.no_grad()
@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.mul_(2),  # in place: the version counter moves
        lambda w: w[1, 5:8].fill_(5.0),  # in place, elements the sample does not hold
        lambda w: setattr(w, "data", torch.randn_like(w)),  # new storage
        lambda w: w.data.normal_(),  # through `.data`: no version change, caught by the sample
        lambda w: w.data.copy_(torch.randn_like(w)),
    ],
    ids=["in-place", "in-place-partial", "new-storage", "data-normal", "data-copy"],
)
def test_a_changed_weight_is_never_computed_from_a_stale_pack(packing, change):
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    layer(x), layer(x)
    assert prepack.pack_rows(layer.weight) == 16
    change(layer.weight)
    for _ in range(3):  # the stale pack is dropped at once; a new one is made on the second call
        _close(layer(x), layer, x)
    assert prepack.pack_rows(layer.weight) == 16 and len(packing) == 3


def test_training_frees_packs_and_neither_training_nor_autocast_uses_them(packing):
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48, requires_grad=True)
    for _ in range(2):
        y = layer(x)
    y.sum().backward()
    with torch.no_grad():
        layer(x), layer(x)
    assert packing == [16] and prepack.pack_rows(layer.weight) == 16
    layer(x)  # with autograd: the pack is dropped (training would make it stale)
    assert prepack.pack_rows(layer.weight) is None
    packing.clear()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(16, 48), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x), layer(x)
    assert packing == [] and prepack.pack_rows(layer.weight) is None


@torch.no_grad()
def test_packs_are_freed_with_the_weight_and_stay_out_of_copies_and_state(packing):
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    layer(x), layer(x)
    gc.collect()  # packs of earlier tests' weights go now, not during the count below
    before = len(prepack._packs)
    assert before >= 1 and prepack.pack_rows(layer.weight) == 16
    assert set(layer.state_dict()) == {"weight", "bias"}
    clone = copy.deepcopy(layer)
    restored = pickle.loads(pickle.dumps(layer))
    _close(clone(x), layer, x), _close(restored(x), layer, x)
    del layer, clone, restored
    gc.collect()
    assert len(prepack._packs) == before - 1


def test_the_model_equals_the_builtin_with_packed_weights(packing):
    """Short inputs, every linear packed (second forward): logits equal the built-in's."""
    builtin = builtin_model("RoFormerForMaskedLM", max_position_embeddings=512).eval()
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=40)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = builtin(**batch).logits[valid]
        for _ in range(2):
            torch.testing.assert_close(ours(**batch).logits[valid], expected, atol=1e-4, rtol=1e-4)
    linears = [m for name, m in ours.named_modules() if isinstance(m, fast.RoFormerRopeLinear) and "up_proj" not in name]
    assert len(linears) >= 5 and all(prepack.pack_rows(m.weight) == 80 for m in linears)
    # (an up projection may run GELU in oneDNN's epilogue instead, where that measured faster)


@torch.no_grad()
def test_edge_cases_keep_f_linear_semantics(packing):
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40, bias=False)
    x = torch.randn(16, 48)
    for _ in range(3):
        _close(layer(x), layer, x)  # no bias
    assert prepack.pack_rows(layer.weight) == 16
    with pytest.raises(RuntimeError):
        layer(torch.randn(16, 47))  # a wrong width is refused as by F.linear, never read past the pack
    strided = torch.randn(48, 16).t()  # (16, 48), non-contiguous
    _close(layer(strided), layer, strided)
    with torch.inference_mode():
        built = fast.RoFormerRopeLinear(48, 40)  # inference tensors: no version counter, never packed
        for _ in range(3):
            _close(built(x), built, x)
        assert prepack.pack_rows(built.weight) is None
    zero3 = fast.RoFormerRopeLinear(48, 40)
    zero3.weight.ds_id = 7  # a DeepSpeed ZeRO-3 parameter: re-gathered per forward, never packed
    for _ in range(3):
        _close(zero3(x), zero3, x)
    assert prepack.pack_rows(zero3.weight) is None


@pytest.mark.parametrize("value, expected", [("0", "off"), ("1", "forced"), ("auto", "measured")])
def test_environment_switches_packing(value, expected):
    probe = (
        "import json, torch; from modeling_roformer_rope import onednn_roformer_rope as f\n"
        "from modeling_roformer_rope import calibration_roformer_rope as c, prepack_roformer_rope as p\n"
        "l = f.RoFormerRopeLinear(16, 8); x = torch.randn(4, 16)\n"
        "with torch.no_grad(): l(x); y = l(x)\n"
        "ok = torch.allclose(y, torch.nn.functional.linear(x, l.weight, l.bias), atol=1e-6)\n"
        "d = [x['class'][0] for x in c.decisions()]\n"
        "print(json.dumps({'ok': ok, 'packed': p.pack_rows(l.weight), 'measured': 'linear_packed' in d}))"
    )
    out = probe_json(probe, ROFORMER_ROPE_PACK=value)
    assert out["ok"]
    if expected == "off":
        assert out == {"ok": True, "packed": None, "measured": False}
    elif expected == "forced":
        assert out == {"ok": True, "packed": 4, "measured": False}
    else:
        assert out["measured"] and out["packed"] in (None, 4)
