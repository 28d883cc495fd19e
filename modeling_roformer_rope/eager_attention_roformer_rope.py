"""Eager softmax attention (paper eq. 2): the formula with explicit scores, for training with dropout and, in blocks
of batch rows and heads, as one of the measured paths of CPU inference (`eager_attention_in_blocks`).

Shapes: B batch, H heads, T queries, S keys, D head size.
"""

import torch
from torch import nn
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .dropout_roformer_rope import dropout as dropout_fn


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scaling + mask) v (eq. 2); softmax computed in float32 (float64 for float64) so fp16/bf16 rows
    never overflow.

    `attention_mask` as SDPA reads it: bool keeps True positions (a fully masked row gives zeros), a float
    mask is added to the scores (a row at the dtype's minimum everywhere gives zeros too).
    """
    attn_weights = attention_weights(query, key, attention_mask, scaling)  # (B, H, T, S)
    attn_weights = dropout_fn(attn_weights, p=dropout, training=module.training)  # `dropout_roformer_rope.py`
    attn_output = torch.matmul(attn_weights, value)  # (B, H, T, D)
    return attn_output.transpose(1, 2).contiguous(), attn_weights  # (B, T, H, D)


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dead: torch.Tensor | bool | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scaling + mask) (B, H, T, S) in the queries' dtype, masks read as SDPA reads them. `dead`: the
    fully masked rows (B|1, 1|H, T) if the caller knows them (False: none), else found from the mask."""
    # scaling the (B, H, T, D) side: no pass over the (B, H, T, S) scores, forward or backward (one layer with dropout,
    # float32 4×512: 207 → 178 ms, `bench/experiments.py --only dropout`); exact for a power-of-two scaling (head size 64)
    attn_weights = torch.matmul(query * scaling, key.transpose(2, 3))  # (B, H, T, S)
    # bf16/fp16 scores on CPU stay in their dtype: torch's CPU softmax computes them in float32 and rounds once, the
    # same bits as a float32 softmax rounded back, without two full-size float32 copies per pass (forward + backward of
    # a layer's 4×12×512×512 bf16 scores: 59-71 ms → 8-12 ms; its backward is torch's bf16 one, as the built-in's:
    # `python bench/experiments.py --only softmax_dtype`). Elsewhere the scores go to float32 (float64 stays float64).
    reduced_cpu = attn_weights.device.type == "cpu" and attn_weights.dtype in (torch.bfloat16, torch.float16)
    wide = attn_weights.dtype if reduced_cpu else torch.promote_types(attn_weights.dtype, torch.float32)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask, rows = additive_mask(attention_mask, wide)
        dead = rows if dead is None else dead
    if attention_mask is not None:
        # (in place on the fresh scores where the dtypes allow: their GEMM's backward needs q and k, not them)
        attn_weights = attn_weights.to(wide)
        same = torch.result_type(attn_weights, attention_mask) == attn_weights.dtype
        attn_weights = attn_weights.add_(attention_mask) if same else attn_weights + attention_mask
        if dead is None and attention_mask.is_floating_point():  # transformers' eager masks carry the dtype's minimum
            dead = fully_masked_rows(attention_mask)
    # (None: the scores' own dtype; a float32 mask added to bf16 scores made them float32, rounded back below)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=None if reduced_cpu else wide)
    # rows masked at every key: zeros, as on SDPA, not the mean of every value (a copy of the weights only where needed)
    if dead is not None and dead is not False and (torch.compiler.is_compiling() or dead.any()):
        attn_weights = attn_weights.masked_fill(dead[..., None], 0.0)
    return attn_weights.to(query.dtype)


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool mask (True attends) as a mask-sized additive one in `dtype`, 0 or the dtype's minimum (not -inf: a row
    masked everywhere stays finite, so its zeroed gradient is too), and its fully masked rows. Added to the scores,
    not filled into them: a broadcast `masked_fill_` of bf16 scores took 9× an `add_` (3.0 vs 0.33 ms per 2²¹)."""
    additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return additive.masked_fill_(attention_mask.logical_not(), torch.finfo(dtype).min), ~attention_mask.any(dim=-1)


def key_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B|1, S) True at the keys each batch row attends to, when a bool mask (B|1, 1, T|1, S) is a key-padding mask:
    every query row of a batch row sees the same keys (what transformers builds from a 2-D padding mask); else None.
    One pass over the mask (a layer's 1×4096² bool mask: ~3 ms on a Zen 5 EPYC)."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return None
    first = attention_mask[:, :, :1]  # (B|1, 1, 1, S): the first query row's keys
    if attention_mask.shape[2] > 1 and not bool((attention_mask == first).all()):
        return None
    return first[:, 0, 0]  # (B|1, S)


def kept_keys(padding: torch.Tensor, kept: list[int], b: int) -> tuple[int, torch.Tensor | None]:
    """Batch row b of a key-padding mask `padding` (B|1, S) with `kept` keys per row: how many keys it attends to, and
    their (n,) indices (None: every key)."""
    row = b if len(kept) > 1 else 0
    n = kept[row]
    return n, None if n == padding.shape[-1] else padding[row].nonzero().squeeze(1)


def fully_masked_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1|H, T) True where a float mask (B, 1|H, T, S) is at its dtype's minimum (or -inf) for every key."""
    return (attention_mask <= torch.finfo(attention_mask.dtype).min).all(dim=-1)


# Scores per block of `eager_attention_in_blocks` (4 MiB in bf16): a block's scores and weights stay in cache between
# their passes. A layer's 4×12×512×512 bf16 scores at once took 24 ms on a Zen 5 EPYC, in blocks of 2²¹ 10.7 ms; 2²² was
# as fast up to 2048 keys but 11% slower at 4096 (1024-query blocks), where the attention decision's proxy times one
# 512-query block (`_proxy` in `onednn_attention_roformer_rope.py`): with 2²¹ the proxy's block is the real one.
BLOCK_SCORES = 1 << 21
# Blocks computed in two reused scratch buffers (below); False: fresh tensors per block, as before (an experiment's
# switch: `python bench/experiments.py --only eager_scratch` times both).
SCRATCH = True
# With the scratch buffers, every query is scaled once per call instead of once per block: the same products, one
# element at a time, so the same bits; one op per call instead of one per block (96 per layer at 1×4096), and each
# block's GEMM reads compact query rows instead of the projection's strided view. Small: a 4-layer bf16 forward on a
# Zen 4 EPYC, per block / once 0.994-1.052× at 1×4096 and 0.997-1.026× at 4×512 in two runs, within that host's noise
# (`python bench/experiments.py --only eager_scratch`; False: per block, as before).
SCALE_ONCE = True


def eager_attention_in_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Inference: `attention_weights` · v over blocks of batch rows, heads and queries of ≤ BLOCK_SCORES scores each,
    written into one output; q (B, H, T, D), k and v (B, H, S, D) (strided views allowed) → (B, T, H, Dv).

    The same numbers as `eager_attention_forward` (the same GEMMs per block; the softmax is row by row), with memory
    bounded at any length; under a key-padding mask (`key_padding`), blocks of one batch row run on that row's kept
    keys unmasked: the same attention, its sums over fewer terms. `attention_mask` broadcasts to (B, H, T, S) (bool: True attends; float: added);
    `is_causal` lets query i see keys j ≤ i (upper-left, as SDPA's flag)."""
    B, H, T, D = query.shape
    S, Dv = key.shape[2], value.shape[-1]
    check_attention_inputs("eager_attention_in_blocks", query, key, value, attention_mask, is_causal)
    scaling = D**-0.5 if scaling is None else scaling
    out = torch.empty(B, T, H, Dv, dtype=query.dtype, device=query.device)
    if T * S <= BLOCK_SCORES:  # whole heads: as many as fit, and whole batch rows once all heads fit
        rows = T
        heads = min(H, max(1, BLOCK_SCORES // (T * S)))
        batch = max(1, BLOCK_SCORES // (H * T * S)) if heads == H else 1
    else:  # one head's queries in slices
        rows, heads, batch = max(1, BLOCK_SCORES // S), 1, 1
    if attention_mask is not None and (attention_mask.dim() != 4 or any(
        n not in (1, full) for n, full in zip(attention_mask.shape, (B, H, T, S))
    )):  # fmt: skip
        raise ValueError(f"eager_attention_in_blocks: attention_mask {tuple(attention_mask.shape)} must broadcast to {(B, H, T, S)}")
    keys = torch.arange(S, device=query.device)
    # A key-padding mask, where blocks hold one batch row: each row attends to its kept keys only, with no mask (its
    # padded keys' weights are exact zeros: the same attention on fewer keys; bf16 on a Zen 5 EPYC, a layer at 1×4096
    # half padded 157 → 70 ms, at 4×512 with a row half padded 12.2 → 10.1 ms). Not where blocks hold several rows
    # (short inputs): one row per block there took 0.87-1.33× the masked blocks' time, slower in half the cases
    # (`python bench/experiments.py --only eager_padding`).
    padding = None if is_causal or min(batch, B) > 1 else key_padding(attention_mask)  # (B | 1, S)
    if padding is not None:
        attention_mask, kept = None, padding.sum(dim=-1).tolist()  # keys per batch row (one host read)
    dead: torch.Tensor | bool | None = None
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # once per call, not per block
        low = query.dtype if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) else torch.float32
        attention_mask, dead = additive_mask(attention_mask, torch.promote_types(low, query.dtype))
    elif attention_mask is not None and attention_mask.is_floating_point():
        dead = fully_masked_rows(attention_mask)
    if dead is not None and not bool(dead.any()):
        dead = False  # (one host read for the call, not one per block)
    # Two scratch buffers of one block's scores, reused by every block (scores, then the softmax's weights): a fresh
    # 4-MiB block per GEMM and per softmax cost the allocator and the first touch of new pages each time (bf16, a
    # layer at 1×4096 on a Zen 4 EPYC: 227-233 → 204-206 ms, the same bits; `python bench/experiments.py --only
    # eager_scratch`). Not under autograd (an `out=` GEMM has no backward) nor off the CPU.
    scratch = None
    tracked = (query, key, value, attention_mask)  # (a float mask may be a learned bias)
    if SCRATCH and query.device.type == "cpu" and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)):
        numel = min(batch, B) * heads * min(rows, T) * S
        scratch = tuple(torch.empty(numel, dtype=query.dtype, device=query.device) for _ in range(2))
        if SCALE_ONCE:
            query, scaling = query * scaling, 1.0  # (B, H, T, D)
    for b in range(0, B, batch):
        n, index = kept_keys(padding, kept, b) if padding is not None else (S, None)  # the row's keys: (n,) or all
        if n == 0:  # every key masked: zeros, as SDPA gives
            out[b] = 0
            continue
        for h in range(0, H, heads):
            k, v = key[b : b + batch, h : h + heads], value[b : b + batch, h : h + heads]  # (b, h, S, D | Dv)
            # compact copies: the GEMMs read the model's strided views (rows 3·H·D apart) through a transposing copy
            # per block; a plain copy per group of heads costs less and serves every query slice of those heads (a
            # layer's GEMMs at bf16 1×4096: 117 → 100 ms, 8×128 to 4×512: 3-6% faster on a Zen 5 EPYC;
            # `python bench/experiments.py --only eager_compact`)
            if index is None:
                k, v = k.contiguous(), v.contiguous()  # (b, h, S, D | Dv)
            else:
                k, v = k.index_select(2, index), v.index_select(2, index)  # (1, h, n, D | Dv), compact
            for t in range(0, T, rows):
                block = (slice(b, b + batch), slice(h, h + heads), slice(t, t + rows))
                if is_causal:
                    m = keys <= torch.arange(t, min(t + rows, T), device=query.device).unsqueeze(1)  # (rows, S)
                    if scratch is not None:  # as `attention_weights` adds a bool mask (on the CPU: in the scores' dtype)
                        m = additive_mask(m, query.dtype)[0]
                    rows_dead = False
                elif attention_mask is not None:  # sliced where it is not broadcast: (b | 1, h | 1, rows | 1, S | 1)
                    m = attention_mask[tuple(part if n > 1 else slice(None) for part, n in zip(block, attention_mask.shape))]
                    rows_dead = dead if dead is False else dead[tuple(part if n > 1 else slice(None) for part, n in zip(block, dead.shape))]
                else:
                    m, rows_dead = None, None
                if scratch is not None and (m is None or (m.is_floating_point() and torch.result_type(query, m) == query.dtype)):
                    weights = _weights_into(scratch, query[block], k, m, scaling, rows_dead)  # (b, h, rows, S)
                else:
                    weights = attention_weights(query[block], k, m, scaling, rows_dead)  # (b, h, rows, S)
                if scratch is not None:  # (b·h, rows, S) @ (b·h, S, Dv) → (b, h, rows, Dv)
                    pv = torch.bmm(weights.view(-1, *weights.shape[2:]), v.reshape(-1, *v.shape[2:]))
                    pv = pv.view(*weights.shape[:3], -1)
                else:
                    pv = torch.matmul(weights, v)  # (b, h, rows, Dv)
                out[b : b + batch, t : t + rows, h : h + heads] = pv.transpose(1, 2)
    return out  # (B, T, H, Dv)


def _weights_into(
    scratch: tuple[torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dead: torch.Tensor | bool | None,
) -> torch.Tensor:
    """`attention_weights` on the CPU for a mask of the queries' dtype (or none), computed in the flat `scratch`
    buffers: the same ops in the same dtype (the scores' softmax in their own dtype, as there), written in place."""
    shape = (*query.shape[:3], key.shape[2])  # (b, h, rows, S)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    scores, weights = scratch[0][:numel].view(shape), scratch[1][:numel].view(shape)
    # one bmm over the block's heads: (b·h, rows, D) @ (b·h, D, S); matmul's 4-D out= path ran ~7% slower
    q = query * scaling if scaling != 1.0 else query  # (1.0: scaled once by the caller; the product keeps the strides)
    q = q.reshape(-1, *query.shape[2:])  # (b·h, rows, D)
    torch.bmm(q, key.reshape(-1, *key.shape[2:]).transpose(1, 2), out=scores.view(-1, *shape[2:]))
    if attention_mask is not None:
        scores.add_(attention_mask)
    if dead is None and attention_mask is not None:
        dead = fully_masked_rows(attention_mask)
    torch._softmax(scores, -1, False, out=weights)  # what `softmax(scores, -1)` runs, into `weights`
    if dead is not None and dead is not False and dead.any():
        weights.masked_fill_(dead[..., None], 0.0)
    return weights


def eager_blocks_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface signature (inference); causal exactly when SDPA's integration would be."""
    causal = sdpa_causal(module, query, attention_mask, is_causal)
    return eager_attention_in_blocks(query, key, value, attention_mask, scaling, causal), None


def sdpa_causal(module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool | None) -> bool:
    """Whether transformers' SDPA integration would pass `is_causal=True`: no mask, more than one query, and the
    argument (else the module's flag) says causal."""
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return attention_mask is None and query.shape[2] > 1 and is_causal


def check_attention_inputs(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    """Raise a ValueError naming `name` unless q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv), and not both a mask
    and `is_causal`."""
    B, H, _, D = query.shape
    S = key.shape[2]
    if key.shape != (B, H, S, D) or value.shape[:3] != (B, H, S):
        raise ValueError(
            f"{name}: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must be (B, H, T, D), (B, H, S, D), (B, H, S, Dv)"
        )
    if is_causal and attention_mask is not None:
        raise ValueError(f"{name}: pass either attention_mask or is_causal, not both")


__all__ = ["attention_weights", "check_attention_inputs", "eager_attention_forward", "eager_attention_in_blocks",
           "eager_blocks_forward", "fully_masked_rows", "key_padding", "kept_keys", "sdpa_causal"]  # fmt: skip
