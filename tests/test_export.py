"""Export: ONNX (TorchScript exporter) + onnxruntime, and `torch.export.export`, must reproduce PyTorch.

Tiny model (2 layers, hidden 32); exported once at one shape with dynamic batch/sequence axes and checked
at other shapes, each with a padded row (the mask path), to atol 1e-4 on the non-padded positions.
"""

import io
import warnings

import pytest
import torch

import modeling_roformer_rope as rr
from conftest import padded_batch, randomise_, tiny_config

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
ATOL = 1e-4


class Encoder(torch.nn.Module):
    """Positional tensors → last_hidden_state, the signature both exporters want."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state


def encoder(attn: str) -> Encoder:
    model = randomise_(rr.RoFormerRopeModel(tiny_config(type_vocab_size=2)).eval())
    model.set_attn_implementation(attn)
    # eval() on the wrapper too: the ONNX exporter applies the wrapper's mode to every submodule.
    return Encoder(model).eval()


def batch(batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    inputs = padded_batch(batch=batch_size, seq_len=seq_len, seed=seed)
    assert not inputs["attention_mask"].all()  # the mask must matter
    return tuple(inputs[k] for k in INPUTS)


def max_diff(actual: torch.Tensor, expected: torch.Tensor, attention_mask: torch.Tensor) -> float:
    keep = attention_mask.bool()  # padded query rows are don't-care
    return (actual - expected)[keep].abs().max().item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_onnx_export_matches_pytorch(attn):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    model = encoder(attn)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            batch(2, 16, seed=0),
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=list(INPUTS),
            output_names=["last_hidden_state"],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in (*INPUTS, "last_hidden_state")},
        )
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    for shape in ((3, 40), (1, 9)):
        args = batch(*shape, seed=shape[1])
        with torch.no_grad():
            expected = model(*args)
        actual = torch.from_numpy(session.run(None, {k: a.numpy() for k, a in zip(INPUTS, args)})[0])
        assert actual.shape == expected.shape
        assert max_diff(actual, expected, args[1]) <= ATOL, shape


def test_torch_export_matches_eager():
    model = encoder("sdpa")
    B, T = torch.export.Dim("batch", max=64), torch.export.Dim("sequence", min=2, max=4096)
    program = torch.export.export(model, batch(2, 16, seed=0), dynamic_shapes={k: {0: B, 1: T} for k in INPUTS})
    exported = program.module()
    for shape in ((3, 40), (1, 9)):
        args = batch(*shape, seed=shape[1])
        with torch.no_grad():
            expected = model(*args)
            actual = exported(*args)
        assert actual.shape == expected.shape
        assert max_diff(actual, expected, args[1]) <= ATOL, shape


def test_no_grad_exports_at_long_lengths_take_the_traceable_path():
    """Inference-mode export past the oneDNN-attention threshold: the tracers must get SDPA and the
    out-of-place rotary (the in-place GELU is functionalised), and still equal eager."""
    model = encoder("sdpa")
    B, T = torch.export.Dim("batch", max=8), torch.export.Dim("sequence", min=2, max=4096)
    with torch.no_grad():
        program = torch.export.export(
            model, batch(2, 400, seed=0), dynamic_shapes={k: {0: B, 1: T} for k in INPUTS}
        )
        exported = program.module()
        for shape in ((1, 500), (2, 450), (3, 20)):
            args = batch(*shape, seed=shape[1])
            expected, actual = model(*args), exported(*args)
            assert max_diff(actual, expected, args[1]) <= ATOL, shape
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("mkldnn" in op for op in ops)  # nothing of the eager-only kernels leaked in
