"""GoodputPolicy: per-request draft lengths that maximise predicted goodput (SmartSpec, Liu et al.
2024, arXiv 2406.14066, later titled TurboSpec; ALGORITHMS.md §3).

Every ``decide_every`` steps, over the active rows, choose draft lengths k_i in
0..min(max_draft_tokens, remaining_i - 1) that maximise G(k) = sum_i E[tau_i](k_i) / T(k)
(goodput_search.py: an exact search), with E[tau_i] from each row's online acceptance estimate
(acceptance.py: SmartSpec's EMA, 0.85 old / 0.15 new, starting at ``prior``, discounted by the
drafter's coverage) and T the CostModel's fitted step time (step_time.py), corrected online by
measured step wall times (calibration.py, always on). Speculation must beat plain decoding by
``min_gain`` (SmartSpec: 10%); when it does not, every row decodes plainly. A row that does not
draft drifts back towards the prior (REVISIT per step), so a run of rejections does not switch
it off for good. ``search="finish"`` is the one option for static batches (finish.py).

Rows have a lifecycle (``start_rows``, under the Engine): a refilled row's estimate starts at the
population's acceptance, the pooled accepted / judged draft tokens of every row so far (the
prior before any was judged), not at the constructor's prior.

Between decisions the policy does no work: it hands out the same plan and keeps the steps'
records, and at the next decision learns from all of them at once (the EMA from their summed
counts, with the weight 1 - 0.85^n that n one-step updates of a constant would give).

Invariant: the policy changes only how many tokens are drafted; output is the target's own.
Cost: one search per decision, O(K^2 A) work, and O(n x B) counting of the n steps since the
last one. With up to SMALL_SEARCH active rows the decision (gains, search, bookkeeping) and one
step's learning run as Python loops over lists, whose cost grows with the rows, where numpy's
fixed cost per call dominated: deciding every step (max_draft_tokens 5), about 0.14 ms of host
time a step at 1-2 rows, 0.17 ms at 4 and 0.20 ms at 16 on a 2-core CPU (numpy throughout: 0.5
ms), with the same decisions (experiments/policy_host_time.py).
"""

from __future__ import annotations

import numpy as np

from ..stats import StepRecord
from ..types import Plan, is_int_at_least
from .acceptance import AcceptanceEstimator, StepCounts, iid_cumulative_rows, iid_marginal_gains
from .base import Policy
from .calibration import StepTimeCalibration
from .cost_model import CostModel
from .finish import REVISIT, FinishRates
from .goodput_search import SEARCHES, SMALL_SEARCH, choose_lengths, choose_rows
from .step_time import LinearStepTime

CATCH_UP_STEPS = 2  # a row drafting again after more idle steps than this makes its drafter catch up: not calibrated on
FIRST_INTERVAL = 4  # steps before a batch's second decision (its first knows nothing of the rows)
NEVER = -(1 << 40)  # a row's "last drafted" step before it ever drafted


class GoodputPolicy(Policy):
    one_per_micro_batch = True  # one decision and step-time model per sequence of steps (policies/base.py)

    def __init__(self, cost_model: CostModel, max_draft_tokens: int = 8, drafter_index: int = 0, prior: float = 0.5,
                 min_gain: float = 0.10, decide_every: int = 1, search: str = "exact"):
        """cost_model: predicted step times (its drafter ``drafter_index`` must be timed);
        max_draft_tokens: the longest draft of a row; drafter_index: the drafter every row uses;
        prior: the acceptance rate rows start at before anything is judged; min_gain: how much
        speculation must beat plain decoding by; decide_every: steps between decisions;
        search: "exact" (per-row lengths, the paper's per-step goodput) or "finish" (one length
        that finishes a static batch soonest, finish.py)."""
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        if not is_int_at_least(max_draft_tokens, 1):
            raise ValueError(f"max_draft_tokens must be an integer >= 1, got {max_draft_tokens!r}")
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        if not is_int_at_least(drafter_index, 0) or drafter_index >= cost_model.num_drafters:
            raise ValueError(f"drafter_index {drafter_index!r} is not timed by the cost model "
                             f"({cost_model.num_drafters} drafter(s))")
        if not min_gain >= 0 or not is_int_at_least(decide_every, 1):
            raise ValueError(f"need min_gain >= 0 and decide_every >= 1, got {min_gain!r} and {decide_every!r}")
        if isinstance(prior, bool) or not isinstance(prior, (int, float, np.integer, np.floating)) or not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be one acceptance rate in [0, 1], got {prior!r}")
        self.cost_model, self.search, self.drafter_index = cost_model, search, int(drafter_index)
        self._max_draft_tokens, self.prior = int(max_draft_tokens), float(prior)
        self.min_gain, self.decide_every = float(min_gain), int(decide_every)
        self.calibration = StepTimeCalibration()  # kept across generate() calls
        self.estimator: AcceptanceEstimator | None = None
        self.finish_rates: FinishRates | None = None
        self.predicted_goodput = self.predicted_plain_goodput = float("nan")  # of the last decision
        self._batch = None
        self._records: list[StepRecord] = []  # the steps since the last decision
        self._decision = None  # (uncalibrated step time of the active rows, their decided lengths [A])
        self._pooled = np.zeros(2)  # accepted and judged draft tokens of every row of the batch so far

    @property
    def max_draft_tokens(self) -> int:
        return self._max_draft_tokens

    @property
    def population_rate(self) -> float:
        """The batch's pooled acceptance so far (accepted / judged draft tokens of every row), or
        the prior before any token was judged: where a refilled row starts."""
        successes, trials = self._pooled
        return float(successes / trials) if trials > 0 else self.prior

    def plan(self, batch, num_drafters):
        if batch is not self._batch:
            if self.drafter_index >= num_drafters:
                raise ValueError(f"{self!r} drafts with drafter {self.drafter_index} but was given {num_drafters}")
            self._new_batch(batch, num_drafters)
        if self._steps >= self._next_decision:
            self._learn()
            self._plan = self._decide_interval(batch)
        self._steps += 1
        return self._plan  # the same object until the next decision (the loop caps a copy per step)

    def _new_batch(self, batch, num_drafters: int) -> None:
        """A new batch (a generate() call, or an Engine's): every row starts at the prior; the
        calibration is kept, its pairs not across batches."""
        self._learn()  # the last batch's final steps still calibrate
        self.calibration.new_call()
        self._batch, self._steps, self._next_decision = batch, 0, 0
        # [B] the last decision's lengths, within each row's budget (the search keeps to its caps)
        self._lengths = [0] * batch.num_rows
        self._drafters = np.full(batch.num_rows, self.drafter_index, dtype=np.int64)  # [B] every plan's drafter_index
        # [B] the step each row last drafted: a model drafter also reads every token it missed since
        self._last_drafted = [NEVER] * batch.num_rows
        self._previous_ran: bool | None = None  # whether the last step ran the drafter
        self._pooled = np.zeros(2)
        self.estimator = AcceptanceEstimator(batch.num_rows, num_drafters, prior=self.prior)
        self.finish_rates = FinishRates(batch.num_rows, self.prior) if self.search == "finish" else None
        self._decision, self._records = None, []

    def start_rows(self, batch, rows) -> None:
        """New requests in rows of the batch being served (an Engine refilling them): the rows'
        last requests' pending steps are learnt first; their estimates then start at the
        population's rate, their counts at zero, their first drafting step is a catch-up (the
        drafter reads the prompt), and the next plan decides for them. A new batch is plan()'s."""
        if batch is not self._batch:
            return
        self._learn()
        rows = np.asarray(rows, dtype=np.int64)
        for d in range(self.estimator.num_drafters):
            self.estimator.relax(rows, d, 1.0, target=self.population_rate if d == self.drafter_index else None)
        if self.finish_rates is not None:
            self.finish_rates.reset(rows)
        for row in rows.tolist():
            self._last_drafted[row] = NEVER
        self._next_decision = min(self._next_decision, self._steps)

    def observe(self, record: StepRecord) -> None:
        if self._batch is not None:
            self._records.append(record)  # learnt from at the next decision (_learn)

    def learn_now(self) -> None:
        """Learn from the steps observed since the last decision now (the next decision would
        anyway), e.g. to read the calibration after a call."""
        self._learn()

    def _decide_interval(self, batch) -> Plan:
        """A decision: lengths for the active rows, kept (capped by each row's budget) until the next.
        The rows' bookkeeping is Python lists: for a handful of rows, cheaper than numpy's fixed
        cost per call."""
        remaining = np.asarray(batch.remaining)  # [B]
        active = batch.active_rows()  # [A]
        rows, left = active.tolist(), remaining.tolist()
        caps = [min(self.max_draft_tokens, max(left[row] - 1, 0)) for row in rows]  # [A]
        now = self._steps
        last = [min(step, now - 1) for step in self._last_drafted]  # [B] an interval cut short drafted until now
        step_time = LinearStepTime.from_cost_model(self.cost_model, batch.lengths[active], self.drafter_index) \
            if rows else None
        lengths = self._decide(active, caps, step_time, remaining)  # [B]
        drafting = [row for row in rows if lengths[row] > 0]
        # drafting measured with no plain step beside it and far off the model: a few plain steps
        # first, so the calibration can tell a slow host from dear drafting
        probing = bool(drafting and self.calibration.wants_plain_probe(len(rows)))
        probe_steps = StepTimeCalibration.PROBE_STEPS
        if probing:
            lengths, drafting = [0] * len(lengths), []
            self.calibration.probed(len(rows))
            # the probe's plain steps are no idleness: the return after them is no catch-up
            last = [now + probe_steps - CATCH_UP_STEPS if step == now - 1 else step for step in last]
        self._catching_up = any(now - last[row] > CATCH_UP_STEPS for row in drafting)
        interval = self.decide_every if now > 0 else min(self.decide_every, FIRST_INTERVAL)
        if drafting and not self.calibration.measured(len(rows)):
            # drafting where the calibration has no measurements yet: decide again once it has them
            interval = min(interval, StepTimeCalibration.MIN_SAMPLES + int(self._catching_up))
        if probing:
            interval = probe_steps
        self._next_decision = now + interval
        for row in drafting:
            last[row] = now + interval - 1
        self._lengths, self._last_drafted = lengths, last
        planned = np.array(lengths, dtype=np.int64)  # [B]
        self._decision = (step_time, planned[active]) if step_time is not None else None
        return Plan(drafter_index=self._drafters, num_draft_tokens=planned)

    def _decide(self, active: np.ndarray, caps: list[int], step_time: LinearStepTime | None,
                remaining: np.ndarray) -> list[int]:
        """[B] lengths for the active rows [A] (0 elsewhere), each within its cap [A]."""
        lengths = [0] * len(self._lengths)
        if len(active) == 0:
            return lengths
        rows, d = active.tolist(), self.drafter_index
        step_time = self.calibration.apply(step_time, len(rows))
        start = [self._lengths[row] for row in rows]  # [A]
        if self.finish_rates is None and len(rows) <= SMALL_SEARCH:  # Python lists: cheaper than numpy here
            rates, coverage = self.estimator.rate(d).tolist(), self.estimator.coverage(d).tolist()  # [B]
            cumulative = iid_cumulative_rows([rates[row] for row in rows], [coverage[row] for row in rows],
                                             self.max_draft_tokens)  # [A][K+1]
            chosen, self.predicted_goodput, self.predicted_plain_goodput = choose_rows(
                cumulative, caps, step_time, self.min_gain, start)
        else:
            rates = self.finish_rates.samples(active) if self.finish_rates is not None \
                else self.estimator.rate(d)[active]  # [J, A] or [A]
            gains = iid_marginal_gains(rates, self.max_draft_tokens) * self.estimator.coverage(d)[active][:, None]
            chosen, self.predicted_goodput, self.predicted_plain_goodput = choose_lengths(
                gains, np.array(caps, dtype=np.int64), step_time, self.search, self.min_gain, start=start,
                remaining=remaining[active])  # gains [A, K] or [J, A, K]
            chosen = chosen.tolist()
        for row, length in zip(rows, chosen):
            lengths[row] = length
        return lengths

    def _learn(self) -> None:
        """What the steps since the last decision taught: the estimates from their counts at once,
        the idle rows' drift back to the prior, and the calibration from each measured step."""
        records, self._records = self._records, []
        if not records or self.estimator is None:
            return
        if len(records) == 1 and self.finish_rates is None:  # a decision every step: row by row
            self._pooled += self.estimator.learn_step(records[0], self._lengths, self.drafter_index,
                                                      1.0 - (1.0 - REVISIT) ** 1)
        else:
            counts = StepCounts(len(self._lengths))
            counts.add_steps(records, self._lengths)
            self.estimator.update_counts(counts, self.drafter_index)
            self._pooled += (counts.successes.sum(), counts.trials.sum())
            if self.finish_rates is not None:
                self.finish_rates.add(counts)
            idle = counts.idle_steps.nonzero()[0]
            self.estimator.relax(idle, self.drafter_index, 1.0 - (1.0 - REVISIT) ** counts.idle_steps[idle])
        if self._decision is not None:
            self._calibrate(records)

    def _calibrate(self, records: list[StepRecord]) -> None:
        """One calibration sample per measured step of the interval, plain or drafting; a
        catch-up first step, and a step of the other kind than the step before it, are left out:
        both cost more than the steps after them and would skew the scales."""
        step_time, decided = self._decision
        plain, drafting, idle_steps = [], [], 0
        for index, record in enumerate(records):
            ran = self._drafter_ran(record)
            switched, self._previous_ran = ran != self._previous_ran, ran  # a batch's first step counts as switched
            if not record.step_time_s:
                continue
            catch_up = index == 0 and self._catching_up
            idle_steps += not ran and not catch_up
            if switched or catch_up:
                self.calibration.unmeasured(len(decided), drafting=ran)
            else:  # the step less the policy's own plan: what the cost model predicts
                (drafting if ran else plain).append(float(record.step_time_s) - float(record.plan_time_s))
        if plain:
            self.calibration.observe(step_time, np.zeros_like(decided), plain)
        if idle_steps:
            self.calibration.idle(len(decided), steps=idle_steps)
        if drafting and decided.any():
            self.calibration.observe(step_time, decided, drafting)

    @staticmethod
    def _drafter_ran(record: StepRecord) -> bool:
        wall = record.drafter_wall_s
        return bool(wall.sum() > 0) if wall is not None else bool(record.num_drafted.any())

    def __repr__(self) -> str:
        return (f"GoodputPolicy(max_draft_tokens={self.max_draft_tokens}, drafter_index={self.drafter_index}, "
                f"prior={self.prior}, min_gain={self.min_gain}, decide_every={self.decide_every}, search={self.search!r})")
