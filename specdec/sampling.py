"""Logits to probabilities, and the lossless acceptance rules.

Vocabulary (used everywhere in specdec): a draft token is **accepted** when the rule keeps it;
at the first rejection a **recovered** token is sampled from the residual distribution; when
every draft token is accepted a **bonus** token is sampled from the target's next distribution;
**emitted** = accepted + one recovered or bonus token, so every step emits at least one token.

Rules (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
- greedy (temperature 0): accept while the draft token equals the target's argmax; the
  emitted token at the first mismatch (or after the last draft token) is the target's argmax.
  The output is token-identical to the target's own greedy decoding.
- chain rejection sampling: accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection j sample from normalise(max(0, p_j - q_j)); after k acceptances sample
  the bonus from p_{k+1}. The output is distributed exactly as the processed target
  distribution p.
- point mass (a drafter that returns no probabilities): q is one-hot on the draft token, so
  accept with probability p_i(x_i) and on rejection sample from p_j with x_j removed.

Every random number comes from ``noise.py``, keyed by (request seed, token position, purpose);
no rule synchronises with the host.
"""

from __future__ import annotations

import torch

from . import noise
from .types import PAD_ID, SamplingParams, Verdict


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; returns float32 probabilities.

    logits: [..., V] -> probs [..., V]. Not for greedy params (there is no distribution).
    """
    if params.greedy:
        raise ValueError("process_logits needs temperature > 0; greedy decoding uses argmax")
    scores = logits.float() / params.temperature  # [..., V]
    vocab_size = scores.shape[-1]
    if params.top_k is not None and params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [..., V]
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p  # keeps the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per distribution by the exponential race. probs: [..., V], keys: [...] -> [...]."""
    race = probs / noise.exponential_noise(keys, probs.shape[-1])  # [..., V]
    return race.argmax(dim=-1)


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, positions: torch.Tensor, purpose: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose one token per row from its logits: argmax when greedy, else a keyed sample.

    logits: [R, V], seeds: [R], positions: [R] (position the token will take) ->
    (token_ids [R], probs [R, V] or None when greedy).
    """
    if params.greedy:
        return logits.argmax(dim=-1), None
    probs = process_logits(logits, params)  # [R, V]
    return sample(probs, noise.stream_keys(seeds, positions, purpose)), probs


def chain_verdict(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
) -> Verdict:
    """Apply the chain acceptance rule to every row at once.

    draft_token_ids: [R, K] (PAD_ID beyond num_draft_tokens), num_draft_tokens: [R],
    target_logits: [R, K+1, V] (slot j scores the token at first_positions + j),
    draft_probs: [R, K, V] or None (point mass), seeds: [R], first_positions: [R]
    (position of the first draft token) -> Verdict with token_ids [R, K+1].
    """
    num_rows, max_draft = draft_token_ids.shape
    device = target_logits.device
    slots = torch.arange(max_draft + 1, device=device)  # [K+1]
    is_draft_slot = slots[:max_draft] < num_draft_tokens[:, None]  # [R, K]
    safe_draft_ids = draft_token_ids.clamp(min=0)  # [R, K]

    if params.greedy:
        target_choice = target_logits.argmax(dim=-1)  # [R, K+1]
        accepted = (safe_draft_ids == target_choice[:, :max_draft]) & is_draft_slot  # [R, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]
        # Accepted drafts equal the target's argmax, so the emitted tokens are its argmax.
        emitted_candidates = target_choice  # [R, K+1]
    else:
        positions = first_positions[:, None] + slots  # [R, K+1]
        target_probs = process_logits(target_logits, params)  # [R, K+1, V]
        target_at_draft = target_probs[:, :max_draft].gather(-1, safe_draft_ids[..., None])[..., 0]  # [R, K]
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(-1, safe_draft_ids[..., None])[..., 0]  # [R, K]
        accept_u = noise.uniform(noise.stream_keys(seeds[:, None], positions[:, :max_draft], noise.ACCEPT))
        accepted = (accept_u * draft_at_draft.double() < target_at_draft.double()) & is_draft_slot  # [R, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]
        residual = _residual_probs(target_probs, draft_probs, safe_draft_ids, is_draft_slot)  # [R, K+1, V]
        recovered = sample(residual, noise.stream_keys(seeds[:, None], positions, noise.TARGET))  # [R, K+1]
        draft_then_pad = torch.cat([safe_draft_ids, safe_draft_ids.new_zeros(num_rows, 1)], dim=1)
        emitted_candidates = torch.where(slots < num_accepted[:, None], draft_then_pad, recovered)

    num_emitted = num_accepted + 1  # [R]
    token_ids = emitted_candidates.masked_fill(slots >= num_emitted[:, None], PAD_ID)  # [R, K+1]
    return Verdict(token_ids=token_ids, num_emitted=num_emitted, num_accepted=num_accepted)


def emitted_logprobs(target_logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probability of each emitted token under the target's processed distribution at its
    slot: log-softmax of the logits when greedy (as transformers' transition scores), the log of
    ``process_logits`` otherwise. target_logits: [R, K+1, V], token_ids: [R, K+1] (PAD_ID beyond
    the emitted ones, which get 0) -> [R, K+1] float32."""
    if params.greedy:
        log_probs = target_logits.float().log_softmax(dim=-1)  # [R, K+1, V]
    else:
        log_probs = process_logits(target_logits, params).log()
    chosen = log_probs.gather(-1, token_ids.clamp(min=0)[..., None])[..., 0]  # [R, K+1]
    return chosen.masked_fill(token_ids == PAD_ID, 0.0)


def _residual_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_ids: torch.Tensor, is_draft_slot: torch.Tensor
) -> torch.Tensor:
    """Distribution to sample from at each slot if the chain stops there (unnormalised).

    At a draft slot: max(0, p - q) (point mass: p with the draft token removed). After the last
    draft token (the bonus slot): p itself. target_probs: [R, K+1, V] -> [R, K+1, V].
    """
    max_draft = draft_ids.shape[1]
    at_drafts = target_probs[:, :max_draft]  # [R, K, V]
    if draft_probs is None:
        residual = at_drafts.scatter(-1, draft_ids[..., None], 0.0)
    else:
        residual = (at_drafts - draft_probs).clamp(min=0.0)
    # A residual with no mass can only arise from rounding (p == q); fall back to p there.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(is_draft_slot[..., None] & ~empty, residual, at_drafts)
    return torch.cat([residual, target_probs[:, max_draft:]], dim=1)
