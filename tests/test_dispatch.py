"""The measured dispatch: every path it can choose gives the built-in's numbers, choices are visible and overridable."""

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import builtin_model, padded_batch, probe_json
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_attention_roformer_rope as oa
from modeling_roformer_rope import onednn_roformer_rope as fast
from roformer_rope.conversion.from_transformers import convert_model

needs_onednn = pytest.mark.skipif(fast._LINEAR_POINTWISE is None, reason="this torch build has no oneDNN linear op")


@pytest.fixture
def forced():
    def force(**paths):
        for kind, path in paths.items():
            calibration.force(kind, path)

    saved = dict(calibration._forced)  # what ROFORMER_ROPE_FORCE / _ONEDNN=1 set for this process, if anything
    yield force
    for kind in calibration.KINDS:
        calibration.force(kind, saved.get(kind))


@needs_onednn
@pytest.mark.parametrize("attention", ["onednn", "sdpa"])
@pytest.mark.parametrize(
    "linear, backward, gelu, pack",
    [("onednn", "onednn", "fused", "unpacked"), ("onednn", "torch", "separate", "onednn_packed"),
     ("torch", "torch", "separate", "packed"), ("torch", "torch", "fused", "unpacked"),
     ("onednn", "onednn", "fused_packed", "onednn_packed"), ("torch", "onednn", "separate_native", "unpacked")],
)  # fmt: skip
def test_every_path_equals_the_builtin(forced, linear, backward, gelu, pack, attention):
    """Forward (at a length where the attention kernel may run; twice, so packed weights are made and used) and
    gradients, per forced path."""
    forced(linear=linear, linear_backward=backward, linear_gelu=gelu, linear_packed=pack, attention=attention)
    builtin = builtin_model("RoFormerForMaskedLM", max_position_embeddings=512)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=400)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = builtin(**batch).logits[valid]
        for _ in range(2):
            torch.testing.assert_close(ours(**batch).logits[valid], expected, atol=1e-4, rtol=1e-4)
    labels = torch.where(valid, batch["input_ids"], -100)
    ours.train(), builtin.train()
    ours(**batch, labels=labels).loss.backward()
    builtin(**batch, labels=labels).loss.backward()
    theirs = dict(builtin.named_parameters())
    q_grad = ours.roformer.layers[0].attention.qkv.weight.grad[:32]  # our fused q rows = their query weight
    torch.testing.assert_close(q_grad, theirs["roformer.encoder.layer.0.attention.self.query.weight"].grad,
                               atol=1e-5, rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(
        ours.lm_head.dense.weight.grad, theirs["cls.predictions.transform.dense.weight"].grad, atol=1e-5, rtol=1e-4
    )


@needs_onednn
def test_choices_are_measured_once_and_logged(caplog):
    calibration.reset()
    layer = fast.RoFormerRopeLinear(48, 40)
    x = torch.randn(300, 48)
    with caplog.at_level(logging.DEBUG, logger=calibration.__name__), torch.no_grad():
        first = layer(x)
        layer(x)
        layer(torch.randn(310, 48))  # same shape class: no new measurement
    made = {tuple(d["class"]): d for d in calibration.decisions()}
    gemm, packing = ("linear", "torch.float32", 48, 40, 1024), ("linear_packed", "torch.float32", 48, 40, 1024)
    onednn = fast._onednn_applies(x, layer.weight)
    packs = {"unpacked"} | ({"packed"} if fast._packing_applies(x, layer.weight) else set())
    packs |= {"onednn_packed"} if fast._onednn_packing_applies(x, layer.weight, onednn) else set()
    measured = len(packs) > 1 and calibration.forced("linear_packed") is None
    assert set(made) == ({gemm, packing} if measured else {gemm})
    assert made[gemm]["choice"] in ("onednn", "torch") and set(made[gemm]["ms"]) == {"onednn", "torch"}
    if packing in made:
        assert made[packing]["choice"] in packs and set(made[packing]["ms"]) == packs
    assert len([r for r in caplog.records if "roformer_rope dispatch" in r.getMessage()]) == len(made)
    torch.testing.assert_close(first, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value, expected", [("0", "torch"), ("1", "onednn"), ("auto", "measured"), ("", "measured")])
def test_environment_forces_or_measures(value, expected):
    probe = (
        "import json, torch; from modeling_roformer_rope import onednn_roformer_rope as f\n"
        "from modeling_roformer_rope import calibration_roformer_rope as c\n"
        "l = f.RoFormerRopeLinear(16, 8); x = torch.randn(4, 16, requires_grad=True); y = l(x)\n"
        "print(json.dumps({'fn': type(y.grad_fn).__name__, 'n': len(c.decisions())}))"
    )
    out = probe_json(probe, ROFORMER_ROPE_ONEDNN=value)
    if expected == "torch":
        assert out == {"fn": "AddmmBackward0", "n": 0}
    elif expected == "onednn":
        assert out["fn"] == "_OneDNNLinearBackward" and out["n"] == 0  # forced: nothing measured
    else:
        assert out["n"] == 1 and out["fn"] in ("_OneDNNLinearBackward", "AddmmBackward0")


def test_emulated_bf16_warns_once(monkeypatch, caplog):
    monkeypatch.setitem(fast._NATIVE, torch.bfloat16, False)
    monkeypatch.setattr(fast, "_warned_dtypes", set())
    layer = fast.RoFormerRopeLinear(16, 8).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=fast.__name__), torch.no_grad():
        layer(torch.randn(3, 16, dtype=torch.bfloat16))
        layer(torch.randn(3, 16, dtype=torch.bfloat16))
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warnings) == 1 and "use float32 here" in warnings[0]


@pytest.mark.parametrize(
    "flags, environ, bf16, fp16",
    [({"avx512_bf16"}, {}, True, False),
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, False),
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False, False),  # oneDNN reads it in any case
     ({"avx512_bf16"}, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, False),
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "ALL"}, True, False),
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "no-such-isa"}, True, False),  # ignored by oneDNN too
     ({"amx_tile", "amx_fp16"}, {}, True, True),
     ({"amx_tile", "amx_fp16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True, False),
     ({"amx_tile", "amx_fp16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI_2"}, False, False),
     ({"amx_tile"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False, False),  # AMX needs an AMX level
     ({"amx_tile", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX10_2"}, True, False),  # bf16, no AMX
     ({"amx_tile", "amx_fp16"}, {"ONEDNN_MAX_CPU_ISA": "AVX10_2"}, False, False),  # AVX10_2 is not above AMX
     ({"amx_tile", "amx_fp16"}, {"ONEDNN_MAX_CPU_ISA": "avx10_2_amx_2"}, True, True),
     ({"avx512_bf16"}, {"DNNL_MAX_CPU_ISA": "AVX2"}, False, False),  # the older name limits too
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}, True, False),  # ONEDNN_ first
     ({"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": "AVX2"}, False, False),  # empty: not set
     (set(), {}, False, False)],
)  # fmt: skip
def test_native_dtypes_follow_the_cpu_and_the_onednn_isa_limit(monkeypatch, flags, environ, bf16, fp16):
    for name in ("avx512_bf16", "amx_tile", "amx_fp16"):
        monkeypatch.setattr(torch.cpu, f"_is_{name}_supported", lambda name=name: name in flags, raising=False)
    assert fast.native_dtypes(environ) == {torch.bfloat16: bf16, torch.float16: fp16}


@pytest.mark.skipif(not fast.native_dtypes({})[torch.bfloat16], reason="the CPU has no bf16 instructions to limit")
def test_an_isa_limit_below_bf16_makes_bf16_warn_in_a_fresh_process():
    """`ONEDNN_MAX_CPU_ISA=AVX2` on a CPU with AVX512-BF16: torch's flag still says bf16, the GEMMs are emulated."""
    out = probe_json(
        """
import json, logging, torch
from modeling_roformer_rope import onednn_roformer_rope as fast
records = []
handler = logging.Handler(); handler.emit = records.append
logging.getLogger(fast.__name__).addHandler(handler)
with torch.no_grad():
    fast.RoFormerRopeLinear(16, 8).to(torch.bfloat16)(torch.randn(3, 16, dtype=torch.bfloat16))
print(json.dumps({"native": fast._NATIVE[torch.bfloat16], "warnings": [r.getMessage() for r in records]}))
""",
        ONEDNN_MAX_CPU_ISA="AVX2",
    )
    assert out["native"] is False
    assert len(out["warnings"]) == 1 and "ONEDNN_MAX_CPU_ISA=AVX2" in out["warnings"][0], out["warnings"]


def _gradient_ready_order(model: torch.nn.Module, batch: dict) -> list[str]:
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
        for name, p in model.named_parameters()
    ]
    model(**batch).loss.backward()
    for handle in handles:
        handle.remove()
    return order


@needs_onednn
def test_training_graph_does_not_depend_on_the_measured_choice(forced):
    """Two data-parallel ranks may measure different winners; DeepSpeed ZeRO and DDP bucket gradients in the order
    they become ready, so that order (the autograd graph) must be the same whichever GEMM path a rank picked."""
    builtin = builtin_model("RoFormerForMaskedLM", max_position_embeddings=512)
    batch = padded_batch(seq_len=24)
    batch["labels"] = batch["input_ids"].masked_fill(~batch["attention_mask"].bool(), -100)
    orders, grads = {}, {}
    for linear in ("onednn", "torch"):
        forced(linear=linear, linear_backward="torch")
        model = convert_model(builtin).train()
        orders[linear] = _gradient_ready_order(model, batch)
        grads[linear] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(orders["onednn"]) == len(list(model.parameters())) > 0
    assert orders["onednn"] == orders["torch"]
    for name, grad in grads["onednn"].items():
        torch.testing.assert_close(grad, grads["torch"][name], atol=1e-5, rtol=1e-4)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_in_the_gemm_epilogue_only_where_nothing_can_see_the_gemm_output(forced, dtype):
    """The fused GELU equals F.gelu(F.linear(...)); a hook on the producer, autograd or a non-exact GELU get
    the unfused path (the hook sees the pre-GELU output)."""
    if dtype == torch.bfloat16 and not fast._NATIVE[torch.bfloat16]:
        pytest.skip("bf16 runs on oneDNN only where the CPU has bf16 instructions")
    from transformers.activations import ACT2FN

    forced(linear_gelu="fused")
    torch.manual_seed(0)
    producer = fast.RoFormerRopeLinear(48, 96).to(dtype)
    x = torch.randn(2, 70, 48, dtype=dtype)
    pre_gelu = torch.nn.functional.linear(x.float(), producer.weight.float(), producer.bias.float())  # (2, 70, 96)
    expected = torch.nn.functional.gelu(pre_gelu)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    calls = []
    original = fast._LINEAR_POINTWISE
    fast._LINEAR_POINTWISE = lambda *args: (args[3] == "gelu" and calls.append(args[3])) or original(*args)
    try:
        with torch.no_grad():
            fused = fast.linear_activation(x, producer, ACT2FN["gelu"])
            assert calls == ["gelu"]
            seen = []
            hook = producer.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
            hooked = fast.linear_activation(x, producer, ACT2FN["gelu"])
            hook.remove()
            approximate = fast.linear_activation(x, producer, ACT2FN["gelu_new"])  # tanh form: never fused
        with torch.enable_grad():
            trained = fast.linear_activation(x.requires_grad_(), producer, ACT2FN["gelu"])
    finally:
        fast._LINEAR_POINTWISE = original
    assert calls == ["gelu"]  # only the first call fused
    assert fused.shape == (2, 70, 96) and fused.dtype == dtype
    for got in (fused, hooked, trained):
        torch.testing.assert_close(got.float(), expected, **tolerance)
    torch.testing.assert_close(seen[0].float(), pre_gelu, **tolerance)  # the hook saw the GEMM output
    torch.testing.assert_close(approximate.float(), ACT2FN["gelu_new"](pre_gelu), **tolerance)


def _fused_views(B: int, T: int, H: int = 2, D: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model hands them to SDPA: (B, H, T, D) views into one (B, T, 3, H, D) projection."""
    qkv = torch.randn(B, T, 3, H, D)
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def test_sdpa_layout_is_measured_only_at_long_cpu_inference(forced):
    forced(sdpa_layout=None)
    calibration.reset()
    q, k, v = _fused_views(1, 600)
    with torch.no_grad():
        assert oa.sdpa_layout(q[:, :, :1], k, v) == "strided"  # one-token decode step
        assert oa.sdpa_layout(q[:, :, :0], k, v) == "strided"  # no queries
        assert oa.sdpa_layout(*_fused_views(0, 600)) == "strided"  # empty batch
        assert oa.sdpa_layout(*_fused_views(1, 100)) == "strided"  # below MIN_KEYS
        assert oa.sdpa_layout(q, k.contiguous(), v.contiguous()) == "strided"  # nothing to compact
        assert calibration.decisions() == []
        choice = oa.sdpa_layout(q, k, v)
    made = calibration.decisions()
    assert [d["class"] for d in made] == [["sdpa_layout", "torch.float32", 1024]]
    assert made[0]["choice"] == choice and set(made[0]["ms"]) == {"strided", "contiguous"}
    forced(sdpa_layout="contiguous")
    with torch.no_grad():
        assert oa.sdpa_layout(q, k, v) == "contiguous"
    assert oa.sdpa_layout(q.requires_grad_(), k, v) == "strided"  # training: SDPA's backward sees the views
    with torch.no_grad():
        compiled = torch.compile(lambda q, k, v: torch.tensor(oa.sdpa_layout(q, k, v) == "strided"), fullgraph=True)
        assert compiled(q.detach(), k, v)  # traced: the views as given, no decision


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_each_sdpa_layout_equals_the_builtin(forced, monkeypatch, layout):
    """The model at 400 tokens (≥ MIN_KEYS) on SDPA: keys/values reach it compact or as views, as forced."""
    forced(attention="sdpa", sdpa_layout=layout)
    seen = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, *args, **kwargs):
        seen.append(key.is_contiguous() and value.is_contiguous())
        return sdpa(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    builtin = builtin_model("RoFormerForMaskedLM", max_position_embeddings=512)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=400)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        got, expected = ours(**batch).logits[valid], builtin(**batch).logits[valid]
    assert seen and all(compact == (layout == "contiguous") for compact in seen)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_decided_class_costs_a_lookup_and_forced_paths_are_checked_once(forced):
    """Candidates given as a function are built only when the class is decided (a decode step's GEMMs run
    thousands of times); a forced path is checked against them once per class."""
    calibration.reset()
    built = []

    def candidates():
        built.append(1)
        return {"a": lambda: None, "b": lambda: None}

    key = ("linear", "test", 1, 2, 3)
    first = calibration.choose(key, candidates)
    assert first in ("a", "b") and len(built) == 1
    assert all(calibration.choose(key, candidates) == first for _ in range(5)) and len(built) == 1
    forced(linear="b")
    assert [calibration.choose(key, candidates) for _ in range(3)] == ["b"] * 3 and len(built) == 2
    forced(linear="c")
    with pytest.raises(ValueError, match=r"linear forced to 'c' .* the paths are \['a', 'b'\]"):
        calibration.choose(key, candidates)


@needs_onednn
@pytest.mark.usefixtures("on_proxies")
def test_decode_steps_get_their_own_gemm_classes(forced):
    """A one-row decode GEMM is not decided by its prompt's: prompt rows and a single row fall in other buckets."""
    assert [calibration.row_bucket(n) for n in (1, 2, 4, 5, 16, 17, 64, 65, 300, 5000)] == [
        1, 4, 4, 16, 16, 64, 64, 256, 1024, 4096]  # fmt: skip
    forced(linear=None)  # measured, whatever the environment says
    calibration.reset()
    layer = fast.RoFormerRopeLinear(48, 40)
    with torch.no_grad():
        prompt, step = layer(torch.randn(1, 16, 48)), layer(torch.randn(1, 1, 48))
    buckets = {d["class"][-1] for d in calibration.decisions() if d["class"][0] == "linear"}
    assert buckets == {16, 1} and prompt.shape == (1, 16, 40) and step.shape == (1, 1, 40)


@needs_onednn
@pytest.mark.usefixtures("on_proxies")
@pytest.mark.parametrize("pack", ["packed", "onednn_packed", "unpacked"])
def test_the_fast_inference_plan_is_the_whole_paths(forced, pack):
    """`linear` without autograd looks its plan up by a short key: for every row class and weight layout it is the
    plan the whole path decides (a contiguous weight's pack is never lent to a transposed or ZeRO-3 weight of the
    same shapes), and outputs equal `F.linear`'s; other calls take the whole path."""
    forced(linear=None, linear_packed=pack)
    calibration.reset()
    torch.manual_seed(0)
    plain = torch.randn(40, 48)
    weights = {"plain": plain, "transposed": torch.randn(48, 40).t(), "zero3": plain.clone()}
    weights["zero3"].ds_id = 7
    bias = torch.randn(40)
    with torch.no_grad():
        # the key's row bucket stands for "at most PACK_MAX_ROWS" (whether MKL's pack applies): a bucket boundary
        assert calibration.row_bucket(fast.PACK_MAX_ROWS) == fast.PACK_MAX_ROWS
        for rows in (1, 16, fast.PACK_MAX_ROWS, fast.PACK_MAX_ROWS + 1):
            x = torch.randn(rows, 48)
            for name, weight in weights.items():
                for _ in range(3):  # the packs are made on the second call and used from the third
                    plan = fast._fast_inference_plan(x[None], weight, bias)
                    assert plan == fast._inference_choice(x, weight, bias), (rows, name)
                    torch.testing.assert_close(fast.linear(x[None], weight, bias)[0], F.linear(x, weight, bias))
                assert (plan[1] is None) == (name != "plain" or pack == "unpacked"), (rows, name, plan)
        x = torch.randn(2, 48)
        assert fast._fast_inference_plan(x.bfloat16(), plain.bfloat16(), None) is None
        assert fast._fast_inference_plan(x[:0], plain, None) is None
        assert fast._fast_inference_plan(x[:, :40], plain, None) is None
        for grad in (False, True):
            with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"\(2x40 and 48x40\)"):
                fast.linear(x[:, :40], plain)  # F.linear's error, naming both shapes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fast._fast_inference_plan(x, plain, None) is None


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch.backends.mkldnn.flags() says it, on every CPU
@pytest.mark.parametrize("shape", [(1, 3072), (5, 48), (3, 7), (1,), (), (2,), (1, 3), (4,), (0, 8)])
def test_native_gelu_is_torchs_own_kernel_in_place(shape):
    """`native_gelu_` writes in place exactly what aten's own GELU kernel gives (oneDNN's is ≤1.2e-6 off)."""
    x = 3 * torch.randn(shape)
    with torch.backends.mkldnn.flags(enabled=False):
        expected = torch.nn.functional.gelu(x)
    data = x.data_ptr()
    out = fast.native_gelu_(x)
    assert out is x and x.data_ptr() == data
    torch.testing.assert_close(x, expected, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
@pytest.mark.parametrize("numel", [3072, 7])
def test_native_gelu_in_place_on_a_tensor_at_an_offset_into_its_storage(numel):
    """Only the tensor's own elements change, however far into its storage it starts."""
    storage = 3 * torch.randn(numel + 5)
    x = storage[3 : 3 + numel]  # (numel,) contiguous, storage offset 3
    with torch.backends.mkldnn.flags(enabled=False):
        expected = torch.nn.functional.gelu(x)
    before = storage.clone()
    fast.native_gelu_(x)
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
    assert torch.equal(storage[:3], before[:3]) and torch.equal(storage[3 + numel :], before[3 + numel :])


@pytest.mark.parametrize("path", fast._GELU_PATHS)
def test_every_gelu_path_equals_f_gelu_and_a_hook_still_sees_the_projection(forced, path):
    """Each decided `linear_gelu` path, on calls that make and then use a pack, equals F.gelu(F.linear(...)); with a
    hook on the projection, the module is called as a module (the hook sees its pre-GELU output)."""
    from transformers.activations import ACT2FN

    forced(linear_gelu=path)
    torch.manual_seed(0)
    producer = fast.RoFormerRopeLinear(48, 96)
    x = torch.randn(2, 7, 48)
    pre_gelu = torch.nn.functional.linear(x, producer.weight, producer.bias)  # (2, 7, 96)
    expected = torch.nn.functional.gelu(pre_gelu)
    with torch.no_grad():
        for _ in range(3):  # a oneDNN pack is made on the second call and used on the third
            torch.testing.assert_close(fast.linear_activation(x, producer, ACT2FN["gelu"]), expected)
        seen = []
        hook = producer.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        try:
            torch.testing.assert_close(fast.linear_activation(x, producer, ACT2FN["gelu"]), expected)
        finally:
            hook.remove()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], pre_gelu)


def test_a_forced_path_must_exist(forced):
    forced(sdpa_layout="dense")
    q, k, v = _fused_views(1, 600)
    expected = r"sdpa_layout forced to 'dense' \(by ROFORMER_ROPE_FORCE or force\(\)\); the paths are \['contiguous', 'strided'\]"
    with torch.no_grad(), pytest.raises(ValueError, match=expected):
        oa.sdpa_layout(q, k, v)
    with pytest.raises(ValueError, match="unknown decision kind 'layout'"):
        calibration.force("layout", "strided")


def test_environment_fixes_any_decision():
    probe = (
        "import json, torch; from modeling_roformer_rope import onednn_attention_roformer_rope as oa\n"
        "from modeling_roformer_rope import calibration_roformer_rope as c\n"
        "qkv = torch.randn(1, 600, 3, 2, 16); q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))\n"
        "with torch.no_grad(): layout = oa.sdpa_layout(q, k, v)\n"
        "print(json.dumps({'layout': layout, 'n': len(c.decisions()), 'forced': c.forced('linear')}))"
    )
    out = probe_json(probe, ROFORMER_ROPE_FORCE=" sdpa_layout=contiguous, linear=torch,bogus, =x")
    assert out == {"layout": "contiguous", "n": 0, "forced": "torch"}
    # The family switch forces every oneDNN path except the one named explicitly.
    probe += "\nprint(json.dumps({'backward': c.forced('linear_backward'), 'linear': c.forced('linear')}))"
    out = probe_json(probe, ROFORMER_ROPE_FORCE="linear=torch", ROFORMER_ROPE_ONEDNN="1")
    assert out == {"backward": "onednn", "linear": "torch"}


@pytest.mark.parametrize(
    "B, H, T, S, heads, rows",
    [(4, 12, 512, 512, 4, 512), (1, 12, 4096, 4096, 1, 512), (1, 12, 1536, 1536, 1, 1024), (2, 3, 400, 400, 3, 400),
     (1, 12, 60, 20000, 1, 60), (1, 12, 300, 30000, 1, 69), (1, 12, 8192, 8192, 1, 256), (1, 12, 3000, 700, 1, 1497)],
)  # fmt: skip
def test_attention_proxy_holds_a_query_block_and_about_a_million_scores(B, H, T, S, heads, rows):
    """One whole query block of the kernel (the GEMM shapes it really runs) and about PROXY_SCORES scores, as
    whole heads of the first batch row while they fit (the decision then sees the layer's per-head costs), else
    one head's first queries; never more than the problem has."""
    q = torch.randn(B, H, T, 8)
    k, v = torch.randn(B, H, S, 8), torch.randn(B, H, S, 4)
    pq, pk, pv = oa._proxy(q, k, v)
    assert pq.shape == (1, heads, rows, 8) and pk.shape == (1, heads, S, 8) and pv.shape == (1, heads, S, 4)
    assert pq.data_ptr() == q.data_ptr() and pk.data_ptr() == k.data_ptr()  # slices, not copies
    assert rows == T or rows >= oa._block_rows(S)
    if 1 < heads < H:  # as many whole heads as the budget holds
        assert heads * rows * S <= oa.PROXY_SCORES < (heads + 1) * rows * S
