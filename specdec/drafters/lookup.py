"""PromptLookupDrafter: propose the tokens that followed the latest earlier occurrence of the
row's last n tokens, for the longest n in [min_ngram, max_ngram] that occurs
(prompt lookup decoding, Saxena 2023; ALGORITHMS.md §6).

Invariant: a proposal is copied from the row's own prompt plus committed output, never
invented; a row with no match proposes nothing that step (plain decoding for it). Proposals are
point masses (no probabilities), which the acceptance rule handles exactly.

Example, tokens ``a b c d a b`` with max_ngram 2: the suffix ``a b`` last occurred at index 0,
followed by ``c d a b``, so k = 3 proposes ``c d a``.

Cost: on the host, O(rows x length x n) comparisons per step, vectorised over rows.
"""

from __future__ import annotations

import numpy as np

from ..transfer import to_device
from numpy.lib.stride_tricks import sliding_window_view

from ..batch import BatchState
from ..types import PAD_ID, Draft
from .base import Drafter


def find_continuations(
    token_ids: np.ndarray, lengths: np.ndarray, num_tokens: np.ndarray, min_ngram: int, max_ngram: int
) -> tuple[np.ndarray, np.ndarray]:
    """Longest-and-latest n-gram match per row.

    token_ids: [B, T] (valid up to lengths), lengths: [B], num_tokens: [B] wanted ->
    (proposals [B, K] padded with PAD_ID, counts [B]) with K = max(num_tokens).
    """
    num_rows, width = token_ids.shape
    max_tokens = int(num_tokens.max(initial=0))
    match_start = np.full(num_rows, -1, dtype=np.int64)  # start of the chosen earlier occurrence
    match_len = np.zeros(num_rows, dtype=np.int64)
    for n in range(max_ngram, min_ngram - 1, -1):
        if width < n + 1:
            continue
        undecided = (match_start < 0) & (lengths > n) & (num_tokens > 0)
        if not undecided.any():
            continue
        windows = sliding_window_view(token_ids, n, axis=1)  # [B, T-n+1, n]
        suffix_index = np.clip(lengths[:, None] - n + np.arange(n), 0, width - 1)  # [B, n]
        suffix = np.take_along_axis(token_ids, suffix_index, axis=1)  # [B, n]
        starts = np.arange(windows.shape[1])  # [W]
        # an earlier occurrence must end before the row's last token
        found = (windows == suffix[:, None, :]).all(axis=2) & (starts[None, :] + n < lengths[:, None])
        found &= undecided[:, None]
        has = found.any(axis=1)
        latest = windows.shape[1] - 1 - np.argmax(found[:, ::-1], axis=1)
        match_start = np.where(has, latest, match_start)
        match_len = np.where(has, n, match_len)
    first = match_start + match_len  # [B] index of the first proposed token
    counts = np.where(match_start >= 0, np.minimum(num_tokens, lengths - first), 0)
    columns = np.arange(max_tokens)
    source = np.clip(first[:, None] + columns, 0, width - 1)  # [B, K]
    proposals = np.where(columns < counts[:, None], np.take_along_axis(token_ids, source, axis=1), PAD_ID)
    return proposals, counts


class PromptLookupDrafter(Drafter):
    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(
                f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, max_ngram={max_ngram!r}"
            )
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def describe(self) -> str:
        return f"PromptLookupDrafter(n={self.min_ngram}..{self.max_ngram})"

    def start(self, batch, sampling, device, max_draft_tokens) -> None:
        self._device = device

    def propose(self, batch: BatchState, num_tokens: np.ndarray) -> Draft:
        proposals, counts = find_continuations(
            batch.token_ids, batch.lengths, num_tokens, self.min_ngram, self.max_ngram
        )
        return Draft(token_ids=to_device(proposals, self._device), num_tokens=counts)
