"""RoFormer (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding") for transformers v5.

One post-norm BERT-style encoder with rotary self-attention (paper eq. 34), shared by RoFormer v1,
RoFormerV2 (parameter-free RMS norm, no biases), RoFormer-Sim (UniLM mask + pooler) and RoFormer-GPT
(causal LM with a KV cache). Attention runs through the transformers attention interface
(`eager`, `sdpa` default, `flash_attention_*`, `flex_attention`).

Shipped next to every checkpoint for `trust_remote_code`: imports only transformers / torch and
`from .sibling import X`.
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.loss.loss_utils import fixed_cross_entropy
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention_roformer_rope import RoFormerRopeSelfAttention, attention_class, position_slice, unilm_mask_function
from .cache_name_roformer_rope import cache_kwarg, causal_mask, output_cache, take_cache
from .configuration_roformer_rope import RoFormerRopeConfig
from .dropout_roformer_rope import RoFormerRopeDropout
from .inputs_roformer_rope import check_inputs
from .kv_cache_roformer_rope import install_key_value_layers
from .linear_self_attention_roformer_rope import RoFormerRopeLinearSelfAttention, install_cache_layers
from .onednn_roformer_rope import RoFormerRopeLinear, linear_activation
from .rotary_roformer_rope import RoFormerRopeRotaryEmbedding

logger = logging.get_logger(__name__)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 (float64 stays float64): losses and norms of low-precision models are computed there."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _float64_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' MLM / token-classification cross-entropy for a float64 model: theirs calls `.float()`, so the
    loss (and `gradcheck`) would drop to float32; the built-in RoFormer's stays float64."""
    logits = logits.reshape(-1, logits.shape[-1])  # (rows, K)
    return fixed_cross_entropy(logits, labels.reshape(-1).to(logits.device), **kwargs)


def _check_label_shape(labels: torch.Tensor, shape: torch.Size) -> None:
    """Per-token labels have the tokens' shape (or its flattened form): flattened, a mis-shaped tensor would pair
    labels with the wrong rows."""
    if labels.shape != shape and labels.shape != (shape.numel(),):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match the input shape {tuple(shape)}")


class RoFormerRopeRMSNorm(nn.Module):
    """RoFormerV2's norm: x / sqrt(mean(x²) + eps), no learnable scale or shift, computed in float32 (or float64)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = _wide(hidden_states)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(hidden_states.dtype)


def make_norm(config: RoFormerRopeConfig, dim: int) -> nn.Module:
    if config.norm_type == "rms_norm":
        return RoFormerRopeRMSNorm(config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps)


class RoFormerRopeEmbeddings(nn.Module):
    """Word + segment embeddings, then norm and dropout. No position embeddings: RoPE carries positions."""

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.norm = make_norm(config, config.embedding_size)
        self.dropout = RoFormerRopeDropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, T, E)
        if token_type_ids is None:
            # All-zero segments: add row 0 by broadcasting instead of gathering B·T copies of it.
            embeddings = inputs_embeds + self.token_type_embeddings.weight[0]
        else:
            embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(embeddings))


class RoFormerRopeMLP(nn.Module):
    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__()
        self.up_proj = RoFormerRopeLinear(config.hidden_size, config.intermediate_size, bias=config.use_bias)
        self.down_proj = RoFormerRopeLinear(config.intermediate_size, config.hidden_size, bias=config.use_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = linear_activation(hidden_states, self.up_proj, self.act_fn)  # (B, T, I)
        return self.down_proj(hidden_states)


class RoFormerRopeLayer(GradientCheckpointingLayer):
    """Post-norm block (BERT layout, as the original): x = norm(x + attn(x)); x = norm(x + mlp(x))."""

    def __init__(self, config: RoFormerRopeConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention = attention_class(config, layer_idx)(config, layer_idx)
        self.mask_kind = "softmax" if config.attention_kind(layer_idx) == "softmax" else "linear"
        self.attention_norm = make_norm(config, config.hidden_size)
        self.mlp = RoFormerRopeMLP(config)
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.dropout = RoFormerRopeDropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        query_position: int | torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`query_position` (softmax layers): compute only some positions' outputs, attending to every key. 0 or -1:
        that position, (B, 1, C); a (B, T) bool mask: the selected positions, (N, C) in row-major order."""
        cache = take_cache(cache, kwargs)
        if query_position is not None:
            kwargs["query_position"] = query_position
        attn_output, _ = self.attention(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        if torch.is_tensor(query_position):
            hidden_states = hidden_states[query_position]  # (N, C), the rows the attention output lists
        elif query_position is not None:
            hidden_states = hidden_states[:, position_slice(query_position)]  # (B, 1, C)
        hidden_states = self.attention_norm(hidden_states + self.dropout(attn_output))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))


class RoFormerRopePooler(nn.Module):
    """Dense layer on the [CLS] state (RoFormer-Sim uses a linear activation, BERT tanh)."""

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__()
        self.dense = RoFormerRopeLinear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        self.activation = nn.Identity() if config.pooler_activation == "linear" else ACT2FN[config.pooler_activation]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class RoFormerRopeCarriedLinear(nn.Module):
    """A linear layer's `weight` (out, in) and `bias` (out,) held as buffers: loaded and saved with the model, never
    trained (no optimizer, weight decay or DeepSpeed partition touches a buffer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features))  # (out, in)
        self.register_buffer("bias", torch.empty(out_features) if bias else None)  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RoFormerRopeCarriedPooler(RoFormerRopePooler):
    """The pooler of a task model's encoder, carried but not run (see `_task_encoder`): `RoFormerRopePooler` with its
    dense weights (same names, `dense.weight`, `dense.bias`) as untrained buffers. Called, it pools as the pooler
    does (RoFormer-Sim's sentence vector from a MaskedLM: `model.roformer.pooler(last_hidden_state)`)."""

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        self.dense = RoFormerRopeCarriedLinear(config.hidden_size, config.hidden_size, bias=config.use_bias)


@auto_docstring
class RoFormerRopePreTrainedModel(PreTrainedModel):
    config: RoFormerRopeConfig
    base_model_prefix = "roformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RoFormerRopeEmbeddings", "RoFormerRopeLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": RoFormerRopeLayer,
        "attentions": RoFormerRopeSelfAttention,
    }

    def __init__(self, config: RoFormerRopeConfig, *inputs, **kwargs) -> None:
        # `from_pretrained(path, attention_type=...)` overrides and later assignments to the config are set field by
        # field, without the cross-field checks construction ran: run them again before building anything.
        config.validate_architecture()
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RoFormerRopeRotaryEmbedding):
            # A non-persistent buffer: recompute it, models are first built on the meta device.
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, RoFormerRopeLinearSelfAttention) and module.kind == "performer":
            init.copy_(module.feature_projection, module.draw_projection())
        elif isinstance(module, RoFormerRopeLMHead) and module.decoder.bias is not None:
            init.zeros_(module.decoder.bias)
        elif isinstance(module, RoFormerRopeCarriedLinear):  # buffers: drawn as the pooler's linear layer is
            init.normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)

    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Draw new FAVOR+ projections for every Performer layer. Never done implicitly: not at inference, not by
        `eval()`, not on reload (the projection is saved with the weights)."""
        for module in self.modules():
            if isinstance(module, RoFormerRopeLinearSelfAttention) and module.kind == "performer":
                module.redraw_features(generator)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # `custom_object_save` only records the saved class; write the whole family so that every Auto class
        # loads the folder with trust_remote_code.
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        return super().save_pretrained(save_directory, *args, **kwargs)


@auto_docstring(
    custom_intro="""
    The bare RoFormer encoder (or decoder, with `is_decoder=True`) outputting hidden states, plus the pooled
    [CLS] state when `add_pooler=True`.
    """
)
class RoFormerRopeModel(RoFormerRopePreTrainedModel):
    # A checkpoint saved from a task model (e.g. a converted RoFormer-Sim MLM) also holds its head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(
        self, config: RoFormerRopeConfig, add_pooling_layer: bool | None = None, carry_pooler: bool = False
    ) -> None:
        r"""
        add_pooling_layer (`bool`, *optional*):
            Whether to build the [CLS] pooler; defaults to `config.add_pooler`.
        carry_pooler (`bool`, *optional*, defaults to `False`):
            Without a pooler to run, still hold the pooler's weights (`RoFormerRopeCarriedPooler`), as task models do
            for a config with `add_pooler`.
        """
        super().__init__(config)
        self.embeddings = RoFormerRopeEmbeddings(config)
        if config.embedding_size != config.hidden_size:
            self.embeddings_project = RoFormerRopeLinear(config.embedding_size, config.hidden_size, bias=config.use_bias)
        self.rotary_emb = RoFormerRopeRotaryEmbedding(config)
        kinds = {config.attention_kind(i) for i in range(config.num_hidden_layers)}
        if "performer" in kinds and config.performer_rope_placement == "numerator":
            # eq. 19's placement on FAVOR+ features rotates vectors of size M = nb_features
            self.feature_rotary_emb = RoFormerRopeRotaryEmbedding(config, dim=config.performer_nb_features)
        self.layers = nn.ModuleList([RoFormerRopeLayer(config, i) for i in range(config.num_hidden_layers)])
        # the cache layer a causal mask is sized against (linear-attention layers keep no keys)
        self.first_softmax_layer = next((i for i, layer in enumerate(self.layers) if layer.mask_kind == "softmax"), 0)
        add_pooling_layer = config.add_pooler if add_pooling_layer is None else add_pooling_layer
        if add_pooling_layer:
            self.pooler = RoFormerRopePooler(config)
        else:  # built before `post_init`, which draws a carried pooler's weights a checkpoint does not hold
            self.pooler = RoFormerRopeCarriedPooler(config) if carry_pooler else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    @property
    def runs_pooler(self) -> bool:
        """`forward` returns a `pooler_output` (not for a pooler a task model only carries, nor without one)."""
        return isinstance(self.pooler, RoFormerRopePooler) and not isinstance(self.pooler, RoFormerRopeCarriedPooler)

    @property
    def has_linear_layers(self) -> bool:
        return any(layer.mask_kind == "linear" for layer in self.layers)

    @property
    def has_softmax_layers(self) -> bool:
        return any(layer.mask_kind == "softmax" for layer in self.layers)

    def _summary_layer(
        self, position: int | torch.Tensor | None, cache: Cache | None, mask: torch.Tensor | None, kwargs: dict
    ) -> nn.Module | None:
        """The last layer, when only `position`'s final states are wanted and nothing else reads the others (see
        `summary_position` and `selected_positions` in `forward`); else None."""
        if position is None or cache is not None or not self.layers or self.layers[-1].mask_kind != "softmax":
            return None
        if self.config._attn_implementation not in ("eager", "sdpa") or not (mask is None or torch.is_tensor(mask)):
            return None  # flash / flex attention take masks sized for every query (a flex BlockMask, unpadding)
        recorded = ("output_hidden_states", "output_attentions")
        if any(kwargs.get(name, getattr(self.config, name, False)) for name in recorded):
            return None  # every layer's full output is returned
        return self.layers[-1]

    def _check_selection(
        self,
        summary_position: int | None,
        selected_positions: torch.Tensor | None,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
    ) -> int | torch.Tensor | None:
        """The positions `forward` was asked for (`summary_position` or `selected_positions`), checked."""
        if summary_position is not None and summary_position not in (0, -1):
            raise ValueError(
                f"summary_position must be 0 (the first token) or -1 (the last), got {summary_position!r}"
            )
        if selected_positions is None:
            return summary_position
        if summary_position is not None:
            raise ValueError("pass summary_position or selected_positions, not both")
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        if not torch.is_tensor(selected_positions) or selected_positions.dtype != torch.bool:
            raise ValueError(
                f"selected_positions must be a bool tensor of shape (batch, seq) {tuple(shape)}, got "
                f"{getattr(selected_positions, 'dtype', type(selected_positions).__name__)}"
            )
        if selected_positions.shape != shape:
            raise ValueError(
                f"selected_positions has shape {tuple(selected_positions.shape)}, the inputs {tuple(shape)}"
            )
        if self.runs_pooler:
            raise ValueError(
                "selected_positions returns the selected rows only, and the pooler reads [CLS] of every sequence: "
                "use a model without a pooler (add_pooling_layer=False)"
            )
        return selected_positions.to(self.device)

    def _key_padding_mask(self, attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """The (B, T) key mask of the new tokens for linear-attention layers (True = real token)."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2:
            raise ValueError(
                "linear attention layers take a 2-D (batch, keys) padding mask; a 4-D attention_mask cannot be applied"
            )
        return attention_mask[:, -length:].bool()

    def _attention_mask(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """Build the mask once per forward, in the form the attention backend wants."""
        if self.config.is_decoder:
            return causal_mask(
                layer_idx=self.first_softmax_layer,
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
        and_mask = None
        if self.config.unilm_mask and token_type_ids is not None:
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("unilm_mask does not support a KV cache: pass the whole sequence")
            and_mask = unilm_mask_function(token_type_ids)
        return create_bidirectional_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            and_mask_function=and_mask,
        )

    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        summary_position: int | None = None,
        selected_positions: torch.BoolTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        r"""
        cache (`Cache`, *optional*):
            The KV cache of earlier tokens (decoders): a `DynamicCache` from an earlier call with `use_cache=True`.
            transformers before 5.24 named it `past_key_values`; that name is accepted too.
        summary_position (`int`, *optional*):
            The one position (0: [CLS], -1: the last) whose final state the caller reads, as a sequence-classification
            or multiple-choice head does. The last layer then computes only that position (its keys and values still
            cover every position, so the result is exact) and `last_hidden_state` is (batch, 1, hidden): three
            quarters of the last layer's GEMM FLOPs are skipped (output projection and MLP), forward and backward,
            ~6% of a 12-layer encoder's, ~19% of a 4-layer one's. Ignored
            (the full sequence) when hidden states or attentions are being returned, with a KV cache, when the
            last layer is a linear-attention one, and with attention implementations other than eager and sdpa.
        selected_positions (`torch.BoolTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The positions whose final states the caller reads, as an MLM loss on its labelled tokens does
            (`sparse_prediction`). The last layer then computes only those positions and `last_hidden_state` is
            (N, hidden), the selected rows in row-major order (what `last_hidden_state[selected_positions]` of the
            whole computation gives). With 15% of the tokens selected, ~85% of the last layer's attention, output
            projection and MLP are skipped in the forward and the attention's backward. Ignored (the full sequence,
            (batch, seq, hidden)) in the same cases as `summary_position`; not with a pooler, which reads [CLS].
        """
        cache = take_cache(cache, kwargs)
        for name in ("encoder_hidden_states", "encoder_attention_mask"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} was given, but RoFormer has no cross-attention layers to read it")
        if not self.config.is_decoder:
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None and self.has_linear_layers:
            install_cache_layers(cache, self.config)
        past_seen = cache.get_seq_length() if cache is not None else 0
        if cache is not None and past_seen == 0:
            install_key_value_layers(cache, self.config)  # append in place instead of concatenating
        check_inputs(
            input_ids,
            inputs_embeds,
            attention_mask,
            token_type_ids,
            position_ids,
            past_seen,
            self.config.num_attention_heads,
            self.config._attn_implementation,
        )
        selection = self._check_selection(summary_position, selected_positions, input_ids, inputs_embeds)
        if (
            attention_mask is not None
            and attention_mask.dim() == 4
            and attention_mask.shape[2] == 1 < (input_ids if input_ids is not None else inputs_embeds).shape[1]
            and (self.config.is_decoder or (self.config.unilm_mask and token_type_ids is not None))
        ):
            # a 4-D mask is used as given, so one row broadcast over the queries would drop the causal/UniLM rule
            raise ValueError(
                f"a 4-D attention_mask with one query row {tuple(attention_mask.shape)} would replace the "
                f"{'causal' if self.config.is_decoder else 'UniLM'} mask: pass the 2-D (batch, keys) padding mask"
            )

        hidden_states = self.embeddings(input_ids, token_type_ids, inputs_embeds)  # (B, T, E)
        if hasattr(self, "embeddings_project"):
            hidden_states = self.embeddings_project(hidden_states)  # (B, T, C)

        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device) + past_seen
            position_ids = position_ids.unsqueeze(0)  # (1, T)
        position_embeddings = self.rotary_emb(position_ids)  # cos, sin: (B or 1, T, D/2) float32
        if hasattr(self, "feature_rotary_emb"):
            kwargs["feature_position_embeddings"] = self.feature_rotary_emb(position_ids)  # (B or 1, T, M/2)

        # Masks built once: the form the softmax backend wants, and a (B, T) key mask for linear layers.
        masks = {}
        if self.has_softmax_layers:
            masks["softmax"] = self._attention_mask(
                hidden_states, attention_mask, token_type_ids, cache, position_ids
            )
        if self.has_linear_layers:
            masks["linear"] = self._key_padding_mask(attention_mask, hidden_states.shape[1])
        summary_layer = self._summary_layer(selection, cache, masks.get("softmax"), kwargs)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer.mask_kind],
                position_embeddings=position_embeddings,
                **cache_kwarg(cache),  # under this transformers' name: gradient checkpointing drops it by name
                **({"query_position": selection} if layer is summary_layer else {}),
                **kwargs,
            )

        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden_states,
            pooler_output=self.pooler(hidden_states) if self.runs_pooler else None,
            **cache_kwarg(cache if use_cache else None),
        )


# Pooler weights in a checkpoint whose config has no `add_pooler`: the LM models do not use them.
_UNUSED_POOLER = [r"^roformer\.pooler\."]


def _task_encoder(config: RoFormerRopeConfig) -> RoFormerRopeModel:
    """The encoder of a task model, which runs no pooler. A config with `add_pooler` (RoFormer-Sim, a v1 release
    with its pooler) names a pooler its checkpoints hold next to the task head: the encoder carries those weights
    (`RoFormerRopeCarriedPooler`: untrained, never run), so loading keeps them and `save_pretrained` writes them
    back (a fine-tuned and saved folder still gives `AutoModel` its pooled sentence vectors)."""
    return RoFormerRopeModel(config, add_pooling_layer=False, carry_pooler=config.add_pooler)


class RoFormerRopeLMHead(nn.Module):
    """MLM / LM head. v1: dense → act → LayerNorm → tied decoder + bias. V2: tied decoder only."""

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__()
        if config.has_mlm_transform:
            self.dense = RoFormerRopeLinear(config.hidden_size, config.embedding_size, bias=config.use_bias)
            self.act_fn = ACT2FN[config.hidden_act]
            self.norm = make_norm(config, config.embedding_size)
        self.decoder = RoFormerRopeLinear(config.embedding_size, config.vocab_size, bias=config.use_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "dense"):
            hidden_states = self.norm(self.act_fn(self.dense(hidden_states)))
        return self.decoder(hidden_states)


_LM_TIED_WEIGHTS = {"lm_head.decoder.weight": "roformer.embeddings.word_embeddings.weight"}


def _before_the_loss_row_wise(model: nn.Module) -> list[nn.Module]:
    """The linears between the last attention and an MLM loss: the head's, and the last layer's output projection and
    MLP. Each row of theirs reaches only its own position's logits (norms, GELU, dropout and residual adds work per
    row), so a position the loss ignores gives them an all-zero gradient row, which `linear`'s `zero_grad_rows`
    skips in their backward GEMMs (exact: the rows are found in the gradient itself). The attention mixes rows, so
    the layers below get gradients on every row. 12 layers at 4×512, 15% labelled: ~41 of the step's ~1390 GFLOP."""
    head = model.lm_head
    last = model.roformer.layers[-1] if len(model.roformer.layers) else None
    candidates = [head.decoder, getattr(head, "dense", None)]
    if last is not None:
        candidates += [getattr(last.attention, "o_proj", None), last.mlp.up_proj, last.mlp.down_proj]
    return [m for m in candidates if isinstance(m, RoFormerRopeLinear)]


@auto_docstring
class RoFormerRopeForMaskedLM(RoFormerRopePreTrainedModel):
    _tied_weights_keys = _LM_TIED_WEIGHTS
    _keys_to_ignore_on_load_unexpected = _UNUSED_POOLER

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        if config.is_decoder:
            logger.warning("RoFormerRopeForMaskedLM expects config.is_decoder=False for bidirectional attention.")
        self.roformer = _task_encoder(config)
        self.lm_head = RoFormerRopeLMHead(config)
        # The MLM loss ignores ~85% of positions: the backward GEMMs skip their (zero) gradient rows.
        for linear in _before_the_loss_row_wise(self):
            linear.zero_grad_rows = True
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        keep = None
        tokens = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and tokens is not None:  # no tokens at all: the encoder says so
            shape = tokens.shape[:2]  # (B, T)
            _check_label_shape(labels, shape)
            labels = labels.reshape(shape)
            if self.config.sparse_prediction:
                # Only the masked ~15% of tokens carry a label: the last layer (but for its keys and values) and the
                # vocabulary projection (the largest GEMM of an MLM step) run on those rows only.
                keep = labels != -100  # (B, T)
        outputs = self.roformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            selected_positions=keep,
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, C), or (N, C) with sparse_prediction
        if keep is not None:
            if hidden_states.dim() == 3:  # the encoder computed every position (see `selected_positions`)
                hidden_states = hidden_states[keep.to(hidden_states.device)]  # (N, C)
            labels = labels[keep]  # (N,), in the order of the rows
        logits = self.lm_head(hidden_states)  # (B, T, V), or (N, V) with sparse_prediction
        loss = None
        if labels is not None and logits.dtype == torch.float64:
            loss = _float64_cross_entropy(logits, labels, **kwargs)
        elif labels is not None and self.config.sparse_prediction:  # every row already carries a label
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        elif labels is not None:
            loss = self._mlm_loss(logits, labels, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    def _mlm_loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """The loss on the labelled rows only: the same value and gradients as on all rows (an ignored row adds
        nothing and gets a zero gradient), without the log-softmax over the ~85% ignored rows of (B·T, V)
        logits, which costs as much as the decoder GEMM itself in a dense-head step."""
        labels = labels.reshape(-1)  # (B·T,) or (N,)
        rows = (labels != kwargs.get("ignore_index", -100)).nonzero().squeeze(1)  # (M,)
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)  # (M, V)
        return self.loss_function(
            logits=logits, labels=labels.index_select(0, rows), vocab_size=self.config.vocab_size, **kwargs
        )


@auto_docstring(custom_intro="RoFormer with a language-modeling head for causal generation (RoFormer-GPT).")
class RoFormerRopeForCausalLM(RoFormerRopePreTrainedModel, GenerationMixin):
    _tied_weights_keys = _LM_TIED_WEIGHTS
    _keys_to_ignore_on_load_unexpected = _UNUSED_POOLER

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        if not config.is_decoder:
            logger.warning("RoFormerRopeForCausalLM expects config.is_decoder=True for causal attention.")
        self.roformer = _task_encoder(config)
        self.lm_head = RoFormerRopeLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings

    @staticmethod
    def create_masks_for_generate(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """`generate` with a static (compileable) cache asks for the masks before the forward; transformers' default
        reads `config.layer_types` as mask kinds, which ours are not ("linear_attention" layers take a padding
        mask). The forward builds every mask itself from the 2-D padding mask, so that is passed through."""
        return attention_mask

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithCrossAttentions:
        r"""
        cache (`Cache`, *optional*):
            The KV cache of earlier tokens: a `DynamicCache` from an earlier call with `use_cache=True`.
            transformers before 5.24 named it `past_key_values`; that name is accepted too.
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Next-token labels; shifted inside the loss, -100 is ignored.
        """
        cache = take_cache(cache, kwargs)
        outputs = self.roformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # (B, T_kept, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            **cache_kwarg(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class RoFormerRopeClassificationHead(nn.Module):
    """[CLS] → dropout → dense → act → dropout → out_proj (the built-in RoFormer's layout)."""

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = RoFormerRopeDropout(config.classifier_dropout_prob)
        self.act_fn = ACT2FN[config.hidden_act]
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.dropout(hidden_states[:, 0])  # (B, C): the [CLS] token
        x = self.dropout(self.act_fn(self.dense(x)))
        return self.out_proj(x)  # (B, num_labels)


@auto_docstring(custom_intro="RoFormer with a [CLS] classification / regression head.")
class RoFormerRopeForSequenceClassification(RoFormerRopePreTrainedModel):
    # Its loss is a mean over this batch that ignores `num_items_in_batch` (for sequence classification: the
    # regression and multi-label forms): with this False the Trainer divides it by the gradient-accumulation steps
    # itself (seeing **kwargs in `forward`, it would assume the model had normalised it).
    accepts_loss_kwargs = False

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roformer = _task_encoder(config)
        self.classifier = RoFormerRopeClassificationHead(config)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        outputs = self.roformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            summary_position=0,  # the head reads [CLS] only: the last layer computes no other position
            **kwargs,
        )
        logits = self.classifier(outputs.last_hidden_state)
        loss = None
        if labels is not None:  # regression, single- or multi-label by `config.problem_type`, as transformers does
            loss = self.loss_function(labels=labels, pooled_logits=_wide(logits), config=self.config, **kwargs)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@auto_docstring(custom_intro="RoFormer with a per-token classification head (NER, POS tagging).")
class RoFormerRopeForTokenClassification(RoFormerRopePreTrainedModel):
    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roformer = _task_encoder(config)
        self.dropout = RoFormerRopeDropout(config.classifier_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        outputs = self.roformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            _check_label_shape(labels, logits.shape[:-1])
        if labels is not None and logits.dtype == torch.float64:
            loss = _float64_cross_entropy(logits, labels, **kwargs)
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, config=self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@auto_docstring(custom_intro="RoFormer with a span-extraction head (start/end logits) for extractive QA.")
class RoFormerRopeForQuestionAnswering(RoFormerRopePreTrainedModel):
    # Its loss is a mean over this batch that ignores `num_items_in_batch`: with this False the Trainer divides it
    # by the gradient-accumulation steps itself (seeing **kwargs in `forward`, it would assume the model had).
    accepts_loss_kwargs = False

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        self.roformer = _task_encoder(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        outputs = self.roformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            **kwargs,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)  # (B, T, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # 2 × (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the sequence are clamped to T and ignored, as in BERT.
            loss = self.loss_function(_wide(start_logits), _wide(end_logits), start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


@auto_docstring(custom_intro="RoFormer scoring each of several choices (input shape (batch, num_choices, seq_len)).")
class RoFormerRopeForMultipleChoice(RoFormerRopePreTrainedModel):
    # Its loss is a mean over this batch that ignores `num_items_in_batch`: with this False the Trainer divides it
    # by the gradient-accumulation steps itself (seeing **kwargs in `forward`, it would assume the model had).
    accepts_loss_kwargs = False

    def __init__(self, config: RoFormerRopeConfig) -> None:
        super().__init__(config)
        self.roformer = _task_encoder(config)
        # No dropout before the classifier unless `classifier_dropout` asks for it: the built-in's summary layer has
        # none (RoFormerConfig sets no `summary_*_dropout`), so a converted checkpoint fine-tunes the same way.
        self.dropout = RoFormerRopeDropout(config.classifier_dropout) if config.classifier_dropout else nn.Identity()
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MultipleChoiceModelOutput:
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("RoFormerRopeForMultipleChoice expects inputs of shape (batch, num_choices, seq_len)")
        num_choices = source.shape[1]
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            # (B, N, T) per choice (a 5-D attention mask (B, N, heads, T, T) is checked after flattening)
            if t is not None and (t.shape[:2] != source.shape[:2] or (t.dim() == 3 and t.shape != source.shape[:3])):
                raise ValueError(
                    f"{name} shape {tuple(t.shape)} must be the inputs' (batch, num_choices, seq_len) = "
                    f"{tuple(source.shape[:3])}: one row per choice"
                )

        index = 0 if self.config.summary_type == "first" else -1

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            # (B, N, T, ...) → (B·N, T, ...): every choice is an independent sequence.
            return None if t is None else t.reshape(-1, *t.shape[2:])

        outputs = self.roformer(
            flat(input_ids),
            attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            inputs_embeds=flat(inputs_embeds),
            return_dict=True,  # the head reads fields: a config with return_dict=False gets its tuple from the head
            summary_position=index,  # the last layer computes only this position
            **kwargs,
        )
        summary = outputs.last_hidden_state[:, index]  # (B·N, C): the last layer's only position, or that of all
        logits = self.classifier(self.dropout(summary)).view(-1, num_choices)  # (B, N)
        # transformers has no multiple-choice loss function: plain cross-entropy over the choices.
        loss = nn.functional.cross_entropy(_wide(logits), labels) if labels is not None else None
        return MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


AUTO_CLASSES = {
    "AutoModel": RoFormerRopeModel,
    "AutoModelForMaskedLM": RoFormerRopeForMaskedLM,
    "AutoModelForCausalLM": RoFormerRopeForCausalLM,
    "AutoModelForSequenceClassification": RoFormerRopeForSequenceClassification,
    "AutoModelForTokenClassification": RoFormerRopeForTokenClassification,
    "AutoModelForQuestionAnswering": RoFormerRopeForQuestionAnswering,
    "AutoModelForMultipleChoice": RoFormerRopeForMultipleChoice,
}
AUTO_MAP = {
    "AutoConfig": "configuration_roformer_rope.RoFormerRopeConfig",
    **{auto: f"modeling_roformer_rope.{cls.__name__}" for auto, cls in AUTO_CLASSES.items()},
}
RoFormerRopeConfig.register_for_auto_class()
for _auto, _cls in AUTO_CLASSES.items():
    _cls.register_for_auto_class(_auto)

__all__ = [
    "AUTO_MAP",
    "RoFormerRopeForCausalLM",
    "RoFormerRopeForMaskedLM",
    "RoFormerRopeForMultipleChoice",
    "RoFormerRopeForQuestionAnswering",
    "RoFormerRopeForSequenceClassification",
    "RoFormerRopeForTokenClassification",
    "RoFormerRopeModel",
    "RoFormerRopePreTrainedModel",
]
