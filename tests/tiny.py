"""Tiny random causal LMs of several architectures, built in code (no downloads)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdec.policies import Policy
from specdec.types import Plan

ARCHS = ("llama", "qwen2", "gpt_neox")
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_model(arch: str, vocab_size: int = 96, num_layers: int = 2, hidden: int = 32, seed: int = 0,
               dtype=torch.float64, device="cpu", max_positions: int = 256, **overrides):
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4, max_position_embeddings=max_positions,
                  **NO_SPECIAL_TOKENS)
    if arch == "llama":
        config = LlamaConfig(num_key_value_heads=2, **common, **overrides)
        model_class = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(num_key_value_heads=2, **common, **overrides)
        model_class = Qwen2ForCausalLM
    elif arch == "gpt_neox":
        config = GPTNeoXConfig(rotary_pct=0.5, **common, **overrides)
        model_class = GPTNeoXForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_class(config)
    # Random init is nearly uniform over the vocabulary; sharpen the head so that greedy
    # choices are far from ties and the models have something like real distributions.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype=dtype, device=device).eval()


def perturbed_copy(model, scale: float, seed: int = 1):
    """A drafter that agrees with ``model`` often but not always."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.add_(scale * noise.to(parameter.dtype).to(parameter.device) * parameter.std())
    return drafter


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """The target's own greedy decoding of one prompt, by Hugging Face generate()."""
    input_ids = torch.tensor([prompt], device=model.device)
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=0 if eos_token_id is None else eos_token_id,
    )
    return output[0, len(prompt):].tolist()


def random_prompts(batch_size: int, vocab_size: int, seed: int, min_len: int = 1, max_len: int = 12) -> list[list[int]]:
    """Prompts of different lengths; some repeat a phrase so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for index in range(batch_size):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        prompt = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        if index % 2 == 0 and length >= 2:
            prompt = prompt + prompt[: max(1, length // 2)]
        prompts.append(prompt)
    return prompts


class AlternatingPolicy(Policy):
    """Row r drafts with drafter r % num_drafters: several drafters in every step."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens

    def plan(self, batch, num_drafters):
        rows = np.arange(batch.num_rows)
        return Plan(drafter_index=rows % num_drafters, num_draft_tokens=np.full(batch.num_rows, self.num_draft_tokens))


def device_params():
    """cpu in float64 always; cuda in float32 when asked with -m cuda (skipped without a GPU)."""
    return [
        pytest.param("cpu", torch.float64, id="cpu-f64"),
        pytest.param("cuda", torch.float32, id="cuda-f32", marks=pytest.mark.cuda),
    ]


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, device: str, dtype: torch.dtype, seed: int = 0, vocab_size: int = 96):
    return make_model(arch, seed=seed, dtype=dtype, device=device, vocab_size=vocab_size)


def chisquare_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square p-value of observed ``counts`` against the distribution ``joint`` (same shape):
    0 if a cell the distribution cannot produce was seen; cells expected fewer than 5 times pooled."""
    from scipy import stats

    observed = np.asarray(counts, dtype=np.float64).ravel()
    expected = joint.ravel() / joint.sum() * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


def shifted(joint: np.ndarray, amount: float = 0.05) -> np.ndarray:
    """``joint`` with ``amount`` of probability moved from its likeliest cell to the next."""
    first, second = np.argsort(joint.ravel())[::-1][:2]
    moved = joint.ravel().copy()
    moved[first] -= amount
    moved[second] += amount
    return moved.reshape(joint.shape)
