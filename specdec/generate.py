"""generate(): the speculative decoding loop (DESIGN §2).

Each step: the policy plans (drafter and length per row), drafters propose, the verifier
scores every active row's chain in one target forward and applies the acceptance rule, the
batch commits the emitted tokens (the step's one host synchronisation), drafters roll back to
what was accepted, and the policy observes. Output is the target's own: token-identical under
greedy decoding, identically distributed under sampling.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .transfer import to_device

from . import inputs
from .batch import BatchState
from .distributed import tensor_parallel_group
from .drafters.base import Drafter, empty_draft, merge_drafts
from .policies.base import Policy
from .policies.fixed import FixedPolicy
from .sampling import TREE_PROBLEMS
from .runner import ModelRunner, PackedLayout, models_in_use, resolve_backend, runner_for
from .stats import GenerationStats, StatsRecorder, StepRecord
from .timing import PhaseTimer
from .types import Draft, Plan, SamplingParams
from .verifiers.base import Verifier
from .verifiers.padding_free import PaddingFreeVerifier


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
                         return_logprobs)
    finally:
        _THIS_THREAD.in_call = False


def _generate(target, prompts, drafter, verifier, policy, max_new_tokens, sampling, eos_token_id, seed, attention,
              cuda_graphs, compile, attention_mask, min_new_tokens, stop_sequences, stream,
              return_logprobs) -> GenerateOutput:
    started = time.perf_counter()
    vocab_size, device = inputs.check_target(target)
    token_prompts = inputs.normalise_prompts(prompts, vocab_size, attention_mask)
    max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
    min_new_tokens = inputs.check_min_new_tokens(min_new_tokens)
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be a function of (request index, token ids), got {type(stream).__name__}")
    inputs.check_lengths_fit(target, token_prompts, max_new_tokens)
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    drafters = inputs.normalise_drafters(drafter)
    inputs.check_drafters(drafters, vocab_size, token_prompts, max_new_tokens)
    for d in drafters:
        d.check_target(target)
    verifier = PaddingFreeVerifier() if verifier is None else verifier
    policy = (FixedPolicy(4) if drafters else FixedPolicy(0)) if policy is None else policy
    inputs.check_component(verifier, Verifier, "verifier")
    inputs.check_component(policy, Policy, "policy")
    inputs.check_trees(drafters, verifier, policy.max_draft_tokens)
    if policy.max_draft_tokens > 0 and not drafters:
        raise ValueError(f"{policy!r} drafts tokens but no drafter was given: pass drafter=... or FixedPolicy(0)")

    batch = BatchState(
        token_prompts,
        max_new_tokens,
        inputs.normalise_seeds(seed, len(token_prompts)),
        inputs.normalise_eos(eos_token_id, vocab_size),
        inputs.normalise_stop_sequences(stop_sequences, vocab_size),
        min_new_tokens,
    )
    # a row drafts at most one token fewer than it may still emit (_bounded), so caches and
    # graphs are sized by what the call can use, not by the policy's largest length
    # (a tree's nodes are not bounded so, only its depth: its node budget sizes them)
    trees = np.array([d.makes_trees for d in drafters], dtype=bool)  # [D]
    max_draft = (policy.max_draft_tokens if trees.any() and max_new_tokens > 1
                 else min(policy.max_draft_tokens, max(max_new_tokens - 1, 0)))
    attention, cuda_graphs, compile = resolve_backend(target, attention, cuda_graphs, compile)
    graph_shape = (max_draft + 1, batch.num_rows * (max_draft + 1)) if cuda_graphs else None
    group = tensor_parallel_group(target)  # None unless the target is sharded over processes
    recorder = StatsRecorder(batch.num_rows, max_draft)
    timer = PhaseTimer(device)
    with contextlib.ExitStack() as stack:  # unwinds in reverse: drafters finish, the target detaches, locks go
        # threads sharing a model take turns: its runners, caches and attention switch are one call's at a time
        stack.enter_context(models_in_use([target, *(model for d in drafters for model in d.models())]))
        hidden_layers = tuple(sorted({j for d in drafters for j in d.target_hidden_layers()}))
        runner = runner_for(target, role="target", max_rows=batch.num_rows, max_len=batch.max_total_len + max_draft + 1,
                            attention=attention, graph_shape=graph_shape, compile=compile, hidden_layers=hidden_layers)
        stack.enter_context(runner.attached())
        for d in drafters:
            stack.callback(d.finish)  # first: a start that fails half-way is still undone
            d.bind_target(runner)
            d.start(batch, sampling, device, max_draft)
        _prefill(runner, batch, device)
        if device.type == "cuda":  # the prefill's kernels end inside prefill_time_s, not in step 0's synchronisation
            torch.cuda.synchronize(device)
        prefill_time = time.perf_counter() - started
        step = 0
        while not batch.finished.all():
            step_started = time.perf_counter()
            plan = _bounded(_checked(policy.plan(batch, len(drafters)), policy, batch, trees), batch, trees)
            plan_time_s = time.perf_counter() - step_started
            with timer.phase("draft"):
                draft = _propose(drafters, batch, plan, device, vocab_size, timer)
            with timer.phase("verify"):
                verdict, cost = verifier.verify(runner, batch, draft, sampling, logprobs=return_logprobs)
            rows = batch.active_rows()
            host = verdict.to_host(group)  # the step's one synchronisation (rank 0 decides)
            _raise_on_malformed_trees(host, plan, drafters)
            lengths_before = batch.lengths.copy()
            appended = batch.commit(host)
            for d in drafters:
                d.commit(lengths_before, host.num_accepted)
            if stream is not None:
                for row in np.flatnonzero(appended):
                    stream(int(row), batch.token_ids[row, lengths_before[row] : batch.lengths[row]].tolist())
            times = timer.collect()
            record = StepRecord(
                step=step,
                rows=rows,
                drafter_index=plan.drafter_index,
                num_drafted=draft.num_tokens,
                num_accepted=np.minimum(host.num_accepted, appended),
                num_emitted=appended,
                draft_time_s=times.get("draft", 0.0),
                verify_time_s=times.get("verify", 0.0),
                cost=cost,
                drafter_time_s=np.array([times.get(f"drafter {i}", 0.0) for i in range(len(drafters))]),
                drafter_wall_s=np.array([timer.host_seconds.get(f"drafter {i}", 0.0) for i in range(len(drafters))]),
                step_time_s=time.perf_counter() - step_started,
                plan_time_s=plan_time_s,
                draft_depths=draft.depths if draft.is_tree else None,
            )
            recorder.record(record, time.perf_counter() - started, batch.finished)
            policy.observe(record)
            step += 1
    stats = recorder.finish(wall_time_s=time.perf_counter() - started, prefill_time_s=prefill_time)
    return GenerateOutput(sequences=batch.outputs(), stats=stats,
                          logprobs=batch.output_logprobs() if return_logprobs else None)


def _prefill(runner: ModelRunner, batch: BatchState, device: torch.device) -> None:
    """Fill the target's cache with every prompt but its last token (the first step feeds it)."""
    rows = np.flatnonzero((batch.prompt_lengths > 1) & ~batch.finished)
    if len(rows):
        counts = batch.prompt_lengths[rows] - 1
        starts = np.zeros(len(rows), dtype=np.int64)
        token_ids = batch.packed_tokens(rows, starts, counts)
        layout = PackedLayout(rows=rows, starts=starts, counts=counts)
        runner.forward(to_device(token_ids, device), layout, logits_indices=np.zeros(1, dtype=np.int64))


def _raise_on_malformed_trees(host, plan: Plan, drafters: list[Drafter]) -> None:
    """A tree the verifier found malformed (sampling.tree_problems, copied with the verdict):
    a clear error naming the row and its drafter, before anything is committed."""
    if host.tree_problems is None or not host.tree_problems.any():
        return
    row = int(np.flatnonzero(host.tree_problems)[0])
    drafter = drafters[plan.drafter_index[row]].describe()
    raise ValueError(f"row {row}: the token tree from {drafter} is malformed: "
                     f"{TREE_PROBLEMS[int(host.tree_problems[row])]}")


def _checked(plan: Plan, policy: Policy, batch: BatchState, trees: np.ndarray) -> Plan:
    """A policy's plan must name existing drafters, stay within its own max_draft_tokens, and ask
    for trees only from drafters that grow them (``trees`` [D])."""
    num_drafters = len(trees)
    problem = None
    if not isinstance(plan, Plan):
        problem = f"returned {type(plan).__name__}, not a Plan"
    elif plan.drafter_index.shape != (batch.num_rows,) or plan.num_draft_tokens.shape != (batch.num_rows,):
        problem = f"returned arrays of shapes {plan.drafter_index.shape} and {plan.num_draft_tokens.shape}, not ({batch.num_rows},)"
    elif plan.num_draft_tokens.min() < 0 or plan.num_draft_tokens.max() > policy.max_draft_tokens:
        problem = f"asked for draft lengths outside [0, max_draft_tokens={policy.max_draft_tokens}]"
    elif np.any((plan.num_draft_tokens > 0) & ((plan.drafter_index < 0) | (plan.drafter_index >= num_drafters))):
        problem = f"named a drafter outside the {num_drafters} given to generate()"
    elif plan.trees is not None and (plan.trees.shape != (batch.num_rows,) or plan.trees.dtype != bool):
        problem = f"returned trees of shape {plan.trees.shape} and dtype {plan.trees.dtype}, not ({batch.num_rows},) bool"
    elif plan.trees is not None and np.any(plan.trees & (plan.num_draft_tokens > 0) & ~trees[plan.drafter_index]):
        problem = ("asked for a token tree from a drafter without a TreeSpec: give it tree=TreeSpec(...) or ask "
                   "that row for a chain")
    if problem:
        raise ValueError(f"{policy!r} {problem}")
    return plan


def _bounded(plan: Plan, batch: BatchState, trees: np.ndarray) -> Plan:
    """No drafting for finished rows, nor beyond what a row may still emit (the step's own
    recovered or bonus token takes one of those). A row whose drafter grows trees (``trees``
    [D]) keeps its node budget while it may emit two tokens or more: the drafter bounds the
    tree's depth by what the row may still emit."""
    limit = np.maximum(batch.remaining - 1, 0)
    if plan.trees is not None:
        tree_row = plan.trees
    else:
        tree_row = trees[plan.drafter_index] if len(trees) else np.zeros(batch.num_rows, dtype=bool)
    limit = np.where(tree_row & (limit > 0), plan.num_draft_tokens, limit)
    return Plan(drafter_index=plan.drafter_index, num_draft_tokens=np.minimum(plan.num_draft_tokens, limit),
                trees=plan.trees)


def _propose(drafters: list[Drafter], batch: BatchState, plan: Plan, device: torch.device, vocab_size: int,
             timer: PhaseTimer) -> Draft:
    """The step's draft: only the drafters some row asks for tokens are called (a drafter asked
    for nothing costs nothing, whereas calling an idle drafter still costs host time, which
    every multi-drafter step would pay); with one
    drafter asked its draft is the step's, with several they are merged by row."""
    if plan.max_draft_tokens == 0:
        return empty_draft(batch.num_rows, device)
    asked = np.unique(plan.drafter_index[plan.num_draft_tokens > 0])  # [D'] the drafters some row asks
    drafts = []
    for i in asked:
        with timer.phase(f"drafter {i}"):  # nested in "draft": each drafter's share, for policies
            # a drafter on another device (a second GPU, or the CPU) hands its proposals over here
            counts = np.where(plan.drafter_index == i, plan.num_draft_tokens, 0)
            # the per-row choice of tree or chain goes only to drafters that grow trees (others take no such argument)
            shape = {} if plan.trees is None or not drafters[i].makes_trees else {"trees": plan.trees}
            drafts.append(drafters[i].propose(batch, counts, **shape).to(device))
    if len(drafts) == 1:
        return drafts[0]  # every row it was not asked for has zero tokens in it
    # each row's draft among those called; a row whose drafter was not called asks for nothing,
    # and the first called draft gives it zero tokens
    position = np.zeros(len(drafters), dtype=np.int64)
    position[asked] = np.arange(len(asked))
    return merge_drafts(drafts, position[plan.drafter_index], vocab_size)
