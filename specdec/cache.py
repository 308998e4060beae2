"""Our own KV cache: preallocated per layer, one valid length per row, rollback by length.

Invariant: for row r, positions [0, lengths[r]) of every layer hold the keys and values of
the tokens the owner has committed to; anything at or beyond lengths[r] is stale and is simply
overwritten by the next write at that position. Rolling back rejected draft tokens therefore
costs nothing but lowering a length. A token tree's accepted path is moved into place by
``compact`` (its nodes were written at slot length + node index, and belong at length + depth).

Layout per layer: keys and values [max_rows, num_kv_heads, max_len, head_dim], allocated on
the first write (when the model's head count, head size, dtype and device are known).
"""

from __future__ import annotations

import numpy as np
import torch

from .inference import inference


FUSED_STORE = True  # caches on a GPU: one Triton kernel writes keys and values (triton_cache); False: two index_put


def store(key_cache: torch.Tensor, value_cache: torch.Tensor, token_rows: torch.Tensor, token_positions: torch.Tensor,
          keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys and values [kv_heads, N, head_dim] into one layer's caches [rows, kv_heads,
    max_len, head_dim] at (token_rows[n], token_positions[n]). On a GPU one Triton kernel writes
    both (``FUSED_STORE``); on the CPU, and while torch.compile traces (it fuses the writes
    itself), two index_put writes. Both write the same values; Triton is imported only for the GPU."""
    if FUSED_STORE and key_cache.is_cuda and not torch.compiler.is_compiling():
        from .triton_cache import fits, store_kv

        if fits(key_cache, value_cache, token_rows, token_positions, keys, values):
            store_kv(key_cache, value_cache, token_rows, token_positions, keys, values)
            return
    key_cache[token_rows, :, token_positions] = keys.transpose(0, 1)  # [N, kv_heads, head_dim]
    value_cache[token_rows, :, token_positions] = values.transpose(0, 1)


class KVCache:
    def __init__(self, num_layers: int, max_rows: int, max_len: int):
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [rows, kv_heads, max_len, head_dim]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # valid positions per row (host)
        self.smallest_window: int | None = None  # the narrowest sliding window a layer attended with

    def write(
        self,
        layer_idx: int,
        token_rows: torch.Tensor,
        token_positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store new keys and values at (row, position).

        token_rows, token_positions: [N]; keys, values: [kv_heads, N, head_dim].
        """
        if self.keys[layer_idx] is None:
            num_kv_heads, _, head_dim = keys.shape
            shape = (self.max_rows, num_kv_heads, self.max_len, head_dim)
            self.keys[layer_idx] = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=values.dtype, device=values.device)
        store(self.keys[layer_idx], self.values[layer_idx], token_rows, token_positions, keys, values)

    def layers_written(self) -> int:
        return sum(k is not None for k in self.keys)

    def rollback(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Declare rows' valid lengths; entries beyond them become stale."""
        if np.any(lengths > self.lengths[rows]):
            raise ValueError("rollback can only shorten rows; use the runner to write new tokens")
        self.lengths[rows] = lengths

    @inference
    def compact(self, rows: torch.Tensor, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copy every layer's key and value at (rows[m], source_slots[m]) to (rows[m], target_slots[m])
        ([M] device tensors each; all sources are read before any target is written). After a tree
        step the accepted path's nodes move to consecutive slots; as a node's position is length +
        depth, its rotated key is already right there. Cost: one gather and one scatter per layer."""
        for layer in range(self.num_layers):
            if self.keys[layer] is None:
                continue
            for cache in (self.keys[layer], self.values[layer]):
                moved = cache[rows, :, source_slots]  # [M, Hkv, D], a copy
                cache[rows, :, target_slots] = moved
