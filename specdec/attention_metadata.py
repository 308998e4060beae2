"""The description of one packed forward pass that every attention layer reads (DESIGN §4).

It sits below both attention modules (``attention.py``, the backends, and
``compiled_attention.py``, the custom op for compiled passes), which import it and not each
other's definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .cache import KVCache

METADATA_KWARG = "specdec_metadata"  # the keyword the runner passes the metadata under


@dataclass
class AttentionMetadata:
    cache: KVCache
    token_rows: torch.Tensor  # [N] cache row of each packed token
    token_positions: torch.Tensor  # [N] cache slot of each packed token (its position too, but in tree passes)
    token_group: torch.Tensor  # [N] group (contiguous run of one row) of each token
    token_slot: torch.Tensor  # [N] index of each token within its group
    group_rows: torch.Tensor  # [G] cache row of each group
    group_first_token: torch.Tensor  # [G] packed index of each group's first token
    group_counts: torch.Tensor  # [G] tokens per group
    group_query_positions: torch.Tensor  # [G, Q] cache slot of each query (0 in empty slots)
    max_group_tokens: int  # host: Q, the most tokens in one group
    max_kv_len: int  # host: 1 + the largest cache slot in the pass
    backend: Callable
    # tree passes (None in causal ones): a query sees its row's keys at slots below its group's
    # tree start causally, and a key at tree start + j only if bit j of its tree mask is set
    token_tree_mask: torch.Tensor | None = None  # [N] int64 bitmask over the 64 slots from the tree start
    group_tree_start: torch.Tensor | None = None  # [G] first tree slot of each group (cache max_len: no tree)
    tree_pass: bool = False  # host: an eager tree pass (a captured graph's masks may hold a tree or not)
    # static sparse passes (None in dense ones): a query also needs its key below its group's sink
    # end or at its window start or later (runner.SparseLayout; sink end = min(sink, window start))
    group_sink_end: torch.Tensor | None = None  # [G] keys below this slot are sinks
    group_window_start: torch.Tensor | None = None  # [G] first slot of the group's window (0: the whole row)
    kv_splits: int = 1  # host: programs per (row, KV head) in the fast kernel, each a share of the keys
    role: str = ""  # host: the role of the runner running the pass (runner_for), for hooks that act in some only

    def on(self, device: torch.device) -> "AttentionMetadata":
        """The same description with its tensors on ``device``, made once per device: a model
        whose layers sit on several devices (``device_map``) reads it in each layer's own."""
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            moved = {name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
                     for name, value in vars(self).items() if name != "_copies"}
            copies[device] = AttentionMetadata(**moved)
        return copies[device]
