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
    token_positions: torch.Tensor  # [N] position of each packed token in its row
    token_group: torch.Tensor  # [N] group (contiguous run of one row) of each token
    token_slot: torch.Tensor  # [N] index of each token within its group
    group_rows: torch.Tensor  # [G] cache row of each group
    group_first_token: torch.Tensor  # [G] packed index of each group's first token
    group_counts: torch.Tensor  # [G] tokens per group
    group_query_positions: torch.Tensor  # [G, Q] position of each query slot (0 in empty slots)
    max_group_tokens: int  # host: Q, the most tokens in one group
    max_kv_len: int  # host: 1 + the largest position in the pass
    backend: Callable

    def on(self, device: torch.device) -> "AttentionMetadata":
        """The same description with its tensors on ``device``, made once per device: a model
        whose layers sit on several devices (``device_map``) reads it in each layer's own."""
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            moved = {name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
                     for name, value in vars(self).items() if name != "_copies"}
            copies[device] = AttentionMetadata(**moved)
        return copies[device]
