"""Pins the private transformers methods `RoFormerRopeTokenizer` overrides or calls to the installed transformers.

`_encode_plus` (21 parameters), `_encode_without_added_tokens`, `_decode`, `_save_pretrained` and `_add_tokens`
are private: transformers may rename them or change their parameters in any release. Our overrides take
`**kwargs`, so a new parameter would be swallowed silently and a renamed method would simply never be
called (the backend would then tokenize without jieba). These tests fail loudly on such an upgrade:
re-read the new base method, adapt ours, then update the pins.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("modeling_roformer_rope") is None:
    sys.path.insert(0, str(REPO))

from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: E402

from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer  # noqa: E402

# Every base-class method we override (besides __init__). Private ones are the reason for this file;
# the public ones are pinned too since the private ones call them with their base signature.
OVERRIDDEN = (
    "_encode_plus",
    "_encode_without_added_tokens",
    "_decode",
    "_save_pretrained",
    "save_vocabulary",
    "convert_tokens_to_string",
    "get_special_tokens_mask",
    "_add_tokens",  # refuses a new token's id already in use (a repeated vocab.txt line)
)
# Private base methods our `_encode_plus` calls, with the parameters it passes (by name).
CALLED = {
    "set_truncation_and_padding": (
        "self",
        "padding_strategy",
        "truncation_strategy",
        "max_length",
        "stride",
        "pad_to_multiple_of",
        "padding_side",
    ),
    "_eventual_warn_about_too_long_sequence": ("self", "ids", "max_length", "verbose"),
}


def _shape(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) of every parameter; annotations are ignored (ours are strings)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _base_definition(name: str):
    """The method our class would inherit without its override (the next class in the MRO)."""
    for klass in RoFormerRopeTokenizer.__mro__[1:]:
        if name in vars(klass):
            return vars(klass)[name]
    return None


@pytest.mark.parametrize("name", OVERRIDDEN)
def test_override_matches_base_signature(name):
    ours = vars(RoFormerRopeTokenizer)[name]
    base = _base_definition(name)
    assert base is not None, f"transformers no longer defines {name}: our override is never called"
    assert _shape(ours) == _shape(base), (
        f"{name}: base signature changed, adapt ours\n ours {_shape(ours)}\n base {_shape(base)}"
    )


def test_every_override_is_pinned():
    """A new override of a transformers method must be added to OVERRIDDEN (and so pinned)."""
    ours = {
        name
        for name, value in vars(RoFormerRopeTokenizer).items()
        if callable(value) and not name.startswith("__") and _base_definition(name) is not None
    }
    assert ours == set(OVERRIDDEN)


@pytest.mark.parametrize("name", sorted(CALLED))
def test_called_private_methods_keep_their_parameters(name):
    method = getattr(TokenizersBackend, name, None)
    assert method is not None, f"transformers no longer defines {name}, which our _encode_plus calls"
    assert tuple(p.name for p in inspect.signature(method).parameters.values()) == CALLED[name]


def test_public_entry_points_reach_our_overrides(monkeypatch):
    """The base class still routes __call__, encode, tokenize and decode through the overridden methods."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "今", "天", "今天"])}
    tok = RoFormerRopeTokenizer(vocab=vocab)
    calls: list[str] = []
    for name in ("_encode_plus", "_decode"):
        original = getattr(RoFormerRopeTokenizer, name)
        monkeypatch.setattr(
            RoFormerRopeTokenizer,
            name,
            lambda self, *a, _name=name, _original=original, **k: calls.append(_name) or _original(self, *a, **k),
        )
    tok("今天")
    tok(["今天", "天"], ["今", "天今"])
    tok.encode("今天")
    assert tok.tokenize("今天") == ["今天"] and tok._encode_without_added_tokens("今天") == [7]
    assert tok.decode([2, 7, 3], skip_special_tokens=True) == "今天"
    assert calls == ["_encode_plus"] * 5 + ["_decode"]
