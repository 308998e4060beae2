"""Host-to-device transfers that do not synchronise.

Invariant: control data the host decides (row indices, counts, proposals) reach the GPU through
pinned memory from PyTorch's caching host allocator, copied with ``non_blocking=True``: the
host never waits for the device, and the allocator keeps a pinned block alive until its copy
has completed, so it is safe to reuse. On CPU the array is simply wrapped.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int64 arrays in one transfer (one pinned buffer, one copy) -> views, one per array."""
    sizes = [int(np.size(a)) for a in arrays]
    packed = to_device(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]), device)
    return [view.view(np.shape(a)) for view, a in zip(torch.split(packed, sizes), arrays)]
