"""Acceptance rules and logits processing.

Distribution tests: each draws N independent rows (one seed each) through one rule and runs a
chi-square goodness-of-fit test of the emitted tokens against the processed target
distribution. Thresholds: the rule passes when the p-value exceeds ALPHA = 1e-3 (seeds are
fixed, so each test is deterministic). Power: with N = 60,000 and 6 to 8 categories a shift of
0.01 in one probability gives a chi-square statistic far beyond the threshold; the negative
controls below check that the same test rejects the draft distribution q where q != p.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import noise
from specdec.sampling import chain_verdict, process_logits, sample
from specdec.types import PAD_ID, SamplingParams

ALPHA = 1e-3
N = 60_000


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double().numpy()
    probs = probs.double().numpy()
    expected = probs / probs.sum() * counts.sum()
    support = expected > 0
    if counts[~support].sum() > 0:  # a token the distribution cannot produce: reject outright
        return 0.0
    return stats.chisquare(counts[support], expected[support]).pvalue


def run_one_position(target_logits, draft_probs_row, params, point_mass=False, draft_tokens=None):
    """K = 1: draft one token per row from draft_probs_row (or take draft_tokens), verify."""
    vocab = target_logits.shape[-1]
    seeds = torch.arange(N)
    positions = torch.full((N,), 7)
    if draft_tokens is None:
        draft_tokens = sample(draft_probs_row.expand(N, vocab), noise.stream_keys(seeds, positions, noise.DRAFT))
    verdict = chain_verdict(
        draft_token_ids=draft_tokens[:, None],
        num_draft_tokens=torch.ones(N, dtype=torch.long),
        target_logits=target_logits.expand(N, 2, vocab),
        draft_probs=None if point_mass else draft_probs_row.expand(N, 1, vocab),
        params=params,
        seeds=seeds,
        first_positions=positions,
    )
    return verdict, draft_tokens


TARGET_LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.3, 0.3, 1.5, -2.0, 0.8, 0.1]])  # [2, V]
DRAFT_LOGITS = torch.tensor([2.0, -0.3, 0.4, 1.0, -1.0, 0.5])  # [V]
PARAM_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.85),
]


@pytest.mark.parametrize("params", PARAM_CASES, ids=str)
def test_chain_rule_with_draft_probs_reproduces_target(params):
    target_probs = process_logits(TARGET_LOGITS, params)  # [2, V]
    draft_probs = process_logits(DRAFT_LOGITS, params)  # [V]
    verdict, draft_tokens = run_one_position(TARGET_LOGITS, draft_probs, params)
    first = verdict.token_ids[:, 0]
    assert chi_square_pvalue(first, target_probs[0]) > ALPHA
    # after an accepted first token the bonus token follows the next distribution
    accepted = verdict.num_accepted == 1
    assert chi_square_pvalue(verdict.token_ids[accepted, 1], target_probs[1]) > ALPHA
    # negative controls: the drafts themselves follow q, which the same test rejects as p; and the
    # classic bug of drawing a rejected row's token from p instead of the residual (p - q)+ gives
    # min(p, q) + (1 - alpha) p, which has p's support, so only the test's power can reject it
    assert chi_square_pvalue(draft_tokens, target_probs[0]) < ALPHA
    alpha = torch.minimum(target_probs[0], draft_probs).sum()
    recovered_from_p = torch.minimum(target_probs[0], draft_probs) + (1 - alpha) * target_probs[0]
    assert chi_square_pvalue(first, recovered_from_p) < ALPHA
    # acceptance rate matches alpha = sum min(p, q) within 4 standard errors
    alpha = torch.minimum(target_probs[0], draft_probs).sum().item()
    rate = accepted.double().mean().item()
    assert abs(rate - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / N)


@pytest.mark.parametrize("params", PARAM_CASES, ids=str)
@pytest.mark.parametrize("proposal", ["random", "constant"])
def test_point_mass_rule_reproduces_target(params, proposal):
    """Drafts with no probabilities (prompt lookup): whatever token is proposed, and however
    it was chosen, the emitted token follows p. The random proposals are not uniform: under a
    uniform proposal, drawing a rejected row's token from p itself (not from p without x) would
    also give p, and the test could not catch that bug."""
    target_probs = process_logits(TARGET_LOGITS, params)
    generator = torch.Generator().manual_seed(0)
    if proposal == "random":
        draft_tokens = torch.multinomial(DRAFT_LOGITS.softmax(-1), N, replacement=True, generator=generator)
    else:
        draft_tokens = torch.full((N,), 3)
    verdict, _ = run_one_position(TARGET_LOGITS, None, params, point_mass=True, draft_tokens=draft_tokens)
    assert chi_square_pvalue(verdict.token_ids[:, 0], target_probs[0]) > ALPHA
    # acceptance happens with probability p(x) for the proposed x
    expected_rate = target_probs[0][draft_tokens].double().mean().item()
    assert abs(verdict.num_accepted.double().mean().item() - expected_rate) < 4 * np.sqrt(0.25 / N)


CHAIN_TARGET = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.3, 0.3, 1.5, -2.0, 0.8, 0.1],
                             [-1.0, 2.0, 0.0, 0.5, 0.5, 1.0], [0.0, 0.0, 0.0, 3.0, -1.0, 1.0]])  # [K+1, V]
CHAIN_DRAFT = torch.tensor([[2.0, -0.3, 0.4, 1.0, -1.0, 0.5], [0.3, 0.0, 1.0, 0.0, 0.8, 0.4],
                            [-0.5, 1.5, 0.3, 0.5, 0.0, 1.0]])  # [K, V]


@pytest.mark.parametrize("point_mass", [False, True], ids=["with-probs", "point-mass"])
def test_three_token_chain_emits_each_slot_from_its_distribution(point_mass):
    """With slot distributions that do not depend on the prefix, the token emitted at slot j
    (accepted draft, recovered or bonus) follows p_j among the rows that reach slot j."""
    params = SamplingParams(temperature=1.0)
    target_probs = process_logits(CHAIN_TARGET, params)  # [4, V]
    draft_probs = process_logits(CHAIN_DRAFT, params)  # [3, V]
    seeds = torch.arange(N)
    positions = torch.full((N,), 3)
    slots = torch.arange(3)
    draft_tokens = sample(draft_probs.expand(N, 3, 6), noise.stream_keys(seeds[:, None], positions[:, None] + slots, noise.DRAFT))
    verdict = chain_verdict(draft_tokens, torch.full((N,), 3), CHAIN_TARGET.expand(N, 4, 6),
                            None if point_mass else draft_probs.expand(N, 3, 6), params, seeds, positions)
    for slot in range(4):
        reached = verdict.num_emitted > slot
        assert reached.sum() > 500  # enough rows for a chi-square over 6 categories
        assert chi_square_pvalue(verdict.token_ids[reached, slot], target_probs[slot]) > ALPHA
    if not point_mass:  # i.i.d. slots: the chance of reaching slot j is the product of the alphas before it
        alphas = torch.minimum(target_probs[:3], draft_probs).sum(-1)
        for slot in range(1, 4):
            expected = alphas[:slot].prod().item()
            assert abs((verdict.num_accepted >= slot).double().mean().item() - expected) < 4 * np.sqrt(0.25 / N)


def test_greedy_rule_table():
    """Rows: draft tokens, count, target argmax per slot -> emitted tokens, accepted."""
    cases = [
        ([3, 1, 4], 3, [3, 1, 4, 5], [3, 1, 4, 5], 3),  # all accepted, bonus
        ([3, 1, 4], 3, [3, 2, 4, 5], [3, 2], 1),  # rejected at the second: recovered argmax
        ([3, 1, 4], 3, [0, 1, 4, 5], [0], 0),  # rejected at once
        ([3, 1, PAD_ID], 2, [3, 1, 7, 5], [3, 1, 7], 2),  # shorter draft: bonus at its end
        ([PAD_ID] * 3, 0, [6, 1, 2, 3], [6], 0),  # no draft: plain decoding
    ]
    vocab = 8
    for draft, count, argmaxes, emitted, accepted in cases:
        logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).double()[None]  # [1, 4, V]
        verdict = chain_verdict(torch.tensor([draft]), torch.tensor([count]), logits, None, SamplingParams(),
                                torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        assert verdict.token_ids[0, : len(emitted)].tolist() == emitted
        assert (verdict.token_ids[0, len(emitted):] == PAD_ID).all()
        assert verdict.num_accepted.item() == accepted and verdict.num_emitted.item() == len(emitted)


@pytest.mark.parametrize("params", PARAM_CASES[1:], ids=str)
def test_processing_matches_hugging_face_warpers(params):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=generator) * 3
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k is not None:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p is not None:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    torch.testing.assert_close(process_logits(logits, params), scores.softmax(-1))


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    keys = noise.stream_keys(torch.arange(N), torch.zeros(N, dtype=torch.long), noise.TARGET)
    tokens = sample(probs.expand(N, 5), keys)
    assert chi_square_pvalue(tokens, probs) > ALPHA
