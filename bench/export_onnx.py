"""Export the `RoFormerRopeModel` encoder to ONNX (dynamic batch and sequence axes) and check onnxruntime.

    python bench/export_onnx.py --layers 12            # base size; the .onnx goes to a temporary folder
    python bench/export_onnx.py --layers 2 --keep bench/results/encoder.onnx

Exporter: the TorchScript-based `torch.onnx.export(..., dynamo=False)`, opset 17 (the dynamo-based exporter
needs `onnxscript`, which is not a dependency). Inputs `input_ids`, `attention_mask`, `token_type_ids`
(int64, (batch, seq)) → `last_hidden_state` (float32, (batch, seq, hidden)), SDPA attention (exported as
plain MatMul/Softmax). The exported graph is run by onnxruntime (CPUExecutionProvider) at two shapes that
differ from the one traced, each with a padded row, and must equal PyTorch to atol 1e-4 on the
non-padded positions.

Pitfall: export an `eval()` module. The exporter runs the wrapper in the wrapper's own train/eval mode
(applied recursively), so a freshly built wrapper around an eval model exports with dropout active.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from functools import partial

import torch
from common import ATOL, Section, interleaved, random_batch, shape_name

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
CHECK_SHAPES = [(3, 40), (1, 300)]


class EncoderForExport(torch.nn.Module):
    """Positional tensor inputs → last_hidden_state: the signature ONNX wants."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state


def export_encoder(model: torch.nn.Module, path: str, opset: int = 17) -> None:
    wrapper = EncoderForExport(model).eval()
    example = random_batch(2, 16, vocab=model.config.vocab_size, pad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about shape checks that are constant per trace
        torch.onnx.export(
            wrapper,
            tuple(example[k] for k in INPUTS),
            path,
            dynamo=False,
            opset_version=opset,
            input_names=list(INPUTS),
            output_names=["last_hidden_state"],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in (*INPUTS, "last_hidden_state")},
        )


def max_diff(session, model: torch.nn.Module, inputs: dict) -> float:
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    actual = torch.from_numpy(session.run(None, {k: inputs[k].numpy() for k in INPUTS})[0])
    keep = inputs["attention_mask"].bool()
    return (actual - expected)[keep].abs().max().item()


def run(layers: int, shapes=CHECK_SHAPES, time_shape=(4, 512), reps: int = 3) -> list[Section]:
    import onnxruntime as ort
    from common import make_pair

    _, ours = make_pair(layers, 8192)
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "encoder.onnx")
        start = time.perf_counter()
        export_encoder(ours, path)
        export_s = time.perf_counter() - start
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        for batch, length in shapes:
            diff = max_diff(session, ours, random_batch(batch, length, pad=True, seed=batch))
            if not diff <= ATOL:
                raise AssertionError(f"onnxruntime differs from PyTorch by {diff:.3g} > {ATOL} at {batch}×{length}")
            rows.append([shape_name(batch, length) + " (padded)", f"{diff:.1e}", "", ""])
            data.append(dict(batch=batch, length=length, max_abs_diff=diff))
        inputs = random_batch(*time_shape)
        feeds = {k: inputs[k].numpy() for k in INPUTS}
        diff = max_diff(session, ours, inputs)
        with torch.no_grad():
            timing = interleaved(
                {"torch": partial(ours, **inputs), "ort": partial(session.run, None, feeds)}, reps=reps
            )
        rows.append([shape_name(*time_shape), f"{diff:.1e}", f"{timing.ms('torch'):.0f}", f"{timing.ms('ort'):.0f}"])
        data.append(
            dict(
                batch=time_shape[0],
                length=time_shape[1],
                max_abs_diff=diff,
                torch_s=timing.median("torch"),
                ort_s=timing.median("ort"),
            )
        )
        size_mb = os.path.getsize(path) / 2**20
    print(
        f"export: onnx {size_mb:.0f} MiB in {export_s:.0f} s; max |Δ| {max(d['max_abs_diff'] for d in data):.1e}",
        flush=True,
    )
    method = (
        f"`RoFormerRopeModel` ({layers} layers, SDPA) exported with `torch.onnx.export(dynamo=False, opset_version=17)`"
        f", dynamic batch and sequence axes, traced at 2×16 ({export_s:.0f} s, {size_mb:.0f} MiB), then run by "
        "onnxruntime (CPUExecutionProvider) at other shapes; max |Δ| vs PyTorch over non-padded positions must be "
        f"≤ {ATOL}. Latency: median of {reps} interleaved runs (PyTorch eager SDPA vs onnxruntime, fp32)."
    )
    headers = ["B×T", "max abs diff, onnxruntime vs PyTorch", "PyTorch ms", "onnxruntime ms"]
    return [Section("export", "ONNX export (onnxruntime vs PyTorch)", method, headers, rows, None, {"rows": data})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--keep", help="also write the .onnx here (a path under bench/results/ or /tmp)")
    args = parser.parse_args()
    for section in run(args.layers):
        print(section.markdown())
    if args.keep:
        from common import make_pair

        export_encoder(make_pair(args.layers, 8192)[1], args.keep)
        print(f"wrote {args.keep}")


if __name__ == "__main__":
    main()
