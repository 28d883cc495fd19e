"""The declarative part every converter shares: regex rules → our state-dict keys, and q/k/v fusion.

A converter states its rules as a list of `(pattern, replacement)` pairs, first match wins, replacement
`None` drops the tensor on purpose; `map_keys` applies them to a whole checkpoint and fails listing
every name no rule knows (nothing is skipped silently). Our attention layers hold one fused `qkv`
projection, so `fuse_qkv` concatenates the separate query/key/value rows that every RoFormer checkpoint
stores, in that order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch

Rule = tuple[str, str | None]
Array = torch.Tensor | np.ndarray

# Our per-layer query/key/value keys after renaming, before fusion.
QKV = re.compile(r"^(roformer\.layers\.\d+\.attention)\.(query|key|value)\.(weight|bias)$")
_QKV_WORD = re.compile(r"(?<![A-Za-z_])(query|key|value)(?![A-Za-z_])")
_PARTS = ("query", "key", "value")


class ConversionError(ValueError):
    """The input cannot be converted; the message names the variables, file or fields at fault."""


def _equal(a: Array, b: Array) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return np.array_equal(a, b)


def map_key(name: str, rules: list[Rule]) -> str | None:
    """Our key for `name` under the first matching rule (None = dropped on purpose); KeyError if none."""
    for pattern, replacement in rules:
        if re.search(pattern, name):
            return None if replacement is None else re.sub(pattern, replacement, name)
    raise KeyError(name)


def map_keys(
    tensors: Mapping[str, Array], rules: list[Rule], noun: str = "weight"
) -> tuple[dict[str, Array], dict[str, str]]:
    """Rename every tensor (torch or numpy); returns (our key → tensor, our key → source name).

    Two sources mapping to one key (tied aliases) must hold equal values. Names no rule matches are
    all listed in one ConversionError (`noun` says what they are: "variable", "built-in weight", ...).
    """
    renamed: dict[str, Array] = {}
    sources: dict[str, str] = {}
    unknown = []
    for name, tensor in tensors.items():
        try:
            key = map_key(name, rules)
        except KeyError:
            unknown.append(name)
            continue
        if key is None:
            continue
        if key in renamed:
            if not _equal(renamed[key], tensor):
                raise ConversionError(f"{sources[key]!r} and {name!r} both map to {key!r} with different values")
            continue
        renamed[key], sources[key] = tensor, name
    if len(unknown) == 1:
        raise ConversionError(f"unknown {noun} {unknown[0]!r}: no rule in KEY_MAP")
    if unknown:
        raise ConversionError(f"{len(unknown)} unknown {noun}s, no rule in KEY_MAP: {sorted(unknown)}")
    return renamed, sources


def fuse_qkv(
    state_dict: Mapping[str, torch.Tensor], sources: Mapping[str, str], noun: str = "weight"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Concatenate each layer's query/key/value rows (in that order) into our fused `qkv` projection.

    Returns the new (state dict, sources); a missing or differently shaped part is an error naming the
    source tensors (`noun` as in `map_keys`).
    """
    parts: dict[tuple[str, str], dict[str, str]] = {}
    fused: dict[str, torch.Tensor] = {}
    fused_sources: dict[str, str] = {}
    for key, tensor in state_dict.items():
        match = QKV.match(key)
        if match:
            prefix, which, leaf = match.groups()
            parts.setdefault((prefix, leaf), {})[which] = key
        else:
            fused[key], fused_sources[key] = tensor, sources[key]
    missing: list[str] = []
    n_missing = 0
    for (prefix, leaf), keys in sorted(parts.items()):
        absent = [w for w in _PARTS if w not in keys]
        if absent:
            sibling = sources[next(iter(keys.values()))]
            names = [_QKV_WORD.sub(w, sibling) for w in absent]
            missing.append(f"{prefix}: missing {absent} {leaf} ({', '.join(names)})")
            n_missing += len(absent)
            continue
        shapes = {w: tuple(state_dict[keys[w]].shape) for w in _PARTS}
        if len(set(shapes.values())) != 1:
            raise ConversionError(f"{prefix}: query/key/value {leaf} shapes differ: {shapes}")
        key = f"{prefix}.qkv.{leaf}"
        fused[key] = torch.cat([state_dict[keys[w]] for w in _PARTS], dim=0)
        fused_sources[key] = _QKV_WORD.sub("{query,key,value}", sources[keys["query"]])
    if missing:
        raise ConversionError(f"missing {n_missing} {noun}(s) for the fused qkv projection: {'; '.join(missing)}")
    return fused, fused_sources
