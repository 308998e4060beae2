"""The fast attention as one opaque custom op, for passes compiled with ``torch.compile``.

Invariant: ``specdec::cached_packed_attention`` does exactly what ``attention.fast_attention``
does eagerly (write the pass's keys and values into the layer's cache at (row, position), then
run the Triton kernel of ``triton_attention.py``), so compiled and eager passes agree. The op
declares that it mutates the two cache tensors; the compiler neither traces into Triton's
launcher nor reorders the cache write after the read.
"""

from __future__ import annotations

import torch

from .attention_metadata import AttentionMetadata
from .cache import store


@torch.library.custom_op("specdec::cached_packed_attention", mutates_args=("key_cache", "value_cache"))
def _cached_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_rows: torch.Tensor,
    token_positions: torch.Tensor,
    group_rows: torch.Tensor,
    group_first_token: torch.Tensor,
    group_counts: torch.Tensor,
    max_group_tokens: int,
    scaling: float,
    sliding_window: int,
    tree_mask: torch.Tensor | None,
    group_tree_start: torch.Tensor | None,
    group_sink_end: torch.Tensor | None,
    group_window_start: torch.Tensor | None,
    kv_splits: int,
) -> torch.Tensor:
    """query: [N, H, D]; key, value: [Hkv, N, D]; caches [R, Hkv, L, D] -> output [N, H, D]."""
    from .triton_attention import packed_attention

    store(key_cache, value_cache, token_rows, token_positions, key, value)
    return packed_attention(query, key_cache, value_cache, token_positions, group_rows, group_first_token,
                            group_counts, max_group_tokens, scaling, sliding_window or None, tree_mask,
                            group_tree_start, group_sink_end, group_window_start, kv_splits)


@_cached_packed_attention.register_fake
def _(query, key, value, key_cache, value_cache, token_rows, token_positions, group_rows, group_first_token,
      group_counts, max_group_tokens, scaling, sliding_window, tree_mask, group_tree_start, group_sink_end,
      group_window_start, kv_splits):
    return query.new_empty(query.shape)


def cached_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                            layer_idx: int, scaling: float, sliding_window: int | None) -> torch.Tensor:
    """query: [1, H, N, D], key/value: [1, Hkv, N, D] -> output [1, N, H, D]."""
    if meta.cache.keys[layer_idx] is None:
        raise RuntimeError("the KV cache must be allocated (one eager pass) before compiling a pass over it")
    output = _cached_packed_attention(
        query[0].transpose(0, 1), key[0], value[0], meta.cache.keys[layer_idx], meta.cache.values[layer_idx],
        meta.token_rows, meta.token_positions, meta.group_rows, meta.group_first_token, meta.group_counts,
        meta.max_group_tokens, scaling, sliding_window or 0, meta.token_tree_mask, meta.group_tree_start,
        meta.group_sink_end, meta.group_window_start, meta.kv_splits,
    )
    return output[None]
