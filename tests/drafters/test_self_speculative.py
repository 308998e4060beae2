"""SelfSpeculativeDrafter (MagicDec): the target drafts over the sink and window of its own cache.

The sharp oracle: with a window at least as long as every row, the draft *is* the target, so at
temperature 0 every drafted token is accepted (tau = k + 1 in every full step). With a narrow
window drafts are rejected, and the output is still the target's own greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.drafters import ModelDrafter, SelfSpeculativeDrafter
from specdec.policies import FixedPolicy
from specdec.runner import runners_of
from specdec.verifiers import PaddedVerifier, PaddingFreeVerifier
from tests.test_generate_exact import MAX_NEW_TOKENS, drafter_model, eos_for, reference
from tests.tiny import ARCHS, AlternatingPolicy, cached_model, device_params, hf_greedy, random_prompts


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch,verifier_class,num_draft_tokens", [
    ("llama", PaddedVerifier, 3), ("qwen2", PaddingFreeVerifier, 6), ("gpt_neox", PaddingFreeVerifier, 3),
    ("llama", PaddingFreeVerifier, 6)])
def test_a_window_covering_every_row_makes_the_draft_the_target(num_draft_tokens, verifier_class, arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(5, target.config.vocab_size, seed=21, min_len=4, max_len=40)
    out = generate(target, prompts, drafter=SelfSpeculativeDrafter(sink=1, window=1000), verifier=verifier_class(),
                   policy=FixedPolicy(num_draft_tokens), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference(arch, device, dtype, tuple(p), None) for p in prompts]
    assert out.stats.drafted > 0 and out.stats.accepted == out.stats.drafted
    # every step but a row's last (cut by max_new_tokens) emits k + 1 tokens
    steps_per_row = -(-MAX_NEW_TOKENS // (num_draft_tokens + 1))
    assert out.stats.steps == steps_per_row


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch_size,num_draft_tokens,sink,window", [(1, 4, 2, 5), (8, 1, 0, 3), (8, 4, 2, 5)])
@pytest.mark.parametrize("verifier_class", [PaddedVerifier, PaddingFreeVerifier])
def test_greedy_output_equals_target_greedy_with_a_narrow_window(verifier_class, sink, window, num_draft_tokens,
                                                                 batch_size, arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(batch_size, target.config.vocab_size, seed=batch_size + 30, min_len=6, max_len=30)
    eos = eos_for(arch, device, dtype, prompts)
    out = generate(target, prompts, drafter=SelfSpeculativeDrafter(sink=sink, window=window),
                   verifier=verifier_class(), policy=FixedPolicy(num_draft_tokens), max_new_tokens=MAX_NEW_TOKENS,
                   eos_token_id=eos)
    assert out.sequences == [reference(arch, device, dtype, tuple(p), eos) for p in prompts]
    if batch_size == 8:  # the narrow view drafts other tokens than the target (so rollbacks ran)
        assert 0 < out.stats.accepted < out.stats.drafted


def test_it_mixes_with_a_small_drafter_in_one_step():
    target = cached_model("llama", "cpu", torch.float64)
    prompts = random_prompts(6, target.config.vocab_size, seed=5, min_len=6, max_len=30)
    out = generate(target, prompts, drafter=[SelfSpeculativeDrafter(sink=1, window=4),
                                              ModelDrafter(drafter_model("llama", "cpu", torch.float64))],
                   policy=AlternatingPolicy(3), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences == [reference("llama", "cpu", torch.float64, tuple(p), None) for p in prompts]


def test_the_draft_leaves_the_targets_cache_to_the_verifier():
    """After a call, every committed cache entry is the target's own (as after plain decoding)."""
    target = cached_model("qwen2", "cpu", torch.float64)
    prompts = random_prompts(3, target.config.vocab_size, seed=8, min_len=10, max_len=20)
    caches = []
    for drafter in (None, SelfSpeculativeDrafter(sink=1, window=3)):
        generate(target, prompts, drafter=drafter, policy=FixedPolicy(4 if drafter else 0), max_new_tokens=12)
        cache = runners_of(target)["target"].cache
        caches.append([(cache.keys[i].clone(), cache.lengths.copy()) for i in range(cache.num_layers)])
    for (plain_keys, plain_lengths), (self_keys, self_lengths) in zip(*caches):
        assert np.array_equal(plain_lengths, self_lengths)
        for row, length in enumerate(plain_lengths[: len(prompts)]):
            torch.testing.assert_close(self_keys[row, :, :length], plain_keys[row, :, :length], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sink=-1), "sink must be an int >= 0"),
    (dict(window=2.5), "window must be an int >= 1"),
    (dict(sink=4, window=0), "window must be an int >= 1"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SelfSpeculativeDrafter(**kwargs)


def test_it_says_it_needs_generate_to_start():
    with pytest.raises(RuntimeError, match="pass it to generate"):
        SelfSpeculativeDrafter().start(batch=None, sampling=None, device=None, max_draft_tokens=4)


@pytest.mark.cuda
def test_sparse_draft_passes_replay_from_the_targets_graphs():
    target = cached_model("llama", "cuda", torch.float32)
    prompts = random_prompts(6, target.config.vocab_size, seed=3, min_len=8, max_len=40)
    call = lambda: generate(target, prompts, drafter=SelfSpeculativeDrafter(sink=1, window=6),  # noqa: E731
                            policy=FixedPolicy(3), max_new_tokens=20, cuda_graphs=True)
    call()  # builds the runner (and its graphs) the measured call reuses
    runner = runners_of(target)["target"]
    before = runner.graph_passes
    out = call()
    assert out.sequences == [hf_greedy(target, p, 20) for p in prompts]
    assert runners_of(target)["target"] is runner
    assert runner.graph_passes - before > 3 * out.stats.steps  # draft passes replayed too, not just the verify
    assert 0 < out.stats.accepted < out.stats.drafted
