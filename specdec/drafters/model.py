"""ModelDrafter: a small causal LM with the target's vocabulary proposes tokens autoregressively
(Leviathan et al. 2023, arXiv 2211.17192).

Invariant: the drafter's own KV cache (through the same ModelRunner as the target) holds, for
each row, a prefix of the committed tokens: ``cache.lengths[r]`` positions. A proposal first
catches every unfinished row up on the committed tokens it has not seen (one packed forward, any
lengths; rows not drafting this step too, so no row falls out of the captured graphs' shapes),
then runs k - 1 more single-token steps for the asked rows; after the verdict, ``commit`` keeps exactly
the prefix that the target accepted. Sampling uses the same processed distribution rules as
the target (sampling.py), each row with its request's own parameters (BatchState.sampling_of),
with the drafter's own noise stream, and returns the distributions.

Cost: k forward passes of the small model per step, the first one carrying the catch-up tokens
(up to MAX_CATCH_UP_PASSES more when the drafter sat out some steps and its graphs take fewer
tokens per row than it missed). Under CUDA graphs, a greedy chain with no token rules whose rows
all ask one length runs its k - 1 single-token passes as replays of the runner's greedy feeds
(graphs.py: the argmax is inside the graph), with no host work between them (GREEDY_FEEDS).
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from ..transfer import to_device

from .. import noise
from ..batch import BatchState
from ..runner import (ModelRunner, PackedLayout, TreeLayout, check_supported, device_of, resolve_backend, runner_for,
                      runners_of, vocab_size_of)
from ..sampling import DETACHED, next_tokens, process_logits
from ..token_rules import apply_token_rules, committed_tokens_seen, penalises_repeats, rules_active
from ..types import PAD_ID, Draft, RowSampling, SamplingParams, take_rows
from .base import Drafter, merge_drafts, trees_and_chains
from .tree import TreeSpec, choose_children, select_nodes, sibling_draft_probs, static_shape


MAX_CATCH_UP_PASSES = 4  # graphed passes a lagging catch-up may take before one eager pass does it
GREEDY_FEEDS = True  # under CUDA graphs, a greedy chain's single-token passes replay captured greedy feeds


def _free_drafter_role(model, prefix: str = "drafter") -> str:
    """The first drafter runner of ``model`` that no drafter holds now ("drafter-0", "drafter-1",
    ...): a new ModelDrafter per call reuses the model's runner (and its graphs) instead of adding
    one, and two drafters of one model in the same call still get a cache each. Drafters that
    change what a pass computes (SPIRe's memory writes) keep runners of their own ``prefix``."""
    runners = runners_of(model)
    return next(role for role in (f"{prefix}-{i}" for i in itertools.count())
                if not getattr(runners.get(role), "in_use", False))


class ModelDrafter(Drafter):
    role_prefix = "drafter"  # its runners' roles: drafter-0, drafter-1, ...

    def __init__(self, model, attention: str = "auto", cuda_graphs: bool | str = False, compile: bool = False,
                 tree: TreeSpec | None = None):
        """attention, cuda_graphs and compile as for generate(): attention "auto" is the fast
        kernel on a CUDA model and the reference backend elsewhere; graphs are opt-in. tree: grow
        token trees of this spec (drafters/tree.py; verify with TreeVerifier), None for chains."""
        check_supported(model)
        if tree is not None and not isinstance(tree, TreeSpec):
            raise TypeError(f"tree must be a TreeSpec (depth, branching, sampled) or None for chains, got {tree!r}")
        self.tree = tree
        self.model = model
        self.attention, self.cuda_graphs, self.compile = resolve_backend(model, attention, cuda_graphs, compile)
        self.vocab_size = vocab_size_of(model)
        self._runner: ModelRunner | None = None
        self._attached = None
        self.runner_role: str | None = None  # the model's runner this drafter used last (runners_of(model))

    def device(self) -> torch.device:
        return device_of(self.model)

    def models(self) -> list[torch.nn.Module]:
        return [self.model]

    def max_positions(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def describe(self) -> str:
        shape = "" if self.tree is None else f", tree depth {self.tree.depth} x {self.tree.branching}"
        return f"ModelDrafter({type(self.model).__name__}, {sum(p.numel() for p in self.model.parameters()):,} params{shape})"

    def _current_device(self):
        """Make the drafter's GPU the current one while it works (kernel launches and graph
        capture follow the current device, which is the target's when it sits on another GPU)."""
        device = self.device() if self._runner is None else self._runner.device  # (the runner's: no walk of the parameters)
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def start(self, batch: BatchState, sampling: SamplingParams, device: torch.device, max_draft_tokens: int) -> None:
        with self._current_device():
            self._start(batch, max_draft_tokens)

    def _start(self, batch: BatchState, max_draft_tokens: int) -> None:
        group = self._graph_group()
        graph_shape = (group, group * batch.num_rows) if self.cuda_graphs else None
        self.runner_role = _free_drafter_role(self.model, self.role_prefix)
        # a tree's expansion writes (depth - 1) * branching nodes past the row, which may exceed the budget
        reach = max_draft_tokens if self.tree is None else max(max_draft_tokens, (self.tree.depth - 1) * self.tree.branching)
        self._runner = runner_for(self.model, role=self.runner_role, max_rows=batch.num_rows, max_len=batch.max_total_len + reach + 1,
                                  attention=self.attention, graph_shape=graph_shape, compile=self.compile)
        self._runner.cache.lengths[:] = 0  # a reused runner: nothing cached is valid for this batch
        self._runner.in_use = True
        self._attached = self._runner.attached()
        self._attached.__enter__()
        if self._runner.graphs is not None and self._feeds_replayable():
            self._runner.graphs.capture_greedy_feeds()  # once per runner's graphs
        self._seeds = to_device(batch.seeds, self.device())

    def start_rows(self, batch: BatchState, rows: np.ndarray) -> None:
        self._runner.cache.lengths[rows] = 0  # the next catch-up feeds each new prompt
        self._seeds[to_device(rows, self._seeds.device)] = to_device(batch.seeds[rows], self._seeds.device)

    def _feeds_replayable(self) -> bool:
        """Whether a greedy chain's single-token passes may replay the runner's greedy feeds: a
        chain drafter whose passes are the runner's plain ones (SPIRe's and MagicDec's differ)."""
        return GREEDY_FEEDS and self.tree is None and type(self)._feed is ModelDrafter._feed

    def _graph_group(self) -> int:
        """The most tokens a row feeds in one pass (the graphs' group size): catch-up passes carry
        one or two tokens per row after the first step, single-token steps one; a tree's expansion
        passes ``branching`` a row, and after a tree step the catch-up feeds the accepted path and
        the new token (the fed nodes are not kept): up to depth + 1."""
        return 2 if self.tree is None else max(2, self.tree.branching, self.tree.depth + 1)

    def finish(self) -> None:
        if self._attached is not None:
            self._attached.__exit__(None, None, None)
        if self._runner is not None:
            self._runner.in_use = False
        self._runner = self._attached = None

    def propose(self, batch: BatchState, num_tokens: np.ndarray, trees: np.ndarray | None = None) -> Draft:
        """trees: with a TreeSpec, the rows that get a tree ([B] bool; None: all), the others a chain."""
        with self._current_device():
            if self.tree is None:
                return self._propose(batch, num_tokens)
            return trees_and_chains(self._propose_tree, self._propose, batch, num_tokens, trees, self.vocab_size)

    def _propose(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        """Chains of ``num_tokens[r]`` tokens."""
        runner = self._runner
        device = runner.device
        max_tokens = int(num_tokens.max(initial=0))
        token_ids = torch.full((batch.num_rows, max_tokens), PAD_ID, dtype=torch.int64, device=device)  # [B, K]
        rows = np.flatnonzero(num_tokens > 0)
        sampling = batch.sampling_of(rows, device)  # the asked rows' (a RowSampling when they differ)
        probs = None
        if not sampling.greedy and max_tokens > 0:
            probs = torch.zeros(batch.num_rows, max_tokens, runner.vocab_size, device=device)  # [B, K, V]
        if len(rows) == 0:
            return Draft(token_ids=token_ids, num_tokens=num_tokens.copy(), probs=probs)

        logits = self._catch_up(batch, rows)  # [R, V] next-token logits of the asked rows

        greedy = sampling.greedy
        rules = rules_active(batch, sampling)
        # the committed tokens do not change within a proposal: one mask of them for every depth
        seen = (committed_tokens_seen(batch, rows, runner.vocab_size, device)
                if rules and penalises_repeats(sampling) else None)
        rows_t = to_device(rows, device)  # [R]
        if (greedy and not rules and max_tokens > 1 and runner.graphs is not None and runner.graphs.greedy_feeds
                and self._feeds_replayable() and (num_tokens[rows] == max_tokens).all()):
            chained = self._greedy_chains(logits, rows, rows_t, max_tokens, token_ids)
            if chained is not None:
                return Draft(token_ids=chained, num_tokens=num_tokens.copy(), probs=None)
        for depth in range(max_tokens):
            if rules:  # the target's rules at this position, so that fewer drafts are rejected for them
                logits = apply_token_rules(logits[:, None], batch, rows, token_ids[rows_t, :depth], depth,
                                           sampling, committed_seen=seen)[:, 0]
            if greedy:  # no randomness: neither seeds nor positions are needed
                chosen, chosen_probs = logits.argmax(dim=-1), None
            else:
                positions = to_device(batch.lengths[rows] + depth, device)  # [R]
                chosen, chosen_probs = next_tokens(logits, sampling, self._seeds[rows_t], positions, noise.DRAFT)
            token_ids[rows_t, depth] = chosen
            if probs is not None:
                probs[rows_t, depth] = chosen_probs
            # Rows that want another token feed the one just drafted.
            keep = num_tokens[rows] > depth + 1  # [R]
            if not keep.any():
                break
            if not keep.all():
                rows = rows[keep]
                kept = to_device(np.flatnonzero(keep), device)
                chosen, rows_t = chosen[kept], rows_t[kept]
                seen = None if seen is None else seen[kept]
                sampling = take_rows(sampling, kept)
            logits = self._feed(batch, chosen, rows, depth)  # [R', V]
        return Draft(token_ids=token_ids, num_tokens=num_tokens.copy(), probs=probs)

    def _greedy_chains(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor, length: int,
                       token_ids: torch.Tensor) -> torch.Tensor | None:
        """Every asked row's chain of ``length`` tokens, greedy and without token rules: the
        argmax of the catch-up's logits ([R, V]), then length - 1 replays of the runner's greedy
        feeds -> token_ids [B, K] filled; None (nothing fed) where the feeds cannot run them."""
        first = logits.argmax(dim=-1)  # [R]
        cached = self._runner.cache.lengths
        rest = self._runner.greedy_chains(first, rows, cached[rows], length - 1)  # [R, length - 1]
        if rest is None:
            return None
        cached[rows] += length - 1
        token_ids[rows_t] = torch.cat([first[:, None], rest], dim=1)
        return token_ids

    def _feed(self, batch: BatchState, tokens: torch.Tensor, rows: np.ndarray, depth: int) -> torch.Tensor:
        """Feed each row its drafted token ``depth`` ([R] device ids, one per row of ``rows``) right
        after what its cache holds -> next-token logits [R, V]."""
        cached = self._runner.cache.lengths
        layout = PackedLayout(rows=rows, starts=cached[rows], counts=np.ones(len(rows), dtype=np.int64))
        logits = self._runner.forward(tokens, layout)
        cached[rows] += 1
        return logits

    def _propose_tree(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        """Grow each asked row's tree of ``num_tokens[r]`` nodes (drafters/tree.py): depth - 1
        packed passes of ``branching`` tokens a row after the catch-up, each frontier node at
        position length + level - 1 and cache slot length + its feeding order, attending to its
        ancestors. The cache keeps only the committed tokens (the fed nodes lie beyond
        ``cache.lengths``), so commit() needs nothing more than for chains. The drafter's own
        logits are not adjusted by token rules here (more rejections under them, never a wrong
        token)."""
        spec, runner = self.tree, self._runner
        device, vocab = runner.device, runner.vocab_size
        width = int(num_tokens.max(initial=0))
        draft = Draft(token_ids=torch.full((batch.num_rows, width), PAD_ID, dtype=torch.int64, device=device),
                      num_tokens=num_tokens.copy(), parents=torch.full((batch.num_rows, width), DETACHED,
                                                                        dtype=torch.int64, device=device),
                      depths=np.minimum(np.minimum(spec.depth, num_tokens), np.maximum(batch.remaining - 1, 0)),
                      max_children=spec.branching, well_formed=True)
        rows = np.flatnonzero(num_tokens > 0)
        if len(rows) == 0:
            return draft
        sampling = batch.sampling_of(rows, device)
        greedy = sampling.greedy
        sampled = spec.sampled and not greedy
        if sampled and isinstance(sampling, RowSampling):
            return self._tree_per_sampling(batch, num_tokens, rows)
        logits = self._catch_up(batch, rows)  # [R, V]
        num_rows, k = len(rows), spec.branching

        def distribution(scores):  # [R, E, V] -> q [R, E, V]: the softmax when greedy (a greedy row's too)
            if greedy:
                return scores.float().softmax(dim=-1)
            q = process_logits(scores, sampling)
            if isinstance(sampling, RowSampling) and sampling.some_greedy:
                q = torch.where(sampling.per_row(sampling.is_greedy, q), scores.float().softmax(dim=-1), q)
            return q
        rows_t = to_device(rows, device)
        seeds, lengths = self._seeds[rows_t], to_device(batch.lengths[rows], device)  # [R] each
        depth_limit = np.minimum(np.minimum(spec.depth, num_tokens[rows]), np.maximum(batch.remaining[rows] - 1, 1))
        max_depth = int(depth_limit.max())

        q = distribution(logits)[:, None]  # [R, 1, V] after the root
        kids = choose_children(q, k, sampled, seeds, lengths)
        expander_q, expander_children = [q], [kids.tokens]  # per expanded node: its q and its children
        pool_tokens, pool_scores = [kids.tokens[:, 0]], [kids.log_probs[:, 0]]  # [R, k] level 1
        pool_parent = [torch.full((num_rows, k), -1, dtype=torch.int64, device=device)]
        frontier = torch.arange(k, device=device).expand(num_rows, k)  # pool indices of the nodes to feed
        frontier_tokens, frontier_scores = kids.tokens[:, 0], kids.log_probs[:, 0]  # [R, k] each
        slots = torch.arange(k, device=device)
        if sampled:  # a static shape: no key looks at any draw (drafters/tree.py)
            shape_keys, shape_frontiers = static_shape(k, max_depth)
            shape_frontiers = to_device(shape_frontiers, device)  # [max_depth - 1, k]
        masks = (torch.ones(k, dtype=torch.int64, device=device) << slots).expand(num_rows, k)  # [R, k]
        root_positions = lengths.repeat_interleave(k)  # [R * k]: the root children's position
        pool_size = k
        for level in range(2, max_depth + 1):
            fed = (level - 2) * k  # the frontier's first tree slot
            layout = PackedLayout(rows=rows, starts=batch.lengths[rows] + fed, counts=np.full(num_rows, k))
            tree = TreeLayout(positions=root_positions + (level - 2), masks=masks.reshape(-1),
                              tree_starts=batch.lengths[rows])
            q = distribution(runner.forward(frontier_tokens.reshape(-1), layout, tree=tree).view(num_rows, k, vocab))
            kids = choose_children(q, k, sampled, seeds, lengths + level - 1)  # [R, k, k]
            expander_q.append(q)
            expander_children.append(kids.tokens)
            scores = (frontier_scores[:, :, None] + kids.log_probs).reshape(num_rows, k * k)
            level_tokens = kids.tokens.reshape(num_rows, k * k)
            pool_tokens.append(level_tokens)
            pool_scores.append(scores)
            pool_parent.append(frontier.repeat_interleave(k, dim=1))
            if level < max_depth:  # the next frontier: this level's best k (ties: earlier first)
                best = (shape_frontiers[level - 1].expand(num_rows, k) if sampled
                        else torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k])  # [R, k]
                masks = masks.gather(1, best // k) | (torch.ones_like(best) << (fed + k + slots))
                frontier, frontier_scores, frontier_tokens = pool_size + best, scores.gather(1, best), \
                    level_tokens.gather(1, best)
            pool_size += k * k
        # host-side pool layout: each candidate's level, and the expanded node whose child it is
        # (0 the root, 1 + i the i-th fed node): k at level 1, k * k at each later level
        pool_level = np.concatenate([np.ones(k, dtype=np.int64)]
                                    + [np.full(k * k, level, dtype=np.int64) for level in range(2, max_depth + 1)])
        pool_expander = np.concatenate([np.zeros(k, dtype=np.int64)] + [
            1 + (level - 2) * k + np.repeat(np.arange(k), k) for level in range(2, max_depth + 1)])

        scores = torch.cat(pool_scores, dim=1)  # [R, P]
        levels = to_device(pool_level, device)  # [P]
        allowed = levels[None, :] <= to_device(depth_limit, device)[:, None]  # [R, P]
        if sampled:  # a static shape; a child that cannot be drawn (and its subtree: -inf too) is left empty,
            # not replaced, so that no draw decides which other nodes the budget keeps
            chosen, real = select_nodes(-to_device(shape_keys, device).float().expand(num_rows, -1), allowed,
                                        to_device(num_tokens[rows], device), width)
            real &= torch.isfinite(scores.gather(1, chosen))
        else:
            chosen, real = select_nodes(scores, allowed & torch.isfinite(scores), to_device(num_tokens[rows], device),
                                        width)
        parent_pool = torch.cat(pool_parent, dim=1).gather(1, chosen)  # [R, W]
        node_of = torch.full((num_rows, pool_size + 1), -1, dtype=torch.int64, device=device).scatter_(
            1, torch.where(real, chosen, pool_size), torch.arange(width, device=device).expand(num_rows, width))
        # [R, P + 1] pool index -> node index of the kept candidates (column P: empty slots)
        parents = torch.where(parent_pool >= 0, node_of.gather(1, parent_pool.clamp(min=0)), -1)
        draft.parents[rows_t] = torch.where(real, parents, DETACHED)
        draft.token_ids[rows_t] = torch.cat(pool_tokens, dim=1).gather(1, chosen)
        if sampled:  # each node's q: its parent's with the siblings drawn before it removed
            expander = to_device(pool_expander, device)[chosen]  # [R, W]
            parent_q = torch.cat(expander_q, dim=1).gather(1, expander[..., None].expand(-1, -1, vocab))
            siblings = torch.cat(expander_children, dim=1).gather(1, expander[..., None].expand(-1, -1, k))  # [R, W, k]
            place = chosen.remainder(k)  # sibling index: the pool gives each expanded node k consecutive entries
            earlier = torch.where(torch.arange(k, device=device) < place[..., None], siblings, -1)
            draft.probs = torch.zeros(batch.num_rows, width, vocab, device=device)
            draft.probs[rows_t] = sibling_draft_probs(parent_q, earlier)
        return draft

    def _tree_per_sampling(self, batch: BatchState, num_tokens: np.ndarray, rows: np.ndarray) -> Draft:
        """Sampled trees for asked ``rows`` whose sampling parameters differ: the children of a
        sampled tree are drawn with one SamplingParams for all rows (choose_children, static_shape),
        so each set of parameters gets a tree proposal of its own (its rows' own, as alone), merged
        by row. Cost: one tree proposal (depth - 1 passes) per distinct set of parameters."""
        _, group = np.unique(batch.row_sampling[rows], axis=0, return_inverse=True)
        owner = np.zeros(batch.num_rows, dtype=np.int64)
        owner[rows] = group.ravel()
        asked = num_tokens > 0
        drafts = [self._propose_tree(batch, np.where(asked & (owner == g), num_tokens, 0)) for g in range(owner.max() + 1)]
        return merge_drafts(drafts, owner, self.vocab_size)

    def _catch_up(self, batch: BatchState, asked: np.ndarray) -> torch.Tensor:
        """Feed every unfinished row the committed tokens its cache lacks (at least the last one
        for each asked row) -> logits [len(asked), V] after each asked row's last token.

        Rows that do not draft this step are fed too: their few tokens ride along in the same
        pass almost for free, and keep each row at most two tokens behind, within the captured
        graphs' groups; otherwise a row resuming after a pause would send the whole pass to the
        eager path. A lag longer than the graphs' groups (the drafter sat out some steps) is fed
        in several graphed passes of at most that many tokens per row, ending together, when that
        takes at most MAX_CATCH_UP_PASSES passes; a longer one (the prompt) in one eager pass."""
        runner = self._runner
        cached = runner.cache.lengths
        behind = ~batch.finished & (cached[: batch.num_rows] < batch.lengths)
        behind[asked] = True
        rows = np.flatnonzero(behind)  # [F] ascending, holds every asked row
        ends = batch.lengths[rows]  # [F]
        starts = np.minimum(cached[rows], ends - 1)  # [F] an asked row is fed its last token at least
        lag = int((ends - starts).max())
        group = runner.graphs.max_group_tokens if runner.graphs is not None else 0
        passes = -(-lag // group) if group else 1
        if passes > MAX_CATCH_UP_PASSES:
            passes = 1
        step = lag if passes == 1 else group
        asked_slots = np.searchsorted(rows, asked)  # [R] where each asked row sits in ``rows``
        for p in range(passes):
            upper = ends - (passes - 1 - p) * step  # [F] each row's chunk ends here...
            lower = np.maximum(starts, upper - step)  # ...and starts here (empty when upper <= starts)
            present = upper > lower
            layout = PackedLayout(rows=rows[present], starts=lower[present], counts=(upper - lower)[present])
            token_ids = batch.packed_tokens(layout.rows, layout.starts, upper[present])
            last = p == passes - 1  # every row ends in the last pass, so all are present there
            logits = runner.forward(to_device(token_ids, runner.device), layout,
                                    logits_indices=layout.last_token_indices()[asked_slots] if last else np.zeros(1, dtype=np.int64))
        cached[rows] = ends
        return logits

    def commit(self, lengths_before: np.ndarray, num_accepted: np.ndarray) -> None:
        # Cached drafts beyond the accepted ones were computed from rejected tokens.
        cache = self._runner.cache
        rows = np.flatnonzero(num_accepted >= 0)  # [R] the rows the step verified
        cache.rollback(rows, np.minimum(cache.lengths[rows], lengths_before[rows] + num_accepted[rows]))
