"""The peers, run the way their documentation says, on the same prompts and models:
Hugging Face eager ``generate()``; the same with a static cache and ``torch.compile``; assisted
generation with a small assistant; prompt-lookup decoding. All greedy; the last two at batch 1,
the only size Hugging Face supports for them.
"""

from __future__ import annotations

import time
import warnings

import torch


def hf_generate_one(model, prompt: list[int], max_new_tokens: int, eos: int | None, **kwargs) -> list[int]:
    input_ids = torch.tensor([prompt], device=model.device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                            **kwargs)
    return output[0, len(prompt):].tolist()


def timed_batch1(model, prompts, max_new_tokens, eos, **kwargs) -> tuple[list[list[int]], float]:
    """Each prompt alone; returns the outputs and the total seconds (device synchronised)."""
    return _timed(lambda prompt: hf_generate_one(model, prompt, max_new_tokens, eos, **kwargs), prompts, model.device)


def _timed(generate_one, prompts, device: torch.device) -> tuple[list[list[int]], float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = [generate_one(prompt) for prompt in prompts]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - started


class StaticCompiled:
    """Hugging Face decoding with a static cache, which transformers 5 compiles by itself
    (``torch.compile`` in reduce-overhead mode, with CUDA graphs: its documented fast path).

    One ``StaticCache`` of a fixed size serves every call, reset in between: a fresh cache per
    call would put the compiled step's static inputs at new addresses and recompile it each
    call. Wrapping the forward in another ``torch.compile`` conflicts with those graphs."""

    def __init__(self, model, max_cache_len: int):
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)

    def generate_one(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
        self.cache.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # `past_key_values` is named `cache` from 5.2x
            return hf_generate_one(self.model, prompt, max_new_tokens, eos, past_key_values=self.cache)

    def timed_batch1(self, prompts, max_new_tokens, eos) -> tuple[list[list[int]], float]:
        return _timed(lambda prompt: self.generate_one(prompt, max_new_tokens, eos), prompts, self.model.device)

    def close(self) -> None:
        torch._dynamo.reset()
