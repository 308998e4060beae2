"""Logit rules that depend on a row's own tokens: a repetition penalty (Keskar et al. 2019, CTRL;
transformers' RepetitionPenaltyLogitsProcessor) and a minimum number of new tokens before EOS
(transformers' MinNewTokensLengthLogitsProcessor). They act on the raw logits, before
temperature, top-k and top-p, in greedy decoding too.

Invariant: the logits scoring the token at a position are adjusted from exactly the tokens that
precede that position (the prompt, the committed output and, inside a draft chain, the chain's
tokens before it) and from how many new tokens precede it, as plain decoding adjusts them at the
same position. The target's logits at every chain slot and a model drafter's at every depth are
adjusted alike, so speculative decoding stays lossless with the rules on. Under a RowSampling each
row has its own penalty (1 on rows without one, a factor that changes no bit).

Cost: nothing while both rules are off; otherwise one float32 copy of the logits [R, S, V]. With
a penalty, one host-to-device copy of the rows' committed tokens [R, T] per pass, a [R, V] mask
of the tokens seen and a few [R, V] operations per slot; with min_new_tokens, one masked fill.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import BatchState
from .transfer import to_device
from .types import PAD_ID, RowSampling, SamplingParams


def _penalised(scores: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """scores [R, ...] float32 with the repetition penalty applied to every entry (negative ones
    multiplied by it, the others divided), per row under a RowSampling (1 on rows without one,
    which changes no bit). Callers check penalises_repeats first."""
    if isinstance(params, RowSampling):
        divided = params.divide(scores, params.penalty, params.inv_penalty)
        return torch.where(scores < 0, scores * params.per_row(params.penalty, scores), divided)
    penalty = float(params.repetition_penalty)
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def penalises_repeats(params: SamplingParams | RowSampling) -> bool:
    if isinstance(params, RowSampling):
        return params.penalises
    return params.repetition_penalty not in (None, 1.0)


def rules_active(batch: BatchState, params: SamplingParams | RowSampling) -> bool:
    return penalises_repeats(params) or (batch.min_new_tokens > 0 and batch.has_eos())


def apply_token_rules(logits: torch.Tensor, batch: BatchState, rows: np.ndarray, extra: torch.Tensor | None,
                      seen_extra: int, params: SamplingParams | RowSampling,
                      committed_seen: torch.Tensor | None = None) -> torch.Tensor:
    """Adjusted float32 logits, a new tensor. logits: [R, S, V], slot s scoring the token after
    the committed tokens of ``rows`` [R] and the first ``seen_extra + s`` tokens of ``extra``
    [R, X] (tokens past the committed ones, PAD_ID where absent) -> [R, S, V]. committed_seen:
    committed_tokens_seen of the same rows, when the caller keeps it across passes (left unchanged)."""
    num_rows, num_slots, vocab_size = logits.shape
    device = logits.device
    adjusted = logits.to(torch.float32, copy=True)  # [R, S, V]
    if penalises_repeats(params):
        seen = (committed_tokens_seen(batch, rows, vocab_size, device) if committed_seen is None
                else committed_seen.clone())  # [R, V + 1], column V: absent
        added = 0
        for slot in range(num_slots):
            wanted = 0 if extra is None else min(seen_extra + slot, extra.shape[1])
            if wanted > added:  # the chain's tokens before this slot join the seen ones
                seen.scatter_(1, _with_spare_column(extra[:, added:wanted], vocab_size), True)
                added = wanted
            scores = adjusted[:, slot]  # [R, V]
            adjusted[:, slot] = torch.where(seen[:, :vocab_size], _penalised(scores, params), scores)
    if batch.min_new_tokens > 0 and batch.has_eos():
        new_before = batch.num_generated[rows][:, None] + seen_extra + np.arange(num_slots)  # [R, S]
        blocked = new_before < batch.min_new_tokens  # [R, S]
        if blocked.any():  # host data: rows past min_new_tokens cost nothing
            adjusted.masked_fill_(to_device(blocked, device)[..., None] & eos_mask(batch, rows, vocab_size, device)[:, None, :],
                                  float("-inf"))
    return adjusted


def apply_tree_token_rules(logits: torch.Tensor, batch: BatchState, rows: np.ndarray, token_ids: torch.Tensor,
                           reach: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """The same rules over a tree: slot 0 scores the token after the committed ones, slot i + 1
    the token after node i, which follows its ancestors and itself only. logits: [R, N + 1, V],
    token_ids: [R, N] (PAD_ID beyond a row's nodes), reach: [R, N, N] (sampling.tree_reach) ->
    adjusted float32 logits [R, N + 1, V], a new tensor. Cost: a [R, N + 1, V] mask of seen tokens."""
    num_rows, num_slots, vocab_size = logits.shape
    device = logits.device
    adjusted = logits.to(torch.float32, copy=True)  # [R, S, V]
    no_node = torch.zeros_like(reach[:, :1])  # [R, 1, N]: slot 0 follows the root alone
    before_slot = torch.cat([no_node, reach], dim=1)  # [R, S, N]: the nodes each slot's token follows
    if penalises_repeats(params):
        seen = committed_tokens_seen(batch, rows, vocab_size, device)[:, None, :].repeat(1, num_slots, 1)  # [R, S, V+1]
        index = torch.where(before_slot, token_ids[:, None, :], PAD_ID)  # [R, S, N]
        seen.scatter_(2, _with_spare_column(index, vocab_size), True)
        adjusted = torch.where(seen[..., :vocab_size], _penalised(adjusted, params), adjusted)
    if batch.min_new_tokens > 0 and batch.has_eos():
        generated = to_device(batch.num_generated[rows], device)  # [R]
        blocked = generated[:, None] + before_slot.sum(dim=2) < batch.min_new_tokens  # [R, S]
        adjusted.masked_fill_(blocked[..., None] & eos_mask(batch, rows, vocab_size, device)[:, None, :], float("-inf"))
    return adjusted


def eos_mask(batch: BatchState, rows: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """[R, V] bool: each row's EOS tokens."""
    ids = batch.row_eos[rows]  # [R, E]
    index = to_device(np.where(ids < 0, vocab_size, ids), device)  # padding -> a spare column, dropped
    mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    return mask.scatter_(1, index, True)[:, :vocab_size]


def _with_spare_column(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids with PAD_ID pointed at column ``vocab_size``, a spare one that is dropped."""
    return torch.where(tokens == PAD_ID, vocab_size, tokens)


def committed_tokens_seen(batch: BatchState, rows: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """[R, V + 1] bool: which tokens occur among each row's committed tokens (prompt included)."""
    width = int(batch.lengths[rows].max())
    committed = batch.token_ids[rows, :width].copy()  # [R, T]
    committed[np.arange(width)[None, :] >= batch.lengths[rows][:, None]] = PAD_ID
    index = _with_spare_column(to_device(committed, device), vocab_size)
    seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    return seen.scatter_(1, index, True)
