"""Token trees from a model drafter: the spec, the candidate pool, and the choice of nodes
(EAGLE-2, Li et al. 2024, arXiv 2406.16858; sampling without replacement: RSD, Jeon et al. 2024,
arXiv 2402.14160; ALGORITHMS.md section 7).

A tree of depth D grows level by level. Level 1 is the root's ``branching`` first children;
each later level gives every node of the previous level's *frontier* (its ``branching`` best
nodes) ``branching`` children, so the pool holds ``branching + (D - 1) * branching**2``
candidates, stored level by level, within a level by frontier rank and then sibling order
(parents always before children). Children are:
- greedy, or ``sampled=False``: the top ``branching`` tokens of the drafter's distribution q,
  deterministic, verified with q one-hot (draft probs None). The frontier and the row's tree
  are the candidates of highest cumulative log-probability (EAGLE-2's dynamic tree and rerank;
  ties go to the earlier candidate, and a child's score never exceeds its parent's, so every
  kept node's parent is kept);
- ``sampled=True`` under sampling: ``branching`` draws without replacement from q (Gumbel-top-k
  by the exponential race), each with its q given the parent and the siblings drawn before it.
  The shape is static (as Sequoia's trees are): frontier and tree are the candidates of lowest
  shape key, key(child) = max(key(parent), frontier rank of the parent + sibling index) + 1
  (root children: sibling index + 1), which grows along every path and favours the first
  siblings of the first frontier nodes, so trees go deep. Which nodes a tree keeps then never
  depends on any draw, as recursive rejection sampling needs to stay lossless; EAGLE-2's rerank
  would keep a sampled child because of its own probability and bias the output. (A tree whose
  shape depends only on ancestors' draws would be lossless too, but a budget shared across
  branches makes a node's siblings and cousins compete with it, through its own level's ranks.)
A candidate that lies deeper than its row may draft is left out. A sampled candidate that cannot
be drawn (q has no mass left once its earlier siblings are removed) keeps its place in the shape
but its slot stays empty, detached (parent sampling.DETACHED) with its subtree, and the rule
never tries it; letting another candidate take its place would make the kept set depend on draws
(and the next step reuses some of their keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import noise
from ..runner import TREE_MASK_BITS
from ..sampling import SIBLING_PURPOSE_STRIDE
from ..types import is_int_at_least


@dataclass(frozen=True)
class TreeSpec:
    """How a drafter grows token trees; the node budget comes from the policy (a row asked for
    k draft tokens gets a tree of k nodes: the budget is to trees what k is to chains).

    depth: levels (the most tokens one step can accept); branching: children per expanded node
    and nodes expanded per level; sampled: under sampling, draw children without replacement
    from the drafter's q (True) or take its top ``branching`` tokens with q one-hot (False).
    The drafter feeds ``(depth - 1) * branching`` nodes a row, which must fit the attention's
    64-bit ancestor masks.
    """

    depth: int = 6
    branching: int = 4
    sampled: bool = True

    def __post_init__(self) -> None:
        if not is_int_at_least(self.depth, 1) or not is_int_at_least(self.branching, 1):
            raise ValueError(f"TreeSpec needs integers depth >= 1 and branching >= 1, got depth={self.depth!r}, "
                             f"branching={self.branching!r}")
        if (self.depth - 1) * self.branching > TREE_MASK_BITS:
            raise ValueError(f"TreeSpec(depth={self.depth}, branching={self.branching}) feeds "
                             f"{(self.depth - 1) * self.branching} nodes a row, over the attention's {TREE_MASK_BITS}-bit "
                             "ancestor masks: lower depth or branching")
        if not isinstance(self.sampled, bool):
            raise TypeError(f"TreeSpec.sampled must be True or False, got {self.sampled!r}")

    @property
    def pool_size(self) -> int:
        return self.branching + (self.depth - 1) * self.branching ** 2


@dataclass
class Children:
    """One level's candidates: ``count`` children for each of E expanded nodes."""

    tokens: torch.Tensor  # [R, E, C] int64
    log_probs: torch.Tensor  # [R, E, C] float32: log q_parent(token), -inf where it cannot be drawn


def choose_children(q: torch.Tensor, count: int, sampled: bool, seeds: torch.Tensor,
                    positions: torch.Tensor) -> Children:
    """The children of E expanded nodes a row. q: [R, E, V] the drafter's distribution after
    each (processed probabilities, or softmax of the logits when greedy); seeds: [R]; positions:
    [R] the children's position. Sampled: the exponential race over q, keyed per (seed, position,
    expanded node), gives the order of draws without replacement; a child whose remaining q has
    no mass cannot be drawn (log-probability -inf)."""
    if sampled:
        expanded = torch.arange(q.shape[1], device=q.device)  # [E]
        purposes = noise.DRAFT + SIBLING_PURPOSE_STRIDE * expanded  # distinct from ACCEPT and TARGET purposes
        keys = noise.stream_keys(seeds[:, None], positions[:, None], purposes[None, :])  # [R, E]
        race = q / noise.exponential_noise(keys, q.shape[-1])  # [R, E, V]
        tokens = race.topk(count, dim=-1).indices  # [R, E, C]
        chosen_q = q.gather(-1, tokens)
        log_probs = torch.where(chosen_q > 0, chosen_q.log(), float("-inf"))
    else:
        top = q.topk(count, dim=-1)
        tokens, log_probs = top.indices, top.values.log()  # -inf where q is 0
    return Children(tokens=tokens, log_probs=log_probs)


def sibling_draft_probs(parent_q: torch.Tensor, earlier_siblings: torch.Tensor) -> torch.Tensor:
    """Each node's q given its parent and the siblings drawn before it: the parent's q with those
    siblings' tokens removed, renormalised. parent_q: [R, N, V]; earlier_siblings: [R, N, C] token
    ids (-1 where there are fewer) -> [R, N, V] (zeros where nothing is left)."""
    vocab = parent_q.shape[-1]
    index = torch.where(earlier_siblings >= 0, earlier_siblings, vocab)
    spare = torch.cat([parent_q, parent_q.new_zeros(*parent_q.shape[:-1], 1)], dim=-1)  # column V: absent
    remaining = spare.scatter(-1, index, 0.0)[..., :vocab]
    mass = remaining.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, remaining / mass.clamp(min=1e-30), 0.0)


def static_shape(branching: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """A sampled tree's shape (module docstring), the same for every row and step: (the shape key
    of each pool candidate [P], and each level's frontier [depth - 1, branching]: the places,
    within levels 1 .. depth - 1, of the nodes fed next, the lowest keys, earlier first)."""
    k = branching
    slots = np.arange(k)
    rank_plus_sibling = (slots[:, None] + slots[None, :]).reshape(-1)  # [k * k]: frontier rank j + sibling c
    level_keys = slots + 1  # root children
    keys, frontiers = [level_keys], [slots]
    for level in range(2, depth + 1):
        level_keys = np.maximum(np.repeat(level_keys[frontiers[-1]], k), rank_plus_sibling) + 1
        keys.append(level_keys)
        if level < depth:
            frontiers.append(np.argsort(level_keys, kind="stable")[:k])
    return np.concatenate(keys), np.stack(frontiers[: max(depth - 1, 1)])


def select_nodes(ranking: torch.Tensor, allowed: torch.Tensor, budgets: torch.Tensor,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``budget`` allowed candidates of highest ``ranking`` (ties: the earlier first), in
    pool order. ranking, allowed: [R, P]; budgets: [R] -> (chosen [R, width] pool indices, real
    [R, width] whether each chosen slot is a kept node; slots past a row's budget or without a
    candidate are not). A ranking that falls strictly from parent to child keeps every kept
    node's parent (a cumulative log-probability falls or stays, and then the earlier wins)."""
    num_rows, pool = ranking.shape
    index = torch.arange(pool, device=ranking.device).expand(num_rows, pool)
    key = torch.where(allowed, ranking, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [R, P]
    rank = torch.empty_like(order).scatter_(1, order, index)  # each candidate's place in that order
    kept = allowed & (rank < budgets[:, None])
    order_key = torch.where(kept, index, pool + index)  # kept ones first, in pool order
    chosen = order_key.sort(dim=1).indices[:, :width]  # [R, min(width, P)]
    real = kept.gather(1, chosen)
    if width > pool:  # a budget over the pool: the rest are empty slots
        chosen = torch.cat([chosen, chosen.new_zeros(num_rows, width - pool)], dim=1)
        real = torch.cat([real, real.new_zeros(num_rows, width - pool)], dim=1)
    return chosen, real
