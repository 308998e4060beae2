"""The Verifier protocol: score every active row's last committed token plus its draft in one
target forward pass, then apply the chain acceptance rule (sampling.py).

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
from ..sampling import chain_verdict
from ..token_rules import apply_token_rules, rules_active
from ..types import PAD_ID, Draft, SamplingParams, Verdict, VerifyCost


class Verifier(ABC):
    def verify(
        self, runner: ModelRunner, batch: BatchState, draft: Draft, sampling: SamplingParams, logprobs: bool = False
    ) -> tuple[Verdict, VerifyCost]:
        """One target pass over every active row's chain -> (verdict, cost); with ``logprobs`` the
        verdict carries each emitted token's log-probability (sampling.emitted_logprobs)."""
        rows = batch.active_rows()  # [A]
        device = runner.device
        num_draft = draft.num_tokens[rows]  # [A]
        rows_t, last_t, num_draft_t, seeds_t, lengths_t = to_device_many(
            [rows, batch.last_token_ids(rows), num_draft, batch.seeds[rows], batch.lengths[rows]], device)
        every_row = len(rows) == batch.num_rows  # the common case: no row gathering or scattering
        draft_ids = draft.token_ids if every_row else draft.token_ids[rows_t]  # [A, K]
        chains = torch.cat([last_t[:, None], draft_ids], dim=1)  # [A, K+1]: last committed token, then the draft
        target_logits, cost = self.score(runner, batch, rows, chains, num_draft)  # [A, K+1, V]
        if rules_active(batch, sampling):  # slot j follows the committed tokens and draft tokens 1..j
            target_logits = apply_token_rules(target_logits, batch, rows, draft_ids, 0, sampling)
        draft_probs = draft.probs if draft.probs is None or every_row else draft.probs[rows_t]
        verdict = chain_verdict(
            draft_token_ids=draft_ids,
            num_draft_tokens=num_draft_t,
            target_logits=target_logits,
            draft_probs=draft_probs,
            params=sampling,
            seeds=seeds_t,
            first_positions=lengths_t,
            logprobs=logprobs,
        )
        return (verdict if every_row else _scatter_rows(verdict, rows_t, batch.num_rows)), cost

    @abstractmethod
    def score(
        self, runner: ModelRunner, batch: BatchState, rows: np.ndarray, chains: torch.Tensor, num_draft: np.ndarray
    ) -> tuple[torch.Tensor, VerifyCost]:
        """Target logits for every chain slot. chains: [A, K+1] (PAD_ID beyond 1 + num_draft)
        -> (logits [A, K+1, V], cost). Slots beyond a row's chain may hold anything."""


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
    logprobs = None
    if verdict.logprobs is not None:
        logprobs = torch.zeros(num_rows, width, dtype=torch.float32, device=device)
        logprobs[rows] = verdict.logprobs
    return Verdict(token_ids=token_ids, num_emitted=num_emitted, num_accepted=num_accepted, logprobs=logprobs)


def chain_layout(batch: BatchState, rows: np.ndarray, chain_lengths: np.ndarray) -> PackedLayout:
    """Each row's chain starts at its last committed token's position."""
    return PackedLayout(rows=rows, starts=batch.lengths[rows] - 1, counts=chain_lengths)
