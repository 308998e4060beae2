"""generate(): speculative decoding of a closed set of prompts (DESIGN §2).

It is the Engine (engine.py) run over one batch: every prompt is admitted at once into a row of
its own and prefilled, then engine steps run until every request is done. Each step: the policy
plans (drafter and length per row), drafters propose, the verifier scores every active row's
chain in one target forward and applies the acceptance rule, the batch commits the emitted
tokens (the step's one host synchronisation), drafters roll back to what was accepted, and the
policy observes. Output is the target's own: token-identical under greedy decoding, identically
distributed under sampling.
"""

from __future__ import annotations

import numbers
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import inputs
from .drafters.base import Drafter
from .engine import Engine
from .pipeline import PipelinedEngine
from .policies.base import Policy
from .stats import GenerationStats
from .types import SamplingParams
from .verifiers.base import Verifier


_THIS_THREAD = threading.local()  # .in_call: a generate() call is running on this thread


@dataclass
class GenerateOutput:
    sequences: list[list[int]]  # per prompt: generated token ids, prompt excluded, EOS included
    stats: GenerationStats
    logprobs: list[list[float]] | None = None  # per prompt, per generated token (return_logprobs=True)


def generate(
    target,
    prompts,
    drafter: Drafter | list[Drafter] | None = None,
    verifier: Verifier | None = None,
    policy: Policy | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | list[int] = 0,
    attention: str = "auto",
    cuda_graphs: bool | str = False,
    compile: bool = False,
    *,
    attention_mask=None,
    min_new_tokens: int = 0,
    stop_sequences: list[list[int]] | None = None,
    stream: Callable[[int, list[int]], None] | None = None,
    return_logprobs: bool = False,
    pipeline: int = 1,
) -> GenerateOutput:
    """Generate from ``target`` for every prompt, speculatively.

    prompts: token-id lists or 1-D tensors, any lengths; or one [B, T] tensor, padded on the left
    or the right with ``attention_mask`` [B, T] (1 for tokens), as a tokenizer returns it.
    drafter: one Drafter or a list (the policy picks per row); none means plain decoding.
    eos_token_id: an id or a list of ids stops a row after it emits one; None takes the model's
    ``generation_config.eos_token_id`` (as transformers does), and [] never stops early.
    min_new_tokens: EOS cannot be emitted before a row has this many new tokens (its logits are
    -inf there, for the target and the drafters alike). stop_sequences: token-id lists; a row stops
    right after emitting one (it may begin in the prompt). stream: called after every step with
    (request index, the token ids just committed to it) for each request that got some.
    return_logprobs: also return each generated token's log-probability under the target's
    processed distribution (the log-softmax of the logits when greedy).
    pipeline: split the rows into this many micro-batches and draft for the next while the
    target verifies one (SPIN; pipeline.py); 1 (the default) steps every row together.
    seed: an int (request i uses seed + i)
    or one per prompt; a request's output depends only on its own seed, not on its batch.
    attention: "reference" (plain torch, any device), "fast" (Triton, CUDA) or "auto" (fast on
    CUDA). cuda_graphs: capture the target's verify passes as CUDA graphs (needs the fast
    backend; "auto" follows it; off by default for now); the runner and its graphs are kept with
    the model and reused by later calls of the same or smaller size. compile: fuse the small
    kernels of the graphed passes with torch.compile before capture (needs cuda_graphs; slower
    first call, faster steps; float32 results may differ from the eager kernels' in the last bits).
    """
    if getattr(_THIS_THREAD, "in_call", False):
        raise RuntimeError("generate() was called from inside another generate() call on the same thread (from a "
                           "stream callback?): it would share the outer call's caches; call it after that one returns")
    _THIS_THREAD.in_call = True
    try:
        return _generate(target, prompts, drafter, verifier, policy, max_new_tokens, sampling, eos_token_id, seed,
                         attention, cuda_graphs, compile, attention_mask, min_new_tokens, stop_sequences, stream,
                         return_logprobs, pipeline)
    finally:
        _THIS_THREAD.in_call = False


def _generate(target, prompts, drafter, verifier, policy, max_new_tokens, sampling, eos_token_id, seed, attention,
              cuda_graphs, compile, attention_mask, min_new_tokens, stop_sequences, stream,
              return_logprobs, pipeline) -> GenerateOutput:
    started = time.perf_counter()
    vocab_size, _ = inputs.check_target(target)
    token_prompts = inputs.normalise_prompts(prompts, vocab_size, attention_mask)
    max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a function of (request index, token ids), got {type(stream).__name__}")
    inputs.check_lengths_fit(target, token_prompts, max_new_tokens)
    if not (isinstance(pipeline, numbers.Integral) and not isinstance(pipeline, bool) and pipeline >= 1):
        raise ValueError(f"pipeline must be an int >= 1 (micro-batches; 1: no pipelining), got {pipeline!r}")
    pipeline = int(pipeline)
    engine_class, options = (Engine, {}) if pipeline == 1 else (PipelinedEngine, {"micro_batches": pipeline})
    with engine_class(target, drafter, verifier, policy, max_rows=len(token_prompts),
                      max_len=max(map(len, token_prompts)) + max_new_tokens, sampling=sampling,
                      eos_token_id=eos_token_id, attention=attention, cuda_graphs=cuda_graphs, compile=compile,
                      min_new_tokens=min_new_tokens, stop_sequences=stop_sequences, return_logprobs=return_logprobs,
                      max_new_tokens=max_new_tokens, **options) as engine:
        engine.restart_clock(started)  # request times count from the start of this call
        seeds = inputs.normalise_seeds(seed, len(token_prompts))
        for prompt, row_seed in zip(token_prompts, seeds.tolist()):
            engine.enqueue(prompt, max_new_tokens, row_seed)  # request i takes row i
        engine.admit()  # on a GPU it waits for the prefill: prefill_time_s holds its device work
        prefill_time = time.perf_counter() - started
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step(stream))
        stats = engine.recorder.finish(wall_time_s=time.perf_counter() - started, prefill_time_s=prefill_time)
    done = [finished[i] for i in range(len(token_prompts))]
    return GenerateOutput(sequences=[d.token_ids for d in done], stats=stats,
                          logprobs=[d.logprobs for d in done] if return_logprobs else None)


