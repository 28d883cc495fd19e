"""RoFormerRope: RoFormer with rotary position embedding for transformers v5.

This folder is the `trust_remote_code` payload copied next to every checkpoint. Importing the package
(installed with pip) also registers the classes with the transformers Auto classes, so
`AutoModel.from_pretrained(folder)` works in-process without `trust_remote_code`.
"""

from .configuration_roformer_rope import RoFormerRopeConfig
from .modeling_roformer_rope import (
    AUTO_CLASSES,
    RoFormerRopeForCausalLM,
    RoFormerRopeForMaskedLM,
    RoFormerRopeForMultipleChoice,
    RoFormerRopeForQuestionAnswering,
    RoFormerRopeForSequenceClassification,
    RoFormerRopeForTokenClassification,
    RoFormerRopeModel,
    RoFormerRopePreTrainedModel,
)


def register_auto_classes() -> None:
    """Register config and models with transformers' Auto classes (idempotent)."""
    import transformers

    try:
        transformers.AutoConfig.register(RoFormerRopeConfig.model_type, RoFormerRopeConfig)
    except ValueError:  # already registered
        return
    for auto_name, model_class in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(RoFormerRopeConfig, model_class)
    from .tokenization_roformer_rope import RoFormerRopeTokenizer

    transformers.AutoTokenizer.register(RoFormerRopeConfig, tokenizer_class=RoFormerRopeTokenizer, exist_ok=True)


register_auto_classes()

from .tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402

__all__ = [
    "RoFormerRopeConfig",
    "RoFormerRopeTokenizer",
    "RoFormerRopeForCausalLM",
    "RoFormerRopeForMaskedLM",
    "RoFormerRopeForMultipleChoice",
    "RoFormerRopeForQuestionAnswering",
    "RoFormerRopeForSequenceClassification",
    "RoFormerRopeForTokenClassification",
    "RoFormerRopeModel",
    "RoFormerRopePreTrainedModel",
    "register_auto_classes",
]
