"""PipelinedEngine: speculation pipelined with verification over micro-batches (SPIN, Chen et
al. 2025, ALGORITHMS.md §9).

The rows in flight are split into ``micro_batches`` groups. Each ``step()`` (a half-step of
SPIN's pipeline when there are two groups) verifies the group whose draft is ready while the
drafters draft for the next group, then commits the verified group:

    step t:   verify group t % N (drafted in step t - 1)  ||  plan + propose group (t + 1) % N

On a GPU the drafting runs on a side CUDA stream (or on the drafters' own GPU when they sit on
another device), so the device verifies one group while the host plans and launches the other
group's drafts; on the CPU the two run one after the other. A request joins the group drafted
in the step that admits it, and each group holds at most ceil(max_rows / N) rows, so the groups
stay balanced as requests come and go (an idle engine spreads what it admits over every group).

Invariant (lossless): each row goes through the same plan -> propose -> verify -> commit cycle,
on the same passes of its own data, as in the Engine; only which rows share a pass changes, and
rows never attend to each other. Greedy output is the target's token for token, and on the CPU
sampled output too is the unpipelined engine's token for token, under a policy whose lengths do
not depend on the rows beside (the seeded noise of a draw is a function of seed and position).
Drafters that read the target's runner (self-speculation, SPIRe) are refused: their passes would
share the target's buffers with the verification that runs beside them. A policy whose state
follows one sequence of steps (``one_per_micro_batch``: GoodputPolicy) gets a copy per
micro-batch; the object passed in serves the first.

Cost: a row is verified every N steps, each step's verify pass holds about 1/N of the rows;
ideally a full cycle (every row drafted and verified once) takes max(draft, verify) of the
whole batch instead of their sum (BENCHMARKS.md section 11: a micro-batch's passes cost nearly the
whole batch's at batch 16-64, which bounds the gain). Steps that find a group without a draft
(the first one) draft it first, without overlap; a group that emptied gives its turn away.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .engine import Engine
from .timing import PhaseTimer
from .types import Draft, Plan


@dataclass
class _Pending:
    """A group's draft awaiting verification, with what its step record needs."""

    plan: Plan
    draft: Draft
    plan_time_s: float
    timer: PhaseTimer  # the draft phase's timing (events on the drafting stream)
    done: list = field(default_factory=list)  # CUDA events on the drafters' other devices


class PipelinedEngine(Engine):
    """An Engine whose steps pipeline drafting with verification over ``micro_batches`` groups of
    rows (see the module docstring); every other argument is the Engine's."""

    def __init__(self, *args, micro_batches: int = 2, **kwargs):
        if not (isinstance(micro_batches, numbers.Integral) and not isinstance(micro_batches, bool)
                and micro_batches >= 2):
            raise ValueError(f"micro_batches must be an int >= 2 (1 is the plain Engine), got {micro_batches!r}")
        micro_batches = int(micro_batches)
        super().__init__(*args, **kwargs)
        self._runs_ahead = False  # its steps interleave micro-batches (_decode below)
        try:
            reading = [d.describe() for d in self.drafters if d.reads_target]
            if reading:
                raise ValueError(f"pipelining drafts beside the target's verification, but {', '.join(reading)} "
                                 "drafts from the target's own runner: use a ModelDrafter or prompt lookup, or "
                                 "pipeline=1")
            if self.tensor_parallel:
                raise ValueError("pipelining a tensor-parallel target is not supported: use pipeline=1")
        except BaseException:
            self.close()
            raise
        self.micro_batches = micro_batches
        self._capacity = math.ceil(self.batch.num_rows / micro_batches)  # rows per group at most
        self._group_of = np.full(self.batch.num_rows, -1, dtype=np.int64)  # [B] each running row's group, -1: free
        self._pending: list[_Pending | None] = [None] * micro_batches
        self._turn = 0  # steps begun
        self._pending_timer = PhaseTimer(self.device)  # the draft timing of the group being verified
        # each group's policy (policies/base.py): the one passed in, and copies of it where it asks
        self._copies = ([copy.deepcopy(self.policy) for _ in range(micro_batches - 1)]
                        if self.policy.one_per_micro_batch else [])
        self._policies = [self.policy] + (self._copies or [self.policy] * (micro_batches - 1))
        cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if cuda else None  # where drafts are launched
        self._other_devices = sorted({d.device() for d in self.drafters if d.device() is not None
                                      and d.device().type == "cuda" and d.device() != self.device}, key=str)

    def close(self) -> None:
        """Wait for drafts still in flight (a micro-batch drafted, then cancelled or dropped), then
        release as the Engine does: the drafters' runners outlive the engine, and the next engine
        to use them (on its main stream) must not overwrite their caches and graph buffers while
        this one's side stream or other GPUs still run on them."""
        if getattr(self, "_side", None) is not None:
            self._side.synchronize()
        for device in getattr(self, "_other_devices", ()):
            torch.cuda.synchronize(device)
        super().close()

    # ---- groups ----------------------------------------------------------------------------
    def _drafting_group(self) -> int:
        return (self._turn + 1) % self.micro_batches

    def _members(self, group: int) -> np.ndarray:
        """[R] the running, unfinished rows of ``group``."""
        return np.flatnonzero((self._group_of == group) & ~self.batch.finished)

    def _admit(self) -> np.ndarray:
        """Admit into the group drafted this step, up to its share of the rows; an idle engine
        (nothing running, so no draft pending for a running row) spreads what it admits over
        every group, beginning with the one the next step verifies (it drafts it first)."""
        if self._waiting and not self.num_running:  # (not batch.finished, which _only hides rows in)
            self._pending = [None] * self.micro_batches  # drafts of rows since released
            rows = self._admit_rows()  # at most max_rows <= capacity x micro_batches: round robin fits
            groups = (self._turn + np.arange(len(rows))) % self.micro_batches
            self._group_of[rows] = np.where(self.batch.finished[rows], -1, groups)  # budget 0: released at once
            return rows
        group = self._drafting_group()
        room = self._capacity - np.count_nonzero(self._group_of == group)
        if room <= 0 or not self._waiting:
            return np.zeros(0, dtype=np.int64)
        overflow = []
        while len(self._waiting) > room:  # the rest wait for their group's turn
            overflow.append(self._waiting.pop())
        try:
            rows = self._admit_rows()
        finally:
            self._waiting.extend(reversed(overflow))
        self._group_of[rows] = np.where(self.batch.finished[rows], -1, group)  # budget 0: released at once
        return rows

    def _admit_rows(self) -> np.ndarray:
        """The Engine's admission; every policy copy forgets the admitted rows' last requests."""
        rows = super()._admit()
        if rows.size:
            for policy in self._copies:
                policy.start_rows(self.batch, rows)
        return rows

    def _release(self, request, reason: str):
        row = request.row
        result = super()._release(request, reason)
        self._group_of[row] = -1  # a free row is in no group
        return result

    @contextlib.contextmanager
    def _only(self, group: int):
        """The batch as seen by one group's step: every other running row counts as finished, so
        the policy, drafters and verifier serve the group's rows alone."""
        hidden = np.flatnonzero(~self.batch.finished & (self._group_of != group))  # [H]
        self.batch.finished[hidden] = True
        self.policy = self._policies[group]
        try:
            yield
        finally:  # a row released meanwhile (a stream callback cancelled it) stays finished
            self.batch.finished[hidden] = self._group_of[hidden] < 0
            self.policy = self._policies[0]

    # ---- the step ----------------------------------------------------------------------------
    def _propose_group(self, group: int, ready) -> _Pending:
        """Plan and propose for ``group``; on a GPU on the side stream, after ``ready`` (an event
        on the main stream), so that every proposal runs on one stream, in order."""
        timer = PhaseTimer(self.device)
        with self._only(group), self._drafting_stream(ready):
            plan, plan_time_s = self._plan()
            draft = self._draft(plan, timer)
        done = []
        for device in self._other_devices:  # the drafts' copies to this device are queued there
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            done.append(event)
        return _Pending(plan, draft, plan_time_s, timer, done)

    def _drafting_stream(self, ready):
        if self._side is None:
            return contextlib.nullcontext()
        self._side.wait_event(ready)
        return torch.cuda.stream(self._side)

    def _decode(self, stream) -> None:
        step_started = time.perf_counter()
        for _ in range(self.micro_batches - 1):  # a micro-batch that emptied gives its turn to the next
            if self._members(self._turn % self.micro_batches).size:
                break
            self._pending[self._turn % self.micro_batches] = None
            self._turn += 1
        verified, drafted = self._turn % self.micro_batches, self._drafting_group()
        self._turn += 1
        main = torch.cuda.current_stream(self.device) if self._side is not None else None
        ready = main.record_event() if main is not None else None  # after the admissions' prefill
        if not self._members(verified).size:  # its rows were cancelled: nothing to verify
            self._pending[verified] = None
        elif self._pending[verified] is None:  # no draft yet (the first step): draft it now, no overlap
            self._pending[verified] = self._propose_group(verified, ready)
        pending, self._pending[verified] = self._pending[verified], None
        if pending is not None:
            if main is not None:
                main.wait_stream(self._side)
                for event in pending.done:
                    main.wait_event(event)
            self._pending_timer = pending.timer
            with self._only(verified):
                rows, verdict, cost = self._verify(pending.draft)
        if self._members(drafted).size:  # while the device verifies, the host drafts the next group
            self._pending[drafted] = self._propose_group(drafted, ready)
        if pending is not None:
            with self._only(verified):
                self._finish(rows, pending.plan, pending.draft, verdict.to_host(self._group), cost,
                             pending.plan_time_s, step_started, stream)

    def _phase_times(self, timer: PhaseTimer | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """The verify phase from this step, the draft phases from the step that drafted the group
        (complete: the verification waited for them)."""
        times, host_seconds = super()._phase_times(timer)
        times.update(self._pending_timer.collect())
        host_seconds = {**host_seconds, **self._pending_timer.host_seconds}
        return times, host_seconds
