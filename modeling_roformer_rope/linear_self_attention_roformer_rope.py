"""Linear-attention layers of RoFormer: the paper's eq. 19 and Performer FAVOR+ with RoPE, as attention modules.

Same parameters as the softmax layer (`qkv`, `o_proj`), so a softmax checkpoint loads into either type; the
Performer layer adds its random projection as a saved buffer (`feature_projection`, drawn once, reloaded
with the checkpoint, redrawn only by `redraw_features()`). The arithmetic is in
`linear_attention_roformer_rope.py`; this file chooses features and rotations:

- "linear" (eq. 19): φ = elu + 1 (or relu) on queries and keys; the numerator uses R_mφ(q_m), R_nφ(k_n) (the
  rotation of eq. 34 applied to the feature vectors, size F = D), the denominator the unrotated φ(q)ᵀφ(k).
- "performer", `performer_rope_placement="before_features"` (the paper's §4.4 experiment): RoPE on q and k
  (eq. 34), then FAVOR+ positive random features φ(R q), φ(R k) approximating exp(qᵀk/√D) (numerator and
  denominator alike). `"numerator"`: FAVOR+ features of q, k, rotated (F = nb_features) in the numerator only,
  as eq. 19 places it.

Masks: padding only, as a (B, S) boolean key mask (True = real token) — linear attention never forms the T×S
matrix a general mask would need. Causal (`is_decoder`) layers use chunked prefix sums, and generation keeps
a constant-size state (S, z) per layer in the cache (`RoFormerRopeLinearAttentionCacheLayer`), so memory does
not grow with the generated length. No attention-probability dropout: there are no probabilities to drop.

Shapes: B batch, T new tokens, S keys, H heads, D head size, F feature size, M random features.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .linear_attention_roformer_rope import (
    LinearAttentionState,
    elu_feature_map,
    favor_plus_features,
    gaussian_orthogonal_random_matrix,
    linear_attention,
    linear_attention_step,
    relu_feature_map,
)
from .onednn_roformer_rope import RoFormerRopeLinear, rotate

FEATURE_MAPS = {"elu": elu_feature_map, "relu": relu_feature_map}


class RoFormerRopeLinearAttentionCacheLayer(CacheLayerMixin):
    """A layer's generation cache for linear attention: the state (S, z, reference) and the tokens seen.

    A `CacheLayerMixin`, so the cache's sequence length (positions of the next tokens, mask sizes) is known even
    when every layer is linear.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.state: LinearAttentionState | None = None
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a linear-attention layer keeps a (S, z) state, not keys and values")

    def update_state(self, state: LinearAttentionState, new_tokens: int) -> None:
        self.state = state
        self.seen += new_tokens
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.state, self.seen, self.is_initialized = None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = LinearAttentionState(*(t.index_select(0, beam_idx.to(t.device)) for t in self.state))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each batch row's state `repeats` times in a row (B → B·repeats), as `DynamicLayer` repeats its keys."""
        if self.state is not None:
            self.state = LinearAttentionState(*(t.repeat_interleave(repeats, dim=0) for t in self.state))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` of the state."""
        if self.state is not None:
            self.state = LinearAttentionState(*(t[indices] for t in self.state))

    def crop(self, tokens_to_remove: int) -> None:
        """A running sum cannot forget tokens (`is_croppable` is False): transformers checks that before cropping a
        main model's cache, but crops an `assistant_model`'s without asking."""
        raise ValueError(
            "a linear-attention layer's cache is a running (S, z) state that cannot forget tokens, so it cannot be "
            "cropped: assisted decoding (`assistant_model=`, `prompt_lookup_num_tokens=`) needs models with softmax "
            "attention only, main and assistant"
        )


def install_cache_layers(cache: Cache, config) -> None:
    """Give every linear-attention layer of `cache` (e.g. a `DynamicCache` made by `generate`) our layer class."""
    for idx in range(config.num_hidden_layers):
        if config.attention_kind(idx) == "softmax":
            continue
        while len(cache.layers) <= idx:  # a cache made without a config: its layers so far, by their kinds
            softmax = config.attention_kind(len(cache.layers)) == "softmax"
            replicate = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
            cache.layers.append(replicate() if softmax else RoFormerRopeLinearAttentionCacheLayer())
        layer = cache.layers[idx]
        if not isinstance(layer, RoFormerRopeLinearAttentionCacheLayer):
            # `DynamicCache(config=...)` made a key/value layer, or transformers' recurrent-state layer for
            # "linear_attention" entries of `layer_types`: replace it while it is still empty.
            if isinstance(layer, CacheLayerMixin) and layer.get_seq_length() > 0:
                raise ValueError(f"cache layer {idx} already holds keys/values, but layer {idx} uses linear attention")
            cache.layers[idx] = RoFormerRopeLinearAttentionCacheLayer()


class RoFormerRopeLinearSelfAttention(nn.Module):
    """Multi-head linear self-attention with RoPE: eq. 19 ("linear") or FAVOR+ ("performer")."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.attention_kind(layer_idx)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.rotary_value = config.rotary_value
        self.is_causal = bool(config.is_decoder)
        self.chunk_size = config.linear_chunk_size
        self.qkv = RoFormerRopeLinear(config.hidden_size, 3 * config.hidden_size, bias=config.use_bias)
        self.o_proj = RoFormerRopeLinear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        if self.kind == "performer":
            self.nb_features = config.performer_nb_features
            self.rope_placement = config.performer_rope_placement
            # Saved with the checkpoint: a reloaded model draws nothing and gives identical outputs.
            self.register_buffer("feature_projection", self.draw_projection(), persistent=True)
        else:
            self.feature_map = FEATURE_MAPS[config.linear_feature_map]

    def draw_projection(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A fresh FAVOR+ projection W (M, D): orthogonal random features (Choromanski et al. 2021, §2.4)."""
        return gaussian_orthogonal_random_matrix(self.nb_features, self.head_dim, generator=generator)

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Replace the random projection (only when asked: never at inference, in eval() or on reload)."""
        self.feature_projection.copy_(self.draw_projection(generator).to(self.feature_projection))

    def features(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        feature_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor | None]:
        """Denominator features (q_feat, k_feat ≥ 0), numerator features (rotated, or None) and key log scales.

        query, key: (B, H, T, D) unrotated; angles (B or 1, T, D/2) (and (B or 1, T, M/2) for features of size M).
        """
        cos, sin = (t[:, None] for t in position_embeddings)  # (B, 1, T, D/2): broadcast over heads
        with torch.autocast(device_type=query.device.type, enabled=False):  # feature maps in float32 (or float64)
            dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
            query, key = query.to(dtype), key.to(dtype)
            if self.kind == "linear":
                q_feat, k_feat = self.feature_map(query), self.feature_map(key)  # (B, H, T, D) ≥ 0
                # eq. 19: R_mφ(q_m), R_nφ(k_n) in the numerator, the rotation of eq. 34 on the feature vectors
                return {"q_feat": q_feat, "k_feat": k_feat, "q_feat_rot": rotate(q_feat, cos, sin),
                        "k_feat_rot": rotate(k_feat, cos, sin), "k_log_scale": None}  # fmt: skip
            if self.rope_placement == "before_features":  # φ(R_m q_m), φ(R_n k_n): RoPE first, then FAVOR+
                query, key = rotate(query, cos, sin), rotate(key, cos, sin)
            q_feat, _ = favor_plus_features(query, self.feature_projection)  # (B, H, T, M); a row factor cancels
            k_feat, k_log_scale = favor_plus_features(key, self.feature_projection)  # (B, H, S, M), (B, H, S)
            if self.rope_placement == "before_features":
                return {"q_feat": q_feat, "k_feat": k_feat, "q_feat_rot": None, "k_feat_rot": None,
                        "k_log_scale": k_log_scale}  # fmt: skip
            fcos, fsin = (t[:, None] for t in feature_position_embeddings)  # (B, 1, T, M/2)
            return {"q_feat": q_feat, "k_feat": k_feat, "q_feat_rot": rotate(q_feat, fcos, fsin),
                    "k_feat_rot": rotate(k_feat, fcos, fsin), "k_log_scale": k_log_scale}  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        feature_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """attention_mask: the (B, T) key-padding mask of these tokens (True = real), or None."""
        B, T, _ = hidden_states.shape
        qkv = self.qkv(hidden_states).view(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, H, D)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, H, T, D) views
        if self.rotary_value:  # the English ELECTRA-style RoFormers also rotate values
            value = rotate(value, *(t[:, None] for t in position_embeddings))
        inputs = self.features(query, key, position_embeddings, feature_position_embeddings)
        if cache is not None and self.is_causal:
            layer = cache.layers[self.layer_idx]
            out, state = linear_attention_step(
                **inputs, value=value, state=layer.state, key_mask=attention_mask, chunk_size=self.chunk_size
            )
            layer.update_state(state, T)
        else:
            out = linear_attention(
                **inputs, value=value, key_mask=attention_mask, causal=self.is_causal, chunk_size=self.chunk_size
            )  # (B, T, H, D)
        return self.o_proj(out.reshape(B, T, -1)), None


__all__ = ["RoFormerRopeLinearAttentionCacheLayer", "RoFormerRopeLinearSelfAttention", "install_cache_layers"]
