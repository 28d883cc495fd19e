"""Self-attention of RoFormer with rotary position embedding, and the one place that picks how it is computed.

`attention_class(config, layer_idx)` maps a layer to its module: softmax attention (paper eq. 2 with eq. 34's
rotary queries/keys), or linear attention (eq. 19) / Performer FAVOR+ from `linear_attention_roformer_rope.py`.
For softmax layers, `softmax_attention_function(config)` maps `config._attn_implementation` to a function of
the transformers attention interface: `eager` (`eager_attention_roformer_rope.py`), `flash_attention_*` and
`flex_attention` from `ALL_ATTENTION_FUNCTIONS`, and `sdpa`, which on CPU inference runs whichever measures fastest
of `F.scaled_dot_product_attention`, our exact blocked kernel for long inputs (`onednn_attention_roformer_rope.py`)
and eager attention in blocks, and otherwise `F.scaled_dot_product_attention`.

Shapes: B batch, T queries, S keys (past + T with a cache), H heads, D head size.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .calibration_roformer_rope import forced
from .eager_attention_roformer_rope import eager_attention_forward, eager_blocks_forward, fully_masked_rows
from .linear_self_attention_roformer_rope import RoFormerRopeLinearSelfAttention
from .onednn_attention_roformer_rope import onednn_attention_forward, onednn_attention_path, sdpa_layout
from .onednn_roformer_rope import _NATIVE, RoFormerRopeLinear, rotate_qkv, tracing


def unilm_mask_function(token_type_ids: torch.Tensor) -> Callable:
    """UniLM (RoFormer-Sim): query i sees key j iff cumsum(token_type_ids)[j] <= cumsum(token_type_ids)[i].

    Bidirectional inside segment 0, causal over segment 1. The returned function follows the
    transformers mask-function protocol (batch, head, q_idx, kv_idx) -> bool.
    """
    segment_rank = token_type_ids.cumsum(dim=-1)  # (B, T)

    def mask(batch_idx, head_idx, q_idx, kv_idx):
        return segment_rank[batch_idx, kv_idx] <= segment_rank[batch_idx, q_idx]

    return mask


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """"sdpa", chosen per call: CPU inference runs on our oneDNN kernel for long inputs (same semantics, faster there;
    for bf16 with bf16 PV where that measures faster) or on eager attention in blocks (bf16 on a CPU with bf16
    instructions) where either measures faster than SDPA (`onednn_attention_path`), or on SDPA with compact keys and
    values where that measures faster (`sdpa_layout`); CPU training with attention dropout on our eager attention
    (`dropout_attention_path`)."""
    if dropout and dropout_attention_path(module, query, attention_mask, **kwargs) == "eager":
        return _eager_dropout_attention(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    path = onednn_attention_path(query, key, attention_mask, dropout, value)
    if path == "eager":
        out, weights = eager_blocks_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    elif path is not None:
        out, weights = onednn_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, bf16_pv=path == "onednn_bf16", **kwargs
        )
    else:
        if sdpa_layout(query, key, value) == "contiguous":
            key, value = key.contiguous(), value.contiguous()  # (B, H, S, D) each
        out, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        # a float mask given by the caller: a row at the dtype's minimum (or -inf) everywhere gives zeros, as a bool
        # mask's fully masked row does (and as on eager), not the mean of every value
        out = out.masked_fill(fully_masked_rows(attention_mask).transpose(1, 2)[..., None], 0.0)  # (B, T, H, D)
    return out, weights


DROPOUT_PATHS = ("eager", "sdpa")


def dropout_attention_path(
    module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool | None = None, **kwargs
) -> str:
    """"eager" or "sdpa" for attention with dropout (training).

    With dropout_p > 0, CPU SDPA has no fused kernel: it runs its math path, the same two GEMMs and softmax as
    eager, in float32 for bf16/fp16 inputs (4× the GEMM time of bf16 on a CPU with bf16 instructions: a 12-layer
    bf16-autocast MLM step at 4×512 with dropout 0.1 ran at 0.89× the built-in on a Zen 5 EPYC, whose eager
    attention stays in bf16; 1.37-1.43× on this path: `bench/results/amd-epyc-zen5-avx512-bf16/layers12-train-dropout*`),
    with torch's dropout. Our eager attention does the same GEMMs in the inputs' dtype
    (in float32 where that dtype is emulated: `_eager_dropout_attention`) with half the dropout work
    (`dropout_roformer_rope.py`), so on CPU it is the faster by construction, and measured so
    (`python bench/experiments.py --only dropout`: 1.29-1.33× in float32, 1.5-2.2× in bf16 on the Zen 5 EPYC; float32
    1.14-1.31× with AVX2 kernels, where emulated bf16 in float32 is 1.10-1.33× and in bf16 0.13-0.15×, both measured
    before the queries were scaled instead of the scores). It is a rule, not a timed decision, on purpose: the path decides which random
    masks a step draws, and a choice made by timing could differ between two runs of one seed, or between a
    resumed run and an uninterrupted one. SDPA's own causal flag (a decoder given no mask) stays on SDPA, as do
    other devices and tracing. `ROFORMER_ROPE_FORCE=attention_dropout=sdpa|eager` overrides."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if query.device.type != "cpu" or tracing() or (attention_mask is None and causal and query.shape[2] > 1):
        return "sdpa"
    path = forced("attention_dropout") or "eager"
    if path not in DROPOUT_PATHS:
        raise ValueError(
            f"roformer_rope dispatch: attention_dropout forced to {path!r} (by ROFORMER_ROPE_FORCE or force()); "
            f"the paths are {sorted(DROPOUT_PATHS)}"
        )
    return path



def _eager_dropout_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with dropout, computed in float32 where the CPU emulates the inputs' dtype (bf16 without
    AVX512-BF16/AMX, fp16 without AMX-FP16: an emulated bf16 layer took 7× the float32 one, `--only dropout` under
    an AVX2 limit), as SDPA's math path computes it, autocast or not; the output is rounded to the dtype once."""
    if _NATIVE.get(query.dtype, True):
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    wide = (t.float() for t in (query, key, value))  # (B, H, T | S, D) each
    with torch.autocast("cpu", enabled=False):  # autocast would hand the float32 GEMMs back to the emulated dtype
        out, weights = eager_attention_forward(module, *wide, attention_mask, **kwargs)
    return out.to(query.dtype), weights


def softmax_attention_function(config) -> Callable:
    """The attention-interface function for `config._attn_implementation`."""
    if config._attn_implementation == "sdpa":
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


class RoFormerRopeSelfAttention(nn.Module):
    """Multi-head softmax self-attention with rotary queries/keys (and values when `rotary_value`).

    One fused QKV projection (a single GEMM instead of three); queries and keys (and values) are rotated
    together straight from its output, and handed to the attention backend as strided views.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_probs_dropout_prob
        self.rotary_value = config.rotary_value
        # SDPA reads this flag: an encoder (and the UniLM mask, always materialised) must not be causal.
        self.is_causal = bool(config.is_decoder)
        self.qkv = RoFormerRopeLinear(config.hidden_size, 3 * config.hidden_size, bias=config.use_bias)
        self.o_proj = RoFormerRopeLinear(config.hidden_size, config.hidden_size, bias=config.use_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        query_position: int | torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`query_position`: attend from some positions only, to every key. 0 or -1: that one position, the output is
        (B, 1, C); a (B, T) bool mask: the selected positions, the output is (N, C), the selected rows in row-major
        order (as `output[query_position]` of the whole computation). Exact for a caller that reads only those
        positions (a [CLS] head, or an MLM loss on the labelled tokens, on the last layer: `RoFormerRopeModel`)."""
        B, T, _ = hidden_states.shape
        qkv = self.qkv(hidden_states).view(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, H, D)
        query, key, value = rotate_qkv(qkv, *position_embeddings, self.rotary_value, self.qkv)  # 3 × (B, T, H, D)
        # (B, H, T, D) views: SDPA on CPU reads these strides directly and writes (B, T, H, D) memory.
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, H, S, D), S = past + T
            key, value, attention_mask = written_slots(cache, self.layer_idx, key, value, attention_mask)
        valid = None
        if torch.is_tensor(query_position):
            index, valid = selected_queries(query_position)  # (B, L) each
            query, T = gather_positions(query, index, dim=2), index.shape[1]  # (B, H, L, D), rotated at their own
            if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] > 1:
                attention_mask = gather_positions(attention_mask.expand(B, -1, -1, -1), index, dim=2)  # (B, 1|H, L, S)
        elif query_position is not None:
            rows = position_slice(query_position)
            query, T = query[:, :, rows], 1  # (B, H, 1, D) view, rotated at its own position
            if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] > 1:
                attention_mask = attention_mask[:, :, rows]  # (B, 1 | H, 1, S): that query's row of the mask

        attn_output, attn_weights = softmax_attention_function(self.config)(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(B, T, -1)  # (B, T, H·D)
        if valid is not None:
            attn_output = attn_output[valid]  # (N, H·D): the padding slots of rows with fewer selections dropped
        return self.o_proj(attn_output), attn_weights


def written_slots(cache: Cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None):
    """A fixed-size (static) cache layer returns all its `max_cache_len` slots, and the mask hides the unwritten
    ones: in eager mode attend over the written slots only, `past + T` of them (the same result: the dropped keys
    had weight exactly 0). One decode step then reads past + 1 keys instead of the whole cache. Kept as is under
    torch.compile / export, whose graph wants the fixed shape, and for any other kind of cache layer."""
    layers = getattr(cache, "layers", ())
    if layer_idx >= len(layers) or type(layers[layer_idx]) is not StaticLayer or tracing():  # cheap checks first
        return key, value, mask
    if not torch.is_tensor(mask) or mask.dim() != 4 or mask.shape[-1] != key.shape[-2]:
        return key, value, mask  # no mask to trim alongside (or a mask of another shape): attend as given
    written = int(layers[layer_idx].get_seq_length())
    if written >= key.shape[-2]:
        return key, value, mask
    return key[:, :, :written], value[:, :, :written], mask[..., :written]  # (B, H, S', D) ×2, (B, 1|H, T, S')


def position_slice(position: int) -> slice:
    """The one-element slice of sequence position `position` (0 or negative: -1 is the last)."""
    return slice(position, position + 1 or None)


def selected_queries(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a (B, T) bool mask selects, as a padded (B, L) index (L = the most any row selects, at least 1):
    each row's selected positions first, in increasing order, then unselected ones as padding; and the (B, L) bool
    mask of the slots that are real selections. `x.gather(index)[valid]` lists the rows `x[selected]` lists."""
    counts = selected.sum(dim=1)  # (B,)
    slots = max(int(counts.max()) if counts.numel() else 0, 1)
    index = torch.argsort((~selected).to(torch.uint8), dim=1, stable=True)[:, :slots]  # (B, L)
    valid = torch.arange(slots, device=selected.device) < counts[:, None]  # (B, L)
    return index, valid


def gather_positions(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` (B, ..., T, ...) with the sequence axis `dim` replaced by `index`'s (B, L) positions (per batch row)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    expanded = list(x.shape)
    expanded[dim] = index.shape[1]
    return x.gather(dim, index.view(shape).expand(expanded))  # (B, ..., L, ...)


def attention_class(config, layer_idx: int) -> type[nn.Module]:
    """The attention module of layer `layer_idx`: by `config.layer_types`, else `config.attention_type`."""
    return RoFormerRopeSelfAttention if config.attention_kind(layer_idx) == "softmax" else RoFormerRopeLinearSelfAttention


__all__ = [
    "RoFormerRopeSelfAttention",
    "attention_class",
    "eager_attention_forward",
    "gather_positions",
    "position_slice",
    "sdpa_attention_forward",
    "selected_queries",
    "softmax_attention_function",
    "unilm_mask_function",
]
