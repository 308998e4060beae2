"""End to end: the first two tokens sampled by generate() follow the target's own distribution.

A tiny-vocabulary model (V = 8) gives the exact joint distribution of the first two tokens,
P(t1, t2) = P(t1 | prompt) P(t2 | prompt, t1), by enumeration. N = 8,000 requests of the same
prompt (one seed each) go through generate() and a chi-square test compares the 64 joint
counts with it (cells with expected count < 5 pooled). Threshold: p-value > 1e-3. Negative
controls: the same test must reject the draft model's own distribution, and the target's joint
with 0.05 of probability moved between its two likeliest pairs (the same support; the expected
chi-square statistic is about 250 at N = 8,000 against a critical value of about 57).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter, SelfSpeculativeDrafter, SPIReDrafter, SpireDraft
from specdec.policies import FixedPolicy
from specdec.sampling import process_logits
from specdec.verifiers import PaddedVerifier, PaddingFreeVerifier
from tests.tiny import AlternatingPolicy, chisquare_pvalue, make_model, perturbed_copy, random_prompts, shifted

ALPHA = 1e-3
N = 8_000
VOCAB = 8
PROMPT = [1, 2, 5, 1, 2]  # prompt lookup finds "1 2" earlier and proposes "5 1" (p(5) is about 0.43)
PARAMS = SamplingParams(temperature=1.0, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", vocab_size=VOCAB, seed=4)


@pytest.fixture(scope="module")
def drafter_model(target):
    return perturbed_copy(target, scale=0.6, seed=2)


def joint_first_two(model, params) -> np.ndarray:
    """[V, V] exact probabilities of the first two tokens under ``params``."""
    with torch.no_grad():
        first = process_logits(model(torch.tensor([PROMPT])).logits[0, -1], params)  # [V]
        continued = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = process_logits(model(continued).logits[:, -1], params)  # [V, V]
    return (first[:, None] * second).double().numpy()


def joint_pvalue(sequences, joint: np.ndarray) -> float:
    counts = np.zeros_like(joint)
    for first, second in sequences:
        counts[first, second] += 1
    return chisquare_pvalue(counts, joint)


@pytest.mark.parametrize(
    "drafter_kind,verifier_class,num_draft_tokens",
    [("none", PaddingFreeVerifier, 0), ("model", PaddingFreeVerifier, 1), ("model", PaddingFreeVerifier, 2),
     ("model", PaddedVerifier, 3), ("lookup", PaddingFreeVerifier, 2), ("self", PaddingFreeVerifier, 2),
     ("self", PaddedVerifier, 3), ("spire", PaddingFreeVerifier, 3)],
)
def test_first_two_tokens_follow_the_target(target, drafter_model, drafter_kind, verifier_class, num_draft_tokens):
    drafter = {"none": None, "model": ModelDrafter(drafter_model), "lookup": PromptLookupDrafter(),
               # the target over its first and last two positions: a draft distribution of its own
               "self": SelfSpeculativeDrafter(sink=1, window=2),
               "spire": SPIReDrafter(SpireDraft.from_target(target, window=2)) if drafter_kind == "spire" else None,
               }[drafter_kind]
    out = generate(target, [PROMPT] * N, drafter=drafter, verifier=verifier_class(),
                   policy=FixedPolicy(num_draft_tokens), max_new_tokens=4, sampling=PARAMS, seed=0)
    assert all(len(s) == 4 for s in out.sequences)
    first_two = [s[:2] for s in out.sequences]
    joint = joint_first_two(target, PARAMS)
    assert joint_pvalue(first_two, joint) > ALPHA
    if num_draft_tokens >= 2 and drafter_kind in ("model", "self", "spire"):  # chains reached their second and third slots
        assert out.stats.accepted_by_position[1] > 1000
    if num_draft_tokens == 1:  # token 2 is the bonus token wherever token 1 was accepted
        assert out.stats.accepted_by_position[0] > 1000
    if drafter_kind != "none":
        assert 0.0 < out.stats.acceptance_rate < 1.0  # both branches of the rule ran
    # negative controls: the same test tells the drafter's distribution, and a small shift, apart
    assert joint_pvalue(first_two, joint_first_two(drafter_model, PARAMS)) < ALPHA
    assert joint_pvalue(first_two, shifted(joint)) < ALPHA


def test_two_drafters_mixed_within_each_step(target, drafter_model):
    """Rows alternate between a drafter with probabilities and prompt lookup (point mass), so
    every step merges both kinds of proposal."""
    out = generate(target, [PROMPT] * N, drafter=[ModelDrafter(drafter_model), PromptLookupDrafter()],
                   policy=AlternatingPolicy(2), max_new_tokens=4, sampling=PARAMS, seed=0)
    first_two = [s[:2] for s in out.sequences]
    assert joint_pvalue(first_two, joint_first_two(target, PARAMS)) > ALPHA
    assert joint_pvalue(first_two, joint_first_two(drafter_model, PARAMS)) < ALPHA


def test_output_does_not_depend_on_the_batch(target, drafter_model):
    """A request's sampled output depends only on its seed, not on who shares its batch."""
    prompts = random_prompts(6, VOCAB, seed=1)
    seeds = [101, 202, 303, 404, 505, 606]
    kwargs = dict(drafter=ModelDrafter(drafter_model), policy=FixedPolicy(3), max_new_tokens=12, sampling=PARAMS)
    together = generate(target, prompts, seed=seeds, **kwargs).sequences
    alone = [generate(target, [p], seed=[s], **kwargs).sequences[0] for p, s in zip(prompts, seeds)]
    reordered = generate(target, prompts[::-1], seed=seeds[::-1], **kwargs).sequences[::-1]
    assert together == alone == reordered
    assert len(set(map(tuple, together))) > 1


def test_same_seed_same_output_different_seed_different_output(target):
    kwargs = dict(max_new_tokens=10, sampling=SamplingParams(temperature=1.0))
    first = generate(target, [PROMPT] * 4, seed=7, **kwargs).sequences
    again = generate(target, [PROMPT] * 4, seed=7, **kwargs).sequences
    other = generate(target, [PROMPT] * 4, seed=8, **kwargs).sequences
    assert first == again and first != other


def hf_processed_joint(model, penalty: float, min_new_tokens: int, eos: int) -> np.ndarray:
    """[V, V] exact probabilities of the first two tokens under transformers' own processors:
    repetition penalty and min_new_tokens on the float32 logits, then PARAMS' warpers."""
    from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    processors = [RepetitionPenaltyLogitsProcessor(penalty),
                  MinNewTokensLengthLogitsProcessor(len(PROMPT), min_new_tokens, eos),
                  TemperatureLogitsWarper(PARAMS.temperature), TopKLogitsWarper(PARAMS.top_k),
                  TopPLogitsWarper(PARAMS.top_p)]

    def next_probs(input_ids: torch.Tensor) -> torch.Tensor:  # [N, L] -> [N, V]
        with torch.no_grad():
            scores = model(input_ids).logits[:, -1].float()
        for processor in processors:
            scores = processor(input_ids, scores)
        return scores.softmax(dim=-1)

    first = next_probs(torch.tensor([PROMPT]))[0]  # [V]
    second = next_probs(torch.tensor([PROMPT + [t] for t in range(VOCAB)]))  # [V, V]
    return (first[:, None] * second).double().numpy()


@pytest.mark.parametrize("drafter_kind", ["model", "lookup"])
def test_repetition_penalty_and_min_new_tokens_keep_the_target_distribution(target, drafter_model, drafter_kind):
    """With a repetition penalty of 1.5 and EOS (the likeliest first token) held back for 2 new
    tokens, the first two sampled tokens follow transformers' processed joint; the same test
    tells apart the joint without those rules."""
    plain_joint = joint_first_two(target, PARAMS)
    eos = int(plain_joint.sum(axis=1).argmax())
    drafter = ModelDrafter(drafter_model) if drafter_kind == "model" else PromptLookupDrafter()
    sampling = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p,
                              repetition_penalty=1.5)
    out = generate(target, [PROMPT] * N, drafter=drafter, policy=FixedPolicy(2), max_new_tokens=4, sampling=sampling,
                   seed=0, eos_token_id=eos, min_new_tokens=2, return_logprobs=True)
    first_two = [s[:2] for s in out.sequences]
    assert 0.0 < out.stats.acceptance_rate < 1.0
    joint = hf_processed_joint(target, 1.5, 2, eos)
    assert joint_pvalue(first_two, joint) > ALPHA
    assert joint_pvalue(first_two, plain_joint) < ALPHA
    # each emitted token's log-probability is that of the processed distribution it was drawn from
    first_logprobs = np.array([lp[0] for lp in out.logprobs])
    second_logprobs = np.array([lp[1] for lp in out.logprobs])
    pairs = np.array(first_two)  # [N, 2]
    first_marginal = joint.sum(axis=1)
    np.testing.assert_allclose(first_logprobs, np.log(first_marginal[pairs[:, 0]]), atol=1e-5)
    np.testing.assert_allclose(second_logprobs, np.log(joint[pairs[:, 0], pairs[:, 1]] / first_marginal[pairs[:, 0]]),
                               atol=1e-5)
