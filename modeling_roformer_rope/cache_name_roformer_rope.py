"""The name under which the installed transformers passes the KV cache: `cache` (5.24+) or `past_key_values`.

transformers 5.24 renamed `past_key_values` to `cache` everywhere: `generate()` calls `forward(cache=...)`,
outputs have a `cache` field, and `create_causal_mask` takes `cache=`. Earlier 5.x releases use
`past_key_values` for all three. A model that reads only one name silently loses its cache on the other
releases: `generate()` then feeds one token per step to a model that starts each step from an empty cache
(wrong tokens, no error). So the models take `cache` and accept the old name from `kwargs`
(`take_cache`), and build outputs and masks with the name this transformers uses (`CACHE_NAME`).
"""

import inspect

from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

# Outputs and masks of this transformers take the cache under this name.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
_MASK_PARAMETERS = inspect.signature(create_causal_mask).parameters
_MASK_CACHE_NAME = "cache" if "cache" in _MASK_PARAMETERS else "past_key_values"


def take_cache(cache: Cache | None, kwargs: dict) -> Cache | None:
    """`cache`, or the cache passed under the old name `past_key_values` (removed from `kwargs`)."""
    old = kwargs.pop("past_key_values", None)
    if old is not None and cache is not None and old is not cache:
        raise ValueError("got both `cache` and `past_key_values`: pass the KV cache once, as `cache`")
    return cache if cache is not None else old


def cache_kwarg(cache: Cache | None) -> dict:
    """{name: cache} for an output class of this transformers."""
    return {CACHE_NAME: cache}


def output_cache(outputs) -> Cache | None:
    """The cache of a transformers output, whichever name it has."""
    return getattr(outputs, CACHE_NAME, None)


def causal_mask(layer_idx: int = 0, **kwargs):
    """`create_causal_mask` with the cache under `cache=` whatever this transformers calls the argument, sized
    against cache layer `layer_idx` (the first softmax layer).

    transformers finds "the first full-attention layer" itself only among its own layer classes, and drops the mask
    of a one-token step when the whole cache is compileable; a cache that mixes our linear-attention layers with
    fixed-size (static) key/value layers is neither, so both are decided here: the mask is always materialised
    against a fixed-size layer, whose unwritten slots must stay masked."""
    cache = kwargs[_MASK_CACHE_NAME] = kwargs.pop("cache")
    layers = getattr(cache, "layers", ())
    if "layer_idx" in _MASK_PARAMETERS:
        kwargs["layer_idx"] = layer_idx
    if layer_idx < len(layers) and getattr(layers[layer_idx], "is_compileable", False):
        if "allow_is_causal_skip" in _MASK_PARAMETERS:
            kwargs["allow_is_causal_skip"] = False
    return create_causal_mask(**kwargs)


__all__ = ["CACHE_NAME", "cache_kwarg", "causal_mask", "output_cache", "take_cache"]
