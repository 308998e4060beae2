"""The peers, run the way their documentation says, on the same prompts and models:
Hugging Face eager ``generate()``; the same with a static cache and ``torch.compile``; assisted
generation with a small assistant; prompt-lookup decoding. All greedy; the last two at batch 1,
the only size Hugging Face supports for them.
"""

from __future__ import annotations

import time

import torch


def hf_generate_one(model, prompt: list[int], max_new_tokens: int, eos: int | None, **kwargs) -> list[int]:
    input_ids = torch.tensor([prompt], device=model.device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                            **kwargs)
    return output[0, len(prompt):].tolist()


def timed_batch1(model, prompts, max_new_tokens, eos, **kwargs) -> tuple[list[list[int]], float]:
    """Each prompt alone; returns the outputs and the total seconds (device synchronised)."""
    outputs = []
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for prompt in prompts:
        outputs.append(hf_generate_one(model, prompt, max_new_tokens, eos, **kwargs))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - started


class StaticCompiled:
    """Hugging Face decoding with a static cache; transformers 5 then compiles the decoding
    step itself (``torch.compile`` in reduce-overhead mode, with CUDA graphs: its documented
    fast path). Wrapping the forward in another ``torch.compile`` conflicts with those graphs.
    Restores the model's setting afterwards."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self._cache = self.model.generation_config.cache_implementation
        self.model.generation_config.cache_implementation = "static"
        return self

    def __exit__(self, *exc):
        self.model.generation_config.cache_implementation = self._cache
        torch._dynamo.reset()
        return False
