"""Logit rules that depend on a row's own tokens: a repetition penalty (Keskar et al. 2019, CTRL;
transformers' RepetitionPenaltyLogitsProcessor) and a minimum number of new tokens before EOS
(transformers' MinNewTokensLengthLogitsProcessor). They act on the raw logits, before
temperature, top-k and top-p, in greedy decoding too.

Invariant: the logits scoring the token at a position are adjusted from exactly the tokens that
precede that position (the prompt, the committed output and, inside a draft chain, the chain's
tokens before it) and from how many new tokens precede it, as plain decoding adjusts them at the
same position. The target's logits at every chain slot and a model drafter's at every depth are
adjusted alike, so speculative decoding stays lossless with the rules on.

Cost: nothing while both rules are off. With a penalty, one host-to-device copy of the rows'
committed tokens [R, T] per pass and a gather and scatter of [R, S, T + X] logits; with
min_new_tokens, one masked fill.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import BatchState
from .transfer import to_device
from .types import PAD_ID, SamplingParams


def _penalty(params: SamplingParams) -> float | None:
    return None if params.repetition_penalty in (None, 1.0) else float(params.repetition_penalty)


def rules_active(batch: BatchState, params: SamplingParams) -> bool:
    return _penalty(params) is not None or (batch.min_new_tokens > 0 and len(batch.eos_token_ids) > 0)


def apply_token_rules(logits: torch.Tensor, batch: BatchState, rows: np.ndarray, extra: torch.Tensor | None,
                      seen_extra: int, params: SamplingParams) -> torch.Tensor:
    """Adjusted float32 logits. logits: [R, S, V], slot s scoring the token after the committed
    tokens of ``rows`` [R] and the first ``seen_extra + s`` tokens of ``extra`` [R, X] (tokens past
    the committed ones, PAD_ID where absent) -> [R, S, V]."""
    num_rows, num_slots, vocab_size = logits.shape
    device = logits.device
    logits = logits.float()
    if _penalty(params) is not None:
        logits = _penalise_repeats(logits, batch, rows, extra, seen_extra, _penalty(params))
    if batch.min_new_tokens > 0 and len(batch.eos_token_ids):
        new_before = batch.num_generated[rows][:, None] + seen_extra + np.arange(num_slots)  # [R, S]
        blocked = to_device(new_before < batch.min_new_tokens, device)  # [R, S]
        eos = to_device(batch.eos_token_ids, device)  # [E]
        eos_logits = logits[..., eos]  # [R, S, E]
        logits[..., eos] = eos_logits.masked_fill(blocked[..., None], float("-inf"))
    return logits


def _penalise_repeats(logits: torch.Tensor, batch: BatchState, rows: np.ndarray, extra: torch.Tensor | None,
                      seen_extra: int, penalty: float) -> torch.Tensor:
    """Every token that occurs before a slot has its logit divided by ``penalty`` when positive and
    multiplied by it when negative (once, however often it occurs)."""
    num_rows, num_slots, vocab_size = logits.shape
    device = logits.device
    width = int(batch.lengths[rows].max())
    committed = batch.token_ids[rows, :width].copy()  # [R, T]
    committed[np.arange(width)[None, :] >= batch.lengths[rows][:, None]] = PAD_ID
    index = to_device(committed, device)[:, None, :].expand(num_rows, num_slots, width)  # [R, S, T]
    if extra is not None and extra.shape[1] > 0:
        visible = torch.arange(extra.shape[1], device=device)[None, :] < (
            seen_extra + torch.arange(num_slots, device=device))[:, None]  # [S, X]
        extra_index = extra[:, None, :].expand(num_rows, num_slots, -1).masked_fill(~visible, PAD_ID)  # [R, S, X]
        index = torch.cat([index, extra_index], dim=2)
    index = torch.where(index == PAD_ID, vocab_size, index)  # absent tokens point at a spare column
    widened = torch.cat([logits, logits.new_zeros(num_rows, num_slots, 1)], dim=2)  # [R, S, V + 1]
    scores = widened.gather(2, index)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return widened.scatter(2, index, scores)[..., :vocab_size]
