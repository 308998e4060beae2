"""PromptLookupDrafter: propose the tokens that followed the latest earlier occurrence of the
row's last n tokens, for the longest n in [min_ngram, max_ngram] that occurs
(prompt lookup decoding, Saxena 2023; ALGORITHMS.md §6).

Invariant: a proposal is copied from the row's own prompt plus committed output, never
invented; a row with no match proposes nothing that step (plain decoding for it). Proposals are
point masses (no probabilities), which the acceptance rule handles exactly.

Example, tokens ``a b c d a b`` with max_ngram 2: the suffix ``a b`` last occurred at index 0,
followed by ``c d a b``, so k = 3 proposes ``c d a``.

Cost: on the host, max_ngram passes over the [rows, length] token array per step, vectorised
(about 0.1 ms at 1 row and 0.2 ms at 64 rows of 450 tokens on one CPU core: numpy's per-call
overhead dominates, hence fancy indexing rather than take_along_axis and clip).
"""

from __future__ import annotations

import numpy as np

from ..transfer import to_device

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
