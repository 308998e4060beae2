"""BanditPolicy: learn which drafter serves each request best (SPIN, Chen et al., INFOCOM 2025,
arXiv 2503.15921, §III: heterogeneous drafters chosen by a multi-armed bandit whose reward is a
rate of tokens per second; ALGORITHMS.md §2 gives specdec's reading of it).

Arms are the drafters given to the loop; every row drafts ``num_draft_tokens`` tokens with the
drafter its bandit picks (bandit_state.py: UCB or SPIN's epochs, the confidence radius scaled by
each arm's measured spread, as UCB-V). ``scope="request"`` keeps one bandit per request (row),
started from what earlier requests taught (``warm_start`` pseudo-pulls per arm at the
population's mean reward); ``scope="batch"`` keeps one bandit for the whole batch that picks one
drafter per step (a "time slot", as in the paper) and keeps learning across calls.

Reward of a row in a step (request scope): tokens it emitted / seconds attributed to it. The
verify pass is one read of the target's weights shared by every row, so its time is split
equally over the step's active rows; a drafter's time (the larger of its GPU time and its
host-clock time: prompt lookup works on the host) is split over the rows it drafted for by the
tokens they asked for. With a ``CostModel`` the times are predicted instead of measured. The
batch-level reward is the emitted tokens per active row over the step's wall time. Rewards are
normalised by the best arm's mean.

A bandit that switches to another drafter holds it HOLD_STEPS steps (request: 2, batch: 4) and
learns from all but the first: a model drafter switched in first reads every token it missed
(the prompt, at a request's first step), in a step that costs several ordinary ones.

``objective="call"`` (batch scope) is the one option kept for static batches: the time slot is a
whole generate() call, rewarded by the call's tokens per row over its seconds, so a drafter's
stragglers count (a static batch lasts as long as its slowest row); kept because on static
batches it measured ahead of per-step rewards (BENCHMARKS.md §3). One sample per call, so its
radius is narrower (CALL_EXPLORATION, CALL_PRIOR_SPREAD).

Invariant: the policy changes only which drafter proposes; the acceptance rule keeps the output
the target's own whatever the choice. Cost: O(B x D) numpy work per step.
"""

from __future__ import annotations

import numpy as np

from ..stats import StepRecord
from ..types import Plan, is_int_at_least
from .bandit_state import STRATEGIES, BanditState
from .base import Policy
from .cost_model import CostModel

SCOPES = ("request", "batch")
OBJECTIVES = ("step", "call")
HOLD_STEPS = {"request": 2, "batch": 4}  # steps a switched-to drafter is held; the first is not learnt from
# objective "call": a whole call's reward varies a few percent from call to call, so the radius
# need not be as wide as for one step's, and its pseudo-pulls spread 0.7 of the widest
CALL_EXPLORATION = 0.3
CALL_PRIOR_SPREAD = 0.7


def charged_drafter_times(record: StepRecord, gpu_s: np.ndarray) -> np.ndarray:
    """[D] what each drafter's pass is charged: the larger of its GPU time ``gpu_s`` and its
    host-clock time (``record.drafter_wall_s``, when recorded); prompt lookup works on the host
    and leaves no trace on the GPU's clock, a model drafter's launches may run ahead of the GPU."""
    gpu_s = np.asarray(gpu_s, dtype=np.float64)
    return gpu_s if record.drafter_wall_s is None else np.maximum(gpu_s, np.asarray(record.drafter_wall_s, dtype=np.float64))


def attributed_times(record: StepRecord, asked: np.ndarray, lengths: np.ndarray,
                     cost_model: CostModel | None = None) -> np.ndarray:
    """[A] seconds of the step attributed to each active row (``record.rows``), as the module
    docstring describes. asked: [B] draft lengths the policy planned (after budget caps);
    lengths: [B] committed lengths when the step was planned."""
    rows = np.asarray(record.rows, dtype=np.int64)
    num_active = len(rows)
    drafter = np.asarray(record.drafter_index, dtype=np.int64)[rows]
    drafted = np.asarray(record.num_drafted, dtype=np.int64)[rows]
    wanted = np.asarray(asked, dtype=np.int64)[rows]
    context = np.asarray(lengths, dtype=np.int64)[rows]
    times = np.zeros(num_active)
    if cost_model is None:
        times += record.verify_time_s / num_active
    else:
        c = dict(zip(cost_model.target.features, cost_model.target.coefficients))
        times += c["fixed"] / num_active + c["rows"] + c["tokens"] * (drafted + 1) + c["kv_tokens"] * (context + drafted)
    if cost_model is None and record.drafter_time_s is None:  # one pool of draft time
        if wanted.sum() > 0:
            times += record.draft_time_s * wanted / wanted.sum()
        return times
    drafter_s = charged_drafter_times(record, record.drafter_time_s) if cost_model is None else None
    for d in np.unique(drafter[wanted > 0]):
        mine = (drafter == d) & (wanted > 0)
        if cost_model is None:
            times[mine] += drafter_s[d] * wanted[mine] / wanted[mine].sum()
        else:
            c = dict(zip(cost_model.drafters[d].features, cost_model.drafters[d].coefficients))
            shared = c["fixed"] + c["steps"] * wanted[mine].max()
            times[mine] += (shared / mine.sum() + c["rows"] + c["tokens"] * wanted[mine]
                            + c["kv_tokens"] * wanted[mine] * context[mine] + c["context_tokens"] * context[mine])
    return times


class BanditPolicy(Policy):
    def __init__(self, num_draft_tokens: int = 4, strategy: str = "ucb", scope: str = "request",
                 cost_model: CostModel | None = None, exploration: float | None = None, warm_start: int = 2,
                 objective: str = "step"):
        """num_draft_tokens: every row's draft length; strategy: "ucb" or "epoch"; scope:
        "request" (one bandit per row) or "batch" (one drafter for the whole batch per step);
        cost_model: predicted rather than measured times (optional); exploration: c in the
        confidence radius (default 1.0, CALL_EXPLORATION for objective "call"); warm_start
        (request scope): a new request's bandit starts from every earlier request's rewards, as
        up to this many pseudo-pulls per arm (0: from scratch); objective (batch scope): "step"
        (the batch's tokens per second of each step) or "call" (one drafter per generate()
        call, rewarded by the call's tokens per row per second)."""
        if not is_int_at_least(num_draft_tokens, 1):
            raise ValueError(f"BanditPolicy's num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if objective == "call" and scope != "batch":
            raise ValueError(f"objective='call' plays one drafter per generate() call and is for batch scope, got scope={scope!r}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        if not is_int_at_least(warm_start, 0):
            raise ValueError(f"warm_start must be an integer >= 0, got {warm_start!r}")
        if exploration is None:
            exploration = CALL_EXPLORATION if objective == "call" else 1.0
        self.num_draft_tokens, self.strategy, self.scope = int(num_draft_tokens), strategy, scope
        self.cost_model, self.warm_start, self.objective = cost_model, int(warm_start), objective
        self.hold_steps = HOLD_STEPS[scope]
        self._options = {"strategy": strategy, "exploration": float(exploration), "confidence": "variance",
                         "prior_spread": CALL_PRIOR_SPREAD if objective == "call" else 1.0}
        self.bandits: BanditState | None = None
        self.population: BanditState | None = None  # request scope: every request's rewards, across calls
        self._batch = None
        self._call = np.zeros(2)  # objective "call": the call so far (tokens per row, seconds)

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens

    def plan(self, batch, num_drafters):
        if num_drafters < 1:
            raise ValueError(f"{self!r} chooses among drafters but was given none")
        if self.cost_model is not None and self.cost_model.num_drafters < num_drafters:
            raise ValueError(f"{self!r}: the cost model times {self.cost_model.num_drafters} drafter(s), "
                             f"the loop was given {num_drafters}")
        per_row = self.scope == "request"
        fresh = self.bandits is None or self.bandits.num_arms != num_drafters
        if fresh:
            self._call = np.zeros(2)  # a call served with other drafters teaches these bandits nothing
        if fresh or (per_row and batch is not self._batch):
            self.bandits = BanditState(batch.num_rows if per_row else 1, num_drafters, **self._options)
            if per_row:
                self._seed_from_population(num_drafters)
        if batch is not self._batch:  # a new call: every model drafter's first pass reads the prompts
            self.end_call()
            num_bandits = self.bandits.counts.shape[0]
            self._previous = np.full(num_bandits, -1, dtype=np.int64)  # [N] the arm played last step
            self._switching = np.zeros(num_bandits, dtype=bool)  # [N] whether that step was a switch
            self._hold_left = np.zeros(num_bandits, dtype=np.int64)  # [N] steps the arm is still held for
            # [B] each row's last plan (while it was active), which observe() rewards: a pipelined
            # engine plans another micro-batch between a plan and the observation of its step
            self._asked = np.zeros(batch.num_rows, dtype=np.int64)  # draft lengths, after budget caps
            self._lengths = np.zeros(batch.num_rows, dtype=np.int64)  # committed lengths
            self._arms = np.zeros(batch.num_rows, dtype=np.int64)  # the arms played
            self._switched = np.zeros(batch.num_rows, dtype=bool)  # whether the arm was a switch
        self._batch = batch
        active = batch.active_rows()  # [A] the rows this plan is for; the others keep their last plan
        remaining = batch.remaining  # [B]
        self._asked[active] = np.minimum(self.num_draft_tokens, np.maximum(remaining[active] - 1, 0))
        self._lengths[active] = batch.lengths[active]
        if self.objective == "call":
            if self._previous[0] < 0:  # the call's first step: its drafter, after learning the call before
                self._previous = self.bandits.choose()
                self._call_rows = max(len(active), 1)
            arms = self._previous
        else:  # a switch is held for hold_steps steps, its first not rewarded (it reads what the drafter missed)
            arms = np.where(self._hold_left > 0, self._previous, self.bandits.choose())  # [N]
            switching = arms != self._previous
            hold_left = np.where(switching, self.hold_steps - 1, np.maximum(self._hold_left - 1, 0))
            if per_row:  # only the active rows play (an inactive row's bandit waits for its next plan)
                live = np.zeros(len(arms), dtype=bool)
                live[active] = True
                self._switching = np.where(live, switching, self._switching)
                self._hold_left = np.where(live, hold_left, self._hold_left)
                self._previous = np.where(live, arms, self._previous)
            else:
                self._switching, self._hold_left, self._previous = switching, hold_left, arms
            self._switched[active] = np.broadcast_to(switching, (batch.num_rows,))[active]
        planned = np.broadcast_to(arms, (batch.num_rows,)).astype(np.int64)  # [B]
        self._arms[active] = planned[active]
        return Plan(drafter_index=planned,
                    num_draft_tokens=np.full(batch.num_rows, self.num_draft_tokens, dtype=np.int64))

    def end_call(self) -> None:
        """Objective "call": the bandit learns the call just served, its tokens per row over the
        seconds its steps took (nothing when no step was measured). plan() calls it at a new call."""
        tokens_per_row, seconds = self._call
        if self.objective == "call" and self.bandits is not None and seconds > 0:
            self.bandits.update(np.zeros(1, dtype=np.int64), self._previous[:1], [tokens_per_row / seconds])
        self._call = np.zeros(2)

    def _seed_from_population(self, num_drafters: int, rows=slice(None)) -> None:
        """The bandits of ``rows`` (all by default) start from the population's warm start."""
        if self.population is None or self.population.num_arms != num_drafters:
            self.population = BanditState(1, num_drafters, **self._options)
        self.bandits.counts[rows], self.bandits.sums[rows], self.bandits.squares[rows] = 0, 0.0, 0.0
        self.bandits._exploring[rows] = True
        if self.warm_start == 0:
            return
        counts = self.population.counts[0]  # [D]
        pseudo = np.minimum(counts, self.warm_start)  # [D]
        mean = self.population.sums[0] / np.maximum(counts, 1)  # [D]
        mean_square = self.population.squares[0] / np.maximum(counts, 1)  # [D] the population's spread comes along
        self.bandits.counts[rows] = pseudo
        self.bandits.sums[rows] = pseudo * mean
        self.bandits.squares[rows] = pseudo * np.maximum(mean_square, mean ** 2)

    def start_rows(self, batch, rows) -> None:
        """Request scope: new requests in rows of the batch being served (an Engine refilling
        them) get fresh bandits, warm-started from the population, and no held arm. A new batch
        is plan()'s; batch scope keeps one bandit for the batch."""
        if self.scope == "batch" or batch is not self._batch or self.bandits is None:
            return
        rows = np.asarray(rows, dtype=np.int64)
        self._seed_from_population(self.bandits.num_arms, rows)
        self._previous[rows], self._switching[rows], self._hold_left[rows] = -1, False, 0

    def observe(self, record: StepRecord) -> None:
        rows = np.asarray(record.rows, dtype=np.int64)  # [A]
        if self.bandits is None or len(rows) == 0:
            return
        emitted = np.asarray(record.num_emitted, dtype=np.float64)[rows]  # [A]
        if self.objective == "call":  # the call's totals; no per-row attribution
            self._call += (emitted.sum() / self._call_rows, self._step_seconds(record))
            return
        seconds = attributed_times(record, self._asked, self._lengths, self.cost_model)  # [A]
        if self.scope == "request":
            with np.errstate(divide="ignore", invalid="ignore"):
                rewards = np.where(seconds > 0, emitted / seconds, np.nan)
            # a drafter some row switched to spent the step catching up, and its time is shared by
            # every row it drafted for: none of them learns from this step (NaN: not learnt from)
            arms = self._arms[rows]  # [A]
            caught_up = np.isin(arms, arms[self._switched[rows]])  # [A]
            rewards = np.where(caught_up, np.nan, rewards)
            drafted = (self._asked[rows] > 0) & np.isfinite(rewards)  # a row capped to 0 tokens did not try its arm
            self.bandits.update(rows[drafted], arms[drafted], rewards[drafted])
            self.population.update(np.zeros(int(drafted.sum()), dtype=np.int64), arms[drafted], rewards[drafted])
            return
        if not self._switched[rows].any() and np.any(self._asked[rows] > 0):  # a step nobody drafted in says nothing
            total = self._step_seconds(record, seconds)
            # per active row: slots with every row active and slots of a call's tail compare
            reward = emitted.sum() / (total * len(rows)) if total > 0 else np.nan
            self.bandits.update(np.zeros(1, dtype=np.int64), self._arms[rows[:1]], [reward])

    def _step_seconds(self, record: StepRecord, seconds: np.ndarray | None = None) -> float:
        """Batch scope: the step's measured wall time (without a cost model), else the sum of its
        rows' attributed times (``seconds`` [A], when already computed)."""
        if self.cost_model is None and record.step_time_s:
            return float(record.step_time_s)
        if seconds is None:
            seconds = attributed_times(record, self._asked, self._lengths, self.cost_model)
        return float(seconds.sum())

    def __repr__(self) -> str:
        objective = f", objective={self.objective!r}" if self.scope == "batch" else ""
        return (f"BanditPolicy(num_draft_tokens={self.num_draft_tokens}, strategy={self.strategy!r}, "
                f"scope={self.scope!r}{objective})")
