"""PromptLookupDrafter: propose the tokens that followed the latest earlier occurrence of the
row's last n tokens, for the longest n in [min_ngram, max_ngram] that occurs
(prompt lookup decoding, Saxena 2023; ALGORITHMS.md §6).

Invariant: a proposal is copied from the row's own prompt plus committed output, never
invented; a row with no match proposes nothing that step (plain decoding for it). Proposals are
point masses (no probabilities), which the acceptance rule handles exactly.

Example, tokens ``a b c d a b`` with max_ngram 2: the suffix ``a b`` last occurred at index 0,
followed by ``c d a b``, so k = 3 proposes ``c d a``.

With a ``TreeSpec`` it proposes a token tree instead: the continuations after every earlier
occurrence of the row's last n tokens (every n in range, longer and later first) merged into a
trie (as SGLang's n-gram trie and SuffixDecoding's trees do).

Cost: on the host, max_ngram passes over the [rows, length] token array per step, vectorised
(about 0.1 ms at 1 row and 0.2 ms at 64 rows of 450 tokens on one CPU core: numpy's per-call
overhead dominates, hence fancy indexing rather than take_along_axis and clip).
"""

from __future__ import annotations

import numpy as np

from ..transfer import to_device

from ..batch import BatchState
from ..types import PAD_ID, Draft
from .base import Drafter, trees_and_chains
from .tree import TreeSpec


def find_continuations(
    token_ids: np.ndarray, lengths: np.ndarray, num_tokens: np.ndarray, min_ngram: int, max_ngram: int
) -> tuple[np.ndarray, np.ndarray]:
    """Longest-and-latest n-gram match per row.

    token_ids: [B, T] (valid up to lengths), lengths: [B], num_tokens: [B] wanted ->
    (proposals [B, K] padded with PAD_ID, counts [B]) with K = max(num_tokens).
    """
    num_rows, width = token_ids.shape
    max_tokens = int(num_tokens.max(initial=0))
    rows = np.arange(num_rows)[:, None]  # [B, 1] for fancy indexing (cheaper than take_along_axis)
    match_end = np.full(num_rows, -1, dtype=np.int64)  # index of the chosen occurrence's last token
    match_len = np.zeros(num_rows, dtype=np.int64)
    ends = np.arange(width)  # candidate index E of an earlier occurrence's last token
    # matches[b, E]: the n tokens ending at E equal row b's last n tokens; grown one n at a time
    matches = (ends[None, :] < lengths[:, None] - 1) & (num_tokens[:, None] > 0)  # ends before the last token
    shifted = np.full_like(token_ids, PAD_ID)
    for n in range(1, min(max_ngram, width - 1) + 1):  # a match of n tokens needs a row of n + 1
        j = n - 1  # compare the token j before E with the row's j-th last token
        suffix_token = token_ids[rows, np.maximum(lengths - 1 - j, 0)[:, None]]  # [B, 1] (index < width: lengths <= width)
        shifted[:, j:], shifted[:, :j] = token_ids[:, : width - j], PAD_ID  # shifted[b, E] = token_ids[b, E - j]
        matches &= (shifted == suffix_token) & (lengths[:, None] > n)
        if n < min_ngram:
            continue
        has = matches.any(axis=1)  # a longer n found later overrides a shorter one
        if not has.any():
            break  # no row matches n tokens, so none matches more
        latest = width - 1 - np.argmax(matches[:, ::-1], axis=1)
        match_end = np.where(has, latest, match_end)
        match_len = np.where(has, n, match_len)
    match_start = np.where(match_end >= 0, match_end - match_len + 1, -1)
    first = match_start + match_len  # [B] index of the first proposed token
    counts = np.where(match_start >= 0, np.minimum(num_tokens, lengths - first), 0)
    columns = np.arange(max_tokens)
    source = np.minimum(first[:, None] + columns, width - 1)  # [B, K] (-1 only in a row without a match: masked below)
    proposals = np.where(columns < counts[:, None], token_ids[rows, source], PAD_ID)
    return proposals, counts


def match_ends(token_ids: np.ndarray, lengths: np.ndarray, min_ngram: int, max_ngram: int) -> list[list[int]]:
    """Every earlier occurrence of each row's last n tokens, for every n in [min_ngram, max_ngram]:
    per row, the index of each occurrence's last token, longer n first and, within one n, latest
    first, each index once. token_ids: [B, T] (valid up to lengths), lengths: [B]."""
    num_rows, width = token_ids.shape
    rows = np.arange(num_rows)[:, None]
    ends = np.arange(width)
    matches = ends[None, :] < lengths[:, None] - 1  # [B, T] grown one n at a time, as find_continuations
    shifted = np.full_like(token_ids, PAD_ID)
    found: list[np.ndarray] = []  # per n >= min_ngram: [B, T]
    for n in range(1, min(max_ngram, width - 1) + 1):
        j = n - 1
        suffix_token = token_ids[rows, np.maximum(lengths - 1 - j, 0)[:, None]]  # [B, 1]
        shifted[:, j:], shifted[:, :j] = token_ids[:, : width - j], PAD_ID
        matches &= (shifted == suffix_token) & (lengths[:, None] > n)
        if not matches.any():
            break
        if n >= min_ngram:
            found.append(matches.copy())
    per_row = []
    for row in range(num_rows):
        seen, order = set(), []
        for matches_n in reversed(found):
            for end in np.flatnonzero(matches_n[row])[::-1].tolist():
                if end not in seen:
                    seen.add(end)
                    order.append(end)
        per_row.append(order)
    return per_row


def continuation_trie(tokens: np.ndarray, length: int, ends: list[int], budget: int, depth: int,
                      branching: int) -> tuple[list[int], list[int], int]:
    """Merge the continuations after ``ends`` (up to ``depth`` tokens each, preferred first) into a
    trie of at most ``budget`` nodes with at most ``branching`` children a node -> (tokens,
    parents, the trie's depth), parents first; a continuation's shared prefix reuses the nodes
    already there."""
    node_tokens: list[int] = []
    node_parents: list[int] = []
    children: dict[int, dict[int, int]] = {-1: {}}  # node -> {token: child node}
    deepest = 0
    for end in ends:
        node = -1
        for level, token in enumerate(tokens[end + 1 : min(end + 1 + depth, length)].tolist(), start=1):
            child = children[node].get(token)
            if child is None:
                if len(node_tokens) == budget or len(children[node]) == branching:
                    break
                child = len(node_tokens)
                node_tokens.append(token)
                node_parents.append(node)
                children[node][token] = child
                children[child] = {}
                deepest = max(deepest, level)
            node = child
        if len(node_tokens) == budget:
            break
    return node_tokens, node_parents, deepest


class PromptLookupDrafter(Drafter):
    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, tree: TreeSpec | None = None):
        """tree: propose a trie of every matching continuation (``depth`` tokens each at most,
        ``branching`` children a node at most; verify with TreeVerifier) instead of the one
        continuation of the longest latest match."""
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(
                f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, max_ngram={max_ngram!r}"
            )
        if tree is not None and not isinstance(tree, TreeSpec):
            raise TypeError(f"tree must be a TreeSpec (depth, branching) or None for chains, got {tree!r}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tree = tree

    def describe(self) -> str:
        shape = "" if self.tree is None else f", trie depth {self.tree.depth} x {self.tree.branching}"
        return f"PromptLookupDrafter(n={self.min_ngram}..{self.max_ngram}{shape})"

    def start(self, batch, sampling, device, max_draft_tokens) -> None:
        self._device = device

    def propose(self, batch: BatchState, num_tokens: np.ndarray, trees: np.ndarray | None = None) -> Draft:
        """trees: with a TreeSpec, the rows that get a trie ([B] bool; None: all), the others a chain."""
        if self.tree is not None:
            return trees_and_chains(self._propose_trie, self._propose_chain, batch, num_tokens, trees,
                                    vocab_size=0)  # point masses only: no distribution to size
        return self._propose_chain(batch, num_tokens)

    def _propose_chain(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        proposals, counts = find_continuations(
            batch.token_ids, batch.lengths, num_tokens, self.min_ngram, self.max_ngram
        )
        return Draft(token_ids=to_device(proposals, self._device), num_tokens=counts)

    def _propose_trie(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        """Per asked row, the trie of its matching continuations (host work: a Python loop over
        the matches, a few microseconds each)."""
        width = int(num_tokens.max(initial=0))
        token_ids = np.full((batch.num_rows, width), PAD_ID, dtype=np.int64)
        parents = np.full((batch.num_rows, width), -1, dtype=np.int64)
        counts = np.zeros(batch.num_rows, dtype=np.int64)
        depths = np.zeros(batch.num_rows, dtype=np.int64)
        asked = np.flatnonzero(num_tokens > 0)
        ends = match_ends(batch.token_ids[asked], batch.lengths[asked], self.min_ngram, self.max_ngram)
        for row, row_ends in zip(asked, ends):
            depth = min(self.tree.depth, int(num_tokens[row]), max(int(batch.remaining[row]) - 1, 1))
            node_tokens, node_parents, depths[row] = continuation_trie(
                batch.token_ids[row], int(batch.lengths[row]), row_ends, int(num_tokens[row]), depth, self.tree.branching)
            count = counts[row] = len(node_tokens)
            token_ids[row, :count], parents[row, :count] = node_tokens, node_parents
        return Draft(token_ids=to_device(token_ids, self._device), num_tokens=counts,
                     parents=to_device(parents, self._device), depths=depths, max_children=self.tree.branching,
                     well_formed=True)
