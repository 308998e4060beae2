"""The Drafter protocol: propose a chain of tokens for the rows a plan assigns.

Invariant: a drafter reads the committed tokens of the batch (``BatchState``) and keeps only
its own state (a model's KV cache, say); it never sees verifiers or policies. ``propose``
returns exactly one ``Draft`` over all B rows, with zero tokens for rows not asked; ``commit``
tells it how much of its last proposal the target accepted, so it can roll back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from ..transfer import to_device

from ..batch import BatchState
from ..types import PAD_ID, Draft, SamplingParams


class Drafter(ABC):
    #: size of the vocabulary the drafter proposes from; None if it copies tokens it has seen
    vocab_size: int | None = None
    #: its token-tree spec (drafters/tree.py), or None when it proposes chains
    tree = None
    #: whether it drafts from the target's runner (bind_target): its cache, weights or activations
    reads_target = False

    @property
    def makes_trees(self) -> bool:
        """Whether it proposes token trees: a row asked for k tokens gets a tree of up to k
        nodes no deeper than the row may still emit less one (``batch.remaining - 1``). Such a
        drafter's ``propose`` also takes ``trees`` ([B] bool, Plan.trees): rows asked for a chain."""
        return self.tree is not None

    def check_target(self, target) -> None:
        """Raise a clear error if this drafter cannot draft for ``target`` beyond the common checks
        (vocabulary, positions), before any runner is built. Nothing by default."""

    def target_hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states this drafter reads from its passes (hidden_states.py: index j
        the input of block j); generate() keeps them in the target's runner. None by default."""
        return ()

    def bind_target(self, runner) -> None:
        """Called before ``start`` with the target's ModelRunner (its model, cache and passes), for
        drafters that read the target's weights, cache or activations (self-speculation, SPIRe);
        others ignore it. Such a drafter must leave the target's committed cache entries as
        they are: it may write only beyond ``runner.cache.lengths``, which verification overwrites."""

    def start(self, batch: BatchState, sampling: SamplingParams, device: torch.device, max_draft_tokens: int) -> None:
        """Prepare for a generate() call (allocate caches). Called once before any propose.
        sampling: the engine's default; each row's own is ``batch.sampling_of(rows, device)``
        (a SamplingParams when the rows share one, else a types.RowSampling)."""

    def start_rows(self, batch: BatchState, rows: np.ndarray) -> None:
        """Rows ``rows`` ([R] host indices) now hold new requests (an Engine admitted them, or a
        generate() call began): forget what was kept for the rows' previous requests and take
        their seeds from ``batch``. Called after ``start``, before the rows' first ``propose``."""

    @abstractmethod
    def propose(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        """Propose up to ``num_tokens[r]`` tokens after row r's committed tokens ([B] host array).
        generate() calls it only in steps that ask this drafter for at least one token (``commit``
        comes every step): a drafter that keeps state must catch up on the tokens committed while
        it sat out."""

    def commit(self, lengths_before: np.ndarray, num_accepted: np.ndarray) -> None:
        """The step that began at committed lengths ``lengths_before`` accepted ``num_accepted``
        draft tokens per row ([B] each). A row with ``num_accepted`` -1 took no part in the step
        (finished, free, or in another micro-batch of a pipelined engine, whose draft may still
        await verification): its state must stay as it is."""

    def models(self) -> list[torch.nn.Module]:
        """The torch models this drafter runs (generate() serialises calls that share one)."""
        return []

    def finish(self) -> None:
        """Release what start() allocated; also called after a start() that raised part-way."""

    def max_positions(self) -> int | None:
        """The most positions (prompt plus output) the drafter can handle, or None if unbounded."""
        return None

    def device(self) -> torch.device | None:
        """The device the drafter computes on, or None if it has no model."""
        return None

    def describe(self) -> str:
        return type(self).__name__


def empty_draft(num_rows: int, device: torch.device) -> Draft:
    return Draft(
        token_ids=torch.full((num_rows, 0), PAD_ID, dtype=torch.int64, device=device),
        num_tokens=np.zeros(num_rows, dtype=np.int64),
    )


def merge_drafts(drafts: list[Draft], owner: np.ndarray, vocab_size: int) -> Draft:
    """One Draft from several drafters' proposals; row r comes from drafter ``owner[r]``.

    If some drafters return probabilities and others do not, point-mass rows get one-hot
    probabilities, which is the same acceptance rule.
    """
    if len(drafts) == 1:
        return drafts[0]
    max_tokens = max(d.max_tokens for d in drafts)
    num_rows = len(owner)
    device = drafts[0].token_ids.device
    owner_t = to_device(owner, device)
    token_ids = torch.full((num_rows, max_tokens), PAD_ID, dtype=torch.int64, device=device)  # [B, K]
    num_tokens = np.zeros(num_rows, dtype=np.int64)
    with_probs = any(d.probs is not None for d in drafts)
    probs = torch.zeros(num_rows, max_tokens, vocab_size, device=device) if with_probs else None  # [B, K, V]
    trees = any(d.is_tree for d in drafts)  # then chain rows become trees with parents i - 1
    parents = chain_parents(num_rows, max_tokens, device) if trees else None  # [B, K]
    depths = np.zeros(num_rows, dtype=np.int64)
    for index, draft in enumerate(drafts):
        mine = owner_t == index  # [B]
        width = draft.max_tokens
        token_ids[:, :width] = torch.where(mine[:, None], draft.token_ids, token_ids[:, :width])
        num_tokens = np.where(owner == index, draft.num_tokens, num_tokens)
        depths = np.where(owner == index, draft.row_depths, depths)
        if trees and draft.is_tree:
            parents[:, :width] = torch.where(mine[:, None], draft.parents, parents[:, :width])
        if probs is not None:
            draft_probs = draft.probs
            if draft_probs is None:
                one_hot_ids = draft.token_ids.clamp(min=0)
                draft_probs = torch.nn.functional.one_hot(one_hot_ids, vocab_size).float()
            probs[:, :width] = torch.where(mine[:, None, None], draft_probs, probs[:, :width])
    children = [1 if not d.is_tree else d.max_children for d in drafts]
    return Draft(token_ids=token_ids, num_tokens=num_tokens, probs=probs, parents=parents,
                 depths=depths if trees else None, max_children=None if None in children else max(children),
                 well_formed=all(d.well_formed or not d.is_tree for d in drafts))


def chain_parents(num_rows: int, width: int, device) -> torch.Tensor:
    """[num_rows, width] the parents of chains as a tree: node i's parent is i - 1."""
    return (torch.arange(width, device=device) - 1).expand(num_rows, width).clone()


def trees_and_chains(propose_tree, propose_chain, batch, num_tokens: np.ndarray, trees: np.ndarray | None,
                     vocab_size: int) -> Draft:
    """One draft with a tree for the rows ``trees`` marks and a chain for the others (all trees
    when ``trees`` is None), from a drafter's two proposal functions of (batch, num_tokens)."""
    if trees is None or trees.all():
        return propose_tree(batch, num_tokens)
    if not trees.any():
        return propose_chain(batch, num_tokens)
    chains = propose_chain(batch, np.where(trees, 0, num_tokens))
    tree = propose_tree(batch, np.where(trees, num_tokens, 0))
    return merge_drafts([chains, tree], trees.astype(np.int64), vocab_size)
