"""The oneDNN linear path against F.linear: outputs and every gradient, and its fallbacks."""

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from conftest import spy
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_roformer_rope as lin

needs_onednn = pytest.mark.skipif(lin._LINEAR_POINTWISE is None, reason="this torch build has no oneDNN linear op")


@pytest.fixture(autouse=True, params=["onednn", "torch"])
def backward_path(request):
    """These tests are about the oneDNN forward; its backward runs either way the dispatcher may pick."""
    calibration.force("linear", "onednn")
    calibration.force("linear_backward", request.param)
    yield request.param
    calibration.force("linear", None)
    calibration.force("linear_backward", None)


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (2, 3, 4, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_f_linear(shape, bias):
    torch.manual_seed(0)
    module = lin.RoFormerRopeLinear(16, 24, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    out = module(x)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_OneDNNLinearBackward"
    grad = torch.randn_like(out)
    out.backward(grad)
    ours = (out.detach(), x.grad, module.weight.grad, module.bias.grad if bias else None)

    x2 = x.detach().clone().requires_grad_()
    w2 = module.weight.detach().clone().requires_grad_()
    b2 = module.bias.detach().clone().requires_grad_() if bias else None
    ref = F.linear(x2, w2, b2)
    ref.backward(grad)
    expected = (ref.detach(), x2.grad, w2.grad, b2.grad if bias else None)
    for got, want in zip(ours, expected):
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_no_grad_path_and_noncontiguous_input():
    torch.manual_seed(0)
    module = lin.RoFormerRopeLinear(16, 8)
    x = torch.randn(4, 16, 6).transpose(1, 2)  # (4, 6, 16), non-contiguous
    with torch.no_grad():
        torch.testing.assert_close(module(x), F.linear(x, module.weight, module.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_take_the_node_where_it_has_a_kernel_and_compile_falls_back(dtype):
    """bf16 with AVX512-BF16/AMX takes the node (oneDNN may run it), and so does a dtype the CPU emulates (its GEMMs
    may run in float32: `_upcast_linear`); fp16 with AMX-FP16 runs F.linear. Under torch.compile: F.linear."""
    module = lin.RoFormerRopeLinear(16, 8).to(dtype)
    x = torch.randn(3, 16, dtype=dtype, requires_grad=True)
    out = module(x)
    native = lin._NATIVE[dtype]
    eligible = not native or (dtype == torch.bfloat16 and lin._LINEAR_POINTWISE is not None)
    assert ("OneDNN" in type(out.grad_fn).__name__) == eligible
    torch.testing.assert_close(out, F.linear(x, module.weight, module.bias), atol=1e-2, rtol=1e-2)
    compiled = torch.compile(lin.RoFormerRopeLinear(16, 8), fullgraph=True)
    y = torch.randn(3, 16)
    torch.testing.assert_close(compiled(y), F.linear(y, compiled.weight, compiled.bias), atol=1e-5, rtol=1e-5)


def test_environment_switch_disables_onednn():
    probe = "from modeling_roformer_rope import onednn_roformer_rope as l; print(l._LINEAR_POINTWISE is None)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={"ROFORMER_ROPE_ONEDNN": "0", "PATH": ""}
    )
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr


@needs_onednn
@pytest.mark.parametrize("labelled", [0.15, 0.9])
def test_backward_on_the_rows_with_a_gradient_is_exact(monkeypatch, labelled):
    """An MLM decoder's upstream gradient is zero on unlabelled rows: with `zero_grad_rows` the backward GEMMs
    run on the other rows only (when they are under half), and every gradient equals F.linear's."""
    taken = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    torch.manual_seed(0)
    x = torch.randn(3, 40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    grad = torch.randn(3, 40, 50) * (torch.rand(3, 40, 1) < labelled)  # rows of zeros where "unlabelled"
    grad[0, 0, 0] = float("nan") if labelled < 0.5 else grad[0, 0, 0]  # a NaN row is not a zero row
    lin.linear(x, weight, bias, zero_grad_rows=True).backward(grad)
    ours = (x.grad, weight.grad, bias.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    F.linear(x2, w2, b2).backward(grad)
    for got, want in zip(ours, (x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert len(taken) == 1 and (taken[0] is not None) == (labelled < 0.5)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_rows_are_found_with_nan_inf_and_negative_zero(monkeypatch, dtype):
    """The rows skipped are exactly those whose every entry compares equal to zero: −0.0 rows are skipped (a masked
    loss's gradient carries them), NaN and inf rows are not; the gradients equal F.linear's (bf16 too where the CPU
    emulates it: the node runs there as well)."""
    rows_used = []
    real_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, d, i: rows_used.append(i.tolist()) or real_select(t, d, i))
    torch.manual_seed(0)
    x = torch.randn(30, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    grad = -torch.rand(30, 50, dtype=dtype) * 0.0  # −0.0 everywhere
    grad[2] = torch.randn(50, dtype=dtype)
    grad[5, 7], grad[9, 0] = float("nan"), float("-inf")
    lin.linear(x, weight, None, zero_grad_rows=True).backward(grad)
    assert rows_used[0] == [2, 5, 9]
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, weight))
    F.linear(x2, w2).backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, equal_nan=True)
    torch.testing.assert_close(weight.grad, w2.grad, equal_nan=True)


@needs_onednn
def test_dense_mlm_head_gradients_equal_the_builtin_with_ignored_positions(monkeypatch):
    """The MaskedLM's linears between the last attention and the loss (decoder, transform, the last layer's o_proj
    and MLP) skip the ignored positions' zero gradient rows: every parameter's gradient equals the built-in's."""
    from conftest import builtin_model, padded_batch
    from roformer_rope.conversion.from_transformers import convert_model, convert_state_dict

    builtin = builtin_model("RoFormerForMaskedLM").train()
    ours = convert_model(builtin).train()
    last = ours.roformer.layers[-1]
    flagged = [ours.lm_head.decoder, ours.lm_head.dense, last.attention.o_proj, last.mlp.up_proj, last.mlp.down_proj]
    assert all(m.zero_grad_rows for m in flagged) and not ours.config.sparse_prediction
    assert not any(m.zero_grad_rows for m in (last.attention.qkv, ours.roformer.layers[0].mlp.up_proj))
    taken = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    batch = padded_batch(seq_len=40)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, ::7] = batch["input_ids"][:, ::7]  # ~15% of positions carry a target
    torch.manual_seed(1)
    ours(**batch, labels=labels).loss.backward()
    torch.manual_seed(1)
    builtin(**batch, labels=labels).loss.backward()
    assert len(taken) == len(flagged) and all(t is not None for t in taken)  # each ran on the labelled rows only
    params = builtin.named_parameters(remove_duplicate=False)  # tied decoder and embedding share one gradient
    want = convert_state_dict({name: p.grad for name, p in params if p.grad is not None})
    got = {name: p.grad for name, p in ours.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert want.keys() == got.keys() and len(got) > 20
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("num_items", [None, 7])
def test_mlm_loss_on_the_labelled_rows_equals_the_loss_on_all_rows(num_items):
    """The dense head's loss skips the log-softmax of ignored rows: same value and logits gradient as
    transformers' loss over every row (mean over labelled tokens, or sum / num_items_in_batch)."""
    import modeling_roformer_rope as rr
    from conftest import tiny_config

    torch.manual_seed(0)
    model = rr.RoFormerRopeForMaskedLM(tiny_config())
    logits = torch.randn(2, 9, model.config.vocab_size, requires_grad=True)
    labels = torch.full((2, 9), -100)
    labels[0, 2], labels[1, 5], labels[1, 8] = 4, 11, 0
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ours = model._mlm_loss(logits, labels, **kwargs)
    (grad_ours,) = torch.autograd.grad(ours, logits)
    reference = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                reduction="mean" if num_items is None else "sum")  # fmt: skip
    reference = reference if num_items is None else reference / num_items
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_ours, grad_ref, atol=1e-7, rtol=1e-6)
    assert grad_ours[0, 0].abs().sum() == 0  # an ignored row gets no gradient


@needs_onednn
@pytest.mark.skipif(not lin._NATIVE[torch.bfloat16], reason="the native bf16 autocast path needs AVX512-BF16 or AMX (emulated: test_emulated.py)")
def test_bf16_autocast_linear_equals_autocast_f_linear_and_skips_zero_rows(monkeypatch):
    """Under CPU bf16 autocast the linear runs what autocast would (bf16 inputs, bf16 GEMM and output, float32
    gradients through the casts), through the node whose backward skips zero gradient rows."""
    from conftest import assert_bf16_autocast_linear_matches_f_linear

    taken = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    module = lin.RoFormerRopeLinear(64, 96)
    module.zero_grad_rows = True
    out = assert_bf16_autocast_linear_matches_f_linear(module)
    assert "OneDNN" in type(out.grad_fn).__name__ and len(taken) == 1 and taken[0] is not None


@needs_onednn
@pytest.mark.skipif(not lin._NATIVE[torch.bfloat16], reason="the native bf16 autocast path needs AVX512-BF16 or AMX (emulated: test_emulated.py)")
@pytest.mark.parametrize("path", ["onednn", "torch"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_bf16_autocast_inference_runs_the_chosen_bf16_gemm_directly(path, mode):
    """At inference under bf16 autocast the linear calls the bf16 GEMM chosen for the shape class itself (no nested
    autocast region): autocast's own F.linear result, bf16, on every path."""
    calibration.force("linear", path)
    try:
        module = lin.RoFormerRopeLinear(64, 96)
        for shape in [(1, 1, 64), (2, 9, 64), (300, 64), (0, 64), (2, 0, 64)]:
            x = torch.randn(shape)
            with mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = module(x), F.linear(x, module.weight, module.bias)
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        empty = lin.RoFormerRopeLinear(0, 24)  # no input features: autocast's F.linear gives the bias
        with mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(empty(torch.randn(3, 0)), F.linear(torch.randn(3, 0), empty.weight, empty.bias))
    finally:
        calibration.force("linear", None)


@needs_onednn
@pytest.mark.skipif(not lin._NATIVE[torch.bfloat16], reason="the native bf16 autocast path needs AVX512-BF16 or AMX (emulated: test_emulated.py)")
def test_bf16_autocast_training_step_matches_the_builtin():
    """A dense-head MLM step under bf16 autocast: loss and tied-embedding gradient as the built-in's (bf16 noise)."""
    from conftest import assert_bf16_autocast_mlm_step_matches_builtin

    assert_bf16_autocast_mlm_step_matches_builtin()
