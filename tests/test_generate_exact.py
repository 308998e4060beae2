"""Exactness grid: greedy speculative output is token-identical to the target's own greedy
decoding (Hugging Face generate(do_sample=False), each prompt alone), for every drafter x
verifier x draft length x batch size x architecture, with rows stopping at EOS and at
max_new_tokens at different steps."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.types import Plan
from specdec.verifiers import DecomposedVerifier, PaddedVerifier, PaddingFreeVerifier
from transformers import GPT2Config, GPT2LMHeadModel

from tests.tiny import ARCHS, AlternatingPolicy, cached_model, device_params, hf_greedy, make_model, perturbed_copy, random_prompts

MAX_NEW_TOKENS = 24  # not a multiple of k + 1 for k in {1, 3, 6}: the budget ends inside a draft


@functools.lru_cache(maxsize=None)
def drafter_model(arch, device, dtype):
    return perturbed_copy(cached_model(arch, device, dtype), scale=0.1)


@functools.lru_cache(maxsize=None)
def reference(arch, device, dtype, prompt: tuple, eos_token_id):
    return hf_greedy(cached_model(arch, device, dtype), list(prompt), MAX_NEW_TOKENS, eos_token_id)


def eos_for(arch, device, dtype, prompts):
    """A token that the first prompt's greedy output emits mid-way: that row stops early at it."""
    return reference(arch, device, dtype, tuple(prompts[0]), None)[8]


def make_drafter(kind, arch, device, dtype):
    if kind == "model":
        return ModelDrafter(drafter_model(arch, device, dtype))
    return PromptLookupDrafter(min_ngram=1, max_ngram=3)


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 6])
@pytest.mark.parametrize("verifier_class", [PaddedVerifier, PaddingFreeVerifier, DecomposedVerifier])
@pytest.mark.parametrize("drafter_kind", ["model", "lookup"])
def test_greedy_output_equals_target_greedy(drafter_kind, verifier_class, num_draft_tokens, batch_size, arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(batch_size, target.config.vocab_size, seed=batch_size)
    eos = eos_for(arch, device, dtype, prompts)
    expected = [reference(arch, device, dtype, tuple(p), eos) for p in prompts]

    out = generate(
        target,
        prompts,
        drafter=make_drafter(drafter_kind, arch, device, dtype),
        verifier=verifier_class(),
        policy=FixedPolicy(num_draft_tokens=num_draft_tokens),
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=eos,
    )

    assert out.sequences == expected
    assert [r.emitted for r in out.stats.requests] == [len(s) for s in expected]
    assert out.stats.drafted > 0


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
def test_plain_decoding_through_the_loop(arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(5, target.config.vocab_size, seed=11)
    out = generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference(arch, device, dtype, tuple(p), None) for p in prompts]
    assert out.stats.tau == 1.0 and out.stats.drafted == 0


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("num_draft_tokens", [3, 6])
def test_eos_inside_a_fully_accepted_draft(num_draft_tokens, device, dtype):
    """The target drafting for itself accepts everything, so a step spans k + 1 tokens and an
    EOS at an output index that is not a multiple of k + 1 falls inside a draft."""
    target = cached_model("llama", device, dtype)
    prompts = random_prompts(4, target.config.vocab_size, seed=5)
    free_running = reference("llama", device, dtype, tuple(prompts[0]), None)
    eos_index = next(i for i, t in enumerate(free_running) if i % (num_draft_tokens + 1) not in (0, num_draft_tokens) and free_running.index(t) == i)
    eos = free_running[eos_index]
    expected = [reference("llama", device, dtype, tuple(p), eos) for p in prompts]
    assert len(expected[0]) == eos_index + 1

    out = generate(target, prompts, drafter=ModelDrafter(target), policy=FixedPolicy(num_draft_tokens),
                   max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)

    assert out.sequences == expected
    first = out.stats.requests[0]
    assert first.steps == eos_index // (num_draft_tokens + 1) + 1
    # earlier steps emit k accepted + 1 bonus; the last one stops at the EOS, itself a draft token
    assert first.accepted == first.emitted - (first.steps - 1)
    # the others stop at max_new_tokens (drafts capped to fit) or at the EOS, draft or bonus token
    assert all(r.emitted - r.steps <= r.accepted <= r.emitted - r.steps + 1 for r in out.stats.requests)


@pytest.mark.parametrize("device,dtype", device_params())
def test_drafter_of_another_architecture_and_size(device, dtype):
    """Any causal LM with the target's vocabulary can draft, whatever its architecture."""
    target = cached_model("llama", device, dtype)
    small = make_model("gpt_neox", num_layers=1, hidden=16, seed=3, dtype=dtype, device=device)
    prompts = random_prompts(6, target.config.vocab_size, seed=21)
    out = generate(target, prompts, drafter=ModelDrafter(small), policy=FixedPolicy(4), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference("llama", device, dtype, tuple(p), None) for p in prompts]


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("policy", [FixedPolicy(3, drafter_index=1), AlternatingPolicy(3)], ids=["one", "mixed"])
def test_several_drafters_with_the_policy_choosing(policy, device, dtype):
    target = cached_model("qwen2", device, dtype)
    prompts = random_prompts(6, target.config.vocab_size, seed=8)
    drafters = [PromptLookupDrafter(), ModelDrafter(drafter_model("qwen2", device, dtype))]
    out = generate(target, prompts, drafter=drafters, policy=policy, max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference("qwen2", device, dtype, tuple(p), None) for p in prompts]
    assert out.stats.accepted > 0


class CountingLookup(PromptLookupDrafter):
    """Prompt lookup that counts the steps it was called in."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, batch, num_tokens):
        self.calls += 1
        return super().propose(batch, num_tokens)


class EveryOtherStep(FixedPolicy):
    """Rows 0, 2, ... draft with drafter 2 and the others with drafter 0 on even steps; every row
    with drafter 2 on odd steps; drafter 1 is never asked."""

    def __init__(self, num_draft_tokens: int):
        super().__init__(num_draft_tokens, 0)
        self.step = 0

    def plan(self, batch, num_drafters):
        rows = np.arange(batch.num_rows)
        owner = np.where(rows % 2 == 0, 2, 0) if self.step % 2 == 0 else np.full(batch.num_rows, 2)
        self.step += 1
        return Plan(drafter_index=owner, num_draft_tokens=np.full(batch.num_rows, self.num_draft_tokens))


@pytest.mark.parametrize("device,dtype", device_params())
def test_a_drafter_asked_for_nothing_is_not_called(device, dtype):
    """generate() calls only the drafters a step asks for tokens (an idle drafter cost every
    multi-drafter step 0.1-0.4 ms on the H200); the output stays the target's, with steps that
    merge two drafters' rows, steps of one drafter alone, and a model drafter catching up."""
    target = cached_model("llama", device, dtype)
    prompts = random_prompts(5, target.config.vocab_size, seed=17)
    idle, lookup = CountingLookup(), CountingLookup()
    drafters = [lookup, idle, ModelDrafter(drafter_model("llama", device, dtype))]
    out = generate(target, prompts, drafter=drafters, policy=EveryOtherStep(3), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference("llama", device, dtype, tuple(p), None) for p in prompts]
    assert idle.calls == 0
    assert 0 < lookup.calls < out.stats.steps  # called in the even steps only
    assert out.stats.accepted > 0


@pytest.mark.parametrize("verifier_class", [PaddedVerifier, PaddingFreeVerifier])
def test_learned_positions_up_to_the_limit(verifier_class):
    """GPT-2 embeds positions from a table: pad slots past its end must not break the padded
    layout when a row reaches the last position while another still drafts."""
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    target = GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    prompts = [[5, 6, 7] * 8, [9, 10]]
    out = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)), verifier=verifier_class(),
                   policy=FixedPolicy(6), max_new_tokens=16)
    assert out.sequences == [hf_greedy(target, p, 16) for p in prompts]


def test_sliding_window_model_matches_its_own_decoding():
    """Qwen2 with sliding-window layers: the reference backend applies the window."""
    target = make_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1, layer_types=None)
    assert any(t == "sliding_attention" for t in target.config.layer_types)
    prompts = random_prompts(3, target.config.vocab_size, seed=2, min_len=8)
    out = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(3), max_new_tokens=16)
    assert out.sequences == [hf_greedy(target, p, 16) for p in prompts]
