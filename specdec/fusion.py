"""Merged projections: a layer's q, k and v projections (and a gated MLP's gate and up) as one
matrix product each.

A decoding step at small batch reads every weight once, and its matrix products are
matrix-vector products whose time is the bytes they read plus a fixed cost per kernel: a Llama
layer runs seven, of which q/k/v and gate/up read the same input. Merged, a layer runs four, over
larger matrices that reach a larger share of the memory bandwidth (BENCHMARKS.md section 2).

Invariant: the model keeps its parameters' names, shapes and values. Merging lays the weights
(and biases) of each group out as consecutive rows of one tensor, and each projection's
parameter becomes a view of its rows: no extra memory, and writes into the parameters (a
``load_state_dict``, an optimiser step) reach the merged tensor. The model's modules are swapped
for ``Part`` modules only while a runner is attached (``installed()``), so outside specdec the
model computes as before; a part holds its projection's parameters under the same names, so the
model's ``parameters()`` and ``state_dict()`` are the same attached or not. No merge moves a
parameter's storage under another runner's captured graphs (runner.py). The group's first
projection (q, gate) computes the whole product, and the others called next on the same input
return their slices of it (the attention and MLP modules of transformers' decoder models call
them so); a projection called alone or on another input (a drafter reusing the target's k and v)
computes its own product, as unmerged.

Cost: one copy of the merged weights at the first runner build of a model (one group at a time:
the old storage is freed as each group is merged); none per pass.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # child names that read one input
# which runners merge: "fast" (those of the fast backend, on a GPU), True (every runner), False (none;
# a bench's baseline). Read when a runner is built: release the model's runners (runners_of) to
# change it for a model already run
MERGE: bool | str = "fast"


class _Group:
    """One merged product: weight [sum(out), in] (and bias [sum(out)]) over the group's linears."""

    def __init__(self, parent: torch.nn.Module, names: tuple[str, ...]):
        self.parent, self.names = parent, names
        self.linears = [getattr(parent, name) for name in names]
        self.sizes = [linear.out_features for linear in self.linears]
        self.weight = _merged(self.linears, "weight")
        self.bias = _merged(self.linears, "bias") if self.linears[0].bias is not None else None
        self.parts = [Part(self, index) for index in range(len(names))]
        self.reset()

    def reset(self) -> None:
        self.outputs, self.input = None, None


class Part(torch.nn.Module):
    """Stands in for one projection of a merged group while a runner is attached."""

    def __init__(self, group: _Group, index: int):
        super().__init__()
        self.group = group  # not a module: not registered, not in the model's state
        self.index = index
        # the projection's own parameters, registered under the same names: while installed, the
        # model's parameters(), state_dict() and weights_fingerprint() are those of the Linear
        linear = group.linears[index]
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out of this part]
        group = self.group
        if self.index == 0:  # the group's first projection: the whole product, which the others join
            group.outputs = F.linear(hidden, group.weight, group.bias).split(group.sizes, dim=-1)
            group.input = hidden
            return group.outputs[0]
        if hidden is group.input:
            output = group.outputs[self.index]
            if self.index == len(group.sizes) - 1:
                group.reset()  # the last one: nothing kept alive until the next pass
            return output
        linear = group.linears[self.index]  # called alone, or on another input: its own product
        return F.linear(hidden, linear.weight, linear.bias)


class MergedProjections:
    """The mergeable groups of a model, merged on construction, installed while a
    runner is attached."""

    def __init__(self, model: torch.nn.Module):
        """Merges every group of ``model`` (the parameters become views of merged tensors)."""
        self.groups = [_Group(module, names) for module, names, _ in _mergeable_groups(model)]

    def __len__(self) -> int:
        return len(self.groups)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Swap each group's projections for its parts for the duration (restored afterwards)."""
        for group in self.groups:
            group.reset()
            for name, part in zip(group.names, group.parts):
                setattr(group.parent, name, part)
        try:
            yield
        finally:
            for group in self.groups:
                group.reset()
                for name, linear in zip(group.names, group.linears):
                    setattr(group.parent, name, linear)


def _mergeable_groups(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, tuple[str, ...], list]]:
    """(parent module, child names, the linears) of every group of ``model`` that can merge."""
    uses = _uses(model)
    for module in model.modules():
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if _mergeable(linears, uses):
                yield module, names, linears


def _mergeable(linears: list, uses: dict[int, int]) -> bool:
    """Plain linear layers (no subclass, no hook, no sharded or quantised weight, no parameter
    tied to another place of the model) of one input size, dtype and device, all with a bias or
    none."""
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return False
    if any(uses.get(id(p), 1) > 1 for linear in linears for p in linear.parameters()):
        return False  # merged, a tied parameter would leave its other holder's product stale
    if any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears):
        return False
    tensors = [linear.weight for linear in linears] + [linear.bias for linear in linears if linear.bias is not None]
    if not all(type(t.data) is torch.Tensor and t.device.type != "meta" for t in tensors):
        return False
    first = linears[0]
    return all(linear.in_features == first.in_features and linear.weight.dtype == first.weight.dtype
               and linear.weight.device == first.weight.device and (linear.bias is None) == (first.bias is None)
               for linear in linears)


def _merged(linears: list, attribute: str) -> torch.Tensor:
    """One tensor whose consecutive rows are the linears' ``attribute`` parameters, each of which
    becomes a view of its rows; reused when they already are (a later runner of the model)."""
    params = [getattr(linear, attribute) for linear in linears]
    rows = sum(p.shape[0] for p in params)
    shape, strides = (rows, *params[0].shape[1:]), params[0].data.stride()
    if _consecutive(params):
        return params[0].data.as_strided(shape, strides)
    merged = torch.cat([p.data for p in params])  # [rows, ...]
    offset = 0
    for p in params:
        p.data = merged[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return merged


def moves_storage(model: torch.nn.Module) -> bool:
    """Whether merging ``model`` now would give some parameters new storage (a group not yet laid
    out as one tensor)."""
    for _, _, linears in _mergeable_groups(model):
        attributes = ("weight", "bias") if linears[0].bias is not None else ("weight",)
        if not all(_consecutive([getattr(linear, a) for linear in linears]) for a in attributes):
            return True
    return False


def _uses(model: torch.nn.Module) -> dict[int, int]:
    """id(parameter) -> how many places of the model hold it (more than one: tied weights)."""
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    return uses


def _consecutive(params: list) -> bool:
    """Whether the parameters are contiguous slices, in order, of one storage."""
    first = params[0].data
    if not all(p.data.is_contiguous() for p in params):
        return False
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in params:
        if p.data.untyped_storage().data_ptr() != storage or p.data.storage_offset() != offset:
            return False
        offset += p.numel()
    return True
