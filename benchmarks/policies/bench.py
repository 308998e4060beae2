"""``python -m benchmarks.policies``: the adaptive policies (GoodputPolicy per-row and
finish, BatchAdaptivePolicy, BanditPolicy per request by UCB and by epochs, per batch with the
step and the call objective)
against every fixed (drafter, length) pair and plain decoding, on copy-heavy, continuation and
mixed workloads (``workloads.py``), at several batch sizes, in one process.

Order of work: load the zoo and make the workloads; build every runner once at the largest
shape any later call needs (on CUDA: compiled and captured; the biggest batch, the longest
prompt, the longest draft), so no call inside a timed window rebuilds one; profile the
CostModel on the same device through the same runners (CUDA graphs and compile as generation
uses them), with the decoding loop's per-step overhead; time whole calls of a few held-out
requests of each workload at each batch size and draft length, for BatchAdaptivePolicy's table
and (their tau per length) GoodputPolicy's prior; then, for each batch size (largest first) and workload (a cell): one short untimed warm-up
call per method on the chunk with the longest prompts, then ``repeats`` rounds that each time one
pass of every method, in an order rotated from round to round (requests at batch B: the first
max(pass_calls x B, num_prompts) in calls of B; batch 1: the first batch1_prompts, one per call), each pass
with a fresh policy, the device synchronised around it and the garbage collector paused during
it; tokens/s from each method's median pass. Interleaving puts a slow spell of the machine on
every method alike. Then the cell's head-to-head rounds (head_to_head.py): the targeted
policies against their references as the grid chose them, and a twin of the best fixed pair,
``head_to_head_rounds`` rounds; the targets are read from both. ``--merge`` joins runs made at different batch
sizes (one GPU call each) into one report.

Invariant: every output of every run is compared token for token with plain decoding of the
same requests at the same batch size (``identical``: every pass; greedy); every figure was
measured in this run; a learning policy's timed passes each start from a copy of the policy
after it served a history of held-out requests (never the measured ones), any other policy's
from a fresh one (the batch-level bandit learns across the calls of its run, not from the warm-up).

Results: JSON (environment, settings, workloads, cost model, tables, every run, the targets), a
markdown report, two PNG plots, and the cost model JSON; a ``.partial.json`` is rewritten after
every cell, so a run cut short keeps what it measured. ``time_limit_s`` skips the cells that would
start after it (they are listed as skipped), so the report is always written.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from specdec import generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import (
    BanditPolicy,
    BatchAdaptivePolicy,
    CostModel,
    FixedPolicy,
    GoodputPolicy,
    Policy,
    ProfileGrid,
    profile,
    rate_from_expected_tokens,
)
from specdec.runner import runners_of
from specdec.verifiers import PaddingFreeVerifier
from .workloads import KINDS, STANDARD, WorkloadGenerator, mean_oracle_lookup_tau
from specdec.zoo import build, load
from . import head_to_head
from specdec.bench.affinity import gpu_local_cpus, pinned, torch_threads, warm_gpu
from specdec.bench.common import agreement, synchronise
from specdec.bench.harness import environment
from .targets import (
    by_batch_text,
    fastest_pass_rows,
    head_to_head_targets,
    kind_oracle_bound,
    policy_targets,
    same_decision_pairs,
    target_table,
)

LOOKUP = "prompt lookup"
# the bandits measured: variant -> (strategy, scope, objective). The batch-scope variants play
# UCB: the epoch schedule's round robin switches drafters at every turn, and every switch makes
# the whole batch catch up. "batch-call" plays one drafter per call, rewarded by the whole call
BANDIT_VARIANTS = {"ucb": ("ucb", "request", "step"), "epoch": ("epoch", "request", "step"),
                   "batch-level": ("ucb", "batch", "step"), "batch-call": ("ucb", "batch", "call")}
FORMAT = "specdec.bench.policies/1"  # the results files' format name, kept across the move to benchmarks/


@dataclass
class PolicyBenchSettings:
    preset: str = "gpu"
    device: str = "cuda"
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    zoo_dir: str | None = None
    cuda_graphs: bool | None = None  # CUDA graphs for the target and model drafters; None: on CUDA
    compile: bool | None = None  # torch.compile inside the CUDA graphs; None: with graphs
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    num_prompts: int = 64  # requests per workload at batch >= 2 (at least pass_calls x the batch size)
    # calls of B per timed pass at batch B >= 2, at least: a pass of one call at batch 16 and 64
    # lasts a fraction of a second, short enough for the host's hiccups to move it; a longer pass
    # averages them over more steps
    pass_calls: int = 1
    batch1_prompts: int = 8  # requests per workload at batch 1, one call each
    # a file's beginning of up to 256 tokens leaves a copy request ~190 tokens of already-seen text
    # to reproduce, more than max_new_tokens: at 128 only ~100 were, fewer than the tokens decoded,
    # so even a perfect copier ran out of text to copy: not a workload where prompt lookup shines
    prompt_tokens: int = 256
    max_new_tokens: int = 128
    workloads: tuple[str, ...] = ("mixed", "copy", "continuation")
    mixed_fraction: float = 0.5  # copy-heavy share of the mixed workload
    drafters: tuple[str, ...] = ()  # empty: prompt lookup + the num_model_drafters of lowest held-out loss
    num_model_drafters: int = 2
    lengths: tuple[int, ...] = (1, 2, 4, 6)  # fixed draft lengths
    max_draft_tokens: int = 8  # GoodputPolicy's and BatchAdaptivePolicy's longest draft
    bandit_length: int = 4  # BanditPolicy's draft length (added to ``lengths`` if missing)
    policy_drafter: str | None = None  # GoodputPolicy's and BatchAdaptivePolicy's; None: the first model drafter
    goodput_decide_every: int = 16  # steps between GoodputPolicy's decisions
    bandit_times: str = "measured"  # "measured" (CUDA events) or "model" (the cost model's predictions)
    profile_grid: str = "default"  # "default" or "tiny"
    # held-out requests per workload for BatchAdaptivePolicy's profile at each batch size below the
    # largest; the largest batch size profiles as many distinct requests as its rows (its slowest row
    # sets a call's length), and GoodputPolicy's prior is fitted on all of them
    profile_prompts: int = 16
    # the profile's new tokens per request, as many as the runs decode: greedy text grows more
    # predictable as it goes on, so a shorter profile reads a lower tau and favours shorter drafts
    # than the timed passes want
    tau_profile_tokens: int = 128
    tau_profile_repeats: int = 3  # measured rounds per (batch size, length) of BatchAdaptivePolicy's profile (median)
    warmup_tokens: int = 8  # new tokens of each untimed warm-up call
    # held-out requests each learning policy (GoodputPolicy, BanditPolicy) serves, untimed, before
    # its timed passes, which each start from a copy of what it learnt (a policy in service has a
    # past; a fresh bandit can spend a whole call exploring): at batch B,
    # max(history_calls x B, history_prompts) in calls of B; at batch 1, batch1_prompts; 0: every
    # pass starts fresh. A history of few calls leaves a batch-scope bandit few pulls per drafter,
    # so its timed passes still explore (a simulation of the one-drafter-per-call bandit's UCB over
    # drafters 15% apart: the pass after 4 calls plays the best in 30% of seeds, after 8 in 90%)
    history_prompts: int = 16
    history_calls: int = 8
    repeats: int = 3  # timed passes per run (a fresh policy each); tokens/s from the median pass
    # rounds of each cell's head-to-head (head_to_head.py): the targeted policies, their references as the
    # grid chose them and a twin of the best fixed pair, every one once a round; 0: none
    head_to_head_rounds: int = 8
    time_limit_s: float | None = None  # no cell (batch size, workload) starts after this many seconds
    pin_cpu: bool = False  # timed passes with the main thread on one core of the GPU's NUMA node (bench.affinity)
    timing_threads: int | None = 1  # torch intra-op threads during the timed passes on CUDA (None: as they are)
    gpu_warmup_ms: float = 30.0  # GPU work right before each timed pass (CUDA only; 0: none)
    seed: int = 0


@dataclass
class Method:
    name: str
    family: str  # "plain", "fixed", "goodput", "batch_adaptive", "bandit"
    variant: str  # "", "per-row", "finish", "ucb", "epoch", "batch-level", "batch-call"
    drafters: tuple[str, ...]  # given to generate(), in this order
    length: int  # fixed: k; goodput / batch_adaptive: the longest draft; bandit: k
    make: Callable[[str], Policy] = field(repr=False)  # workload name -> a fresh policy

    @property
    def learns(self) -> bool:
        """Whether the policy learns from the calls it serves (and so first serves a history)."""
        return self.family in ("goodput", "bandit")


class Tally(Policy):
    """Passes everything to ``inner`` and counts, by request kind, row-steps, drafted tokens and
    which drafter proposed (a few bincounts per step), and the host time the inner policy takes
    (``policy_s``: its plan and observe calls); ``trace`` keeps, per step, the active rows, the
    longest and the mean draft, the drafters used, the step's wall time in ms and the part of it
    the policy's plan took (StepRecord.plan_time_s, ms; Tally's own bookkeeping included)."""

    def __init__(self, inner: Policy, kinds: np.ndarray, num_drafters: int):
        self.inner, self.kinds, self.num_drafters = inner, kinds, max(num_drafters, 1)
        self.policy_s, self.steps = 0.0, 0
        self.row_steps = np.zeros(len(KINDS))
        self.drafted_tokens = np.zeros(len(KINDS))
        self.drafting = np.zeros((len(KINDS), self.num_drafters))  # row-steps that drafted > 0, by drafter
        self.trace: list[list] = []

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens

    def plan(self, batch, num_drafters):
        started = time.perf_counter()
        plan = self.inner.plan(batch, num_drafters)
        self.policy_s += time.perf_counter() - started
        self.steps += 1
        return plan

    def observe(self, record) -> None:
        rows = record.rows
        kinds = self.kinds[rows]
        drafted = record.num_drafted[rows]
        self.row_steps += np.bincount(kinds, minlength=len(KINDS))
        self.drafted_tokens += np.bincount(kinds, weights=drafted, minlength=len(KINDS))
        on = drafted > 0
        self.trace.append([len(rows), int(drafted.max(initial=0)), round(float(drafted.mean()) if len(rows) else 0.0, 2),
                           len(np.unique(record.drafter_index[rows][on])),
                           round(1e3 * (record.step_time_s or 0.0), 3), round(1e3 * record.plan_time_s, 3)])
        if on.any():
            cell = kinds[on] * self.num_drafters + record.drafter_index[rows][on]
            self.drafting += np.bincount(cell, minlength=len(KINDS) * self.num_drafters).reshape(len(KINDS), -1)
        started = time.perf_counter()
        self.inner.observe(record)
        self.policy_s += time.perf_counter() - started


def write_replacing(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it, so a reader (a copy
    packed while the bench runs) sees the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _log(*args) -> None:
    print(*args, flush=True)


def choose_drafters(settings: PolicyBenchSettings, zoo_drafters: dict, manifest: dict) -> list[str]:
    """The drafter names of the run: settings.drafters, or prompt lookup plus the model drafters
    of lowest held-out loss."""
    if settings.drafters:
        names = [LOOKUP if n in ("lookup", LOOKUP) else n for n in settings.drafters]
        unknown = [n for n in names if n != LOOKUP and n not in zoo_drafters]
        if unknown:
            raise ValueError(f"unknown drafters {unknown}; the zoo has {sorted(zoo_drafters)} and 'lookup'")
        return names
    by_loss = sorted(zoo_drafters, key=lambda n: manifest["models"][n].get("heldout_loss", math.inf))
    return [LOOKUP] + by_loss[: settings.num_model_drafters]


def profile_grid(settings: PolicyBenchSettings, prompt_lengths: Sequence[int], max_rows: int, max_k: int) -> ProfileGrid:
    """The cost model's grid for this run: batch sizes up to the largest run, tokens per row up to
    max_k + 1 (a verify pass), contexts spanning what the workloads hold (kept short enough that
    the runners built for the runs cover the profile)."""
    low = int(min(prompt_lengths))
    high = max(low, int(max(prompt_lengths)) + settings.max_new_tokens - 2 * max_k - 4)
    contexts = tuple(sorted({low, (low + high) // 2, high}))
    if settings.profile_grid == "tiny":
        batches = tuple(b for b in (1, 2, 4, 8) if b <= max_rows) or (1,)
        return ProfileGrid(batch_sizes=batches, tokens_per_row=(1, max_k + 1), context_lengths=contexts[::2],
                           draft_lengths=(1, max_k), repeats=2, warmup=1)
    batches = tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max_rows} | {max_rows}))
    per_row = tuple(sorted({1, 2, 4, max_k + 1}))
    return ProfileGrid(batch_sizes=batches, tokens_per_row=per_row, context_lengths=contexts,
                       draft_lengths=tuple(sorted({1, 2, 4, max_k})), repeats=5, warmup=2)


def methods(settings: PolicyBenchSettings, names: list[str], policy_drafter: str, cost_model: CostModel,
            tables: dict[str, dict[int, int]], priors: dict[str, float]) -> list[Method]:
    """Plain decoding, every fixed pair, then the policies (each a factory of fresh policies).
    tables: BatchAdaptivePolicy's table per workload; priors: GoodputPolicy's cold-start
    acceptance rate per workload (fitted to the same short tau profile)."""
    index = {n: i for i, n in enumerate(names)}
    single = cost_model.subset([index[policy_drafter]])
    bandit_model = cost_model if settings.bandit_times == "model" else None
    found = [Method("plain decoding (k=0)", "plain", "", (), 0, lambda w: FixedPolicy(0))]
    for name in names:
        for k in sorted(set(settings.lengths) | {settings.bandit_length}):
            found.append(Method(f"fixed {name} k={k}", "fixed", "", (name,), k, lambda w, k=k: FixedPolicy(k)))
    K, every = settings.max_draft_tokens, settings.goodput_decide_every
    for variant, search in (("per-row", "exact"), ("finish", "finish")):
        found.append(Method(f"GoodputPolicy {variant} ({policy_drafter}, k<={K})", "goodput", variant, (policy_drafter,), K,
                            lambda w, search=search: GoodputPolicy(single, max_draft_tokens=K, search=search,
                                                                   decide_every=every, prior=priors[w])))
    found.append(Method(f"BatchAdaptivePolicy ({policy_drafter}, k<={K})", "batch_adaptive", "", (policy_drafter,), K,
                        lambda w: BatchAdaptivePolicy(tables[w])))
    kb = settings.bandit_length
    for variant, (strategy, scope, objective) in BANDIT_VARIANTS.items():
        found.append(Method(f"BanditPolicy {variant} ({len(names)} drafters, k={kb})", "bandit", variant, tuple(names), kb,
                            lambda w, s=strategy, sc=scope, o=objective: BanditPolicy(
                                kb, strategy=s, scope=sc, cost_model=bandit_model, objective=o)))
    return found


def _runner_ids(models) -> dict:
    return {(id(m), role): id(r) for m in models for role, r in runners_of(m).items()}


def run(settings: PolicyBenchSettings, log=_log, checkpoint=None, command: str | None = None,
        cost_model_path: str | Path | None = None) -> dict:
    """The whole experiment -> one result dictionary (module docstring). ``checkpoint`` receives
    the partial result after every run; ``cost_model_path``: also save the fitted cost model there."""
    started = time.perf_counter()
    elapsed = lambda: time.perf_counter() - started
    save = checkpoint or (lambda partial: None)
    if settings.bandit_length < 1 or settings.max_draft_tokens < 1 or min(settings.lengths, default=1) < 1:
        raise ValueError("bandit_length and max_draft_tokens must be >= 1")
    if settings.repeats < 1 or settings.tau_profile_repeats < 1 or settings.head_to_head_rounds < 0:
        raise ValueError(f"repeats and tau_profile_repeats must be >= 1 (timed passes per run, measured rounds "
                         f"per profiled length) and head_to_head_rounds >= 0, got {settings.repeats}, "
                         f"{settings.tau_profile_repeats} and {settings.head_to_head_rounds}")
    if settings.bandit_times not in ("measured", "model"):
        raise ValueError(f"bandit_times must be 'measured' or 'model', got {settings.bandit_times!r}")
    cuda = settings.device.startswith("cuda")
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if cuda else "float32")
    graphs = cuda if settings.cuda_graphs is None else settings.cuda_graphs
    compiled = graphs if settings.compile is None else (settings.compile and graphs)

    build(settings.preset, out=settings.zoo_dir, device=settings.device)
    zoo = load(settings.preset, out=settings.zoo_dir, device=settings.device, dtype=getattr(torch, dtype))
    tokenizer, target, eos = zoo.tokenizer, zoo.target, zoo.tokenizer.eos_token_id
    names = choose_drafters(settings, zoo.drafters, zoo.manifest)
    model_names = [n for n in names if n != LOOKUP]
    policy_drafter = settings.policy_drafter or (model_names[0] if model_names else names[0])
    if policy_drafter not in names:
        raise ValueError(f"policy drafter {policy_drafter!r} is not among the run's drafters {names}")
    drafters = {n: PromptLookupDrafter() if n == LOOKUP else ModelDrafter(zoo.drafters[n], cuda_graphs=graphs, compile=compiled)
                for n in names}

    # workloads: the measured requests, then held-out ones (same generator, later files) for the tau profile
    batch_sizes = sorted(set(settings.batch_sizes), reverse=True)
    count = max([settings.num_prompts, settings.batch1_prompts] + [measured_size(settings, b) for b in batch_sizes])
    generator = WorkloadGenerator(zoo.heldout_texts(), tokenizer, settings.prompt_tokens, seed=settings.seed)
    workloads = generator.standard(count, settings.workloads, mixed_fraction=settings.mixed_fraction)
    # every held-out request of the profile at every batch size, in calls of at most the largest
    # batch size (a profile of one request reads that file's tau, not the workload's)
    profile_rows = max(1, settings.profile_prompts, max(settings.batch_sizes))
    held_out = generator.standard(profile_rows, settings.workloads, offset=count, mixed_fraction=settings.mixed_fraction)
    # the learning policies' past: more held-out requests, after the profile's
    history_rows = max(history_size(settings, b) for b in batch_sizes)
    history, history_files = history_workloads(generator, settings, history_rows, first=count + profile_rows)
    if history_files < history_rows:
        log(f"the history's {history_rows} requests repeat {history_files} distinct held-out files")
    all_prompts = [p for w in (*workloads.values(), *held_out.values(), *history.values()) for p in w.prompts()]
    # the generator reuses files from the first when it runs out: a profile or history request
    # made from a measured request's file would teach the policies the measured text
    measured_files = {r.id for w in workloads.values() for r in w.requests}
    reused_files = measured_files & {r.id for w in (*held_out.values(), *history.values()) for r in w.requests}
    if reused_files:
        log(f"warning: the zoo's held-out files ran out: {len(reused_files)} of the {len(measured_files)} files measured "
            f"also made profile or history requests (lower --num-prompts, --profile-prompts or --history-prompts)")
    K = max(settings.max_draft_tokens, settings.bandit_length, *settings.lengths)
    max_rows = batch_sizes[0]

    result = {
        "format": FORMAT,
        "environment": {**environment(settings.device), **({"command": command} if command else {})},
        "settings": asdict(settings),
        "dtype": dtype,
        "zoo": zoo.manifest["models"],
        "drafters": names,
        "policy_drafter": policy_drafter,
        "workloads": {},
        "rows": [],
        "head_to_head": [],  # per cell (head_to_head.py)
        "skipped": [],
        "timings": {},
        "timing_cpus": timing_cpus(settings),  # None: the passes ran unpinned
        "reused_files": len(reused_files),  # measured files also used by the profile or the history (0: none)
        "history_files": history_files,  # distinct files the history's requests come from
    }
    cpus = result["timing_cpus"]
    for name, workload in workloads.items():
        summary = workload.summary()
        summary["oracle_lookup_tau"] = mean_oracle_lookup_tau(workload, tokenizer, settings.bandit_length,
                                                              settings.max_new_tokens)
        result["workloads"][name] = summary
    log(f"drafters {names}; policies draft with {policy_drafter}; workloads " + ", ".join(
        f"{n} ({s['num_copy']} copy / {s['num_continuation']} continuation, {s['distinct_files']} files, "
        f"oracle lookup tau {s['oracle_lookup_tau']})" for n, s in result["workloads"].items()))
    log(estimate(settings, len(names)))

    # 1. every runner at the largest shape any later call needs (graphs captured once, compiled once)
    if graphs:
        phase = time.perf_counter()
        longest = max(all_prompts, key=len)
        first_model = next((i for i, n in enumerate(names) if n != LOOKUP), 0)
        generate(target, [longest] * max_rows, drafter=list(drafters.values()), policy=FixedPolicy(K, first_model),
                 max_new_tokens=settings.max_new_tokens, eos_token_id=eos, cuda_graphs=graphs, compile=compiled)
        synchronise(settings.device)
        result["timings"]["build_runners_s"] = time.perf_counter() - phase
        log(f"runners built (rows {max_rows}, drafts up to {K}, prompts up to {len(longest)} tokens) "
            f"in {result['timings']['build_runners_s']:.1f} s")

    # 2. the cost model, through the same runners (and 3., under the timed passes' thread count)
    with torch_threads(timing_threads(settings)):
        phase = time.perf_counter()
        grid = profile_grid(settings, [len(p) for p in all_prompts], max_rows, K)
        cost_model = profile(target, list(drafters.values()), grid=grid, cuda_graphs=graphs, compile=compiled,
                             step_overhead=True)
        result["timings"]["profile_s"] = time.perf_counter() - phase
        result["cost_model"] = {**cost_model.as_dict(), "drafter_names": names, "grid": asdict(grid)}
        if cost_model_path is not None:
            cost_model.save(cost_model_path)
        log(f"{cost_model.describe()}\n(profiled in {result['timings']['profile_s']:.1f} s)")

        # 3. a short measured profile per workload on held-out requests: BatchAdaptivePolicy's table
        # (tokens per second of whole calls per batch size and length) and, from the same calls' tau
        # per length, GoodputPolicy's cold-start acceptance rate (without one, a policy that starts
        # at a pessimistic prior may never draft, and so never learn that drafting pays)
        phase = time.perf_counter()
        options = {"eos_token_id": eos, "cuda_graphs": graphs, "compile": compiled}
        context = int(np.mean([len(p) for p in all_prompts])) + settings.max_new_tokens // 2
        tables, priors, result["tau_profile"] = {}, {}, {}
        for name in settings.workloads:
            # the table from measured rounds at the experiment's batch sizes (the paper's short profile),
            # not from the fitted cost model, which can mispredict speculative steps at large batch sizes
            policy = BatchAdaptivePolicy.from_measurements(
                target, drafters[policy_drafter], held_out[name].prompts(), batch_sizes=sorted(set(batch_sizes)),
                draft_lengths=sorted({0, 1, 2, 3, 4, 6, settings.max_draft_tokens}), max_new_tokens=settings.tau_profile_tokens,
                repeats=settings.tau_profile_repeats, requests_per_size=max(1, settings.profile_prompts), **options)
            # the prior from the same calls' tau per length, pooled over them (a profile of its own
            # would time every length 1..K once more)
            expected = {s: tau for s, tau in sorted(policy.profile["expected_tokens"].items()) if s > 0}
            tables[name], priors[name] = policy.table, rate_from_expected_tokens(expected)
            result["tau_profile"][name] = {"expected_tokens": {str(k): v for k, v in expected.items()},
                                           "acceptance_rate": priors[name], "context_len": context,
                                           "batch_adaptive_table": {str(b): s for b, s in policy.table.items()},
                                           "batch_adaptive_profile": policy.profile}
            log(f"tau profile {name}: {', '.join(f'k={k}: {v:.2f}' for k, v in expected.items())}; fitted acceptance "
                f"rate {priors[name]:.3f}; BatchAdaptivePolicy table {policy.table}")
        result["timings"]["tau_profile_s"] = time.perf_counter() - phase
    save(result)

    # 4. the runs, one cell (batch size, workload) at a time, every method's passes interleaved
    grid_methods = methods(settings, names, policy_drafter, cost_model, tables, priors)
    cells = [(b, w) for b in batch_sizes for w in settings.workloads]
    total = len(cells) * len(grid_methods)
    models = [target] + [zoo.drafters[n] for n in model_names]
    runs_started = time.perf_counter()
    units_done = seconds_done = 0.0
    for number, (batch, workload_name) in enumerate(cells):
        if settings.time_limit_s is not None and elapsed() > settings.time_limit_s:
            result["skipped"] = [{"workload": w, "batch": b, "method": m.name} for b, w in cells[number:] for m in grid_methods]
            log(f"time limit of {settings.time_limit_s:.0f} s reached: {len(result['skipped'])} runs skipped")
            break
        workload = workloads[workload_name]
        size = measured_size(settings, batch)
        prompts, kinds = workload.prompts(size), np.array([KINDS.index(k) for k in workload.kinds(size)])
        before = _runner_ids(models)
        past = history[workload_name].prompts(history_size(settings, batch)) if history else []
        cell_started = time.perf_counter()
        measured, confirmation = measure_cell(target, drafters, grid_methods, workload_name, prompts, kinds, batch,
                                              settings, eos, graphs, compiled, cpus, history=past)
        # the cell's time beyond its rows' passes (the head-to-head rounds), added after its rows' progress lines
        beyond_rows = time.perf_counter() - cell_started - sum(r["elapsed_s"] for r in measured)
        if confirmation is not None:
            result["head_to_head"].append({"workload": workload_name, "batch": batch, **confirmation})
            log(f"head to head, {workload_name} b{batch}, {confirmation['rounds']} rounds: " + (confirmation.get("error") or "; ".join(
                f"{c['policy']} / {c['reference']} {c['median']:.3f}" for c in confirmation["comparisons"])))
        rebuilt = _runner_ids(models) != before
        reference = measured[0].get("sequences")  # plain decoding comes first
        for index, (method, row) in enumerate(zip(grid_methods, measured), start=1):
            row_sequences = row.pop("sequences")
            row = {"workload": workload_name, "batch": batch, "method": method.name, "family": method.family,
                   "variant": method.variant, "drafters": list(method.drafters), "length": method.length,
                   "prompts": len(prompts), **row, "runner_rebuilt": rebuilt}  # rebuilt in this cell (any method)
            row.setdefault("error", "")
            if not row["error"]:
                if method.family == "plain":
                    row["identical"], row["agreement"] = None, 1.0
                elif reference is None:
                    row["error"] = "no plain decoding output to compare with (plain decoding failed)"
                else:
                    row["identical"] = row_sequences == reference and row["passes_agree"]
                    row["agreement"] = agreement(row_sequences, reference)
            result["rows"].append(row)
            units_done += len(prompts) / batch * settings.max_new_tokens
            seconds_done += row["elapsed_s"]
            left = sum(measured_size(settings, b) / b
                       for b, _ in cells[number + 1 :]) * len(grid_methods) * settings.max_new_tokens \
                * seconds_done / max(units_done, 1e-9)
            log(progress_line(row, result["rows"], number * len(grid_methods) + index, total, elapsed(), left))
        seconds_done += beyond_rows
        save(result)
    result["timings"]["runs_s"] = time.perf_counter() - runs_started
    result["timings"]["total_s"] = elapsed()
    result["targets"] = policy_targets(result)
    result["head_to_head_targets"] = head_to_head_targets(result)
    return result


def history_workloads(generator: WorkloadGenerator, settings: PolicyBenchSettings, rows: int,
                      first: int) -> tuple[dict, int]:
    """The learning policies' past: ``rows`` requests per workload from the held-out files from
    ``first`` on (those before are measured or profiled) -> (workloads, distinct files). Where the
    files run out, the history repeats its own requests rather than come back to the first ones,
    which the generator would, teaching the policies the measured text. With no file left at all
    it takes one from the first (the run's reused_files says so)."""
    if rows <= 0:
        return {}, 0
    files = max(0, min(rows, generator.available(first + rows) - first))
    workloads = generator.standard(max(files, 1), settings.workloads, offset=first, mixed_fraction=settings.mixed_fraction)
    return {name: workload.cycled(rows) for name, workload in workloads.items()}, files


def measured_size(settings: PolicyBenchSettings, batch: int) -> int:
    """Requests each timed pass serves at this batch size (in calls of ``batch``)."""
    return settings.batch1_prompts if batch == 1 else max(settings.pass_calls * batch, settings.num_prompts)


def history_size(settings: PolicyBenchSettings, batch: int) -> int:
    """Held-out requests a learning policy serves before its timed passes at this batch size."""
    if settings.history_prompts <= 0:
        return 0
    return settings.batch1_prompts if batch == 1 else max(settings.history_calls * batch, settings.history_prompts)


def timing_threads(settings: PolicyBenchSettings) -> int | None:
    """The torch thread count for timed work: ``timing_threads`` on CUDA; None (as they are) on a
    CPU, where the intra-op threads do the work."""
    return settings.timing_threads if torch.device(settings.device).type == "cuda" else None


def timing_cpus(settings: PolicyBenchSettings) -> list[int] | None:
    """--pin-cpu: one core of the GPU's NUMA node (the middle one listed), else None (unpinned)."""
    if not settings.pin_cpu:
        return None
    device = torch.device(settings.device)
    local = gpu_local_cpus(device.index if device.index is not None else 0)
    return [local[len(local) // 2]]


def measure_cell(target, drafters: dict, grid_methods: list[Method], workload: str, prompts: list[list[int]],
                 kinds: np.ndarray, batch: int, settings: PolicyBenchSettings, eos, graphs: bool,
                 compiled: bool, cpus: list[int] | None = None, history: list[list[int]] = ()) -> tuple[list[dict], dict | None]:
    """Every method on one workload at one batch size -> (a row per method (with its sequences,
    for the comparison), the cell's head-to-head record or None: time_head_to_head, after the
    grid, with ``settings.head_to_head_rounds`` rounds). First one short untimed warm-up call per method, and each learning
    policy serves ``history`` (held-out requests, in calls of ``batch``, untimed); then ``repeats``
    rounds, each timing one pass of every method (the order rotated from round to round), so a
    slow spell of the machine falls on every method alike rather than on one method's passes.
    Each pass runs every chunk of ``batch`` prompts with a fresh policy, the device
    synchronised around it and the garbage collector paused during it (a collection lands on
    whichever pass it happens to fall in); one full collection per cell, after which the objects
    alive are frozen out of later collections. With ``cpus`` (``timing_cpus``) the rounds run
    with the main thread on those CPUs; they run with ``timing_threads`` torch threads, and each
    pass starts after ``gpu_warmup_ms`` of GPU work (bench.affinity). A learning policy's every
    pass starts from a copy of the policy that served the history (a fresh one without history).
    A method that raises gets an error row and takes no further part."""
    chunk_starts = range(0, len(prompts), batch)
    chunks = [prompts[i : i + batch] for i in chunk_starts]
    longest = max(range(len(chunks)), key=lambda c: max(map(len, chunks[c])))
    calls, passes, errors, spent = [], [[] for _ in grid_methods], {}, [0.0] * len(grid_methods)
    trained: dict[int, Policy] = {}  # method index -> the policy that served the history
    for index, method in enumerate(grid_methods):
        given = [drafters[n] for n in method.drafters]
        kwargs = {"drafter": given or None, "verifier": PaddingFreeVerifier(), "eos_token_id": eos,
                  "cuda_graphs": graphs, "compile": compiled}
        calls.append((given, kwargs))
        started = time.perf_counter()
        try:
            with torch_threads(timing_threads(settings)):  # as the timed passes run
                generate(target, chunks[longest], policy=method.make(workload), max_new_tokens=settings.warmup_tokens,
                         **kwargs)
                if method.learns and history:
                    trained[index] = serve_history(target, method.make(workload), history, batch,
                                                   settings.max_new_tokens, kwargs)
        except Exception as error:  # noqa: BLE001 - reported in the results, and the run goes on
            errors[index] = f"{type(error).__name__}: {str(error)[:300]}"
        spent[index] += time.perf_counter() - started
    # one full collection per cell, then every object alive now is frozen out of later
    # collections: a full collection over the compiled models' objects takes most of a second
    gc.collect()
    gc.freeze()
    n = len(grid_methods)
    rotation = max(1, n // settings.repeats)  # each round starts this many methods further on
    order = [(i + r * rotation) % n for r in range(settings.repeats) for i in range(n)]

    def timed_pass(index: int) -> tuple:
        """One pass of method ``index`` -> (seconds, outputs, tallies, policy, learnt state at its start)."""
        given, kwargs = calls[index]
        policy = copy.deepcopy(trained[index]) if index in trained else grid_methods[index].make(workload)
        at_start = learnt_state(policy)
        tallies = [Tally(policy, kinds[i : i + batch], len(given)) for i in chunk_starts]
        warm_gpu(settings.device, settings.gpu_warmup_ms / 1e3)
        gc.disable()
        try:
            synchronise(settings.device)
            started = time.perf_counter()
            outputs = [generate(target, chunk, policy=tally, max_new_tokens=settings.max_new_tokens, **kwargs)
                       for chunk, tally in zip(chunks, tallies)]
            synchronise(settings.device)
            return time.perf_counter() - started, outputs, tallies, policy, at_start
        finally:
            gc.enable()

    confirmation = None  # the head-to-head record
    try:
        with pinned(cpus), torch_threads(timing_threads(settings)):
            for index in order:
                if index in errors:
                    continue
                started = time.perf_counter()  # elapsed_s: passes with their set-up (policy copy, GPU warm-up)
                try:
                    passes[index].append(timed_pass(index))
                except Exception as error:  # noqa: BLE001
                    errors[index] = f"{type(error).__name__}: {str(error)[:300]}"
                finally:
                    spent[index] += time.perf_counter() - started
            if settings.head_to_head_rounds > 0 and grid_methods and grid_methods[0].family == "plain" and 0 not in errors:
                confirmation = time_head_to_head(grid_methods, passes, errors, settings.head_to_head_rounds, timed_pass)
    finally:
        gc.unfreeze()
    rows = []
    for index, method in enumerate(grid_methods):
        if index in errors:
            rows.append({"error": errors[index], "sequences": None, "elapsed_s": spent[index]})
        else:
            rows.append({**summarise_passes(method, passes[index]), "elapsed_s": spent[index]})
    return rows, confirmation


def pass_work(outputs: list, tallies: list) -> tuple[int, float, list[float]]:
    """A pass's (or a call's) decoding work: its steps over all its calls, its mean draft tokens
    per row-step, and per drafter the share of row-steps in which it proposed."""
    steps = int(sum(out.stats.steps for out in outputs))
    drafted, row_steps = sum(t.drafted_tokens.sum() for t in tallies), sum(t.row_steps.sum() for t in tallies)
    drafting = sum(t.drafting.sum(axis=0) for t in tallies)  # [drafters] row-steps that drafted, by drafter
    return steps, float(drafted / max(row_steps, 1)), [float(d / max(row_steps, 1)) for d in drafting]


def median_pass_index(passes: list[tuple]) -> int:
    """The median of a method's passes [(seconds, ...)] by time: the slower middle one for an even count."""
    return int(np.argsort([p[0] for p in passes])[len(passes) // 2])


def pass_sequences(outputs: list) -> list:
    """A pass's output sequences, its calls' in order."""
    return [s for out in outputs for s in out.sequences]


def median_pass_rate(passes: list[tuple]) -> float:
    """Tokens/s of a method's median pass, as its row reads it."""
    seconds, outputs, *_ = passes[median_pass_index(passes)]
    return sum(map(len, pass_sequences(outputs))) / seconds


def time_head_to_head(grid_methods: list[Method], passes: list[list[tuple]], errors: dict, rounds: int,
                      timed_pass: Callable[[int], tuple]) -> dict | None:
    """The cell's head-to-head rounds (head_to_head.py), after its grid: the contenders and
    their references chosen from the grid's median passes, ``rounds`` rounds of them -> the
    record (None: no contender ran). Anything that raises ends the rounds, recorded as ``error``
    (which method, which round), and fails the cell's head-to-head targets; the run goes on."""
    try:
        rates = {i: median_pass_rate(p) for i, p in enumerate(passes) if p and i not in errors}
        entries, comparisons = head_to_head.plan(grid_methods, rates)
        if not comparisons:
            return None
        plain_sequences = pass_sequences(passes[0][0][1])

        def entry_pass(entry: int) -> tuple[float, list, int, float, list[float]]:
            seconds, outputs, tallies, *_ = timed_pass(entries[entry])
            return seconds, pass_sequences(outputs), *pass_work(outputs, tallies)

        timed = head_to_head.run_rounds(len(entries), rounds, entry_pass,
                                        labels=[grid_methods[i].name for i in entries])
        return head_to_head.record(grid_methods, entries, comparisons, timed, plain_sequences)
    except Exception as error:  # noqa: BLE001 - reported in the results, and the run goes on
        return {"error": f"{type(error).__name__}: {str(error)[:300]}", "rounds": rounds, "entries": [], "comparisons": []}


def serve_history(target, policy: Policy, prompts: list[list[int]], batch: int, max_new_tokens: int,
                  kwargs: dict) -> Policy:
    """``policy`` after serving ``prompts`` in calls of ``batch`` (what it learns, it keeps)."""
    for start in range(0, len(prompts), batch):
        generate(target, prompts[start : start + batch], policy=policy, max_new_tokens=max_new_tokens, **kwargs)
    if hasattr(policy, "end_call"):  # the last call's lesson in now, so learnt_state reads it
        policy.end_call()
    if isinstance(policy, GoodputPolicy):  # likewise its last call's steps
        policy.learn_now()
    return policy


def learnt_state(policy: Policy) -> dict:
    """What a learning policy knows before a pass (JSON): GoodputPolicy's prior and step-time
    calibration; a batch-scope bandit's pulls and mean rewards per drafter; {} otherwise."""
    if isinstance(policy, GoodputPolicy):
        return {"prior": policy.prior, "calibrated_steps": policy.calibration.steps_measured,
                "base_scale": {str(b): v for b, v in sorted(policy.calibration.base_scale.items())},
                "extra_scale": {str(b): v for b, v in sorted(policy.calibration.extra_scale.items())}}
    if isinstance(policy, BanditPolicy) and policy.scope == "batch" and policy.bandits is not None:
        return {"pulls": policy.bandits.counts[0].tolist(), "mean_reward": policy.bandits.raw_means()[0].tolist()}
    return {}


def summarise_passes(method: Method, passes: list[tuple]) -> dict:
    """One method's timed passes [(seconds, outputs, tallies, policy, learnt state at the start)] -> its row: time and
    statistics from the median pass (the slower middle one for an even count; adaptive policies
    may choose differently from pass to pass), every pass's output checked against the first."""
    timings = [p[0] for p in passes]
    chosen = median_pass_index(passes)
    seconds, outputs, tallies, policy, at_start = passes[chosen]
    every_pass = [pass_sequences(outs) for _, outs, *_ in passes]
    calibration = getattr(policy, "calibration", None)  # GoodputPolicy's measured corrections, by active rows
    sequences = pass_sequences(outputs)
    tokens = sum(map(len, sequences))
    row_steps = sum(out.stats.row_steps for out in outputs)
    by_kind_steps = sum(t.row_steps for t in tallies)
    drafted = sum(t.drafted_tokens for t in tallies)
    drafting = sum(t.drafting for t in tallies)  # [kinds, drafters]
    # every pass's steps and mean draft, in pass order (the row's own are the median pass's): whether an adaptive
    # policy's choices moved with a pass's timing (a slow pass that drafted less), and whether two runs did the
    # same work in every pass
    works = [pass_work(outs, tals) for _, outs, tals, *_ in passes]
    pass_steps, pass_mean_draft = [w[0] for w in works], [w[1] for w in works]
    use = {}
    for k, kind in enumerate(KINDS):
        if by_kind_steps[k] > 0 and method.drafters:
            use[kind] = {n: float(drafting[k, d] / by_kind_steps[k]) for d, n in enumerate(method.drafters)}
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "tau": tokens / row_steps if row_steps else float("nan"),
        "steps": pass_steps[chosen],
        "mean_draft_tokens": pass_mean_draft[chosen],
        "mean_draft_tokens_by_kind": {kind: float(drafted[k] / by_kind_steps[k]) for k, kind in enumerate(KINDS)
                                      if by_kind_steps[k] > 0},
        "drafter_use": use,  # per kind: fraction of row-steps in which each drafter proposed
        "pass_seconds": timings,
        "pass_steps": pass_steps,
        "pass_mean_draft_tokens": pass_mean_draft,
        # per step of the median pass's first call: [active rows, longest draft, mean draft, drafters used, ms,
        # plan ms] (older results files hold only the first five)
        **({"trace": tallies[0].trace} if method.family != "fixed" else {}),
        # the median pass's calls one by one: steps and mean draft, and the last call's trace (a learning policy's
        # later calls start from what its earlier ones taught it)
        "call_steps": [t.steps for t in tallies],
        "call_mean_draft_tokens": [pass_work([out], [t])[1] for out, t in zip(outputs, tallies)],
        **({"last_call_trace": tallies[-1].trace} if method.family != "fixed" and len(tallies) > 1 else {}),
        "policy_ms_per_step": 1e3 * sum(t.policy_s for t in tallies) / max(sum(t.steps for t in tallies), 1),
        **({"calibration": {"base_scale": {str(b): v for b, v in sorted(calibration.base_scale.items())},
                            "extra_scale": {str(b): v for b, v in sorted(calibration.extra_scale.items())}}}
           if calibration is not None else {}),
        **({"learnt_at_start": at_start} if at_start else {}),  # what the history taught, as the median pass began
        "sequences": sequences,
        "passes_agree": all(p == sequences for p in every_pass),
    }


def progress_line(row: dict, rows: list[dict], number: int, total: int, elapsed: float,
                  left: float) -> str:
    head = f"[{number:>3}/{total}] {row['workload']:<12} b{row['batch']:<3} {row['method']:<48}"
    tail = f"{row['elapsed_s']:5.1f} s; {elapsed:4.0f} s elapsed, about {left:.0f} s of runs left"
    if row["error"]:
        return f"{head} FAILED {row['error']} ({tail})"
    plain = next((r for r in rows if r["family"] == "plain" and r["workload"] == row["workload"]
                  and r["batch"] == row["batch"] and not r["error"]), None)
    ratio = f" ({row['tokens_per_s'] / plain['tokens_per_s']:.2f}x plain)" if plain and row is not plain else ""
    same = {True: "yes", False: "NO", None: "reference"}[row["identical"]]
    return (f"{head} {row['tokens_per_s']:9.1f} tok/s{ratio}, tau {row['tau']:.2f}, "
            f"mean k {row['mean_draft_tokens']:.2f}, identical {same} ({tail})")


def estimate(settings: PolicyBenchSettings, num_drafters: int) -> str:
    """What the run will do, in runs and generate() calls (a plan, not a measurement)."""
    num_methods = 1 + num_drafters * len(set(settings.lengths) | {settings.bandit_length}) + 4 + len(BANDIT_VARIANTS)
    calls = sum(math.ceil(measured_size(settings, b) / b)
                for b in settings.batch_sizes)
    runs = num_methods * len(settings.workloads) * len(settings.batch_sizes)
    return (f"plan: {runs} runs ({num_methods} methods x {len(settings.workloads)} workloads x "
            f"{len(settings.batch_sizes)} batch sizes), each timed in {settings.repeats} passes: one pass of every run "
            f"is {calls * num_methods * len(settings.workloads)} generate() calls of up to {settings.max_new_tokens} new "
            f"tokens; plus one short warm-up call per run; then per cell {settings.head_to_head_rounds} head-to-head "
            f"rounds of up to {2 * len(head_to_head.CONTENDERS) + 1} passes")


# --- report ----------------------------------------------------------------------------------
def _ratio_to_plain(rows: list[dict]) -> dict:
    plain = {(r["workload"], r["batch"]): r["tokens_per_s"] for r in rows if r["family"] == "plain" and not r["error"]}
    return {id(r): r["tokens_per_s"] / plain[(r["workload"], r["batch"])] for r in rows
            if not r["error"] and (r["workload"], r["batch"]) in plain}



def timing_conditions(settings: dict, cpus: list[int] | None) -> str:
    """One line on how the passes were timed (results written before a setting existed: its old
    behaviour, i.e. threads as they were and no GPU warm-up)."""
    threads = settings.get("timing_threads")
    warmup = settings.get("gpu_warmup_ms", 0.0)
    on_cuda = str(settings.get("device", "")).startswith("cuda")
    repeats = settings.get("repeats", "?")
    if isinstance(repeats, list):  # merged parts: one per part
        repeats = "/".join(map(str, repeats)) + " (by part)"
    return (f"Timing: {repeats} passes per run, tokens/s from the median pass; "
            f"{'main thread pinned to CPU ' + ','.join(map(str, cpus)) if cpus else 'main thread unpinned'}; "
            f"{str(threads) + ' torch thread(s)' if threads and on_cuda else 'torch threads as they were'}; "
            f"{f'{warmup:g} ms of GPU work before each pass' if warmup and on_cuda else 'no GPU warm-up before a pass'}"
            f"; {history_conditions(settings)}.")


def _times_b(calls: int) -> str:
    return "B" if calls == 1 else f"{calls}B"


def history_conditions(settings: dict) -> str:
    """How the learning policies' passes started (results from before the history: fresh)."""
    history = settings.get("history_prompts", 0)
    if not history:
        return "every pass of a learning policy started from a fresh policy"
    size = _times_b(settings.get("history_calls", 1))
    return (f"every pass of a learning policy (GoodputPolicy, BanditPolicy) started from its state after serving "
            f"max({size}, {history}) held-out requests at batch B ({settings.get('batch1_prompts', '?')} at batch 1), untimed")


def markdown(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    hardware = env.get("gpu", env.get("cpu", "?"))
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    ratio = _ratio_to_plain(rows)
    lines = [
        "# Adaptive policies against fixed (drafter, length) pairs",
        "",
        f"Command: `{env['command']}` at commit `{env['commit'][:12]}`, {env['time']}.",
        (f"Hardware: {hardware}{' (driver ' + env['driver'] + ')' if 'driver' in env else ''}; "
        f"torch {env['torch']}, transformers {env['transformers']}, specdec {env['specdec']}."),
        (f"Zoo `{settings['preset']}` ({result.get('dtype', settings['dtype'])}), drafters {', '.join(result['drafters'])}; "
        f"GoodputPolicy and BatchAdaptivePolicy draft with {result['policy_drafter']}; "
        f"{settings['max_new_tokens']} new tokens, greedy; batch 1: {settings['batch1_prompts']} requests one call "
        f"each; batch B: max({_times_b(settings.get('pass_calls', 1))}, {settings['num_prompts']}) requests in calls of B. "
        "Every output is compared token for token with plain decoding of the same requests at the same batch size."),
        timing_conditions(settings, result.get("timing_cpus")),
        "",
    ]
    for i, part in enumerate(result.get("parts", [])):
        lines.append(f"- part {i + 1} of {len(result['parts'])}: batch sizes {part['batch_sizes']}, "
                     f"`{part['environment'].get('command', '?')}` at commit `{part['environment'].get('commit', '?')[:12]}`, "
                     f"{part['environment'].get('time', '?')}")
    if result.get("parts"):
        lines.append("")
    for name, w in result.get("workloads", {}).items():
        tau = ", ".join(f"{k} {v:.2f}" for k, v in w.get("oracle_lookup_tau", {}).items())
        lines.append(f"- workload `{name}`: {w['num_copy']} copy-heavy and {w['num_continuation']} continuation "
                     f"requests from {w['distinct_files']} held-out files; prompt lookup's tau if the target "
                     f"reproduced each file: {tau}")
    if "cost_model" in result:
        cm = CostModel.from_dict(result["cost_model"])
        names = result["cost_model"].get("drafter_names", [])
        described = cm.describe().splitlines()
        lines += ["", (f"Cost model, profiled in {result['timings'].get('profile_s', float('nan')):.1f} s "
                      "through the runners generation uses:"), "", "```", described[0], described[1]]
        lines += [f"  {names[i] if i < len(names) else i}: {d.describe()}" for i, d in enumerate(cm.drafters)]
        lines += ["```"]
    for name, part in result.get("tau_profile", {}).items():
        taus = ", ".join(f"{k}: {v:.2f}" for k, v in part["expected_tokens"].items())
        lines.append(f"- tau profile `{name}` ({result['policy_drafter']}, held-out requests), by draft length: {taus}; "
                     f"fitted acceptance rate {part['acceptance_rate']:.3f} (GoodputPolicy's prior); "
                     f"BatchAdaptivePolicy's table batch -> length {part['batch_adaptive_table']}")
    confirmed = result.get("head_to_head") or []
    lines += head_to_head.markdown_lines(confirmed, target_table(result.get("head_to_head_targets") or head_to_head_targets(result)))
    lines += ["", "## Targets, from the grid's median pass" if confirmed else "## Targets", "",
              *target_table(result.get("targets") or policy_targets(result))]
    measured = {w: sorted({r["batch"] for r in rows if r["workload"] == w and not r["error"]}) for w in
                dict.fromkeys(r["workload"] for r in rows)}
    lines += ["", "Batch sizes measured, by workload: " + "; ".join(f"{w} {b}" for w, b in measured.items()) +
              ". A target reads as met only over the batch sizes measured."]
    bound = kind_oracle_bound(result)
    if bound:
        lines += ["", "Room for the bandit's `mixed` target: the best drafter per request kind (from the `copy` and "
                  "`continuation` runs at the bandit's length) against the best single drafter, by batch size: " +
                  ", ".join(f"{b}: {v:.3f}" for b, v in bound.items()) +
                  " (an estimate from the homogeneous runs; the target needs 1.10)."]
    fastest = policy_targets({**result, "rows": fastest_pass_rows(rows)})
    if fastest and any(len(r.get("pass_seconds", [])) > 1 for r in rows):
        lines += ["", "Noise check: the same targets from each run's fastest pass rather than its median one "
                  "(interference only slows a pass down):", "", "| target | workload | worst ratio | ratio by batch size |",
                  "|---|---|---|---|"]
        for t in fastest:
            lines.append(f"| {t['target']} (needs {t['threshold']:.2f}) | {t['workload']} | {t['ratio']:.2f} | {by_batch_text(t)} |")
    twins = same_decision_pairs(rows)
    if twins:
        lines += ["", "A/A check: BatchAdaptivePolicy runs that did a fixed pair's decoding work (as many steps, the "
                  "same mean draft length), so their ratio measures the timing's noise, not the policy:", "",
                  "| workload | batch | policy | fixed pair | ratio, median pass | ratio, fastest pass |", "|---|---|---|---|---|---|"]
        for t in twins:
            fastest_ratio = "-" if t["fastest_ratio"] is None else f"{t['fastest_ratio']:.3f}"
            lines.append(f"| {t['workload']} | {t['batch']} | {t['method']} | {t['fixed']} | {t['median_ratio']:.3f} | {fastest_ratio} |")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += ["", f"## Tokens/s against plain decoding, workload `{workload}`", "",
                  "| method | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
        for method in dict.fromkeys(r["method"] for r in rows if r["workload"] == workload):
            cells = []
            for b in batches:
                row = next((r for r in rows if r["workload"] == workload and r["method"] == method and r["batch"] == b), None)
                if row is None:
                    cells.append("-")
                elif row["error"]:
                    cells.append("failed")
                else:
                    mark = "" if row["identical"] in (True, None) else " (differs!)"
                    cells.append(f"{ratio.get(id(row), float('nan')):.2f}x ({row['tokens_per_s']:.0f}){mark}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "## Every run", "",
              "| workload | batch | method | tok/s | vs plain | tau | mean k | drafter use (copy / continuation rows) | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['workload']} | {r['batch']} | {r['method']} | failed: {r['error'][:80]} | | | | | |")
            continue
        use = " / ".join(", ".join(f"{n} {f:.0%}" for n, f in r["drafter_use"].get(kind, {}).items() if f > 0) or "-"
                         for kind in KINDS) if len(r["drafters"]) > 1 else ""
        same = {True: "yes", False: "no", None: "reference"}[r["identical"]]
        lines.append(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | "
                     f"{ratio.get(id(r), float('nan')):.2f}x | {r['tau']:.2f} | {r['mean_draft_tokens']:.2f} | {use} | {same} |")
    if result.get("skipped"):
        lines += ["", f"Skipped after the time limit: {len(result['skipped'])} runs."]
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in result.get("timings", {}).items())
    lines += ["", f"Timings: {timings}."]
    return "\n".join(lines) + "\n"


POLICY_STYLE = {"goodput": "o-", "batch_adaptive": "s-", "bandit": "^-"}


def _batch_axis(ax, batches: list[int]) -> None:
    """A log2 batch-size axis labelled at the measured sizes only."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    if batches:
        ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(NullLocator())


def plot_policies(result: dict):
    """One panel per workload: tokens/s over plain decoding against batch size for each policy,
    the best fixed pair in hindsight and the best fixed length of the policies' drafter."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r["error"]]
    ratio = _ratio_to_plain(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, max(len(workloads), 1), figsize=(5.2 * max(len(workloads), 1), 4.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        batches = sorted({r["batch"] for r in mine})
        fixed = [r for r in mine if r["family"] in ("fixed", "plain")]
        best = [max((ratio[id(r)] for r in fixed if r["batch"] == b), default=float("nan")) for b in batches]
        ax.plot(batches, best, "k--", linewidth=2, label="best fixed pair (hindsight)")
        own = [max((ratio[id(r)] for r in fixed if r["batch"] == b
                    and (r["family"] == "plain" or r["drafters"] == [result.get("policy_drafter")])), default=float("nan"))
               for b in batches]
        ax.plot(batches, own, ":", color="gray", linewidth=2, label=f"best k of {result.get('policy_drafter')}")
        for method in dict.fromkeys(r["method"] for r in mine if r["family"] in POLICY_STYLE):
            points = sorted((r for r in mine if r["method"] == method), key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in points], [ratio[id(r)] for r in points], POLICY_STYLE[points[0]["family"]],
                    label=method, alpha=0.85)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set(xlabel="batch size", ylabel="tokens/s / plain decoding", title=f"workload: {workload}")
        _batch_axis(ax, batches)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['environment'].get('gpu', 'CPU')}: zoo '{result['settings']['preset']}', policies", fontsize=10)
    fig.tight_layout()
    return fig


def plot_fixed(result: dict):
    """One panel per workload: every fixed (drafter, length) pair over plain decoding against batch size."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r["error"]]
    ratio = _ratio_to_plain(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, max(len(workloads), 1), figsize=(5.2 * max(len(workloads), 1), 4.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(result.get("drafters", []))
    for ax, workload in zip(axes[0], workloads):
        fixed = [r for r in rows if r["workload"] == workload and r["family"] == "fixed"]
        lengths = sorted({r["length"] for r in fixed})
        for method in dict.fromkeys(r["method"] for r in fixed):
            points = sorted((r for r in fixed if r["method"] == method), key=lambda r: r["batch"])
            drafter, k = points[0]["drafters"][0], points[0]["length"]
            colour = colours[names.index(drafter) % len(colours)] if drafter in names else None
            ax.plot([r["batch"] for r in points], [ratio[id(r)] for r in points], "o-", color=colour,
                    alpha=0.35 + 0.65 * (lengths.index(k) + 1) / len(lengths), label=f"{drafter} k={k}")
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set(xlabel="batch size", ylabel="tokens/s / plain decoding", title=f"fixed pairs, {workload}")
        _batch_axis(ax, sorted({r["batch"] for r in fixed}))
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def write(result: dict, folder: str | Path, stem: str) -> list[Path]:
    """JSON, markdown and two PNGs named ``stem`` in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    result = {**result, "targets": policy_targets(result), "head_to_head_targets": head_to_head_targets(result)}
    paths = [folder / f"{stem}.json", folder / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result))
    if any(not r["error"] for r in result["rows"]):
        for suffix, draw in (("", plot_policies), ("_fixed", plot_fixed)):
            fig = draw(result)
            paths.append(folder / f"{stem}{suffix}.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    return paths


# --- merging runs ----------------------------------------------------------------------------
# settings that may differ between merged parts: passes are cheap at batch 16 and 64 (a call of
# 0.1-0.2 s) and a slow spell of the machine lasts seconds, so those parts may time more of them;
# each part profiles its own batch sizes (BatchAdaptivePolicy's table, GoodputPolicy's prior), and
# at batch 1 every profiled request is a call of its own, which makes its profile slow
PER_PART = ("time_limit_s", "repeats", "profile_prompts", "tau_profile_repeats", "head_to_head_rounds")
MERGEABLE = {"batch_sizes", "workloads", *PER_PART}


def _unused_difference(key: str, a: dict, b: dict) -> bool:
    """Whether settings ``a`` and ``b`` differ in ``key`` only where neither part used it:
    ``history_prompts`` and ``history_calls`` size the history at batch sizes above 1 alone
    (batch 1 serves batch1_prompts), so a part that measured batch 1 alone may differ from
    another in them, as long as neither started fresh (0). A part from before ``pass_calls``
    timed passes of one call at least, as ``pass_calls=1`` does."""
    if key == "pass_calls":  # results from before --pass-calls timed one call of B at least
        return a.get(key, 1) == b.get(key, 1)
    if key in ("history_prompts", "history_calls"):
        only_batch_1 = list(a.get("batch_sizes", ())) == [1] or list(b.get("batch_sizes", ())) == [1]
        default = 1 if key == "history_calls" else 0  # results from before --history-calls served one call
        return only_batch_1 and bool(a.get(key, default)) and bool(b.get(key, default))
    return False


def merge(results: list[dict]) -> dict:
    """Runs of the same experiment over different batch sizes or workloads (one GPU call each) ->
    one result: rows and skipped runs concatenated (less the runs another part measured), targets
    recomputed over all of them. Every part must have the same settings but ``MERGEABLE`` and hold
    different (batch size, workload) cells; the first part's cost
    model and tau profile head the report and every part's are kept under ``parts``."""
    if len(results) < 2:
        raise ValueError("merge needs at least two results")
    first = results[0]
    # settings are checked against a part that measured more than batch 1 where there is one (a
    # batch-1 part may differ from it only where batch 1 does not use a setting), and recorded from it
    reference = next((part for part in results if list(part["settings"].get("batch_sizes", ())) != [1]), first)
    for other in results:
        if other is reference:
            continue
        if other.get("format") != reference.get("format"):
            raise ValueError(f"cannot merge results of formats {reference.get('format')!r} and {other.get('format')!r}")
        differing = sorted(k for k in set(reference["settings"]) | set(other["settings"])
                           if k not in MERGEABLE and reference["settings"].get(k) != other["settings"].get(k)
                           and not _unused_difference(k, reference["settings"], other["settings"]))
        differing += [k for k in ("dtype", "zoo", "drafters", "policy_drafter") if reference.get(k) != other.get(k)]
        if differing:
            raise ValueError(f"cannot merge runs whose settings differ in {differing}: run them with the same options "
                             "except --batch-sizes, --workloads, --time-limit-s, --repeats, --profile-prompts, "
                             "--profile-repeats and --head-to-head-rounds")
    seen: dict[tuple[int, str], int] = {}  # (batch, workload) -> the part that measured it
    for i, part in enumerate(results):
        for cell in {(r["batch"], r["workload"]) for r in part["rows"]}:
            if cell in seen:
                raise ValueError(f"parts {seen[cell]} and {i} both measured batch {cell[0]} of workload {cell[1]!r}: "
                                 "merge runs of different batch sizes or workloads")
            seen[cell] = i
    merged = {**first, "settings": dict(reference["settings"]), "timings": {}, "rows": [], "skipped": [], "head_to_head": []}
    merged["settings"]["batch_sizes"] = sorted({batch for batch, _ in seen})
    merged["settings"]["workloads"] = list(dict.fromkeys(w for part in results for w in part["settings"].get("workloads", ())))
    merged["workloads"] = {name: summary for part in results for name, summary in part.get("workloads", {}).items()}
    for key in PER_PART:  # one per part
        merged["settings"][key] = [part["settings"].get(key) for part in results]
    merged["parts"] = [{"environment": part["environment"], "batch_sizes": part["settings"]["batch_sizes"],
                        "timings": part.get("timings", {}), "cost_model": part.get("cost_model"),
                        "tau_profile": part.get("tau_profile")} for part in results]
    for part in results:
        merged["rows"] += part["rows"]
        merged["head_to_head"] += part.get("head_to_head", [])
        # a run one part skipped (its time limit) and another measured is not skipped
        merged["skipped"] += [run for run in part.get("skipped", []) if (run["batch"], run["workload"]) not in seen]
        for key, value in part.get("timings", {}).items():
            merged["timings"][key] = merged["timings"].get(key, 0.0) + value
    merged["targets"] = policy_targets(merged)
    merged["head_to_head_targets"] = head_to_head_targets(merged)
    return merged


# --- command line ----------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.policies",
                                description="adaptive policies against fixed drafter/length pairs on mixed workloads")
    d = PolicyBenchSettings()
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true",
                   help="batch 1 and 8, 8 requests (2 at batch 1), at most 32 new tokens, k in {2, 4}, "
                        "lookup and one model drafter, the tiny profile grid")
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)))
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per workload at batch >= 2")
    p.add_argument("--pass-calls", type=int, default=d.pass_calls,
                   help="at batch B >= 2 a timed pass serves at least this many calls of B requests")
    p.add_argument("--batch1-prompts", type=int, default=d.batch1_prompts)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--workloads", default=",".join(d.workloads), help="of mixed, copy, continuation")
    p.add_argument("--mixed-fraction", type=float, default=d.mixed_fraction)
    p.add_argument("--drafters", default="", help="comma-separated: lookup and zoo drafter names "
                   "(default: lookup and the --num-model-drafters of lowest held-out loss)")
    p.add_argument("--num-model-drafters", type=int, default=d.num_model_drafters)
    p.add_argument("--lengths", default=",".join(map(str, d.lengths)), help="fixed draft lengths")
    p.add_argument("--max-draft-tokens", type=int, default=d.max_draft_tokens)
    p.add_argument("--bandit-length", type=int, default=d.bandit_length)
    p.add_argument("--policy-drafter", default=None)
    p.add_argument("--goodput-decide-every", type=int, default=d.goodput_decide_every)
    p.add_argument("--bandit-times", choices=("measured", "model"), default=d.bandit_times)
    p.add_argument("--profile-grid", choices=("default", "tiny"), default=d.profile_grid)
    p.add_argument("--time-limit-s", type=float, default=None, help="start no cell (batch size, workload) after this many seconds")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed passes per run (median); --quick: 1")
    p.add_argument("--head-to-head-rounds", type=int, default=d.head_to_head_rounds,
                   help="rounds of each cell's head-to-head of the targeted policies and their references "
                        "(head_to_head.py); 0: none; --quick: 2")
    p.add_argument("--history-prompts", type=int, default=d.history_prompts,
                   help="held-out requests each learning policy serves before its timed passes (at batch B: at "
                        "least --history-calls x B; at batch 1: --batch1-prompts); 0: every pass starts fresh; --quick: 4")
    p.add_argument("--history-calls", type=int, default=d.history_calls,
                   help="at batch B > 1 the history holds at least this many calls of B requests")
    p.add_argument("--tau-profile-tokens", type=int, default=d.tau_profile_tokens,
                   help="new tokens per request of the tau profile (GoodputPolicy's prior, BatchAdaptivePolicy's table)")
    p.add_argument("--profile-prompts", type=int, default=d.profile_prompts,
                   help="held-out requests the profile times at each batch size (at least the batch size; at batch 1 "
                        "each its own call)")
    p.add_argument("--profile-repeats", dest="tau_profile_repeats", type=int, default=d.tau_profile_repeats,
                   help="measured rounds per (batch size, length) of BatchAdaptivePolicy's profile (median); --quick: 1")
    p.add_argument("--pin-cpu", action="store_true",
                   help="time the passes with the main thread pinned to one core on the GPU's NUMA node")
    p.add_argument("--timing-threads", type=int, default=d.timing_threads,
                   help="torch intra-op threads during the timed passes on CUDA (0: leave as they are)")
    p.add_argument("--gpu-warmup-ms", type=float, default=d.gpu_warmup_ms,
                   help="milliseconds of GPU work right before each timed pass (CUDA; 0: none)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge results of the same experiment at different batch sizes into one report (no run)")
    p.add_argument("--name", default=None, help="file stem of the written results")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--no-graphs", action="store_true", help="no CUDA graphs (eager passes; implies --no-compile)")
    p.add_argument("--no-compile", action="store_true", help="CUDA graphs without torch.compile inside them")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--zoo-dir")
    return p


def settings_from(args) -> PolicyBenchSettings:
    settings = PolicyBenchSettings(
        preset=args.preset, device=args.device, dtype=args.dtype, zoo_dir=args.zoo_dir,
        cuda_graphs=False if args.no_graphs else None, compile=False if args.no_compile else None, batch_sizes=_ints(args.batch_sizes), num_prompts=args.num_prompts,
        batch1_prompts=args.batch1_prompts, prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
        workloads=tuple(w for w in args.workloads.split(",") if w), mixed_fraction=args.mixed_fraction,
        drafters=tuple(n for n in args.drafters.split(",") if n), num_model_drafters=args.num_model_drafters,
        lengths=_ints(args.lengths), max_draft_tokens=args.max_draft_tokens, bandit_length=args.bandit_length,
        policy_drafter=args.policy_drafter, goodput_decide_every=args.goodput_decide_every,
        bandit_times=args.bandit_times, profile_grid=args.profile_grid, time_limit_s=args.time_limit_s, seed=args.seed,
        repeats=args.repeats, pin_cpu=args.pin_cpu, tau_profile_repeats=args.tau_profile_repeats,
        tau_profile_tokens=args.tau_profile_tokens, timing_threads=args.timing_threads or None,
        gpu_warmup_ms=args.gpu_warmup_ms, history_prompts=args.history_prompts, history_calls=args.history_calls,
        pass_calls=args.pass_calls, profile_prompts=args.profile_prompts, head_to_head_rounds=args.head_to_head_rounds)
    refused = [  # (the options' values are wrong, what they must be)
        (settings.profile_prompts < 1, f"--profile-prompts must be >= 1, got {settings.profile_prompts}"),
        (settings.pass_calls < 1, f"--pass-calls must be >= 1, got {settings.pass_calls}"),
        (settings.history_prompts < 0 or settings.history_calls < 1,
         f"--history-prompts must be >= 0 (0: no history) and --history-calls >= 1, got "
         f"{settings.history_prompts} and {settings.history_calls}"),
        ((args.timing_threads or 0) < 0 or args.gpu_warmup_ms < 0,
         f"--timing-threads and --gpu-warmup-ms must be >= 0, got {args.timing_threads} and {args.gpu_warmup_ms}"),
        (settings.repeats < 1, f"--repeats must be >= 1, got {settings.repeats}"),
        (settings.head_to_head_rounds < 0,
         f"--head-to-head-rounds must be >= 0 (0: no head-to-head), got {settings.head_to_head_rounds}"),
        (settings.tau_profile_repeats < 1 or settings.tau_profile_tokens < 1,
         f"--profile-repeats and --tau-profile-tokens must be >= 1, got "
         f"{settings.tau_profile_repeats} and {settings.tau_profile_tokens}"),
    ]
    for wrong, message in refused:
        if wrong:
            raise SystemExit(message)
    if args.quick:  # smaller settings, except where an option was given explicitly
        defaults = parser().parse_args([])
        quick = {"batch_sizes": (1, 8), "num_prompts": 8, "batch1_prompts": 2, "lengths": (2, 4),
                 "num_model_drafters": 1, "profile_grid": "tiny", "repeats": 1,
                 "prompt_tokens": 128, "tau_profile_repeats": 1, "tau_profile_tokens": 32, "history_prompts": 4,
                 "history_calls": 1, "profile_prompts": 4, "head_to_head_rounds": 2}
        chosen = {k: v for k, v in quick.items() if getattr(args, k) == getattr(defaults, k)}
        settings = replace(settings, **chosen, max_new_tokens=min(settings.max_new_tokens, 32))
    unknown = set(settings.workloads) - set(STANDARD)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {sorted(STANDARD)}")
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = [a for a in sys.argv[1:] if a not in ("bench", "--policies")] if argv is None else list(argv)
    args = parser().parse_args(argv)
    out = Path(args.out)
    if args.merge:
        try:
            result = merge([json.loads(Path(path).read_text()) for path in args.merge])
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"cannot merge {args.merge}: {error}") from error
        for path in write(result, out, args.name or "policies_merged"):
            print(f"wrote {path}", flush=True)
        return 0
    settings = settings_from(args)
    command = "python -m benchmarks.policies " + " ".join(argv)
    stem = args.name or f"policies_{settings.preset}_{settings.device.split(':')[0]}_{time.strftime('%Y%m%d_%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{stem}.partial.json"
    cost_model_path = out / f"{stem}.cost_model.json"
    result = run(settings, checkpoint=lambda so_far: write_replacing(partial, json.dumps(so_far, indent=1)),
                 command=command.strip(), cost_model_path=cost_model_path)
    paths = write(result, out, stem)
    for path in paths + [cost_model_path]:
        print(f"wrote {path}", flush=True)
    partial.unlink(missing_ok=True)
    return 0

