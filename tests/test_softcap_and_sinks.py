"""Attention with logit soft-capping (Gemma 2) and with per-head sink logits (GPT-OSS): the
reference backend implements both, so these models decode exactly as transformers' own greedy
decoding, plainly and with a drafter; the fast backend, which implements neither, is refused
before any pass and 'auto' picks the reference for them (issue 31)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

from specdec import generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.runner import reference_only_feature
from tests.tiny import NO_SPECIAL_TOKENS, hf_greedy, perturbed_copy, random_prompts

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256, sliding_window=4, **NO_SPECIAL_TOKENS)


def make(kind: str, dtype=None, device="cpu"):
    """float64 for Gemma 2; float32 for GPT-OSS, whose expert matmuls take no float64."""
    dtype = dtype or (torch.float64 if kind == "gemma2" else torch.float32)
    torch.manual_seed(0)
    if kind == "gemma2":  # a small cap, so that it bends the scores
        config = Gemma2Config(intermediate_size=64, attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
                              tie_word_embeddings=False, **SMALL)  # an untied head: attention decides the tokens
        model = Gemma2ForCausalLM(config)
    else:
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                               **SMALL))
        with torch.no_grad():  # sinks strong enough to take a real share of each softmax
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # greedy choices far from ties
        for layer in model.model.layers:  # attention scores of a few units, where a cap of 2 bends them
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype=dtype, device=device).eval()


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_decoding_equals_transformers_greedy(kind):
    target = make(kind)
    assert reference_only_feature(target) is not None
    prompts = random_prompts(4, 96, seed=7, min_len=3)  # longer than the sliding window of 4
    expected = [hf_greedy(target, p, 12) for p in prompts]
    assert generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=12).sequences == expected
    drafter = ModelDrafter(perturbed_copy(target, 0.05))
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=12)
    assert out.sequences == expected and out.stats.tau > 1.0


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_the_features_change_the_output(kind):
    """The check above can fail: without the soft-cap or the sinks the same weights decode otherwise."""
    target = make(kind)
    prompts = random_prompts(4, 96, seed=7, min_len=3)
    with torch.no_grad():
        if kind == "gemma2":
            target.config.attn_logit_softcapping = None
            for layer in target.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            for layer in target.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: plain softmax
    changed = generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=12).sequences
    assert changed != [hf_greedy(make(kind), p, 12) for p in prompts]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_the_fast_backend_is_refused_up_front_and_auto_picks_the_reference(kind):
    target = make(kind, dtype=torch.float32, device="cuda")
    prompts = random_prompts(3, 96, seed=8, min_len=3)
    with pytest.raises(ValueError, match="which the fast attention backend does not implement"):
        generate(target, prompts, max_new_tokens=4, attention="fast")
    assert generate(target, prompts, max_new_tokens=8).sequences == [hf_greedy(target, p, 8) for p in prompts]
