"""Engine: continuous batching, the serving loop SmartSpec and SPIN assume (DESIGN §9).

Requests arrive with ``add_request`` and wait; each ``step()`` first admits waiting requests into
free cache rows (their prompts are prefilled before the step's plan: prefill.py),
then runs one speculative step over every row in flight: the policy plans (drafter and length
per row), drafters propose, the verifier scores every active row's draft in one target forward
and applies the acceptance rule, the rows commit the emitted tokens (the step's one host
synchronisation), drafters roll back to what was accepted, and the policy observes. A row whose
request ends (EOS, stop sequence, budget, or ``cancel``) is freed for the next waiting request.
``generate()`` is this engine run over a closed set of requests.

Each request may bring its own SamplingParams (``add_request(..., sampling=...)``). Rows that share
one take every rule's uniform path, as generate() always does; rows that differ share the step's
draft and verify passes with per-row parameters (types.RowSampling: BatchState.sampling_of).

Invariant (lossless, per request): a request's output is the target's own, token for token under
greedy decoding and identically distributed under sampling, and depends only on its prompt, its
budget, its sampling parameters and its seed, never on what else is in flight or when it arrived:
rows never attend to each other, the sampling noise of a token is a function of (seed, position)
alone, and each row is processed with its own parameters by the same operations as alone. On the
CPU the same tokens (a pass of other rows may round a logit otherwise in its last bit, which could
move a draw only at an exact near-tie); on a GPU a pass's shape can change a row's rounding, so
the prompt's keys come from passes of one shape (prefill.py), while a model drafter's passes still
vary with the rows beside: its draft probabilities may differ in the last bits, which moves sampled
outputs (each still distributed as the target's), never greedy ones.

Cost per step: one target forward over the active rows' drafts (plus the prefill's passes in a
step that admits requests: replays of one graph under CUDA graphs), the drafters' passes, and
one device-to-host copy. While rows with different sampling parameters are in flight, also one
small host-to-device copy of them per pass that samples, and the processing of every row's
distribution (greedy rows' included). Plain decoding on a GPU runs ahead (run_ahead.py): each
step is launched before the one before it commits, so the host's work overlaps the device's.
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import inputs, run_ahead
from .batch import BatchState
from .distributed import tensor_parallel_group
from .drafters.base import Drafter, empty_draft, merge_drafts
from .policies.base import Policy
from .policies.fixed import FixedPolicy
from .inference import inference
from .prefill import PREFILL_TOKENS, prefill_passes
from .runner import models_in_use, resolve_backend, runner_for, runners_of
from .sampling import TREE_PROBLEMS
from .stats import RequestStats, StatsRecorder, StepRecord
from .timing import PhaseTimer
from .token_rules import penalises_repeats
from .transfer import to_device
from .types import Draft, HostVerdict, Plan, SamplingParams, VerifyCost
from .verifiers.base import Verifier
from .verifiers.padding_free import PaddingFreeVerifier


ENGINE_FLAG = "_specdec_engine_open"  # set on a drafter while an Engine (or generate()) drafts with it


@dataclass(frozen=True)
class FinishedRequest:
    """A request the engine is done with. Times are seconds on the engine's clock (from its
    construction): arrival (``add_request``), first token committed, last token committed."""

    id: int
    token_ids: list[int]  # generated tokens, prompt excluded, EOS included
    reason: str  # "eos" (an EOS or stop sequence), "length" (max_new_tokens), "cancelled"
    stats: RequestStats
    arrival_s: float
    first_token_s: float | None  # None when it emitted nothing
    finish_s: float
    logprobs: list[float] | None = None  # with return_logprobs=True


@dataclass
class _Request:
    id: int
    prompt: np.ndarray  # [P]
    max_new_tokens: int
    seed: int
    arrival_s: float
    eos_token_ids: np.ndarray | None = None  # [E] its own EOS ids; None: the engine's
    sampling: SamplingParams | None = None  # its own; None: the engine's
    row: int = -1  # its cache row once admitted
    first_token_s: float | None = None


class Engine:
    """A speculative decoding engine over ``max_rows`` cache rows of ``max_len`` positions each
    (a request's prompt plus its max_new_tokens must fit). Components and options are those of
    generate(); stop sequences and min_new_tokens are the engine's, for every request, and so are
    the sampling parameters and the EOS ids unless a request brings its own (``add_request``).
    max_new_tokens: the most any request may ask (default: max_len); caches and graphs are sized
    for drafts no longer than that allows.

    Use it as a context manager, or call ``close()``: while open it holds the target's (and the
    drafters') runners and caches, and the models' locks, taken by the thread that built it (step
    it from that thread).
    """

    def __init__(self, target, drafter: Drafter | list[Drafter] | None = None, verifier: Verifier | None = None,
                 policy: Policy | None = None, max_rows: int = 16, max_len: int = 2048, *,
                 sampling: SamplingParams | None = None, eos_token_id: int | list[int] | None = None,
                 attention: str = "auto", cuda_graphs: bool | str = False, compile: bool = False,
                 min_new_tokens: int = 0, stop_sequences: list[list[int]] | None = None,
                 return_logprobs: bool = False, max_new_tokens: int | None = None):
        self.vocab_size, self.device = inputs.check_target(target)
        if not (isinstance(max_rows, int) and not isinstance(max_rows, bool) and max_rows >= 1):
            raise ValueError(f"max_rows must be an int >= 1 (cache rows, the most requests in flight), got {max_rows!r}")
        if not (isinstance(max_len, int) and max_len >= 1):
            raise ValueError(f"max_len must be an int >= 1 (positions per row: prompt plus new tokens), got {max_len!r}")
        if eos_token_id is None:
            eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
        min_new_tokens = inputs.check_min_new_tokens(min_new_tokens)
        self.sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        self.drafters = inputs.normalise_drafters(drafter)
        self.max_new_tokens = max_len if max_new_tokens is None else inputs.check_max_new_tokens(max_new_tokens)
        if self.max_new_tokens > max_len:
            raise ValueError(f"max_new_tokens={max_new_tokens} does not fit rows of max_len={max_len} positions")
        longest_prompt = np.zeros(max_len - self.max_new_tokens, dtype=np.int64)
        inputs.check_drafters(self.drafters, self.vocab_size, [longest_prompt], self.max_new_tokens)
        for d in self.drafters:
            d.check_target(target)
        for d in self.drafters:
            if getattr(d, ENGINE_FLAG, False):
                raise RuntimeError(f"{d.describe()} is already drafting for an open Engine (or a generate() call); "
                                   "a drafter keeps one call's state: give this one a drafter of its own")
        self.verifier = PaddingFreeVerifier() if verifier is None else verifier
        self.policy = (FixedPolicy(4) if self.drafters else FixedPolicy(0)) if policy is None else policy
        inputs.check_component(self.verifier, Verifier, "verifier")
        inputs.check_component(self.policy, Policy, "policy")
        inputs.check_trees(self.drafters, self.verifier, self.policy.max_draft_tokens)
        if self.policy.max_draft_tokens > 0 and not self.drafters:
            raise ValueError(f"{self.policy!r} drafts tokens but no drafter was given: pass drafter=... or FixedPolicy(0)")
        self.target, self.max_len, self.return_logprobs = target, max_len, return_logprobs
        self.batch = BatchState.empty(max_rows, max_len, inputs.normalise_eos(eos_token_id, self.vocab_size),
                                      inputs.normalise_stop_sequences(stop_sequences, self.vocab_size),
                                      min_new_tokens, sampling=self.sampling)
        self._trees = np.array([d.makes_trees for d in self.drafters], dtype=bool)  # [D]
        # a row drafts at most one token fewer than it may still emit, so caches and graphs are
        # sized by what requests can use, not by the policy's largest length (a tree's nodes are
        # not bounded so, only its depth: its node budget sizes them)
        max_draft = (self.policy.max_draft_tokens if self._trees.any() and self.max_new_tokens > 1
                     else min(self.policy.max_draft_tokens, max(self.max_new_tokens - 1, 0)))
        attention, cuda_graphs, compile = resolve_backend(target, attention, cuda_graphs, compile)
        graph_shape = (max_draft + 1, max_rows * (max_draft + 1)) if cuda_graphs else None
        if graph_shape is not None and self.verifier.cuts_rows:  # a group a token at most
            graph_shape += (graph_shape[1],)
        self._group = tensor_parallel_group(target)  # None unless the target is sharded over processes
        self.recorder = StatsRecorder(max_rows, max_draft)
        self._prefill_passes, self._prefill_s = 0, 0.0  # admitting steps and their host seconds (load_stats)
        self._timer = PhaseTimer(self.device)
        self._waiting: collections.deque[_Request] = collections.deque()  # first come, first served
        self._rows: list[_Request | None] = [None] * max_rows  # the request each row holds
        self._first_token_s = np.full(max_rows, np.nan)  # [B] when each row's request got its first token
        self._finished: list[FinishedRequest] = []  # cancelled before they ran, reported by the next step
        self._next_id = 0
        self._clock = time.perf_counter()
        # plain decoding launches each step before the one before it commits (run_ahead.py)
        self._runs_ahead = run_ahead.enabled(self.device) and self.policy.max_draft_tokens == 0 and self._group is None
        self._launched: run_ahead.Launched | None = None  # a step launched and not yet committed
        self._admissions = np.zeros(max_rows, dtype=np.int64)  # [B] requests each row has been given
        self._no_draft = empty_draft(max_rows, self.device)  # a plain step's draft
        self._last_commit = 0.0  # time.perf_counter() at the last run-ahead commit
        self._stack = contextlib.ExitStack()  # unwinds in reverse: drafters finish, the target detaches, locks go
        try:
            # threads sharing a model take turns: its runners, caches and attention switch are one engine's at a time
            self._stack.enter_context(models_in_use([target, *(m for d in self.drafters for m in d.models())]))
            if getattr(runners_of(target).get("target"), "in_use", False):
                raise RuntimeError("this target is already in use by an open Engine (or a generate() call) on this "
                                   "thread, whose cache a second one would overwrite: close that engine first")
            hidden_layers = tuple(sorted({j for d in self.drafters for j in d.target_hidden_layers()}))
            self.runner = runner_for(target, role="target", max_rows=max_rows, max_len=max_len + max_draft + 1,
                                     attention=attention, graph_shape=graph_shape, compile=compile,
                                     hidden_layers=hidden_layers)
            if cuda_graphs and self.runner.prefill_graph is None:  # admissions replay it (prefill.py)
                self.runner.enable_prefill_graph(PREFILL_TOKENS)
            self._stack.enter_context(self.runner.attached())
            self.runner.in_use = True
            self._stack.callback(setattr, self.runner, "in_use", False)
            for d in self.drafters:
                setattr(d, ENGINE_FLAG, True)
                self._stack.callback(setattr, d, ENGINE_FLAG, False)
                self._stack.callback(d.finish)  # first: a start that fails half-way is still undone
                d.bind_target(self.runner)
                d.start(self.batch, self.sampling, self.device, max_draft)
        except BaseException:
            self._stack.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the runners, caches and model locks (requests still in flight are dropped)."""
        self._stack.close()

    def now(self) -> float:
        """Seconds on the engine's clock."""
        return time.perf_counter() - self._clock

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None, seed: int = 0,
                    eos_token_id: int | list[int] | None = None) -> int:
        """Queue a request (token ids: a list or a 1-D tensor) -> its id. It is admitted by a
        later ``step()`` once a row is free, first come first served. sampling: this request's
        SamplingParams; None takes the engine's. eos_token_id: this request's EOS id(s) ([] never
        stops early); None takes the engine's."""
        sampling = self._check_sampling(sampling)
        (tokens,) = inputs.normalise_prompts([prompt], self.vocab_size)
        max_new_tokens = inputs.check_max_new_tokens(max_new_tokens)
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new_tokens} is more than this engine's max_new_tokens="
                             f"{self.max_new_tokens}: ask for fewer or build the engine with a larger one")
        (seed,) = inputs.normalise_seeds([seed], 1).tolist()
        if len(tokens) + max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {len(tokens)} tokens with max_new_tokens={max_new_tokens} needs "
                             f"{len(tokens) + max_new_tokens} positions, but the engine's rows hold max_len="
                             f"{self.max_len}: shorten the prompt, lower max_new_tokens or build the engine with a "
                             "larger max_len")
        inputs.check_lengths_fit(self.target, [tokens], max_new_tokens)
        eos = None if eos_token_id is None else inputs.normalise_eos(eos_token_id, self.vocab_size)
        return self.enqueue(tokens, max_new_tokens, int(seed), eos, sampling)

    def _check_sampling(self, sampling) -> SamplingParams | None:
        """A request's own sampling parameters, checked: None for the engine's, else a SamplingParams."""
        if sampling is None:
            return None
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (or None for the engine's), got {type(sampling).__name__}"
                            " (the seed is its own argument: add_request(prompt, max_new_tokens, seed=...))")
        return None if sampling == self.sampling else sampling

    def enqueue(self, prompt: np.ndarray, max_new_tokens: int, seed: int, eos_token_ids: np.ndarray | None = None,
                sampling: SamplingParams | None = None) -> int:
        """``add_request`` without its checks, for a caller that made them (generate())."""
        request = _Request(self._next_id, prompt, max_new_tokens, seed, self.now(), eos_token_ids, sampling)
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def restart_clock(self, at: float) -> None:
        """Count the engine's clock from ``at`` (a time.perf_counter() reading)."""
        self._clock = at

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request -> whether it was found; the next ``step()``
        reports it as finished with reason "cancelled" and the tokens it had so far."""
        for index, request in enumerate(self._waiting):
            if request.id == request_id:
                del self._waiting[index]
                self._finished.append(self._result(request, "cancelled", [], logprobs=[] if self.return_logprobs
                                                   else None))
                return True
        for request in self._rows:
            if request is not None and request.id == request_id:
                self._finished.append(self._release(request, "cancelled"))
                return True
        return False

    @property
    def steps(self) -> int:
        """Decoding steps run so far."""
        return self.recorder.num_steps

    @property
    def tensor_parallel(self) -> bool:
        """Whether the target is sharded over processes (every rank must add the same requests)."""
        return self._group is not None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._rows)

    def has_work(self) -> bool:
        return bool(self._waiting or self.num_running or self._finished)

    # ---- the step ----------------------------------------------------------------------------
    @inference
    def step(self, stream=None) -> list[FinishedRequest]:
        """Admit what fits, run one speculative step over the rows in flight -> the requests that
        finished (or were cancelled) since the last step. stream: called with (request id, token
        ids just committed) for each request that got some."""
        self.admit()
        if not self.batch.finished.all():
            self._decode(stream)
        else:
            self._drop_launched()  # a step launched for rows since cancelled: nothing to commit
        done, self._finished = self._finished, []
        return done

    @inference
    def admit(self) -> np.ndarray:
        """Admit waiting requests into free rows, first come first served, and prefill their
        prompts -> the rows admitted. ``step()`` does this first. On a GPU it waits for the
        prefill (once per admitting step), so that the prefill's device work is not charged to the
        decoding step after it (StepRecord.step_time_s, which policies learn from)."""
        rows = self._admit()
        if rows.size:
            started = time.perf_counter()
            try:
                self._prefill(rows)
            except BaseException:  # (out of memory, say) the rows hold no valid cache: back to the queue
                for row in rows[::-1]:
                    request = self._rows[row]
                    if request is not None:
                        self.batch.release(row)
                        self._rows[row], request.row = None, -1
                        self._waiting.appendleft(request)
                raise
            if self.device.type == "cuda":  # this stream's work only: a pipelined draft may run beside it
                torch.cuda.current_stream(self.device).synchronize()
            self._prefill_passes += 1
            self._prefill_s += time.perf_counter() - started
        return rows

    def load_stats(self) -> dict:
        """What the steps so far cost, whichever requests they served (a serving run's diagnosis):
        steps, row_steps (active rows summed over steps), drafted and emitted tokens, host seconds
        of the steps (step_s, of which plan_s in the policy) and the draft and verify phases'
        device seconds; prefill_passes (admitting steps) and their seconds (prefill_s)."""
        r = self.recorder
        return dict(steps=r.num_steps, row_steps=r.row_steps, drafted=r.drafted_tokens, emitted=r.emitted_tokens,
                    step_s=r.step_time_s, plan_s=r.plan_time_s, draft_s=r.draft_time_s, verify_s=r.verify_time_s,
                    prefill_passes=self._prefill_passes, prefill_s=self._prefill_s)

    def _admit(self) -> np.ndarray:
        if not self._waiting:  # most steps: nothing to admit, no scan of the rows
            return np.zeros(0, dtype=np.int64)
        free = [row for row, request in enumerate(self._rows) if request is None]
        admitted = []
        while free and self._waiting:
            request, row = self._waiting.popleft(), free.pop(0)
            request.row = row
            self._rows[row] = request
            self.batch.admit(row, request.prompt, request.max_new_tokens, request.seed, request.eos_token_ids,
                             request.sampling)
            self._first_token_s[row] = np.nan
            self._admissions[row] += 1
            admitted.append(row)
        rows = np.array(admitted, dtype=np.int64)
        if rows.size:
            self.recorder.start_rows(rows)
            for d in self.drafters:
                d.start_rows(self.batch, rows)
            self.policy.start_rows(self.batch, rows)
            for row in rows[self.batch.finished[rows]]:  # max_new_tokens = 0: nothing to generate
                self._finished.append(self._release(self._rows[row], "length"))
        return rows

    def _prefill(self, rows: np.ndarray) -> None:
        """Fill the target's cache with each admitted prompt but its last token (the step feeds
        it): replays of the prefill graph under CUDA graphs, else one eager pass (prefill.py)."""
        rows = rows[(self.batch.prompt_lengths[rows] > 1) & ~self.batch.finished[rows]]
        if len(rows):
            for layout in prefill_passes(rows, self.batch.prompt_lengths[rows] - 1, self.runner.prefill_graph):
                token_ids = self.batch.packed_tokens(layout.rows, layout.starts, layout.starts + layout.counts)  # [N]
                self.runner.forward(to_device(token_ids, self.device), layout, logits_indices=np.zeros(1, dtype=np.int64),
                                    prefill=True)

    def _decode(self, stream) -> None:
        if self._runs_ahead:
            self._decode_ahead(stream)
            return
        step_started = time.perf_counter()
        plan, plan_time_s = self._plan()
        draft = self._draft(plan, self._timer)
        rows, verdict, cost = self._verify(draft)
        self._finish(rows, plan, draft, verdict.to_host(self._group), cost, plan_time_s, step_started, stream)

    def _decode_ahead(self, stream) -> None:
        """A plain decoding step, run ahead (run_ahead.py): launch the next step from the state
        this one's commit will leave, then commit this one (launched by the previous call, or now)."""
        launched, self._launched, wasted = self._launched, None, None
        if launched is not None:
            still = launched.still_running(self._admissions, self.batch)  # [A]
            if len(np.setdiff1d(self.batch.active_rows(), launched.rows[still])):
                # rows admitted since its launch: without run-ahead they emit in this step, so the
                # step is launched again over every running row (the launched pass is wasted)
                launched, wasted = None, launched.cost
        if launched is None:  # launched now from the committed batch: every row of it runs
            launched = self._launch(self.batch, None)
            still = np.ones(len(launched.rows), dtype=bool)
        carried = launched.rows[still]
        ahead = run_ahead.predicted_batch(self.batch, carried)
        rows = ahead.active_rows()
        if len(rows):
            sampling = ahead.sampling_of(rows, self.device)
            if not penalises_repeats(sampling):  # a penalty reads the committed tokens: no running ahead
                last_tokens = launched.next_tokens(rows, np.isin(rows, carried), self.batch)
                self._launched = self._launch(ahead, last_tokens, sampling)
        host = launched.copy.wait()
        dropped = launched.rows[~still]  # ended (or re-admitted) since the launch: they emit nothing
        host.num_emitted[dropped] = host.num_accepted[dropped] = 0
        if len(carried):
            cost = launched.cost if wasted is None else VerifyCost(launched.cost.target_tokens + wasted.target_tokens,
                                                                   launched.cost.padding_tokens + wasted.padding_tokens)
            # the step's time runs from the last commit (or its launch, if later): the plans it
            # counts are those made in that time, its own if launched then and the next step's
            step_started = max(launched.started, self._last_commit)
            plan_time_s = launched.plan_time_s if launched.started >= self._last_commit else 0.0
            plan_time_s += 0.0 if self._launched is None else self._launched.plan_time_s
            self._finish(carried, launched.plan, self._no_draft, host, cost, plan_time_s, step_started, stream,
                         launched.timer)
        self._last_commit = time.perf_counter()
        if self._launched is not None and not self._launched.still_running(self._admissions, self.batch).any():
            self._drop_launched()  # every row of it ended at this commit

    def _drop_launched(self) -> None:
        """Forget the launched step, none of whose rows runs any more; its pass ran: the target's
        tokens count it (what a row ending at an EOS costs)."""
        if self._launched is not None:
            self.recorder.target_tokens += self._launched.cost.target_tokens
            self.recorder.padding_tokens += self._launched.cost.padding_tokens
            self._launched = None

    def _launch(self, batch: BatchState, last_tokens, sampling=None) -> run_ahead.Launched:
        """Launch a plain decoding step over ``batch``'s active rows (the engine's batch, or one
        predicted by run_ahead) and start its verdict's copy to the host."""
        started = time.perf_counter()
        plan, plan_time_s = self._plan(batch)  # no drafts (max_draft_tokens is 0); the policy still plans each step
        rows = batch.active_rows()  # [A]
        timer = PhaseTimer(self.device)
        with timer.phase("verify"):
            sampling = batch.sampling_of(rows, self.device) if sampling is None else sampling
            verdict, cost = self.verifier.verify(self.runner, batch, self._no_draft, sampling,
                                                 logprobs=self.return_logprobs, last_tokens=last_tokens)
        return run_ahead.Launched(rows, self._admissions[rows], verdict, verdict.copy_to_host(), cost, timer, started,
                                  plan, plan_time_s)

    # The step's parts, in order (pipeline.py interleaves them over micro-batches).
    def _plan(self, batch: BatchState | None = None) -> tuple[Plan, float]:
        """The policy's plan for the active rows (of ``batch``: a run-ahead step's predicted one;
        default the engine's), checked and bounded -> (plan, host seconds)."""
        batch = self.batch if batch is None else batch
        started = time.perf_counter()
        plan = _bounded(_checked(self.policy.plan(batch, len(self.drafters)), self.policy, batch, self._trees),
                        batch, self._trees)
        return plan, time.perf_counter() - started

    def _draft(self, plan: Plan, timer: PhaseTimer) -> Draft:
        with timer.phase("draft"):
            return _propose(self.drafters, self.batch, plan, self.device, self.vocab_size, timer)

    def _verify(self, draft: Draft):
        """Launch the verification of every active row's draft -> (rows [A], verdict, cost); the
        verdict stays on the device until ``_finish``."""
        rows = self.batch.active_rows()  # [A] the rows this step serves (commit finishes some)
        with self._timer.phase("verify"):
            sampling = self.batch.sampling_of(rows, self.device)  # SamplingParams when the rows share one
            verdict, cost = self.verifier.verify(self.runner, self.batch, draft, sampling, logprobs=self.return_logprobs)
        return rows, verdict, cost

    def _phase_times(self, timer: PhaseTimer | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """The step's phase seconds (device clock on a GPU) and host seconds, once synchronised
        (``timer``: a run-ahead step's own, else the engine's)."""
        timer = self._timer if timer is None else timer
        return timer.collect(), timer.host_seconds

    def _finish(self, rows: np.ndarray, plan: Plan, draft: Draft, host: HostVerdict, cost, plan_time_s: float,
                step_started: float, stream, timer: PhaseTimer | None = None) -> None:
        """With the verdict on the host (``Verdict.to_host``, the step's one synchronisation;
        rank 0's on a tensor-parallel target): commit, roll the drafters back, record, let the
        policy observe, release finished rows, stream."""
        batch = self.batch
        _raise_on_malformed_trees(host, plan, self.drafters)
        lengths_before = batch.lengths.copy()
        appended = batch.commit(host)
        accepted = np.full(batch.num_rows, -1, dtype=np.int64)  # [B] -1: the row took no part in this step
        accepted[rows] = host.num_accepted[rows]
        for d in self.drafters:
            d.commit(lengths_before, accepted)
        now = self.now()
        self._first_token_s[(appended > 0) & np.isnan(self._first_token_s)] = now
        streamed = []  # (request id, its new tokens), handed to ``stream`` once the step is complete
        if stream is not None:
            streamed = [(self._rows[row].id, batch.token_ids[row, lengths_before[row] : batch.lengths[row]].tolist())
                        for row in np.flatnonzero(appended)]
        times, host_seconds = self._phase_times(timer)
        # only the rows verified count the draft's tokens: in a pipelined engine a row may have been
        # released, and given a new request, since its draft was made (a no-op otherwise: _bounded)
        taking_part = accepted >= 0  # [B]
        record = StepRecord(
            step=self.steps,
            rows=rows,
            drafter_index=plan.drafter_index,
            num_drafted=np.where(taking_part, draft.num_tokens, 0),
            num_accepted=np.minimum(host.num_accepted, appended),
            num_emitted=appended,
            draft_time_s=times.get("draft", 0.0),
            verify_time_s=times.get("verify", 0.0),
            cost=cost,
            drafter_time_s=np.array([times.get(f"drafter {i}", 0.0) for i in range(len(self.drafters))]),
            drafter_wall_s=np.array([host_seconds.get(f"drafter {i}", 0.0) for i in range(len(self.drafters))]),
            step_time_s=time.perf_counter() - step_started,
            plan_time_s=plan_time_s,
            draft_depths=None if not draft.is_tree or draft.depths is None else np.where(taking_part, draft.depths, 0),
        )
        self.recorder.record(record, now, batch.finished)
        self.policy.observe(record)
        for row in rows[batch.finished[rows]]:
            self._finished.append(self._release(self._rows[row], "eos" if batch.stopped[row] else "length"))
        if streamed:  # the caller's code, outside the step's inference mode: its tensors are its own
            with torch.inference_mode(False):
                for request_id, tokens in streamed:  # last: a callback may cancel requests or raise
                    stream(request_id, tokens)

    def _release(self, request: _Request, reason: str) -> FinishedRequest:
        row = request.row
        if not np.isnan(self._first_token_s[row]):
            request.first_token_s = float(self._first_token_s[row])
        start, end = self.batch.prompt_lengths[row], self.batch.lengths[row]
        logprobs = None
        if self.return_logprobs:
            logprobs = [] if self.batch.logprobs is None else self.batch.logprobs[row, start:end].tolist()
        stats = self.recorder.request_stats(row)
        stats.wall_time_s = self.now() - request.arrival_s  # the request's own: from its arrival
        result = self._result(request, reason, self.batch.token_ids[row, start:end].tolist(), stats, logprobs)
        self.batch.release(row)
        self._rows[row] = None
        return result

    def _result(self, request: _Request, reason: str, token_ids: list[int], stats: RequestStats | None = None,
                logprobs: list[float] | None = None) -> FinishedRequest:
        if stats is None:
            stats = RequestStats(steps=0, drafted=0, accepted=0, emitted=0, drafted_by_position=[],
                                 accepted_by_position=[], wall_time_s=self.now() - request.arrival_s)
        return FinishedRequest(id=request.id, token_ids=token_ids, reason=reason, stats=stats,
                               arrival_s=request.arrival_s, first_token_s=request.first_token_s,
                               finish_s=self.now(), logprobs=logprobs)


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
