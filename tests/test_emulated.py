"""bf16/fp16 on a CPU without instructions for them: each GEMM runs in float32 (`_upcast_linear`) or on torch's
emulated kernel, whichever measures faster. Oracles: the float32 product rounded to the dtype, torch's own
`F.linear` (forward and gradients, plain and under autocast) and the built-in RoFormer in the same dtype.

fp16 is emulated on every CPU without AMX-FP16 (this one too, most likely); bf16 is made emulated here by telling
the dispatcher so (`_NATIVE`), which is what it reads on an AVX2-only CPU or under `ONEDNN_MAX_CPU_ISA=AVX2`.
"""

import pytest
import torch
from torch.nn import functional as F

from conftest import (
    assert_bf16_autocast_linear_matches_f_linear,
    assert_bf16_autocast_mlm_step_matches_builtin,
    builtin_model,
    padded_batch,
    spy,
)
from modeling_roformer_rope import calibration_roformer_rope as calibration
from modeling_roformer_rope import onednn_roformer_rope as lin
from roformer_rope.conversion.from_transformers import convert_model

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def emulate(monkeypatch):
    """emulate(dtype): the dispatcher treats `dtype` as emulated for this test; spies on the float32 paths."""
    saved = dict(calibration._forced)
    calibration.reset()  # no decision or remembered plan made for a native dtype may serve this test
    upcast, grads = [], []
    real_upcast, real_grads = lin._upcast_linear, lin._grad_gemms
    monkeypatch.setattr(lin, "_upcast_linear", lambda x, w, b: upcast.append(x.shape[0]) or real_upcast(x, w, b))
    monkeypatch.setattr(lin, "_grad_gemms", lambda *a: grads.append((a[0].dtype, a[-1])) or real_grads(*a))

    def make(dtype):
        monkeypatch.setitem(lin._NATIVE, dtype, False)

    make.upcast_rows, make.backward_paths = upcast, grads
    yield make
    for kind in calibration.KINDS:
        calibration.force(kind, saved.get(kind))
    calibration.reset()


def _clone_leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["upcast", "torch"])
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no-onednn"])
@pytest.mark.parametrize("sliced", [False, True], ids=["one-slice", "5-outputs-per-slice"])
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (2, 3, 4, 16)])
def test_emulated_linear_equals_the_rounded_float32_product_with_f_linear_gradients(
    emulate, monkeypatch, dtype, path, onednn, sliced, shape
):
    """Forward (training and inference) = F.linear on float32 copies rounded to the dtype, gradients = torch's
    emulated F.linear's, on the path forced; the float32 GEMMs inside run on oneDNN (forced) or, without it, BLAS,
    on the whole weight or on slices of 5 outputs (the last one shorter)."""
    if onednn and lin._LINEAR_POINTWISE is None:
        pytest.skip("this torch build has no oneDNN linear op")
    emulate(dtype)
    if sliced:
        monkeypatch.setattr(lin, "_UPCAST_SLICE", 5 * 16)
    if onednn:
        calibration.force("linear", "onednn")
        calibration.force("linear_backward", "onednn")
    else:
        monkeypatch.setattr(lin, "_LINEAR_POINTWISE", None)
    calibration.force("linear_emulated", path)
    torch.manual_seed(0)
    module = lin.RoFormerRopeLinear(16, 24).to(dtype)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    expected = F.linear(x.detach().float(), module.weight.float(), module.bias.float()).to(dtype)
    out = module(x)
    assert type(out.grad_fn).__name__ == "_OneDNNLinearBackward" and out.dtype == dtype
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    x2, w2, b2 = _clone_leaves(x, module.weight, module.bias)
    F.linear(x2, w2, b2).backward(grad)
    for got, want in zip((x.grad, module.weight.grad, module.bias.grad), (x2.grad, w2.grad, b2.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected)
    rows = x.numel() // 16
    if path == "upcast":
        assert emulate.upcast_rows == [rows, rows]  # the training forward and the inference one
        slices = 5 if sliced else 1  # 24 outputs
        assert emulate.backward_paths == [(dtype, "upcast")] + [(torch.float32, "onednn" if onednn else "torch")] * slices
    else:
        assert emulate.upcast_rows == [] and emulate.backward_paths == [(dtype, "torch")]


def test_the_emulated_choice_is_measured_on_a_slice_and_listed(emulate):
    """Unforced, the first call of a shape class times both paths on ≤ 64 rows and one weight slice (an emulated
    GEMM is slow to time), files the decision under the real row bucket, and later calls follow it."""
    emulate(torch.float16)
    calibration.force("linear_emulated", None)
    module = lin.RoFormerRopeLinear(48, 64).half()
    x = torch.randn(300, 48).half()
    with torch.no_grad():
        module(x)
        module(x)
    made = [d for d in calibration.decisions() if d["class"][0] == "linear_emulated"]
    assert [d["class"] for d in made] == [["linear_emulated", "forward", "torch.float16", 48, 64, 1024]]
    assert set(made[0]["ms"]) == {"upcast", "torch"} and all(t > 0 for t in made[0]["ms"].values())
    timed = emulate.upcast_rows.count(64)  # the warm-up, then ≥ 2 timed rounds (more unless FAR behind)
    assert 3 <= timed <= calibration.ROUNDS + 1 and emulate.upcast_rows[:timed] == [64] * timed
    assert emulate.upcast_rows[timed:] == ([300, 300] if made[0]["choice"] == "upcast" else [])


def _fake_candidates(monkeypatch, cost: dict[str, list[float]]):
    """Candidates whose n-th call takes cost[name][n] seconds on a fake clock (the last cost repeats); and their
    call counts."""
    calls = dict.fromkeys(cost, 0)
    clock = [0.0]

    def candidate(name):
        def run():
            clock[0] += cost[name][min(calls[name], len(cost[name]) - 1)]
            calls[name] += 1

        return run

    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    return {name: candidate(name) for name in cost}, calls


def test_a_far_slower_candidate_is_timed_only_until_two_rounds_show_it(monkeypatch):
    """`FAR`: after two timed rounds a candidate that far behind the leader is not run again; the others are timed
    every round while one of them is within reach of the leader (`CLEAR`) without being a tie (`TIE`), and the
    report keeps the beaten one's best time."""
    candidates, calls = _fake_candidates(monkeypatch, {"fast": [1.0], "slow": [10.0], "close": [1.05]})
    times = calibration._time_interleaved(candidates, ("test",))
    assert calls == {"fast": calibration.ROUNDS + 1, "slow": 3, "close": calibration.ROUNDS + 1}
    assert times == pytest.approx({"fast": 1.0, "slow": 10.0, "close": 1.05})


@pytest.mark.parametrize("other", [1.02, 1.2])
def test_timing_stops_after_two_rounds_once_settled(monkeypatch, other):
    """A clear winner (the other 20% behind) or a tie (2%) is settled after the warm-up and two timed rounds."""
    candidates, calls = _fake_candidates(monkeypatch, {"a": [1.0], "b": [other]})
    assert calibration._time_interleaved(candidates, ("test",)) == pytest.approx({"a": 1.0, "b": other})
    assert calls == {"a": calibration.MIN_ROUNDS + 1, "b": calibration.MIN_ROUNDS + 1}


def test_timing_goes_on_while_a_candidate_is_within_reach(monkeypatch):
    """7% behind after two timed rounds is neither a tie nor clear: a third round runs, and stops once it shows
    the other candidate 11% ahead."""
    # each candidate's calls: the warm-up, then the timed rounds
    candidates, calls = _fake_candidates(monkeypatch, {"a": [1.0], "b": [1.0, 1.07, 1.07, 0.9]})
    times = calibration._time_interleaved(candidates, ("test",))
    assert times == pytest.approx({"a": 1.0, "b": 0.9}) and calls == {"a": 4, "b": 4}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["upcast", "torch"])
def test_an_emulated_decoder_backward_runs_on_the_rows_with_a_gradient(emulate, monkeypatch, dtype, path):
    """`zero_grad_rows` in an emulated dtype: the backward GEMMs see only the labelled rows, on the forced path,
    and every gradient equals torch's emulated F.linear's; skipped rows get an exact zero."""
    emulate(dtype)
    calibration.force("linear_emulated", path)
    taken = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    torch.manual_seed(0)
    x = torch.randn(3, 40, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    bias = torch.randn(50, dtype=dtype, requires_grad=True)
    labelled = torch.rand(3, 40, 1) < 0.15
    grad = (torch.randn(3, 40, 50) * labelled).to(dtype)
    lin.linear(x, weight, bias, zero_grad_rows=True).backward(grad)
    x2, w2, b2 = _clone_leaves(x, weight, bias)
    F.linear(x2, w2, b2).backward(grad)
    for got, want in zip((x.grad, weight.grad, bias.grad), (x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(got, want)
    assert len(taken) == 1 and taken[0] is not None
    assert x.grad[~labelled.squeeze(-1)].abs().sum() == 0
    assert emulate.backward_paths[0] == (dtype, path)


@pytest.mark.parametrize("path", ["upcast", "torch"])
def test_bf16_autocast_where_bf16_is_emulated_equals_autocast_f_linear(emulate, monkeypatch, path):
    """Under CPU bf16 autocast on a CPU that emulates bf16, the linear makes autocast's casts itself and runs the
    node (the decoder skips zero rows there too): autocast F.linear's output (bf16) and float32 gradients; at
    inference the GEMM chosen for the class, called directly, for every shape including empty ones."""
    emulate(torch.bfloat16)
    calibration.force("linear_emulated", path)
    taken = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    module = lin.RoFormerRopeLinear(64, 96)
    module.zero_grad_rows = True
    out = assert_bf16_autocast_linear_matches_f_linear(module)
    assert type(out.grad_fn).__name__ == "_OneDNNLinearBackward" and len(taken) == 1 and taken[0] is not None
    assert emulate.backward_paths[0] == (torch.bfloat16, path)
    for shape in [(1, 1, 64), (2, 9, 64), (300, 64), (0, 64), (2, 0, 64)]:
        x = torch.randn(shape)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = module(x), F.linear(x, module.weight, module.bias)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (emulate.upcast_rows != []) == (path == "upcast")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_emulated_model_is_as_close_to_float32_as_the_builtin_in_its_dtype(emulate, dtype):
    """A whole MaskedLM in an emulated dtype, upcast GEMMs forced: its logits are as close to the float32 model's
    as the built-in's in the same dtype are (the float32 GEMMs only reorder float32 sums)."""
    emulate(dtype)
    calibration.force("linear_emulated", "upcast")
    builtin = builtin_model("RoFormerForMaskedLM", max_position_embeddings=128)
    ours = convert_model(builtin).eval()
    batch = padded_batch(seq_len=100)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        exact = builtin(**batch).logits[valid]
        low_builtin = builtin.to(dtype)(**batch).logits[valid]
        low_ours = ours.to(dtype)(**batch).logits[valid]
    assert low_ours.dtype == dtype and emulate.upcast_rows
    error_builtin, error_ours = _relative_error(low_builtin, exact), _relative_error(low_ours, exact)
    assert 0 < error_builtin < 0.05  # the dtype's own rounding, so a broken model cannot pass
    assert error_ours < 1.5 * error_builtin
    assert _relative_error(low_ours, low_builtin) < 2 * error_builtin


def test_an_emulated_bf16_autocast_training_step_matches_the_builtin(emulate, monkeypatch):
    """A dense-head MLM step under bf16 autocast with bf16 emulated, upcast GEMMs forced: loss and tied-embedding
    gradient as the built-in's under autocast (bf16 noise), and the decoder's backward skipped the ignored rows."""
    emulate(torch.bfloat16)
    calibration.force("linear_emulated", "upcast")
    skipped = spy(monkeypatch, lin, "_backward_on_nonzero_rows")
    assert_bf16_autocast_mlm_step_matches_builtin()
    assert emulate.upcast_rows and (torch.bfloat16, "upcast") in emulate.backward_paths
    # the decoder, the transform, the last layer's o_proj and MLP (`_before_the_loss_row_wise`): 6 of 80 rows labelled
    assert len(skipped) == 5 and all(s is not None for s in skipped)
