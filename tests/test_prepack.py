"""Packed weights at inference (MKL's float32 packs, oneDNN's float32/bf16 packs): equal to `F.linear`, made only
when a call repeats, never stale."""

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

# what a decided plan does with packs from its first call on: its classes decided on proxies (the packs made while a
# class is timed on its real calls: tests/test_calibrate_on_calls.py)
pytestmark = [
    pytest.mark.skipif(not prepack.available(), reason="this torch build has no MKL packed GEMM"),
    pytest.mark.usefixtures("on_proxies"),
]


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


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(40, 48),
        lambda: torch.randn(50, 48)[7:47],  # contiguous, at an offset into its storage
        lambda: torch.randn(48, 40).t(),  # not contiguous
        lambda: torch.randn(3, 5),  # fewer elements than samples: every one
    ],
    ids=["plain", "offset", "transposed", "tiny"],
)
def test_the_sample_holds_every_step_th_element_of_the_weight(make):
    """`_sample` (one view op for a contiguous weight) holds what the flat weight's every step-th element is."""
    weight = make()
    flat = weight.reshape(-1)
    expected = flat[:: max(1, flat.numel() // prepack._SAMPLES)]
    sample = prepack._sample(weight)
    assert torch.equal(sample, expected) and sample.shape == expected.shape
    if weight.is_contiguous():  # a view: it sees a later change of a sampled element (what `_fits` relies on)
        step = max(1, flat.numel() // prepack._SAMPLES)
        before = sample.clone()
        weight.view(-1)[step] += 1.0
        assert sample[1] == before[1] + 1.0 and torch.equal(sample, flat[::step])


@torch.no_grad()
def test_a_packed_candidate_timed_on_a_real_call_pays_the_checks_of_a_packed_call(monkeypatch):
    """`trial_linear` checks the pack against its weight as `packed_weight` does on every packed call: the timing
    that decides whether to pack includes what packing costs each call (at one row, several times the GEMM)."""
    checked = []
    fits = prepack._fits
    monkeypatch.setattr(prepack, "_fits", lambda *args: checked.append(args[0]) or fits(*args))
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(3, 48)
    for kind in [kind for kind in prepack.KINDS if prepack.available(kind)]:
        pack = prepack.trial_pack(layer.weight, kind, 3)
        checked.clear()
        y = prepack.trial_linear(x, pack, layer.weight, layer.bias, kind)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert checked == [pack]


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
    out = probe_json(probe, ROFORMER_ROPE_PACK=value, ROFORMER_ROPE_CALIBRATE_ON_CALLS="0")
    assert out["ok"]
    if expected == "off":
        assert out == {"ok": True, "packed": None, "measured": False}
    elif expected == "forced":
        assert out == {"ok": True, "packed": 4, "measured": False}
    else:
        assert out["measured"] and out["packed"] in (None, 4)


@pytest.fixture
def onednn_packing():
    if not prepack.available("onednn"):
        pytest.skip("this torch build has no oneDNN weight packing")
    calibration.force("linear_packed", "onednn_packed")
    calls = []
    original = prepack._ONEDNN_OPS
    prepack._ONEDNN_OPS = (original[0], lambda *args: calls.append(args[0].shape[0]) or original[1](*args))
    yield calls  # the row counts the packed oneDNN GEMM ran with
    prepack._ONEDNN_OPS = original
    calibration.force("linear_packed", None)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_pack_serves_any_row_count_and_equals_the_unpacked_gemm(onednn_packing, dtype):
    """Made on the weight's second call (whatever its row count), used for every row count after; bit-equal to
    oneDNN's unpacked GEMM from 16 rows, within float32/bf16 rounding of `F.linear` below."""
    if not fast._onednn_applies(torch.ones(1, 48, dtype=dtype), torch.ones(4, 48, dtype=dtype)):
        pytest.skip(f"oneDNN's GEMM does not run {dtype} on this CPU")
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40).to(dtype)
    unpacked = lambda x: fast._mm(x.reshape(-1, 48), layer.weight, layer.bias).view(*x.shape[:-1], 40)  # noqa: E731
    x, other = torch.randn(2, 37, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype)
    assert torch.equal(layer(x), unpacked(x)) and onednn_packing == []  # first call: not packed
    assert prepack.pack_kinds(layer.weight) == []
    assert torch.equal(layer(other), unpacked(other))  # second call, another row count: packed and used
    assert onednn_packing == [5] and prepack.pack_kinds(layer.weight) == ["onednn"]
    for rows in (74, 1, 300):
        y = layer(torch.randn(rows, 48, dtype=dtype))
        assert y.shape == (rows, 40)
    assert onednn_packing == [5, 74, 1, 300] and prepack.pack_rows(layer.weight) is None  # no MKL pack
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for rows in (1, 16, 129):
        z = torch.randn(rows, 48, dtype=dtype)
        got = layer(z)
        if rows >= 16:
            assert torch.equal(got, unpacked(z))
        torch.testing.assert_close(got.float(), F.linear(z.float(), layer.weight.float(), layer.bias.float()), **tolerance)


@torch.no_grad()
@pytest.mark.parametrize(
    "change",
    [lambda w: w.mul_(2), lambda w: setattr(w, "data", torch.randn_like(w)), lambda w: w.data.normal_()],
    ids=["in-place", "new-storage", "data-normal"],
)
def test_a_changed_weight_is_never_computed_from_a_stale_onednn_pack(onednn_packing, change):
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    layer(x), layer(x)
    assert prepack.pack_kinds(layer.weight) == ["onednn"]
    change(layer.weight)
    for _ in range(3):  # the stale pack is dropped at once; a new one is made on the second call
        _close(layer(x), layer, x)
    assert prepack.pack_kinds(layer.weight) == ["onednn"] and len(onednn_packing) == 3


def test_training_frees_onednn_packs(onednn_packing):
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(16, 48)
    with torch.no_grad():
        layer(x), layer(x)
    assert prepack.pack_kinds(layer.weight) == ["onednn"]
    layer(x.requires_grad_()).sum().backward()
    assert prepack.pack_kinds(layer.weight) == []


@torch.no_grad()
def test_packing_switches_apply_to_both_kinds(monkeypatch):
    """A forced path that does not apply to a class falls back instead of failing: "packed" (ROFORMER_ROPE_PACK=1)
    takes oneDNN's pack where MKL's does not apply (bf16, > 1024 rows); "onednn_packed" where oneDNN's GEMM does not
    run stays unpacked; ROFORMER_ROPE_PACK=0 turns both kinds off."""
    if not prepack.available("onednn"):
        pytest.skip("this torch build has no oneDNN weight packing")
    layer = fast.RoFormerRopeLinear(48, 40)
    big = torch.randn(1100, 48)  # > PACK_MAX_ROWS: no MKL pack
    assert not fast._packing_applies(big, layer.weight) and fast._onednn_packing_applies(big, layer.weight, True)
    calibration.force("linear_packed", "packed")
    try:
        layer(big), layer(big)
        assert prepack.pack_kinds(layer.weight) == ["onednn"]
        calibration.force("linear_packed", "onednn_packed")
        double = fast.RoFormerRopeLinear(48, 40).double()  # no oneDNN GEMM for float64: F.linear, never packed
        x = torch.randn(16, 48, dtype=torch.float64)
        for _ in range(3):
            torch.testing.assert_close(double(x), F.linear(x, double.weight, double.bias))
        assert prepack.pack_kinds(double.weight) == []
        monkeypatch.setattr(fast, "settings", fast.Settings(pack="off"))
        other = fast.RoFormerRopeLinear(48, 40)
        other(big), other(big)
        assert prepack.pack_kinds(other.weight) == []
    finally:
        calibration.force("linear_packed", None)


@torch.no_grad()
def test_a_remembered_plan_serves_only_what_it_was_made_for(packing, monkeypatch):
    """`_inference_choice` remembers each shape class's plan: a weight of the same shapes that must not be packed (a
    ZeRO-3 parameter, a non-contiguous one) is not packed after one that was, a changed decision or switch is
    followed at once, and every output equals `F.linear`."""
    torch.manual_seed(0)
    x = torch.randn(16, 48)
    plain, zero3, strided = (fast.RoFormerRopeLinear(48, 40) for _ in range(3))
    zero3.weight.ds_id = 3
    strided.weight = torch.nn.Parameter(torch.randn(48, 40).t())  # (40, 48), non-contiguous
    for layer in (plain, zero3, strided):
        for _ in range(3):
            _close(layer(x), layer, x)
    assert prepack.pack_kinds(plain.weight) == ["mkl"] and packing == [16, 16]
    assert prepack.pack_kinds(zero3.weight) == prepack.pack_kinds(strided.weight) == []

    if fast._LINEAR_POINTWISE is not None:
        calibration.force("linear_packed", "unpacked")
        try:
            for path, gemm in (("onednn", fast._mm), ("torch", F.linear), ("onednn", fast._mm)):
                calibration.force("linear", path)
                assert fast._inference_choice(x, plain.weight, plain.bias) == (gemm, None)
        finally:
            calibration.force("linear", None)
            calibration.force("linear_packed", "packed")
    assert fast._inference_choice(x, plain.weight, plain.bias)[1] == "mkl"
    monkeypatch.setattr(fast, "settings", fast.Settings(pack="off"))
    assert fast._inference_choice(x, plain.weight, plain.bias)[1] is None
    monkeypatch.undo()
    assert fast._inference_choice(x, plain.weight, plain.bias)[1] == "mkl"


@torch.no_grad()
def test_gelu_epilogue_on_the_onednn_pack(onednn_packing):
    """"fused_packed": the GELU runs in oneDNN's epilogue of the packed GEMM from the weight's second call on."""
    from transformers.activations import ACT2FN

    calibration.force("linear_gelu", "fused_packed")
    try:
        torch.manual_seed(0)
        producer = fast.RoFormerRopeLinear(48, 96)
        x = torch.randn(2, 70, 48)
        expected = F.gelu(F.linear(x, producer.weight, producer.bias))
        weights = []
        original = fast._LINEAR_POINTWISE
        fast._LINEAR_POINTWISE = lambda *args: weights.append(args[1].is_mkldnn) or original(*args)
        try:
            outs = [fast.linear_activation(x, producer, ACT2FN["gelu"]) for _ in range(3)]
        finally:
            fast._LINEAR_POINTWISE = original
        assert weights == [False, True, True] and prepack.pack_kinds(producer.weight) == ["onednn"]
        for out in outs:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    finally:
        calibration.force("linear_gelu", None)


@torch.no_grad()
def test_a_measured_fused_packed_class_never_packs_a_weight_that_cannot_be(onednn_packing):
    """A `linear_gelu` class decided "fused_packed" on one weight may meet another of the same shapes that must not
    be packed (a DeepSpeed ZeRO-3 parameter): that one runs the fused GEMM unpacked."""
    from transformers.activations import ACT2FN

    calibration.force("linear_gelu", None)
    producer = fast.RoFormerRopeLinear(48, 96)
    x = torch.randn(2, 70, 48)
    key = ("linear_gelu", "torch.float32", 48, 96, 256)
    calibration._choices[key] = "fused_packed"  # as if measured on a packable weight
    try:
        zero3 = fast.RoFormerRopeLinear(48, 96)
        zero3.weight.ds_id = 3
        for _ in range(3):
            got = fast.linear_activation(x, zero3, ACT2FN["gelu"])
        torch.testing.assert_close(got, F.gelu(F.linear(x, zero3.weight, zero3.bias)), atol=1e-5, rtol=1e-5)
        assert prepack.pack_kinds(zero3.weight) == []
        for _ in range(3):
            fast.linear_activation(x, producer, ACT2FN["gelu"])
        assert prepack.pack_kinds(producer.weight) == ["onednn"]
    finally:
        calibration._choices.pop(key, None)


@torch.no_grad()
def test_autocast_inference_never_packs(onednn_packing):
    """Under bf16 autocast the linears compute on casts of their weights (a bf16 model's cast is the weight itself):
    no pack is made for either, as README says."""
    if not fast._NATIVE[torch.bfloat16]:
        pytest.skip("bf16 autocast takes oneDNN's path only with bf16 instructions")
    for dtype in (torch.float32, torch.bfloat16):
        layer = fast.RoFormerRopeLinear(48, 40).to(dtype)
        x = torch.randn(16, 48, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(3):
                layer(x)
        assert prepack.pack_kinds(layer.weight) == [] and onednn_packing == []


@torch.no_grad()
@pytest.mark.skipif(not prepack.available("onednn") or fast._LINEAR_POINTWISE is None, reason="no oneDNN packs")
@pytest.mark.parametrize("onednn_pack_faster", [True, False])
def test_varying_row_counts_fall_back_to_the_onednn_pack_where_it_was_timed_faster(monkeypatch, onednn_pack_faster):
    """A class whose decision chose MKL's pack (one row count) runs a stream of varying row counts on the weight's
    oneDNN pack (any row count) when the same decision timed that pack faster than the unpacked GEMM, else unpacked;
    a row count that repeats still gets MKL's pack. Every output equals `F.linear`."""
    calibration.reset()
    times = {"unpacked": 2e-3, "packed": 1e-3, "onednn_packed": 1.5e-3 if onednn_pack_faster else 2.5e-3}
    monkeypatch.setattr(fast, "_packed_choice", lambda *args: "packed")
    monkeypatch.setattr(fast, "measured", lambda key: times if key[0] == "linear_packed" else None)
    fast._plans.clear()
    runs = []
    for kind in prepack.KINDS:  # record which pack each GEMM ran on
        ops = prepack._ops(kind)
        monkeypatch.setattr(
            prepack, "_OPS" if kind == "mkl" else "_ONEDNN_OPS",
            (ops[0], lambda *args, kind=kind, run=ops[1]: runs.append(kind) or run(*args)),
        )  # fmt: skip
    torch.manual_seed(0)
    layer = fast.RoFormerRopeLinear(48, 40)
    try:
        for rows in (20, 30, 40, 50, 60):  # one bucket (17-64 rows), never the same count twice in a row
            x = torch.randn(rows, 48)
            _close(layer(x), layer, x)
        if onednn_pack_faster:
            # the first call records nothing for oneDNN, the second (rows changed) its first call, the third packs
            assert prepack.pack_kinds(layer.weight) == ["onednn"] and runs == ["onednn"] * 3
        else:
            assert prepack.pack_kinds(layer.weight) == [] and runs == []
        runs.clear()
        x = torch.randn(33, 48)
        for _ in range(3):
            _close(layer(x), layer, x)
        assert runs[-1] == "mkl" and prepack.pack_rows(layer.weight) == 33
    finally:
        fast._plans.clear()
        calibration.reset()
