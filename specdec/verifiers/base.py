"""The Verifier protocol: score every active row's last committed token plus its draft in one
target forward pass, then apply the acceptance rule (sampling.py): the chain rule for chains,
the tree rule for token trees, whose accepted path's cache entries then move into place.

Invariant: how rows are laid out for the forward pass (padded, packed, ...) is the verifier's
whole business; the verdict is the same whatever the layout. The target's cache holds each
row's committed tokens but the last (``batch.lengths - 1`` positions); the pass writes the last
token and the drafts after it, and whatever lies beyond the next committed length is stale and
overwritten by the next step, so the target needs no explicit rollback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from ..transfer import to_device_many

from ..batch import BatchState
from ..runner import ModelRunner, PackedLayout
from ..sampling import chain_verdict, tree_masks, tree_problems, tree_reach, tree_verdict
from ..token_rules import apply_token_rules, apply_tree_token_rules, rules_active
from ..types import PAD_ID, Draft, RowSampling, SamplingParams, Verdict, VerifyCost


class Verifier(ABC):
    #: whether this layout verifies token trees (drafts with parents); TreeVerifier's does
    verifies_trees: bool = False
    #: whether a pass may hold several groups of one row (DecomposedVerifier's pieces): CUDA
    #: graphs are then captured for as many groups as tokens
    cuts_rows: bool = False

    def verify(
        self, runner: ModelRunner, batch: BatchState, draft: Draft, sampling: SamplingParams | RowSampling,
        logprobs: bool = False, last_tokens: torch.Tensor | None = None,
    ) -> tuple[Verdict, VerifyCost]:
        """One target pass over every active row's draft -> (verdict, cost); with ``logprobs`` the
        verdict carries each emitted token's log-probability (sampling.emitted_logprobs).
        sampling: one SamplingParams for every row, or a RowSampling over the active rows
        (``batch.sampling_of(batch.active_rows(), device)``), each row's own. last_tokens: [A] on
        the device, the active rows' last tokens when the host does not hold them yet (a step
        launched before its predecessor's commit: engine.py's run-ahead); ``batch.lengths``
        then counts them already."""
        rows = batch.active_rows()  # [A]
        device = runner.device
        num_draft = draft.num_tokens[rows]  # [A]
        last = batch.last_token_ids(rows) if last_tokens is None else np.zeros(0, dtype=np.int64)
        rows_t, last_t, num_draft_t, seeds_t, lengths_t = to_device_many(
            [rows, last, num_draft, batch.seeds[rows], batch.lengths[rows]], device)
        last_t = last_t if last_tokens is None else last_tokens
        every_row = len(rows) == batch.num_rows  # the common case: no row gathering or scattering
        pick = (lambda tensor: tensor) if every_row else (lambda tensor: None if tensor is None else tensor[rows_t])
        draft_ids = pick(draft.token_ids)  # [A, K]
        chains = torch.cat([last_t[:, None], draft_ids], dim=1)  # [A, K+1]: last committed token, then the draft
        tree = reach = None
        if draft.is_tree:
            if not self.verifies_trees:
                raise ValueError(f"{type(self).__name__} verifies chains; this draft is a token tree (it has parents): "
                                 "pass verifier=TreeVerifier()")
            parents = pick(draft.parents)  # [A, K]
            problems = (torch.zeros_like(num_draft_t) if draft.well_formed
                        else tree_problems(draft_ids, parents, num_draft_t, sampling.greedy or draft.probs is None))
            reach = tree_reach(parents, num_draft_t)  # [A, K, K]
            tree = tree_grid(reach, lengths_t)
        target_logits, cost = self.score(runner, batch, rows, chains, num_draft, tree)  # [A, K+1, V]
        if rules_active(batch, sampling):  # each slot follows the committed tokens and the draft tokens before it
            target_logits = (apply_token_rules(target_logits, batch, rows, draft_ids, 0, sampling) if reach is None
                             else apply_tree_token_rules(target_logits, batch, rows, draft_ids, reach, sampling))
        draft_probs = pick(draft.probs)
        if reach is None:
            verdict = chain_verdict(draft_token_ids=draft_ids, num_draft_tokens=num_draft_t, target_logits=target_logits,
                                    draft_probs=draft_probs, params=sampling, seeds=seeds_t, first_positions=lengths_t,
                                    logprobs=logprobs)
        else:
            max_tried = None if draft.max_children is None else int(draft.row_depths.max(initial=0)) * draft.max_children
            verdict, path = tree_verdict(draft_ids, parents, num_draft_t, target_logits, draft_probs, sampling, seeds_t,
                                         lengths_t, logprobs=logprobs, reach=reach, max_tried=max_tried)
            verdict.path, verdict.tree_problems = path, problems
            compact_accepted_path(runner, rows_t, lengths_t, path)
        return (verdict if every_row else _scatter_rows(verdict, rows_t, batch.num_rows)), cost

    @abstractmethod
    def score(
        self, runner: ModelRunner, batch: BatchState, rows: np.ndarray, chains: torch.Tensor, num_draft: np.ndarray,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, VerifyCost]:
        """Target logits for every draft slot. chains: [A, K+1] (PAD_ID beyond 1 + num_draft): the
        last committed token, then the draft's nodes; tree: for a tree draft, (positions, masks)
        [A, K+1] each (tree_grid) -> (logits [A, K+1, V], cost). Slots beyond a row's draft may hold
        anything."""


def tree_grid(reach: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree draft's attention in the verifier's [A, K+1] grid: the root (the last committed
    token) at position length - 1, node i at length - 1 + its depth; the root attends causally,
    node i to the tree slots of itself and its ancestors (the tree starts at slot length, node
    i's slot length + i). reach: [A, K, K], lengths: [A] -> (positions, masks) [A, K+1] int64."""
    depths = reach.sum(dim=2)  # [A, K]
    zero = depths.new_zeros(depths.shape[0], 1)
    positions = lengths[:, None] - 1 + torch.cat([zero, depths], dim=1)  # [A, K+1]
    masks = torch.cat([zero, tree_masks(reach)], dim=1)  # [A, K+1]
    return positions, masks


def compact_accepted_path(runner: ModelRunner, rows: torch.Tensor, lengths: torch.Tensor, path: torch.Tensor) -> None:
    """Move the target's cache entries of each row's accepted nodes (written at slot length +
    node index) to slots length, length + 1, ... in path order; slots past the accepted ones are
    stale anyway, so every path column is copied (unaccepted ones onto themselves): no host
    synchronisation. rows, lengths: [A]; path: [A, K] (-1 beyond the accepted nodes)."""
    if path.shape[1] == 0:
        return
    depth = torch.arange(path.shape[1], device=path.device)
    target = lengths[:, None] + depth  # [A, K]
    source = torch.where(path >= 0, lengths[:, None] + path, target)
    runner.cache.compact(rows[:, None].expand_as(path).reshape(-1), source.reshape(-1), target.reshape(-1))


def _scatter_rows(verdict: Verdict, rows: torch.Tensor, num_rows: int) -> Verdict:
    """Expand a verdict over the active rows to all B rows (inactive rows emit nothing)."""
    width = verdict.token_ids.shape[1]
    device = rows.device
    token_ids = torch.full((num_rows, width), PAD_ID, dtype=torch.int64, device=device)
    num_emitted = torch.zeros(num_rows, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_rows, dtype=torch.int64, device=device)
    token_ids[rows] = verdict.token_ids
    num_emitted[rows] = verdict.num_emitted
    num_accepted[rows] = verdict.num_accepted
    logprobs = path = None
    if verdict.logprobs is not None:
        logprobs = torch.zeros(num_rows, width, dtype=torch.float32, device=device)
        logprobs[rows] = verdict.logprobs
    problems = None
    if verdict.path is not None:
        path = torch.full((num_rows, width - 1), -1, dtype=torch.int64, device=device)
        path[rows] = verdict.path
        problems = torch.zeros(num_rows, dtype=torch.int64, device=device)
        problems[rows] = verdict.tree_problems
    return Verdict(token_ids=token_ids, num_emitted=num_emitted, num_accepted=num_accepted, logprobs=logprobs,
                   path=path, tree_problems=problems)


def chain_layout(batch: BatchState, rows: np.ndarray, chain_lengths: np.ndarray) -> PackedLayout:
    """Each row's chain starts at its last committed token's position."""
    return PackedLayout(rows=rows, starts=batch.lengths[rows] - 1, counts=chain_lengths)
