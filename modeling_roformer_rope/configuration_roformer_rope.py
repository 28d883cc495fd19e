"""RoFormerRope configuration: the built-in RoFormer's fields plus rotary, attention-type, V2 and Sim switches.

Shipped next to every checkpoint (the `trust_remote_code` payload), so it only imports from
`transformers`, `torch` and the standard library.
"""

from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# `rope_type`s whose frequencies suit the interleaved rotation as they are (transformers' own functions compute them).
ROPE_TYPES = ("default", "linear", "dynamic")
# Softmax over all keys, the paper's linear attention (eq. 19), Performer FAVOR+ with RoPE (§4.4).
ATTENTION_TYPES = ("softmax", "linear", "performer")
# Per-layer kinds, named as transformers names them (`layer_types`): "linear_attention" layers use the config's
# `attention_type` ("linear" or "performer"), "full_attention" layers softmax attention.
LAYER_TYPES = ("full_attention", "linear_attention")
FEATURE_MAPS = ("elu", "relu")
PERFORMER_ROPE_PLACEMENTS = ("before_features", "numerator")


@strict
class RoFormerRopeConfig(PreTrainedConfig):
    r"""Configuration of a RoFormer (Su et al., 2021) with rotary position embedding.

    Fields shared with the built-in `RoFormerConfig` keep their names and meaning. The extra fields:

    - `rope_parameters`: transformers v5 rotary settings, `{"rope_type": "default", "rope_theta": 10000.0}` by
      default, θ_i = rope_theta^(-2i/d) (paper eq. 15). `"linear"` (positions divided by `factor`) and
      `"dynamic"` (NTK-aware base growth once the input is longer than `max_position_embeddings`) run past the
      trained length. Configs saved with the older `rope_theta` / `rope_scaling` fields load unchanged.
    - `norm_type`: `"layer_norm"` (RoFormer v1) or `"rms_norm"` (RoFormerV2: parameter-free RMS norm,
      whose MLM head is the tied embedding only).
    - `use_bias`: biases in every linear layer (`False` for RoFormerV2).
    - `add_pooler` / `pooler_activation`: a pooler on `[CLS]` (RoFormer-Sim uses `"linear"`).
    - `unilm_mask`: RoFormer-Sim's UniLM mask: query i sees key j iff
      cumsum(token_type_ids)[j] <= cumsum(token_type_ids)[i].
    - `summary_type`: which token `...ForMultipleChoice` scores (`"first"` = [CLS]; `"last"` is what the
      built-in model does, kept for checkpoints converted from it).
    - `attention_type`: `"softmax"` (full attention through the transformers attention interface),
      `"linear"` (paper eq. 19: feature map φ, RoPE on φ(q), φ(k) in the numerator only) or `"performer"`
      (FAVOR+ random features approximating softmax, with RoPE).
    - `layer_types`: per layer `"full_attention"` or `"linear_attention"` (the kind `attention_type` names),
      as ModernBERT's `layer_types`; `None` (default): every layer follows `attention_type`.
    - `linear_feature_map` (`"elu"`: elu + 1, or `"relu"`), `linear_chunk_size` (causal prefix sums are
      computed chunk by chunk; keep it ≥ the feature size d: the d×d state kept per chunk
      boundary for backward makes memory O(N·d²/chunk)), `performer_nb_features` (even; random features per head),
      `performer_rope_placement` (`"before_features"`: rotate q, k then take features, the paper's Performer
      experiment; `"numerator"`: eq. 19's placement on the features).
    - `sparse_prediction`: when `...ForMaskedLM` gets `labels`, compute logits only for labelled tokens
      (returned as (N_labelled, vocab_size)), and the last layer only those positions (attending to every key);
      the same loss and gradients, less compute in MLM training. Off by default.

    `max_position_embeddings` is informational only (and the `dynamic` scaling's trained length): rotary
    sinusoids are computed for the actual positions, so any length runs.
    """

    model_type = "roformer_rope"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = 50000
    embedding_size: int | None = None
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    head_dim: int | None = None
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    classifier_dropout: float | int | None = None
    max_position_embeddings: int = 1536
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rotary_value: bool = False
    rope_parameters: RopeParameters | dict | None = None
    norm_type: Literal["layer_norm", "rms_norm"] = "layer_norm"
    use_bias: bool = True
    add_pooler: bool = False
    pooler_activation: str = "tanh"
    unilm_mask: bool = False
    summary_type: Literal["first", "last"] = "first"
    attention_type: str = "softmax"
    layer_types: list[str] | None = None
    linear_feature_map: str = "elu"
    linear_chunk_size: int = 128
    performer_nb_features: int = 256
    performer_rope_placement: str = "before_features"
    sparse_prediction: bool = False
    is_decoder: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_norm_eps is None:
            # bert4keras: LayerNormalization epsilon 1e-12 (v1); RoFormerV2's RMS norm uses 1e-7 here.
            self.layer_norm_eps = 1e-7 if self.norm_type == "rms_norm" else 1e-12
        # `rope_theta` / `rope_scaling` of older configs are moved into `rope_parameters` by the parent
        # (`convert_rope_params_to_dict`); the default is {"rope_type": "default", "rope_theta": 10000.0}.
        super().__post_init__(**kwargs)
        self.rope_parameters.pop("type", None)  # the pre-v5 name of `rope_type`, copied over by the parent

    def attention_kind(self, layer_idx: int) -> str:
        """"softmax", "linear" or "performer" for layer `layer_idx` (`layer_types`, else `attention_type`)."""
        if self.layer_types is not None and self.layer_types[layer_idx] == "full_attention":
            return "softmax"
        return self.attention_type

    @property
    def has_mlm_transform(self) -> bool:
        """RoFormer v1 has a dense + LayerNorm transform before the tied decoder; V2 has none."""
        return self.norm_type == "layer_norm"

    @property
    def classifier_dropout_prob(self) -> float:
        """Dropout of the task heads: `classifier_dropout`, or `hidden_dropout_prob` when unset (as BERT)."""
        return self.hidden_dropout_prob if self.classifier_dropout is None else self.classifier_dropout

    def validate_architecture(self):
        """Cross-field checks, run by `@strict` at construction and again by every model built from the config
        (assignments and `from_pretrained(..., key=value)` overrides are checked field by field only)."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim is not None and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"head_dim ({self.head_dim}) × num_attention_heads ({self.num_attention_heads}) must equal "
                f"hidden_size ({self.hidden_size})"
            )
        if self.head_dim is not None and self.head_dim % 2 != 0:
            raise ValueError(
                f"rotary embedding rotates pairs of dimensions: head_dim = hidden_size / num_attention_heads "
                f"= {self.head_dim} must be even"
            )
        self._validate_rope()
        for name in ("hidden_act", "pooler_activation"):
            value = getattr(self, name)
            if value not in ACT2FN and not (name == "pooler_activation" and value == "linear"):
                raise ValueError(f"{name} {value!r} is not an activation transformers knows (ACT2FN)")
        self._validate_attention_types()
        if getattr(self, "add_cross_attention", False):
            raise ValueError(
                "add_cross_attention=True: RoFormer has no cross-attention layers (use it as an encoder, or as a"
                " decoder-only causal LM)"
            )
        if self.unilm_mask and self.is_decoder:
            raise ValueError("unilm_mask and is_decoder are exclusive: choose the UniLM mask or the causal mask")
        if self.norm_type == "rms_norm" and self.embedding_size != self.hidden_size:
            raise ValueError(
                "norm_type='rms_norm' (RoFormerV2) has no embedding-to-hidden mapping: "
                f"embedding_size ({self.embedding_size}) must equal hidden_size ({self.hidden_size})"
            )
        if self.type_vocab_size < 1:
            raise ValueError(f"type_vocab_size must be >= 1, got {self.type_vocab_size}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")

    def _validate_rope(self) -> None:
        params = self.rope_parameters
        if not params:  # before `__post_init__` has filled it
            return
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters['rope_type'] (rope_scaling type in older configs) must be one of {ROPE_TYPES}, "
                f"got {kind!r}"
            )
        theta = params.get("rope_theta", 10000.0)
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(f"rope_theta (rope_parameters['rope_theta']) must be positive, got {theta!r}")
        if kind != "default":
            factor = params.get("factor")
            if not isinstance(factor, (int, float)) or factor < 1.0:
                raise ValueError(f"rope_parameters['factor']: the scaling factor must be a number >= 1, got {factor!r}")

    def _validate_attention_types(self) -> None:
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {unknown}")
            if "linear_attention" in self.layer_types and self.attention_type == "softmax":
                raise ValueError(
                    "layer_types has 'linear_attention' layers but attention_type='softmax': set attention_type to "
                    "'linear' or 'performer' to choose their kind"
                )
        if self.unilm_mask and any(self.attention_kind(i) != "softmax" for i in range(self.num_hidden_layers)):
            raise ValueError(
                "unilm_mask needs softmax attention: linear attention takes only key-padding masks "
                "(use attention_type='softmax' or layer_types with 'full_attention')"
            )
        if self.linear_feature_map not in FEATURE_MAPS:
            raise ValueError(f"linear_feature_map must be one of {FEATURE_MAPS}, got {self.linear_feature_map!r}")
        if self.linear_chunk_size < 1:
            raise ValueError(f"linear_chunk_size must be >= 1, got {self.linear_chunk_size}")
        if self.performer_nb_features < 2 or self.performer_nb_features % 2:
            raise ValueError(
                f"performer_nb_features must be an even number >= 2 (RoPE rotates pairs), got {self.performer_nb_features}"
            )
        if self.performer_rope_placement not in PERFORMER_ROPE_PLACEMENTS:
            raise ValueError(
                f"performer_rope_placement must be one of {PERFORMER_ROPE_PLACEMENTS}, got {self.performer_rope_placement!r}"
            )


__all__ = ["RoFormerRopeConfig"]
