"""Input checks of the base model: every malformed input gets one clear error instead of a silent broadcast.

Masks mean one thing on every backend:
- 2-D `attention_mask` (B, S), S = past + T: 1/True keeps a key, 0/False drops it (any integer, bool or float
  dtype).
- 4-D `attention_mask` (B or 1, 1 or H, T or 1, S), already in attention form (T = 1 broadcasts over the
  queries, as BERT's "extended" (B, 1, 1, S) mask): bool keeps True positions, a float
  mask is added to the scores (0 keeps, a large negative value or -inf drops). Integer 4-D masks are refused:
  "1 = keep" and "add 1 to the score" would both be plausible readings. Only the `eager` and `sdpa` backends
  take 4-D masks (flash and flex attention build their own).
Only shapes and dtypes are read here (no data-dependent check), so this costs nothing and traces cleanly.
"""

import torch


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int,
    num_heads: int,
    attn_implementation: str | None,
) -> tuple[int, int]:
    """Validate the base model's inputs; returns (B, T)."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None and input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq_len), got {_shape(input_ids)}")
    if inputs_embeds is not None and inputs_embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must have shape (batch, seq_len, embedding_size), got {_shape(inputs_embeds)}")
    shape = _shape(input_ids) if input_ids is not None else _shape(inputs_embeds)[:-1]
    batch, length = shape
    if batch == 0 or length == 0:
        raise ValueError(f"empty input: batch size and sequence length must both be >= 1, got shape {shape}")
    if input_ids is not None and (input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool):
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if token_type_ids is not None and _shape(token_type_ids) != shape:
        raise ValueError(f"token_type_ids shape {_shape(token_type_ids)} does not match input shape {shape}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch)
                                     or position_ids.shape[1] != length):
        raise ValueError(f"position_ids shape {_shape(position_ids)} must be (batch or 1, seq_len) = ({batch}, {length})")
    if attention_mask is not None:
        _check_mask(attention_mask, batch, length, past_length + length, num_heads, attn_implementation)
    return batch, length


def _check_mask(mask: torch.Tensor, batch: int, length: int, keys: int, num_heads: int, impl: str | None) -> None:
    if mask.dim() == 2:
        if _shape(mask) != (batch, keys):
            raise ValueError(
                f"attention_mask shape {_shape(mask)} must be (batch, past + seq_len) = ({batch}, {keys})"
            )
        return
    if mask.dim() != 4:
        raise ValueError(
            f"attention_mask must be 2-D (batch, keys) or 4-D (batch, heads, queries, keys), got shape {_shape(mask)}"
        )
    b, h, t, s = mask.shape
    if b not in (1, batch) or h not in (1, num_heads) or t not in (1, length) or s != keys:
        raise ValueError(
            f"4-D attention_mask shape {_shape(mask)} must be (batch or 1, heads or 1, seq_len or 1, past + seq_len) = "
            f"({batch}, {num_heads}, {length}, {keys})"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(
            f"a 4-D attention_mask must be bool (True = attend) or floating point (added to the scores), got {mask.dtype}"
        )
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"a 4-D attention_mask needs attn_implementation 'eager' or 'sdpa', not {impl!r}")


__all__ = ["check_inputs"]
