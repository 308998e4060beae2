"""Attention over packed ragged rows, reading keys and values from our KV cache (DESIGN §4).

The runner registers ``specdec_attention`` with transformers' ``AttentionInterface``; every
attention layer of the model then calls it with the query, key and value of the packed new
tokens (after the rotary embedding) and our ``AttentionMetadata``. The function writes the new
keys and values into the cache at (row, position) and lets each query attend to its own row's
cached keys up to its own position (causal), optionally within a sliding window, and in a static sparse
pass (runner.SparseLayout) only to its row's sink keys and the keys of its group's window.

Backends share one contract; ``reference_attention`` (plain torch) is the oracle: it gathers
each row's keys up to the longest position in the pass and masks per query. It is exact in
float64 and used on CPU; faster backends must equal it.

Packed queries are laid out as ``[groups, max_queries]``: one group per contiguous run of
tokens of one row. Linear layers and MLPs outside attention see only real tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import AttentionInterface

from .attention_metadata import METADATA_KWARG, AttentionMetadata
from .compiled_attention import cached_packed_attention

ATTENTION_NAME = "specdec"
__all__ = ["ATTENTION_NAME", "BACKENDS", "METADATA_KWARG", "AttentionMetadata", "specdec_attention"]


def reference_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [1, H, N, D], key/value: [1, Hkv, N, D] -> output [1, N, H, D].

    softcap (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask. sinks
    (GPT-OSS): one logit per query head [H] that joins each row's softmax and is then dropped,
    so a head may attend to nothing."""
    layer_idx = module.layer_idx
    meta.cache.write(layer_idx, meta.token_rows, meta.token_positions, key[0], value[0])

    num_heads, head_dim = query.shape[1], query.shape[3]
    num_groups, max_queries = meta.group_query_positions.shape
    num_kv_heads = key.shape[1]
    heads_per_kv = num_heads // num_kv_heads

    grouped_query = query.new_zeros(num_groups, max_queries, num_heads, head_dim)  # [G, Q, H, D]
    grouped_query[meta.token_group, meta.token_slot] = query[0].transpose(0, 1)
    grouped_query = grouped_query.view(num_groups, max_queries, num_kv_heads, heads_per_kv, head_dim)

    kv_len = meta.max_kv_len
    keys = meta.cache.keys[layer_idx][meta.group_rows, :, :kv_len]  # [G, Hkv, L, D]
    values = meta.cache.values[layer_idx][meta.group_rows, :, :kv_len]  # [G, Hkv, L, D]

    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.einsum("gqhrd,ghld->ghrql", grouped_query.to(compute_dtype), keys.to(compute_dtype))
    scores = scores * scaling  # [G, Hkv, R, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap

    key_positions = torch.arange(kv_len, device=query.device)  # [L]
    query_positions = meta.group_query_positions[:, :, None]  # [G, Q, 1]
    visible = key_positions <= query_positions  # [G, Q, L]
    if meta.token_tree_mask is not None:
        visible &= tree_visible(meta, key_positions, max_queries)
    if meta.group_window_start is not None:  # static sparse: sinks and the window
        visible &= ((key_positions < meta.group_sink_end[:, None])
                    | (key_positions >= meta.group_window_start[:, None]))[:, None, :]
    if sliding_window is not None:
        check_window_covers_tree(meta, sliding_window)
        visible &= key_positions > query_positions - sliding_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is None:
        weights = scores.softmax(dim=-1)
    else:
        sink_logits = sinks.to(compute_dtype).view(1, num_kv_heads, heads_per_kv, 1, 1)
        sink_logits = sink_logits.expand(num_groups, -1, -1, max_queries, 1)  # [G, Hkv, R, Q, 1]
        weights = torch.cat([scores, sink_logits], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped
    grouped_out = torch.einsum("ghrql,ghld->gqhrd", weights, values.to(compute_dtype))  # [G, Q, Hkv, R, D]
    grouped_out = grouped_out.reshape(num_groups, max_queries, num_heads, head_dim).to(query.dtype)
    return grouped_out[meta.token_group, meta.token_slot][None]  # [1, N, H, D]


def tree_visible(meta: AttentionMetadata, key_slots: torch.Tensor, max_queries: int) -> torch.Tensor:
    """[G, Q, L] which keys each query of a tree pass may see beside causality: the keys below its
    group's tree start, and the tree slots whose bit its mask sets (bit j: tree start + j)."""
    num_groups = meta.group_rows.shape[0]
    masks = torch.zeros(num_groups, max_queries, dtype=torch.int64, device=key_slots.device)
    masks[meta.token_group, meta.token_slot] = meta.token_tree_mask  # [G, Q]
    offset = key_slots[None, :] - meta.group_tree_start[:, None]  # [G, L]
    in_tree = (offset >= 0) & (offset < 64)
    bit = (masks[:, :, None] >> offset.clamp(0, 63)[:, None, :]) & 1  # [G, Q, L]
    return (offset < 0)[:, None, :] | (in_tree[:, None, :] & (bit == 1))


def check_window_covers_tree(meta: AttentionMetadata, sliding_window: int) -> None:
    """A sliding window counts positions, which differ from cache slots in a tree pass; tree
    passes are exact while the window reaches back past every key (positions <= slots there).
    Records the window on the cache, for the runner to check tree passes replayed from graphs."""
    cache = meta.cache
    cache.smallest_window = sliding_window if cache.smallest_window is None else min(cache.smallest_window,
                                                                                      sliding_window)
    if meta.tree_pass:
        window_covers_tree(meta.max_kv_len, sliding_window)


def window_covers_tree(kv_len: int, sliding_window: int | None) -> None:
    if sliding_window is not None and kv_len > sliding_window:
        raise ValueError(f"a token tree over {kv_len} cached positions reaches past this model's sliding "
                         f"window of {sliding_window}: tree attention with a sliding window is implemented only "
                         "while the window covers the whole row; draft chains (no parents) for longer rows")


def fast_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel of ``triton_attention.py``: reads each row's keys up to its real length.

    query: [1, H, N, D], key/value: [1, Hkv, N, D] -> output [1, N, H, D]. CUDA only. No logit
    soft-capping or sinks: the runner refuses such models for this backend before any pass.
    """
    if softcap is not None or sinks is not None:
        raise ValueError("the fast attention backend implements neither logit soft-capping nor attention sinks; "
                         "use attention='reference' (attention='auto' does)")
    from .triton_attention import packed_attention

    layer_idx = module.layer_idx
    if sliding_window is not None:
        check_window_covers_tree(meta, sliding_window)
    if torch.compiler.is_compiling():  # torch.compile sees one opaque op (compiled_attention.py)
        return cached_packed_attention(query, key, value, meta, layer_idx, scaling, sliding_window)
    meta.cache.write(layer_idx, meta.token_rows, meta.token_positions, key[0], value[0])
    output = packed_attention(
        query[0].transpose(0, 1),  # [N, H, D]
        meta.cache.keys[layer_idx],
        meta.cache.values[layer_idx],
        meta.token_positions,
        meta.group_rows,
        meta.group_first_token,
        meta.group_counts,
        meta.max_group_tokens,
        scaling,
        sliding_window,
        meta.token_tree_mask,
        meta.group_tree_start,
        meta.group_sink_end,
        meta.group_window_start,
        meta.kv_splits,
    )
    return output[None]


BACKENDS: dict[str, Callable] = {"reference": reference_attention, "fast": fast_attention}

def specdec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer while a runner drives the model."""
    meta = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"{type(module).__name__} is set to specdec's attention but was called outside a "
            "specdec runner; restore the model's attention with model.set_attn_implementation('sdpa')"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if meta.token_rows.device != query.device:  # a layer on another device than the embeddings
        meta = meta.on(query.device)
    output = meta.backend(module, query, key, value, meta, scaling, sliding_window,
                          softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return output, None


AttentionInterface.register(ATTENTION_NAME, specdec_attention)
