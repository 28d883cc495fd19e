"""Exact softmax attention for long CPU inputs, computed in float32 with both GEMMs on oneDNN.

Why: at long sequence lengths attention dominates a RoFormer forward (half of it at 4096 tokens), and
PyTorch's CPU flash kernel runs its block GEMMs on the same BLAS sgemm that makes `F.linear` slow on the
CPUs we measured (see `onednn_roformer_rope.py`). Here each head's scores for a block of queries are one
oneDNN GEMM, the softmax numerators are one in-place exponential, and the weighted sum of values is a second
oneDNN GEMM; the normalisation is applied to the (block, D) output instead of the (block, S) weights:

    Σᵢ softmax(s)ᵢ vᵢ = (Σᵢ 2^(s'ᵢ − m') vᵢ) / Σᵢ 2^(s'ᵢ − m'),   s' = s·log₂e,  m' = maxᵢ s'ᵢ

This is the softmax exactly: eˣ = 2^(x·log₂e), and subtracting the row maximum changes nothing but the
floating-point range (query blocks whose weights fit the range without it skip it, see `_well_scaled`). The base is
whichever of PyTorch's `exp2` and `exp` (both ~1 ulp) runs faster on this CPU, measured once (`exponent_here`): exp2
was 3–4× faster on the AVX-512 EPYC the kernel was written on, exp 1.3–1.4× faster on a Cascade Lake and 1.6–1.9×
under an AVX2 limit (`python bench/attention_onednn.py`). Base 2 costs nothing extra: log₂e folds into the scaling.

`bench/attention_onednn.py` times it against SDPA (1.7–2.0× faster at 1×4096 on a 2-core AVX-512 EPYC).

bf16/fp16 inputs are converted per group of heads and the attention runs in float32 (more accurate than SDPA's
reduced-precision kernel, and ~1.8× faster than it at 1×4096 here); the output has the input dtype. With
`bf16_pv` (bf16 on a CPU with bf16 instructions, where measured faster) the normalised weights are rounded to
bf16 for a bf16 PV GEMM instead, as SDPA rounds its weights.

Scope: inference only (no autograd), on CPU, no dropout, and long enough keys that the Python
loop over (batch, head, query block) is amortised; `onednn_attention_applies` says when, and the model
falls back to SDPA otherwise. Masks follow SDPA: a boolean mask keeps True positions, a float mask is
added to the scores, `is_causal` lets query i see keys j ≤ i (upper-left, as SDPA); fully masked rows
give zeros.

Shapes: B batch, H heads, T queries, S keys, D head size, Q a block of queries.
"""

import torch
from torch import nn

from .calibration_roformer_rope import choose, forced, length_bucket, row_bucket
from .eager_attention_roformer_rope import (
    check_attention_inputs,
    eager_attention_in_blocks,
    kept_keys,
    key_padding,
    sdpa_causal,
)
from .onednn_roformer_rope import _LINEAR_POINTWISE, _NATIVE, read_settings, settings, tracing

# Below this many keys SDPA's fused kernel wins: per-call overhead outweighs the faster GEMMs.
MIN_KEYS = settings.onednn_attention_min_keys
# A block of queries gets ≤ 2²¹ scores (8 MiB): the score block stays in cache between its passes
# (`bench/attention_onednn.py --blocks` sweeps it: larger blocks feed the GEMMs better until they spill).
SCORES_PER_BLOCK = 1 << 21
# Heads whose operands are prepared together: ≤ 2¹⁹ float32 keys, and as many queries, per group (2 MiB each: all 12
# heads of 64 at 512 tokens, two at 2048, one from 4096).
GROUP_FLOATS = 1 << 19
MAX_BLOCK = 1024
LOG2E = 1.4426950408889634
# Score blocks the exponent decision is timed on: 2¹⁸ float32 scores (1 MiB), as one thread's part of a block.
EXPONENT_PROXY = (256, 1024)


def exponent_here() -> str:
    """"exp2" or "exp": the faster elementwise exponential on this CPU, measured once per process on a score-sized block
    (in base-2 units the scaling carries log₂e). Forced with `ROFORMER_ROPE_FORCE=attention_exp=exp` and the like."""

    def candidates():
        scores = torch.linspace(-30.0, 0.0, EXPONENT_PROXY[0] * EXPONENT_PROXY[1]).view(EXPONENT_PROXY)  # (Q, S)
        out = torch.empty_like(scores)
        return {"exp2": lambda: torch.exp2(scores, out=out), "exp": lambda: torch.exp(scores, out=out)}

    return choose(("attention_exp", "float32"), candidates)


def onednn_attention_path(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    value: torch.Tensor | None = None,
) -> str | None:
    """Which of our inference paths replaces SDPA for these inputs: "onednn" (float32-attended), "onednn_bf16" (bf16
    weights and PV GEMM, `bf16_pv`), "eager" (`eager_attention_in_blocks`, at any length for bf16 on a CPU with bf16
    instructions: `_eager_applies`), or None (SDPA)."""
    if not _cpu_inference(query, key, value):  # tracers get SDPA (see there)
        return None
    mode = read_settings()
    applicable = (
        mode.onednn_attention_enabled
        and query.dtype == key.dtype
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and dropout == 0.0
        and (attention_mask is None or attention_mask.dim() == 4)
    )
    if not applicable:
        return None
    long = key.shape[2] >= MIN_KEYS and _LINEAR_POINTWISE is not None  # where the oneDNN kernel is a candidate
    if not long and not _eager_applies(query):
        return None
    path = forced("attention")
    if mode.onednn_attention == "on" and path is None and long:  # a path named by ROFORMER_ROPE_FORCE wins
        return "onednn"
    if path is not None and path != "sdpa" and not _forced_path_runs(path, query, value, long):
        return None  # forced to a path these inputs cannot take: SDPA, as before that path existed
    path = _faster_here(query, key, value, long)
    return None if path == "sdpa" else path


def _forced_path_runs(path: str, query: torch.Tensor, value: torch.Tensor | None, long: bool) -> bool:
    """A forced path other than SDPA that these inputs can take (`onednn_bf16` where it cannot run attends in float32,
    see `_faster_here`; an unknown name reaches `choose`, which names the paths)."""
    if path in ("onednn", "onednn_bf16"):
        return long
    if path == "eager":
        return _eager_applies(query)
    return True


def onednn_attention_applies(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    value: torch.Tensor | None = None,
) -> bool:
    """Whether one of our kernels can and should replace SDPA for these inputs (`onednn_attention_path`)."""
    return onednn_attention_path(query, key, attention_mask, dropout, value) is not None


def _cpu_inference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None) -> bool:
    """Eager CPU attention without autograd, of more than one query (not a decode step): where the attention decisions
    below are made. Tracing is checked before any shape is read (a read becomes a guard)."""
    return (
        not tracing()
        and query.device.type == "cpu"
        and query.shape[2] > 1
        and query.numel() > 0
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value)))
    )


def _long_cpu_inference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None) -> bool:
    """`_cpu_inference` over ≥ MIN_KEYS keys (where the oneDNN kernel and `sdpa_layout` are decided)."""
    return _cpu_inference(query, key, value) and key.shape[2] >= MIN_KEYS


def _eager_applies(query: torch.Tensor) -> bool:
    """`eager_attention_in_blocks` is a candidate: bf16 on a CPU with bf16 instructions, where its bf16 GEMMs and bf16
    softmax beat SDPA (0.47-0.68× its time from 2×256 to 1×4096 on a Zen 5 EPYC, `python bench/experiments.py --only
    eager_blocks`). Not float32: 1.2-2× SDPA's time at every shape measured, with AVX-512 and under an AVX2 limit. Not
    emulated bf16 (~7× slower GEMMs than float32), nor fp16 (scores could overflow an fp16 GEMM; SDPA keeps float32)."""
    return query.dtype == torch.bfloat16 and _NATIVE[torch.bfloat16]


# Scores a proxy aims at (queries × keys × heads; whole heads are rounded down to at least one). One head's 256 queries (the first version) was too little
# to stand for the whole problem: at 4×512 on a Zen 5 EPYC it timed our kernel 3% slower than SDPA, which was 25%
# slower on the whole layer (per-call costs weigh more on a small slice), and at 4096 keys a 256-query slice timed
# the bf16 PV GEMM on half the rows the kernel gives it. So the proxy holds one whole query block of the kernel and
# about 2²⁰ scores (`python bench/experiments.py --only attention_proxy`).
PROXY_SCORES = 1 << 20


def _block_rows(S: int) -> int:
    """Queries the kernel scores at a time against S keys: ≤ SCORES_PER_BLOCK scores, 64 to MAX_BLOCK rows."""
    return max(64, min(MAX_BLOCK, SCORES_PER_BLOCK // S))


def _proxy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the attention decisions are timed on, from the first batch row: one query block of the kernel, or more
    up to ≈ PROXY_SCORES scores; as whole heads (all queries, all keys) while one head holds fewer, else one head."""
    T, S = query.shape[2], key.shape[2]
    rows = min(T, max(_block_rows(S), PROXY_SCORES // S))  # queries per head
    heads = max(1, PROXY_SCORES // (rows * S)) if rows == T else 1
    q = query[:1, :heads, :rows]  # (1, h, t, D)
    return tuple(t.detach() for t in (q, key[:1, :heads], value[:1, :heads]))  # (1, h, t | S, D)


def _bf16_pv_applies(query: torch.Tensor, value: torch.Tensor) -> bool:
    """`bf16_pv` can run: bf16 queries and values, and a CPU with bf16 instructions (oneDNN's bf16 GEMM)."""
    return query.dtype == value.dtype == torch.bfloat16 and _NATIVE[torch.bfloat16]


def _faster_here(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, long: bool = True) -> str:
    """The fastest of SDPA and our paths that apply (`onednn_attention_path`) for this (dtype, key-length bucket),
    timed once on a slice of the problem (`_proxy`). Below MIN_KEYS keys (`long` False: SDPA or eager only) the class
    also holds the batch size's bucket, and the slice holds whole batch rows up to ≈ SHORT_PROXY_SCORES scores: how
    much work one call does decides these (bf16 on a Zen 5 EPYC: eager 0.7× SDPA at 2×256, 1.25× its time at 1×128)."""
    B, S = query.shape[0], key.shape[2]
    if long:
        shape_class = ("attention", str(query.dtype), length_bucket(S))
    else:
        shape_class = ("attention", str(query.dtype), length_bucket(S), "short", row_bucket(B))
    value = key if value is None else value

    def candidates():
        q, k, v = _proxy(query, key, value) if long else _short_proxy(query, key, value)  # (b, h, t | S, D)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        paths = {"sdpa": lambda: sdpa(q, k, v)}
        if long:
            paths["onednn"] = lambda: onednn_attention(q, k, v)
            if _bf16_pv_applies(q, v):
                paths["onednn_bf16"] = lambda: onednn_attention(q, k, v, bf16_pv=True)
        if _eager_applies(q):
            paths["eager"] = lambda: eager_attention_in_blocks(q, k, v)
        return paths

    path = forced("attention")
    if path == "onednn_bf16" and not _bf16_pv_applies(query, value):
        return "onednn"  # forced where it cannot run: the float32-attended kernel
    return choose(shape_class, candidates)


# Scores the short-key proxy aims at: whole batch rows (all heads, queries and keys) up to this many, at least one.
SHORT_PROXY_SCORES = 1 << 21


def _short_proxy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a short-key attention decision is timed on: the first batch rows, ≈ SHORT_PROXY_SCORES scores or more."""
    B, H, T, _ = query.shape
    rows = min(B, max(1, SHORT_PROXY_SCORES // (H * T * key.shape[2])))
    return tuple(t[:rows].detach() for t in (query, key, value))  # (rows, H, T | S, D)


def sdpa_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """"contiguous" when SDPA should get compact copies of keys and values, else "strided" (the views as given).

    Keys and values come as views into the fused projection, one row every 3·H·D elements; CPU SDPA's float32
    kernel read them ~8% slower than compact (B, H, S, D) copies at 1536-4096 keys on Sapphire Rapids, copies
    included; for bf16 the copies lost (512-4096 keys). So it is measured per (dtype, key-length bucket) on the
    proxy's heads (`_proxy`), the proxy paying its share of the copy (the rows its queries stand for), wherever
    `_long_cpu_inference` holds. The proxy's small copy runs on one thread where the real one uses all: the
    measurement leans towards "strided", the safe side (the copy never changes the result, only the speed)."""
    if not _long_cpu_inference(query, key, value) or (key.is_contiguous() and value.is_contiguous()):
        return "strided"
    q, k, v = _proxy(query, key, value)  # (1, h, t | S, D)
    share = max(1, key.shape[2] * q.shape[2] // query.shape[2])  # copied rows the proxy's queries stand for
    sdpa = torch.nn.functional.scaled_dot_product_attention
    compact = []  # the proxy's compact keys/values, made on the untimed warm-up call (never once decided)

    def contiguous():
        if not compact:
            compact.extend((k.contiguous(), v.contiguous()))  # (1, h, S, D) each
        k[:, :, :share].contiguous()
        v[:, :, :share].contiguous()
        sdpa(q, *compact)

    shape_class = ("sdpa_layout", str(query.dtype), length_bucket(key.shape[2]))
    return choose(shape_class, {"strided": lambda: sdpa(q, k, v), "contiguous": contiguous})


def _masked_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal_start: int | None
) -> torch.Tensor:
    """q (Q, D) · kᵀ (D, keys) on oneDNN, masked → (Q, keys) scores in the exponent's units (for exp2 q carries log₂e)."""
    scores = _LINEAR_POINTWISE(q, k, None, "none", [], "")  # (Q, keys)
    if causal_start is not None:
        rows = torch.arange(causal_start, causal_start + q.shape[0], device=q.device).unsqueeze(1)  # (Q, 1)
        scores.masked_fill_(torch.arange(k.shape[0], device=q.device) > rows, float("-inf"))  # sees j ≤ i
    elif mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(mask.logical_not(), float("-inf"))
        else:
            scores.add_(mask)  # already in the exponent's units (see onednn_attention)
    return scores


def _well_scaled(denoms: torch.Tensor, value_bound: torch.Tensor | float, block: int) -> list[list[bool]]:
    """Per head and query block: whether weights computed without the max subtraction give the softmax to float32
    precision, from the row sums `denoms` (g, n·block, 1) of g heads (rows past the last query hold 1: neutral) and
    `value_bound` ≥ max |v| over their values (a number, or a one-element tensor: read with the rest).

    Overflow: every weight ≤ denom ≤ 2¹⁰⁰, and |numerator| ≤ denom · max|v| ≤ 2¹²⁰ stays finite. Underflow:
    denom ≥ 2⁻⁶⁰, so the weights lost to it (< 2⁻¹²⁶ each, at most S of them) are < S·2⁻⁶⁶ of the row
    total, far below float32's 2⁻²⁴. (A NaN anywhere, or an infinite value, fails the comparisons: the safe path.)
    One reduction and one host read for all of them.
    """
    low, high = torch.aminmax(denoms.view(denoms.shape[0], -1, block), dim=2)  # (g, n) each
    numerators = high * torch.as_tensor(value_bound, dtype=high.dtype).clamp_min(1.0)  # ≥ max |numerator|; NaN stays
    fine = (low >= 2.0**-60) & (high <= 2.0**100) & (numerators <= 2.0**120)  # NaN compares False
    return fine.tolist()


def onednn_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    is_causal: bool = False,
    block: int | None = None,
    bf16_pv: bool = False,
) -> torch.Tensor:
    """softmax(q kᵀ · scaling + mask) v for q (B, H, T, D), k and v (B, H, S, D) → (B, T, H, D).

    `attention_mask` broadcasts to (B, H, T, S): bool (True = attend) or float (added to the scores); a bool
    key-padding mask (`key_padding`) makes each batch row run on its kept keys, unmasked.
    Inputs may be strided views (the model passes slices of its fused QKV projection). `block` queries
    are scored at a time (default: as many as keep ≤ SCORES_PER_BLOCK scores, 64 to 1024).

    `bf16_pv` (bf16 inputs on a CPU with bf16 instructions): the scores and the softmax statistics stay float32,
    the normalised weights are rounded once to bf16 for a bf16 PV GEMM that writes the output, as SDPA's bf16
    kernel rounds its weights (SDPA normalises after the GEMM): error ~1.2-1.4× SDPA's against a float64 oracle,
    10-12% faster than float32 PV on a Zen 5 EPYC (`python bench/experiments.py --only attention_bf16`).
    """
    B, H, T, D = query.shape
    S = key.shape[2]
    check_attention_inputs("onednn_attention", query, key, value, attention_mask, is_causal)
    if bf16_pv and not _bf16_pv_applies(query, value):
        raise ValueError(
            f"onednn_attention: bf16_pv needs bf16 queries and values on a CPU with bf16 instructions "
            f"(got {query.dtype} and {value.dtype})"
        )
    scaling = D**-0.5 if scaling is None else scaling
    # exp2 takes the scores in base-2 units (log₂e folded into the queries' scaling and the mask), exp as they are.
    base_two = exponent_here() == "exp2"
    unit = LOG2E if base_two else 1.0
    Dv = value.shape[-1]
    mm = _LINEAR_POINTWISE
    block = block or _block_rows(S)
    tiny = torch.finfo(torch.float32).tiny
    # a key-padding mask: each batch row attends to its kept keys only, with no mask (the padded keys' weights are exact
    # zeros: the same attention on fewer keys; float32 1×4096 half padded, a layer 260 → 83 ms on a Zen 5 EPYC,
    # `python bench/experiments.py --only eager_padding`)
    padding = None if is_causal else key_padding(attention_mask)  # (B | 1, S)
    if padding is not None:
        attention_mask, kept = None, padding.sum(dim=-1).tolist()  # keys per batch row (one host read)
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            # Into the exponent's units (base 2: times log₂e) once. Finite values stay finite (finfo.min·log₂e would
            # overflow to −inf): a row masked with finfo.min then averages its values, as SDPA does; −inf rows give zeros.
            low = torch.finfo(torch.float32).min
            attention_mask = attention_mask.float()
            attention_mask = torch.where(
                attention_mask.isinf(), attention_mask, (attention_mask * unit).clamp_min(low)
            )
        attention_mask = attention_mask.expand(B, H, T, S)  # a view: no copy of broadcast dimensions
    # In the input's dtype: written by each block's division (computed in float32, rounded once on the store), or
    # for `bf16_pv` by the bf16 PV GEMM.
    out = torch.empty(B, T, H, Dv, dtype=query.dtype, device=query.device)
    if T == 0:
        return out
    # Scores come out in the exponent's units. A one-element float32 tensor (not a Python number) makes q · scale one
    # float32 op for bf16/fp16 queries too: type promotion reads them as float32 (a number would keep their dtype).
    q_scale = torch.tensor([scaling * unit], dtype=torch.float32, device=query.device)
    # the bf16 weights of every block go to one buffer (fewer fresh pages for the kernel to fault in)
    low_weights = torch.empty(min(block, T) * S, dtype=torch.bfloat16) if bf16_pv else None  # (Q·S,)
    # Operands are prepared for a group of heads at once (one conversion or scaling each instead of
    # one per head: ~15% of the kernel at 4×512, `python bench/experiments.py --only attention_kernel_parts`): a
    # group's float32 keys and queries ≤ GROUP_FLOATS each, or one head where a head alone holds more. Small copies
    # reuse freed heap memory, where (H, S, D)-sized ones at long lengths would be fresh pages to fault in.
    group = max(1, min(H, GROUP_FLOATS // max(1, max(S, T) * D)))
    floats = dict(dtype=torch.float32, device=query.device)  # explicit: the default dtype may be another
    blocks = -(-T // block)  # query blocks per head
    # A group's row sums (g, blocks·block, 1), checked once per group (`_well_scaled`); rows past T stay 1 (pass).
    denoms = torch.ones(group, blocks * block, 1, **floats)

    def attend(hh: int, h: int, start: int, safe: bool) -> None:
        """Query block `start` of head h (hh within its group) of batch row b into `out`; row sums into denoms[hh]."""
        stop = min(start + block, T)
        keys = S_b if not is_causal else min(S, stop)  # causal: keys after the block's last query unseen
        # oneDNN's "weight" (N, K) must be dense, contiguous or the transpose of a contiguous tensor: one with gaps
        # between rows (the model's views into its fused projection, a column slice) falls to a kernel ~400-1000×
        # slower (180 ms vs 0.45 ms at 512 × 512 × 64, `python bench/experiments.py --only attention_operands`). k_g's rows are contiguous and v_g's rows, read as
        # their transposed view (strides (1, Dv), no copy), are dense, for whole heads and causal row slices alike.
        q_blk = q_g[hh, start:stop]  # (Q, D) float32, carries scaling·log₂e
        k_h = k_g[hh, :keys]  # (keys, D)
        v_t = v_g[hh, :keys].t()  # (Dv, keys), a view
        mask = None if attention_mask is None else attention_mask[b, h, start:stop]  # (Q, S)
        causal_start = start if is_causal else None
        denom = denoms[hh, start:stop]  # (Q, 1)
        if not safe:
            # Without subtracting the row maxima (two passes fewer over the scores): the factor 2^(−m') cancels
            # between numerator and denominator, so this IS the softmax whenever no weight overflows and each
            # row's largest weight stays far from underflow; the group's check afterwards redoes the block if not.
            scores = _masked_scores(q_blk, k_h, mask, causal_start)  # (Q, keys)
            weights = scores.exp2_() if base_two else scores.exp_()
            torch.sum(weights, dim=-1, keepdim=True, out=denom)
        else:  # extreme scores or values, or a fully masked row
            scores = _masked_scores(q_blk, k_h, mask, causal_start)
            row_max = scores.amax(dim=-1, keepdim=True)  # (Q, 1)
            row_max.masked_fill_(row_max == float("-inf"), 0.0)  # fully masked row: weights → 0
            scores.sub_(row_max)
            weights = scores.exp2_() if base_two else scores.exp_()  # largest weight of a row is 1
            torch.sum(weights, dim=-1, keepdim=True, out=denom).clamp_min_(tiny)  # ≥ 1 unless fully masked
        if bf16_pv:
            low = low_weights[: (stop - start) * keys].view(stop - start, keys)  # (Q, keys) bf16, dense
            low.copy_(weights.mul_(denom.reciprocal()))  # normalised, rows sum to ~1, rounded once
            out[b, start:stop, h] = mm(low, v_t, None, "none", [], "")  # (Q, Dv) bf16
        else:
            torch.div(mm(weights, v_t, None, "none", [], ""), denom, out=out[b, start:stop, h])  # (Q, Dv)

    for b in range(B):
        # this batch row's keys: all, or the kept ones of a key-padding mask, (S_b,) indices
        S_b, index = kept_keys(padding, kept, b) if padding is not None else (S, None)
        if S_b == 0:  # every key masked: zeros, as SDPA gives
            out[b] = 0
            continue
        for h0 in range(0, H, group):
            g = min(group, H - h0)
            k_b, v_b = key[b, h0 : h0 + g], value[b, h0 : h0 + g]  # (g, S, D | Dv) views
            if index is not None:
                k_b, v_b = k_b.index_select(1, index), v_b.index_select(1, index)  # (g, S_b, D | Dv)
            k_g = torch.empty(g, S_b, D, **floats).copy_(k_b)  # (g, S_b, D) float32, compact
            # Compact values, in bf16 for `bf16_pv`. Not transposed: a (g, Dv, S) copy takes 1.6-4.5× as long as this
            # one at 512-2048 keys, and oneDNN reads the transposed view as fast (`--only attention_operands`).
            v_g = torch.empty(g, S_b, Dv, dtype=value.dtype if bf16_pv else torch.float32, device=query.device)
            v_g.copy_(v_b)  # (g, S_b, Dv)
            # max |v| of the group bounds |numerator| / denominator (`_well_scaled`); bf16 PV normalises its weights
            # first, so |output| ≤ max |v| whatever the values. Over the compact copy: over the strided views it
            # costs a hidden copy of every value first (1.8-2.3× the time, `--only attention_operands`).
            value_bound = 1.0
            if not bf16_pv and v_g.numel():
                v_min, v_max = torch.aminmax(v_g)
                value_bound = torch.maximum(v_min.neg(), v_max)  # a tensor: read with the row sums; NaN stays NaN
            q_g = torch.empty(g, T, D, **floats)  # (g, T, D) scaled queries: bf16/fp16 promoted, float64 stored, as float32
            torch.mul(query[b, h0 : h0 + g], q_scale, out=q_g)
            for hh in range(g):
                for start in range(0, T, block):
                    attend(hh, h0 + hh, start, safe=False)
            for hh, fine in enumerate(_well_scaled(denoms[:g], value_bound, block)):
                for i, ok in enumerate(fine):
                    if not ok:  # extreme scores or values, or a fully masked row: this block the safe way
                        attend(hh, h0 + hh, i * block, safe=True)
    return out  # (B, T, H, Dv)


def onednn_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    bf16_pv: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface signature; causal exactly when SDPA's integration would be."""
    causal = sdpa_causal(module, query, attention_mask, is_causal)
    return onednn_attention(query, key, value, attention_mask, scaling, causal, bf16_pv=bf16_pv), None


__all__ = [
    "onednn_attention",
    "onednn_attention_applies",
    "onednn_attention_forward",
    "onednn_attention_path",
    "sdpa_layout",
]
