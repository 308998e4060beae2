"""Token trees through the whole loop: the first three tokens sampled by generate() with tree
drafts follow the target's own joint distribution.

A two-layer model with a vocabulary of 4 (so the cache matters: each token attends to the
whole row) gives the exact joint of the first three tokens, P(t1) P(t2 | t1) P(t3 | t1, t2), by
enumeration (64 cells). N = 6,000 requests of one prompt (a seed each) go through generate()
with trees of 2 levels and up to 3 children a node (6 nodes); a step that accepts one node emits
two tokens, and the next step reads the cache that one compacted (a second or third sibling
moves to the first one's slot), so a wrong bonus, residual or compaction shows in the joint
(without the compaction the p-value was about 1e-34). Chi-square over the 64 cells (expected counts below 5 pooled),
threshold p > 1e-3. Negative controls in the same test: the drafter's joint and the target's
with 0.05 moved between its two likeliest cells must be rejected (expected statistic about 200
at N = 6,000 against a critical value of about 100).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy
from specdec.sampling import process_logits
from specdec.verifiers import TreeVerifier
from tests.tiny import chisquare_pvalue, make_model, perturbed_copy, shifted

ALPHA = 1e-3
N = 6_000
VOCAB = 4
PROMPT = [1, 2, 3, 1, 2]  # prompt lookup finds "1 2" earlier and proposes "3 1 2"
PARAMS = SamplingParams(temperature=0.8)


@pytest.fixture(scope="module")
def target():
    return make_model("llama", vocab_size=VOCAB, num_layers=2, hidden=64, seed=5)


@pytest.fixture(scope="module")
def drafter_model(target):
    return perturbed_copy(target, scale=1.5, seed=3)


def joint_first_three(model) -> np.ndarray:
    """[V, V, V] exact probabilities of the first three tokens under PARAMS."""
    with torch.no_grad():
        first = process_logits(model(torch.tensor([PROMPT])).logits[0, -1], PARAMS)  # [V]
        pairs = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        second = process_logits(model(pairs).logits[:, -1], PARAMS)  # [V, V]
        triples = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third = process_logits(model(triples).logits[:, -1], PARAMS).view(VOCAB, VOCAB, VOCAB)
    return (first[:, None, None] * second[:, :, None] * third).double().numpy()


def joint_pvalue(sequences, joint: np.ndarray) -> float:
    counts = np.zeros(joint.size)
    np.add.at(counts, [np.ravel_multi_index(tuple(s[:3]), joint.shape) for s in sequences], 1)
    return chisquare_pvalue(counts.reshape(joint.shape), joint)


@pytest.mark.parametrize("kind", ["sampled children", "top-k children", "prompt-lookup trie"])
def test_first_three_tokens_follow_the_target(target, drafter_model, kind):
    drafter = {"sampled children": lambda: ModelDrafter(drafter_model, tree=TreeSpec(2, 3, sampled=True)),
               "top-k children": lambda: ModelDrafter(drafter_model, tree=TreeSpec(2, 3, sampled=False)),
               "prompt-lookup trie": lambda: PromptLookupDrafter(tree=TreeSpec(2, 3))}[kind]()
    out = generate(target, [PROMPT] * N, drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(6),
                   max_new_tokens=3, sampling=PARAMS, seed=0)
    assert all(len(s) == 3 for s in out.sequences)
    joint = joint_first_three(target)
    assert joint_pvalue(out.sequences, joint) > ALPHA
    # nodes were accepted at both depths and rejected too
    assert out.stats.accepted_by_position[1] > (20 if kind == "prompt-lookup trie" else 200)
    assert 0.0 < out.stats.acceptance_by_position[0] < 1.0
    assert joint_pvalue(out.sequences, joint_first_three(drafter_model)) < ALPHA
    assert joint_pvalue(out.sequences, shifted(joint)) < ALPHA
