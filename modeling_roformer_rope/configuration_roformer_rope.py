"""RoFormerRope configuration: the built-in RoFormer's fields plus rotary, V2 and Sim switches.

Shipped next to every checkpoint (the `trust_remote_code` payload), so it only imports from
`transformers`, `torch` and the standard library.
"""

from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

_ROPE_SCALING_TYPES = ("linear", "dynamic")
_ATTENTION_TYPES = ("softmax",)


@strict
class RoFormerRopeConfig(PreTrainedConfig):
    r"""Configuration of a RoFormer (Su et al., 2021) with rotary position embedding.

    Fields shared with the built-in `RoFormerConfig` keep their names and meaning. The extra fields:

    - `rope_theta`: base of the sinusoid frequencies, θ_i = rope_theta^(-2i/d) (paper eq. 15).
    - `rope_scaling`: `None`, `{"type": "linear", "factor": f}` (positions divided by f) or
      `{"type": "dynamic", "factor": f}` (NTK-aware base growth once the input is longer than
      `max_position_embeddings`), to run past the trained length.
    - `norm_type`: `"layer_norm"` (RoFormer v1) or `"rms_norm"` (RoFormerV2: parameter-free RMS norm,
      whose MLM head is the tied embedding only).
    - `use_bias`: biases in every linear layer (`False` for RoFormerV2).
    - `add_pooler` / `pooler_activation`: a pooler on `[CLS]` (RoFormer-Sim uses `"linear"`).
    - `unilm_mask`: RoFormer-Sim's UniLM mask: query i sees key j iff
      cumsum(token_type_ids)[j] <= cumsum(token_type_ids)[i].
    - `summary_type`: which token `...ForMultipleChoice` scores (`"first"` = [CLS]; `"last"` is what the
      built-in model does, kept for checkpoints converted from it).
    - `attention_type`: `"softmax"` (full attention through the transformers attention interface).
    - `sparse_prediction`: when `...ForMaskedLM` gets `labels`, compute logits only for labelled tokens
      (returned as (N_labelled, vocab_size)); speeds up MLM training. Off by default.

    `max_position_embeddings` is informational only: rotary sinusoids are computed for the actual
    positions, so any length runs.
    """

    model_type = "roformer_rope"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 50000
    embedding_size: int | None = None
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
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
    rope_theta: float | int = 10000.0
    rope_scaling: dict | None = None
    norm_type: Literal["layer_norm", "rms_norm"] = "layer_norm"
    use_bias: bool = True
    add_pooler: bool = False
    pooler_activation: str = "tanh"
    unilm_mask: bool = False
    summary_type: Literal["first", "last"] = "first"
    attention_type: str = "softmax"
    sparse_prediction: bool = False
    is_decoder: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.layer_norm_eps is None:
            # bert4keras: LayerNormalization epsilon 1e-12 (v1); RoFormerV2's RMS norm uses 1e-7 here.
            self.layer_norm_eps = 1e-7 if self.norm_type == "rms_norm" else 1e-12
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_mlm_transform(self) -> bool:
        """RoFormer v1 has a dense + LayerNorm transform before the tied decoder; V2 has none."""
        return self.norm_type == "layer_norm"

    def validate_architecture(self):
        """Cross-field checks, run by `@strict` at construction (and on every assignment)."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"rotary embedding rotates pairs of dimensions: head_dim = hidden_size / num_attention_heads "
                f"= {self.head_dim} must be even"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.attention_type not in _ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {_ATTENTION_TYPES}, got {self.attention_type!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            factor = self.rope_scaling.get("factor")
            if kind not in _ROPE_SCALING_TYPES:
                raise ValueError(f"rope_scaling type must be one of {_ROPE_SCALING_TYPES}, got {kind!r}")
            if not isinstance(factor, (int, float)) or factor < 1.0:
                raise ValueError(f"rope_scaling factor must be a number >= 1, got {factor!r}")
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


__all__ = ["RoFormerRopeConfig"]
