"""The oneDNN linear path against F.linear: outputs and every gradient, and its fallbacks."""

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

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


def test_falls_back_for_other_dtypes_and_under_compile():
    module = lin.RoFormerRopeLinear(16, 8).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    out = module(x)
    assert "OneDNN" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, F.linear(x, module.weight, module.bias))
    compiled = torch.compile(lin.RoFormerRopeLinear(16, 8), fullgraph=True)
    y = torch.randn(3, 16)
    torch.testing.assert_close(compiled(y), F.linear(y, compiled.weight, compiled.bias), atol=1e-5, rtol=1e-5)


def test_environment_switch_disables_onednn():
    probe = "from modeling_roformer_rope import onednn_roformer_rope as l; print(l._LINEAR_POINTWISE is None)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={"ROFORMER_ROPE_ONEDNN": "0", "PATH": ""}
    )
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
