"""Targets sharded over several processes: tensor-parallel ``transformers`` models (loaded with
``tp_plan="auto"`` in a ``torchrun`` job), issue 6.

Invariant: every rank runs the same ``generate()`` loop in lockstep over the same prompts, and
every rank commits the same tokens. Each rank's runner caches its own shard of the KV heads (the
attention layers hand the runner the rank's local heads; the cache takes its shape from them),
drafters are replicated (the same weights and inputs on every rank), and rank 0 of the target's
tensor-parallel group decides: its verdict is broadcast to the others each step, inside the
step's one device-to-host copy, so floating-point differences between ranks can never make
them commit different tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_group(model: torch.nn.Module):
    """The process group ``model``'s parameters are sharded over, or None when it is not sharded."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(mesh.ndim - 1)
    return None


def broadcast_from_first_rank(packed: torch.Tensor, group) -> torch.Tensor:
    """``packed`` as rank 0 of ``group`` has it, on every rank of the group (in place)."""
    dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    return packed
