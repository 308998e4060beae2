"""GoodputPolicy: per-request draft lengths that maximise predicted goodput (SmartSpec, Liu et al.
2024, arXiv 2406.14066, later titled TurboSpec; ALGORITHMS.md §3).

Before each step (or every ``decide_every`` steps), over the active rows i with committed
lengths L_i, choose draft lengths k_i in 0..min(max_draft_tokens, remaining_i - 1) to maximise

    G(k) = sum_i E[tau_i](k_i) / T_step(k),

E[tau_i](k) = 1 + sum_{j<k} g_ij with g_ij = coverage_i * prod_{l<=j} a_il the expected tokens the
j-th draft token adds (acceptance.py; i.i.d. a_il = alpha_i by default), and T_step the
CostModel's prediction, which is linear in the lengths once their maximum m (the drafter's
sequential passes) is fixed:

    T(k) = T_0 + [any k_i > 0] (d_fixed + d_steps * m) + sum_i (f_i [k_i > 0] + c_i k_i),

with f_i = d_rows + d_ctx L_i the cost of drafting for row i at all and c_i = c_tok + c_kv +
d_tokens + d_kv L_i the cost of each of its draft tokens.

Searches:
- "exact" (default): for each depth m = 1..K, Dinkelbach's method on the ratio; with m fixed the
  problem max_k N(k) - lambda T(k) separates over rows and each row's best k is found by
  enumeration, so every iteration is exact and the iteration converges to the optimum ratio.
  The best m wins. This is the global optimum of G under the model. Cost O(K^2 A) per iteration,
  a few iterations: vectorised numpy, well under a millisecond for A = 64.
- "greedy": start from k = 0 and repeatedly add one token to the row whose addition gives the
  highest goodput, while goodput improves (the joint per-request choice ALGORITHMS.md asks
  for). Guarantee: the marginal gains g_ij never increase with j, so when every added token
  costs the same time (equal c_i) and there are no per-row, per-pass or fixed drafting terms
  (f_i = d_steps = d_fixed = 0), greedy is exact: for each total it holds the largest gains,
  and G over totals rises then falls, so stopping at the first non-improvement is optimal.
  Otherwise it is a heuristic (it can stop short when one token does not pay for a drafter
  pass but several would); tests measure how close it gets. Cost O(K A^2) per decision.
- "uniform": one k for every row (k capped per row by its budget), enumerated 0..K.
- "finish" (ours, for static batches): one k for every row, the one that minimises the predicted
  time until every active row is done (call_times: row i needs R_i / E[tau_i](k) more steps, and
  each stretch between two rows' finishing points costs the step time of the rows still
  active). generate() runs static batches, which last until their slowest row is done, so a
  longer draft that does not shorten the slowest row only makes steps dearer, which per-step
  goodput does not see. The lowest rows' rates decide it, so it reads each row's rate as a
  Beta posterior: its decayed counts and a prior around the batch's rate (shrunk_rates: the
  lowest of many noisy per-row averages passes for a straggler by chance), the prior's weight
  raised where earlier calls' rows were more alike than its default (RowRateSpread), and it
  times the call over samples of those posteriors (posterior_rate_samples;
  ``finish_rate_samples``, 8). A call's rows start with a prior that never weighs less than
  FINISH_SHRINK_TRIALS: a row's rate moves over a call, so the spread of whole-call rates
  overstates the spread of what is left, and a weaker prior reads stragglers that are not.
  After a row's first FINISH_PRIOR_GRACE steps with a judged token (the counts' memory) its
  prior ages as its counts do, by FINISH_COUNT_DECAY a step, to at least FINISH_PRIOR_FLOOR
  (finish_row_prior_trials: exponential forgetting of the whole posterior, not of the counts
  alone); unaged, a straggler's counts level off below the prior's weight and it reads near
  the batch's rate for as long as it drafts. An aged row that stops drafting drifts back to
  the batch's rate more slowly (its counts shrink by the revisit rate per idle step, its
  prior's weight stays aged).

A call's second decision comes FIRST_INTERVAL steps after its first (which knows nothing of the
call's rows, so it should not stand for long), then every ``decide_every``.

Speculation must beat plain decoding (k = 0) by ``min_gain`` (10% by default); when it does not,
every row decodes plainly this step. Acceptance is estimated online (EMA 0.85/0.15 or a window
of 100 steps, cold start at ``prior``); a row that does not draft drifts back towards the prior
(``revisit``), so a run of rejections does not switch it off for good. Across generate() calls
the policy learns its cold start (``learn_prior``): a call's rows start at the acceptance whose
expected tokens per step match what the earlier calls' row-steps emitted (LearnedPrior, the
given ``prior`` worth PRIOR_ROW_STEPS row-steps, each call's counts halved at the next), so a run of batch-1 calls does not
re-learn the workload's acceptance from the given prior in every request. The step-time model is
corrected online by measured wall times, per bucket of active rows (StepTimeCalibration): the
host's speed from every step, and what drafting costs against the model only from drafting and
plain steps measured together (with a plain probe of PROBE_STEPS steps when drafting steps alone
run far off their prediction; a step that switches between the two is left out, as it costs more
than either), so a slow spell of the host is not read as dear drafting, while a model that
under-predicts what drafting costs at a large batch is still corrected; a batch's straggling last
rows are a different trade-off from its first 64.

Switching a row back on after more than CATCH_UP_STEPS idle steps makes a model drafter read
every token it missed, in a step that can cost several ordinary ones. The policy measures
that excess (catch_up_s, the median of recent catch-up steps) and weighs a choice that
switches rows back on, charged it once (spread over CATCH_UP_HORIZON steps, fewer if fewer
are left), against the choice without them; the first drafting step of a row (its prompt) is not charged.

Decisions come every ``decide_every`` steps (sooner while a probe of speculation lacks its
measurements, and as soon as the active rows fall into another bucket, row_bucket, as rows
finish: a batch's tail is a different trade-off); between them the policy does no work at all: it hands out the same plan and
keeps the steps' records, and at the next decision learns from all of them at once (the pooled
EMA from their summed counts, with the weight 1 - 0.85^n that n one-step updates of a constant
would give; with one step per decision this is exactly the per-step update).

Invariant: the policy changes only how many tokens are drafted; output is the target's own.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np
import scipy.special

from ..stats import StepRecord
from ..types import Plan, is_int_at_least
from .acceptance import (
    AcceptanceEstimator,
    RowRateSpread,
    StepCounts,
    add_padded,
    expected_emitted,
    iid_marginal_gains,
    marginal_gains,
    rate_matching_tokens,
)
from .base import Policy
from .cost_model import CostModel

SEARCHES = ("exact", "greedy", "uniform", "finish")
CATCH_UP_STEPS = 2  # a drafting step after more idle steps than this is not calibrated on (drafter catch-up)
PRIOR_TRIALS = 16.0  # "finish": what the given (or learnt) prior weighs in the batch's pooled rate, in judged draft tokens
PRIOR_ROW_STEPS = 4.0  # learn_prior: what the given prior weighs, in row-steps drafting PRIOR_LENGTH tokens
PRIOR_LENGTH = 4
PRIOR_DECAY = 0.5  # learn_prior: what an earlier call's counts keep at each new call
CATCH_UP_HORIZON = 16  # steps a returning row's measured catch-up is spread over (fewer if fewer are left)
# "finish": what the batch's pooled rate weighs in each row's rate, in judged draft tokens, at the
# least (RowRateSpread may learn that rows are more alike): a Beta prior of sd 0.08 at rate 0.72.
# Lighter, a first probe's few judged tokens per row leave the lowest of many rows reading a
# straggler and "finish" decodes plainly where drafting pays; at 16 the rows' posterior samples
# spread wider than such rows do and k = 0 came back in 9 of 20 batches of 54
# (tests/policies/test_profile_options.py)
FINISH_SHRINK_TRIALS = 32.0
FINISH_COUNT_DECAY = 0.95  # "finish": what a row's judged draft tokens keep per drafting step (a memory of about 20)
# "finish": the batch's weight in a row's rate ages as the row's own counts do, by FINISH_COUNT_DECAY per
# step with a trial in the call, down to this many judged tokens (finish_row_prior_trials). Unaged, a row
# that accepts little judges few tokens a step, its decayed counts level off below the prior's weight,
# and it reads near the batch's rate for as long as it drafts
FINISH_PRIOR_FLOOR = 2.0
FINISH_PRIOR_GRACE = round(1 / (1 - FINISH_COUNT_DECAY))  # steps with a trial before the ageing starts: the counts' memory
# "finish": samples of the batch's rates, each row at stratified quantiles of its posterior
# (posterior_rate_samples); 1: each row at its posterior mean. On synthetic batches of 16 rows
# of different rates, 8 samples reached 0.981 of the best fixed length where the means reached
# 0.955 (tests/policies/test_simulate.py)
FINISH_RATE_SAMPLES = 8
FIRST_INTERVAL = 4  # steps before a call's second decision (its first knows nothing of the call's rows)


class LearnedPrior:
    """A cold-start acceptance rate learnt over generate() calls: the rate whose i.i.d. expected
    tokens per step match the tokens the earlier calls' row-steps emitted at the lengths they
    drafted (rate_matching_tokens), with the given prior p as PRIOR_ROW_STEPS pseudo row-steps
    at PRIOR_LENGTH that emitted E[tau](PRIOR_LENGTH; p). Each call's counts are multiplied by
    PRIOR_DECAY at every new call (recent calls weigh most, so a change of workload is followed
    within a few calls). It matches emitted tokens rather than pooling accepted over judged
    tokens, which reads high on rows of different rates (those that accept long runs judge
    more tokens and weigh more).

    Invariant: the rate lies in [0, 1] and is the given prior until a row-step has been judged."""

    def __init__(self, prior: float):
        self.given = float(prior)
        self.steps = np.zeros(PRIOR_LENGTH + 1)  # [S] decayed row-steps of the calls so far, by draft length
        self.tokens = np.zeros(PRIOR_LENGTH + 1)  # [S] the tokens they emitted
        self._call_steps, self._call_tokens = np.zeros(1), np.zeros(1)  # of the current call
        self._rate = self.given

    @property
    def rate(self) -> float:
        return self._rate

    def add(self, counts: StepCounts) -> None:
        """Row-steps of the current call (StepCounts.length_steps and length_tokens)."""
        self._call_steps = add_padded(self._call_steps, counts.length_steps)
        self._call_tokens = add_padded(self._call_tokens, counts.length_tokens)

    def new_call(self) -> None:
        """Fold the finished call's counts in, older calls' multiplied by PRIOR_DECAY."""
        self.steps = add_padded(PRIOR_DECAY * self.steps, self._call_steps)
        self.tokens = add_padded(PRIOR_DECAY * self.tokens, self._call_tokens)
        self._call_steps, self._call_tokens = np.zeros(1), np.zeros(1)
        if self.steps.sum() > 0:
            pseudo = np.zeros_like(self.steps)
            pseudo[PRIOR_LENGTH] = PRIOR_ROW_STEPS
            prior_tokens = _prior_pseudo_tokens(self.given)
            self._rate = rate_matching_tokens(self.steps + pseudo, self.tokens.sum() + prior_tokens)


@functools.lru_cache(maxsize=16)
def _prior_pseudo_tokens(prior: float) -> float:
    """LearnedPrior: the tokens its given prior's PRIOR_ROW_STEPS pseudo row-steps at PRIOR_LENGTH
    emitted, E[tau](PRIOR_LENGTH; prior) each (cached: the same at every call)."""
    return PRIOR_ROW_STEPS * float(expected_emitted(prior, PRIOR_LENGTH))


@dataclass
class LinearStepTime:
    """T(k) = base + [any k > 0] (draft_fixed + depth_cost * max k) + sum_i (row_cost_i [k_i > 0]
    + token_cost_i k_i) over the active rows."""

    base: float
    token_cost: np.ndarray  # [A]
    row_cost: np.ndarray | float = 0.0  # [A] or one for all rows
    draft_fixed: float = 0.0
    depth_cost: float = 0.0
    row_base: np.ndarray | None = None  # [A] what each row adds to the plain step (base - sum: fixed); None: all fixed

    def __call__(self, k: np.ndarray) -> np.ndarray:
        """k: [..., A] -> [...] seconds."""
        k = np.asarray(k)
        on = k > 0  # [..., A]
        drafting = on.any(axis=-1)
        per_row = (self.row_cost * on + self.token_cost * k).sum(axis=-1)
        return self.base + per_row + drafting * (self.draft_fixed + self.depth_cost * k.max(axis=-1, initial=0))

    def extra(self, k: np.ndarray) -> np.ndarray:
        """What drafting k [..., A] adds to the plain step: T(k) - base."""
        return self(k) - self.base

    def calibrated(self, base_scale: float, extra_scale: float) -> LinearStepTime:
        """The same model with the plain step scaled by ``base_scale`` and everything drafting
        adds scaled by ``extra_scale`` (measured / predicted, see GoodputPolicy)."""
        return LinearStepTime(base=self.base * base_scale, token_cost=self.token_cost * extra_scale,
                              row_cost=np.asarray(self.row_cost) * extra_scale, draft_fixed=self.draft_fixed * extra_scale,
                              depth_cost=self.depth_cost * extra_scale,
                              row_base=None if self.row_base is None else np.asarray(self.row_base) * base_scale)

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, lengths: np.ndarray, drafter_index: int = 0) -> LinearStepTime:
        """The CostModel's step time over active rows of committed ``lengths`` [A], all drafting
        with drafter ``drafter_index``."""
        lengths = np.asarray(lengths, dtype=np.float64)
        num_rows = len(lengths)
        if not drafter_index < cost_model.num_drafters:
            raise ValueError(f"the cost model times {cost_model.num_drafters} drafter(s), not drafter {drafter_index}")
        target = cost_model.target.terms()
        drafter = cost_model.drafters[drafter_index].terms()
        base = float(cost_model.target_time(num_rows, lengths.sum(), num_rows))
        token_cost = target["tokens"] + target["kv_tokens"] + drafter["tokens"] + drafter["kv_tokens"] * lengths
        row_cost = drafter["rows"] + drafter["context_tokens"] * lengths
        row_base = target["tokens"] + target["rows"] + target["kv_tokens"] * lengths  # [A] one token, one row, its keys
        return cls(base=base, token_cost=token_cost, row_cost=row_cost, draft_fixed=drafter["fixed"],
                   depth_cost=drafter["steps"], row_base=row_base)


def _cumulative_gains(gains: np.ndarray) -> np.ndarray:
    """[..., A, K] gains -> [..., A, K+1] the expected tokens each length 0..K adds beyond the one emitted."""
    cumulative = np.zeros(gains.shape[:-1] + (gains.shape[-1] + 1,))
    np.cumsum(gains, axis=-1, out=cumulative[..., 1:])  # in place: no concatenation
    return cumulative


def _per_row(value, num_rows: int) -> np.ndarray:
    """[A] float64: ``value`` as it is where it holds one value per row, else broadcast (one for all rows)."""
    value = np.asarray(value, dtype=np.float64)
    return value if value.shape == (num_rows,) else np.broadcast_to(value, (num_rows,))


def _uniform_lengths(caps: np.ndarray, max_k: int) -> np.ndarray:
    """[K+1, A] row L: every row drafting L tokens, capped by its budget ``caps`` [A]."""
    return np.minimum(caps[None, :], np.arange(max_k + 1)[:, None]).astype(np.int64)


def _shortest_best(values: np.ndarray, tolerance: float) -> int:
    """The index of the largest of ``values`` [K+1], the first one unless a later one beats it by
    the relative ``tolerance`` (the shortest of the best lengths)."""
    values = np.asarray(values).tolist()  # Python floats: the same comparisons, without numpy scalars
    best = 0
    for length in range(1, len(values)):
        if values[length] > values[best] * (1 + tolerance):
            best = length
    return best


def _numerator_of(cumulative: np.ndarray, k: np.ndarray) -> float:
    """sum_i E[tau_i](k_i) with the cumulative gains [A, K+1] (_cumulative_gains)."""
    return float(len(k) + cumulative[np.arange(len(k)), k].sum())


def goodput_of(gains: np.ndarray, k: np.ndarray, step_time: LinearStepTime) -> float:
    return _goodput_of(_cumulative_gains(gains), k, step_time)


def _goodput_of(cumulative: np.ndarray, k: np.ndarray, step_time: LinearStepTime) -> float:
    """goodput_of with the cumulative gains [A, K+1] (_cumulative_gains), computed once per decision."""
    return _numerator_of(cumulative, np.asarray(k, dtype=np.int64)) / float(step_time(np.asarray(k)))


def search_exact(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, tolerance: float = 1e-12,
                 start: np.ndarray | None = None) -> np.ndarray:
    """argmax_k G(k) with 0 <= k_i <= caps_i: Dinkelbach per depth (module docstring), every
    depth iterated at once ([depths, rows, lengths] arrays: a handful of numpy calls per
    iteration, not per depth). gains: [A, K] non-increasing along K; caps: [A]; start: [A] a
    choice to begin from (the last decision's): every depth's iteration starts at the best of its
    goodput and plain decoding's, a lower bound of the optimum, so a good start saves iterations
    (a depth whose optimum lies below it stops at once, and cannot be the argmax)."""
    return _search_exact(_cumulative_gains(gains), caps, step_time, tolerance, start)


def _search_exact(cumulative: np.ndarray, caps: np.ndarray, step_time: LinearStepTime,
                  tolerance: float = 1e-12, start: np.ndarray | None = None, plain: float | None = None) -> np.ndarray:
    """search_exact with the cumulative gains [A, K+1] (_cumulative_gains) and, where the caller
    has it, plain decoding's goodput G(0) (choose_lengths computes both once per decision)."""
    num_rows, max_k = cumulative.shape[0], cumulative.shape[1] - 1
    best_k = np.zeros(num_rows, dtype=np.int64)
    best = _goodput_of(cumulative, best_k, step_time) if plain is None else plain
    if start is not None:
        start = np.minimum(np.asarray(start, dtype=np.int64), np.minimum(caps, max_k))
        started = _goodput_of(cumulative, start, step_time)
        if started > best:
            best, best_k = started, start
    max_depth = min(max_k, int(caps.max(initial=0)))
    if max_depth < 1:
        return best_k
    lengths = np.arange(max_k + 1)
    start_cost = _per_row(step_time.row_cost, num_rows)  # [A]
    row_cost = np.where(lengths > 0, start_cost[:, None], 0.0) + step_time.token_cost[:, None] * lengths  # [A, K+1]
    depths = np.arange(1, max_depth + 1)  # [M]
    allowed = lengths[None, None, :] <= np.minimum(caps[None, :], depths[:, None])[:, :, None]  # [M, A, K+1]
    masked = np.where(allowed, cumulative[None], -np.inf)  # [M, A, K+1]
    fixed = step_time.base + step_time.draft_fixed + step_time.depth_cost * depths  # [M]
    rows = np.arange(num_rows)[None, :]  # [1, A]
    ratio = np.full(len(depths), best)  # [M]
    chosen = np.zeros((len(depths), num_rows), dtype=np.int64)  # [M, A]
    running = np.ones(len(depths), dtype=bool)  # [M] depths still iterating
    for _ in range(100):
        k = np.argmax(masked - ratio[:, None, None] * row_cost[None], axis=2)  # [M, A] first maximum: shorter on ties
        chosen[running] = k[running]
        new_ratio = (num_rows + cumulative[rows, k].sum(axis=1)) / (fixed + row_cost[rows, k].sum(axis=1))  # [M]
        running &= new_ratio > ratio * (1 + tolerance)
        if not running.any():
            break
        ratio = np.where(running, new_ratio, ratio)
    # the achieved goodput of each depth's choice (its max k may be below the depth: true time is lower)
    achieved = ((num_rows + cumulative[rows, chosen].sum(axis=1)) / step_time(chosen)).tolist()  # [M]
    drafts = chosen.any(axis=1).tolist()  # [M]
    for m in range(len(depths)):
        if drafts[m] and achieved[m] > best * (1 + tolerance):
            best, best_k = achieved[m], chosen[m]
    return best_k.copy()


def search_greedy(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, tolerance: float = 1e-12) -> np.ndarray:
    """Add one token at a time to the row that raises G most, while G rises (module docstring)."""
    num_rows, max_k = gains.shape
    caps = np.minimum(caps, max_k)
    k = np.zeros(num_rows, dtype=np.int64)
    numerator, seconds = float(num_rows), float(step_time(k))
    rows = np.arange(num_rows)
    padded = np.concatenate([gains, np.zeros((num_rows, 1))], axis=1)  # [A, K+1]
    while True:
        open_rows = k < caps
        if not open_rows.any():
            return k
        drafting = k.any()
        depth = k.max()
        extra = step_time.token_cost + np.where(k == 0, step_time.row_cost, 0.0)
        extra = extra + np.where(k == depth, step_time.depth_cost, 0.0) + (0.0 if drafting else step_time.draft_fixed)
        candidate = np.where(open_rows, (numerator + padded[rows, k]) / (seconds + extra), -np.inf)
        row = int(np.argmax(candidate))
        if candidate[row] <= (numerator / seconds) * (1 + tolerance):
            return k
        numerator += padded[row, k[row]]
        seconds += extra[row]
        k[row] += 1


def search_uniform(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, tolerance: float = 1e-12) -> np.ndarray:
    """The best single k for every row (capped per row), every k evaluated at once ([K + 1, A])."""
    num_rows, max_k = gains.shape
    k = _uniform_lengths(caps, max_k)  # [K+1, A]
    goodput = (num_rows + _cumulative_gains(gains)[np.arange(num_rows)[None, :], k].sum(axis=1)) / step_time(k)  # [K+1]
    return k[_shortest_best(goodput, tolerance)].copy()


def call_times(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, remaining: np.ndarray) -> np.ndarray:
    """[..., K + 1] predicted seconds until every active row is done, for each uniform length
    0..K (capped per row by ``caps``) kept from now on, for each batch of gains [..., A, K] (a
    leading axis: samples of the rows' rates): row i needs remaining_i / E[tau_i](k_i) more
    steps; between two rows' finishing points the step costs the step time of the rows still
    active (their plain steps, ``row_base``, and their drafting). A static batch lasts until its
    slowest row is done, which per-step goodput does not see.

    A prediction, not a simulation: the rows' contexts and caps stay as they are now, the
    calibration of the current number of active rows applies to every stretch, and each row's
    expected number of steps stands for its random one (the slowest row's expected steps, not
    the expected slowest: stragglers are if anything under-counted)."""
    gains = np.asarray(gains, dtype=np.float64)
    num_rows, max_k = gains.shape[-2:]
    caps = np.minimum(np.asarray(caps, dtype=np.int64), max_k)  # [A]
    k = _uniform_lengths(caps, max_k)  # [K+1, A]
    rows = np.arange(num_rows)
    # numpy lays this out lengths, rows, then samples in memory, which sets the order in which the
    # sums over rows below add (and so the predictions' last bits): keep it
    emitted = 1.0 + _cumulative_gains(gains)[..., rows[None, :], k]  # [..., K+1, A] E[tau_i](k_i)
    steps = np.asarray(remaining, dtype=np.float64) / emitted  # [..., K+1, A] each row's steps to its finish
    # with a row's steps s_i, the stretches between finishing points add up, term by term, to:
    # the fixed part of the step for the slowest row's steps; each row's own part for its steps;
    # the drafter's depth-d pass for as long as a row drafting >= d tokens is active
    row_base = np.zeros(num_rows) if step_time.row_base is None else np.asarray(step_time.row_base, dtype=np.float64)
    fixed_base = step_time.base - row_base.sum()
    row_cost, token_cost = _per_row(step_time.row_cost, num_rows), _per_row(step_time.token_cost, num_rows)  # [A]
    per_row = row_base[None, :] + row_cost[None, :] * (k > 0) + token_cost[None, :] * k  # [K+1, A]
    # rows drafting >= d tokens at uniform length l: those of cap >= d, if l >= d; the longest of
    # their steps from a running maximum over the rows in order of decreasing cap (whose last
    # entry is the slowest row's steps)
    depths = np.arange(1, max_k + 1)  # [D]
    by_cap = np.argsort(-caps, kind="stable")  # [A]
    running_max = np.maximum.accumulate(steps[..., by_cap], axis=-1)  # [..., K+1, A]
    seconds = fixed_base * running_max[..., -1] + (per_row * steps).sum(axis=-1)  # [..., K+1]
    capable = (caps[None, :] >= depths[:, None]).sum(axis=1)  # [D] rows of cap >= d
    longest = np.where(capable > 0, running_max[..., np.maximum(capable - 1, 0)], 0.0)  # [..., K+1, D]
    longest = longest * (np.arange(max_k + 1)[:, None] >= depths[None, :])  # [..., K+1, D] only where l >= d
    depth_step = np.full(max_k, step_time.depth_cost)  # [D] what the d-th sequential pass adds
    depth_step[0] += step_time.draft_fixed  # the first also starts the drafter
    return seconds + longest @ depth_step


SEARCH_FUNCTIONS = {"exact": search_exact, "greedy": search_greedy, "uniform": search_uniform}


def choose_lengths(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, search: str = "exact",
                   min_gain: float = 0.10, start: np.ndarray | None = None,
                   remaining: np.ndarray | None = None, switch_cost_s: float = 0.0,
                   switch_steps: int = 1) -> tuple[np.ndarray, float, float]:
    """Draft lengths [A] by ``search``, or all zeros unless they beat plain decoding by
    ``min_gain`` (gains [A, K]; "finish" also takes samples [J, A, K] of them, and times
    the expected call over the samples); also returns the predicted goodput of the choice and of plain decoding (per
    step; for "finish", tokens per second until every row is done).
    start: [A] the exact search's starting choice (search_exact); remaining: [A] the rows'
    remaining token budgets ("finish" only); switch_cost_s: seconds any drafting at all costs
    once (a drafter's catch-up on the tokens its rows missed), spread over ``switch_steps``
    steps by the per-step searches (a fixed drafting cost of switch_cost_s / switch_steps per
    step) and added once to the call time of every drafting length by "finish"."""
    gains = np.asarray(gains, dtype=np.float64)
    caps = np.minimum(np.asarray(caps, dtype=np.int64), gains.shape[-1])
    zeros = np.zeros(len(caps), dtype=np.int64)
    if switch_cost_s < 0 or switch_steps < 1:
        raise ValueError(f"need switch_cost_s >= 0 and switch_steps >= 1, got {switch_cost_s!r} and {switch_steps!r}")
    if gains.ndim != 2 and search != "finish":
        raise ValueError(f"search={search!r} takes gains [A, K]; samples of them [J, A, K] are for 'finish' only")
    if search == "finish":
        if remaining is None or len(remaining) != len(caps):
            raise ValueError("search='finish' needs every active row's remaining budget (remaining=[A])")
        if len(caps) == 0:
            return zeros, float("nan"), float("nan")
        times = call_times(gains, caps, step_time, remaining)  # [..., K+1]
        times = times.reshape(-1, times.shape[-1]).mean(axis=0)  # [K+1] the expectation over samples of the rates
        times[1:] += switch_cost_s
        if not times[0] > 0:
            return zeros, float("nan"), float("nan")  # no budget left in any row: nothing to time
        goodput = float(np.sum(remaining)) / times  # [K+1] tokens per second until every row is done
        best = _shortest_best(goodput, 1e-12)  # the soonest finish, the shorter length on ties
        plain, chosen = float(goodput[0]), float(goodput[best])
        if chosen < (1.0 + min_gain) * plain:
            return zeros, plain, plain
        return np.minimum(caps, best).astype(np.int64), chosen, plain
    if switch_cost_s > 0:
        step_time = dataclasses.replace(step_time, draft_fixed=step_time.draft_fixed + switch_cost_s / switch_steps)
    cumulative = _cumulative_gains(gains)  # [A, K+1]
    plain = _goodput_of(cumulative, zeros, step_time)
    if len(caps) == 0 or caps.max() <= 0:
        return zeros, plain, plain
    if search == "exact":
        k = _search_exact(cumulative, caps, step_time, start=start, plain=plain)
    else:
        k = SEARCH_FUNCTIONS[search](gains, caps, step_time)
    chosen = _goodput_of(cumulative, k, step_time)
    if chosen < (1.0 + min_gain) * plain:
        return zeros, plain, plain
    return k, chosen, plain


def shrunk_rates(successes: np.ndarray, trials: np.ndarray, prior_rate: float,
                 prior_trials: float | np.ndarray = FINISH_SHRINK_TRIALS) -> np.ndarray:
    """[B] each row's acceptance rate from its (decayed) accepted and judged draft tokens, shrunk
    towards the batch's pooled rate: (S_i + w p) / (T_i + w), p = (sum S + w0 prior) / (sum T + w0)
    with w = prior_trials (one for all rows, or [B]) and w0 = PRIOR_TRIALS (the mean of a Beta
    posterior whose prior is the batch). A row with little evidence reads about the batch's rate, so the most pessimistic
    of many noisy rates does not pass for a straggler; one with a long record of rejections keeps
    a low rate."""
    successes, trials = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    pooled = (successes.sum() + PRIOR_TRIALS * prior_rate) / (trials.sum() + PRIOR_TRIALS)
    return (successes + prior_trials * pooled) / (trials + prior_trials)


def posterior_rate_samples(successes: np.ndarray, trials: np.ndarray, prior_rate: float,
                           prior_trials: float | np.ndarray = FINISH_SHRINK_TRIALS,
                           samples: int = FINISH_RATE_SAMPLES) -> np.ndarray:
    """[J, B] samples of the rows' acceptance rates, J = ``samples``: row i's rate is Beta with
    mean shrunk_rates' (S_i + w p) / (T_i + w) and variance m (1 - m) / (T_i + w + 1) (a Beta(w p,
    w (1 - p)) prior around the batch's pooled rate p, w = ``prior_trials`` (scalar or [B]),
    updated by the row's counts), at the stratified levels u_l = (l + 0.5) / J, row i at level (i + j) mod J in sample
    j: each sample is a whole batch, and rows of one posterior (every row, at a call's start) are
    spread over its quantiles rather than all read at its mean. Quantiles by the normal
    approximation, clipped to [0.005, 0.995] (a decision at batch 64 takes 512 of them).

    Invariant: the samples lie in [0, 1]; their mean over j is each row's posterior mean up to
    the clip and the approximation's symmetry."""
    successes, trials = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    mean = shrunk_rates(successes, trials, prior_rate, prior_trials)  # [B]
    spread = np.sqrt(mean * (1.0 - mean) / (trials + prior_trials + 1.0))  # [B]
    return np.clip(mean[None, :] + spread[None, :] * _stratified_levels(len(mean), samples), 0.005, 0.995)


@functools.lru_cache(maxsize=16)
def _stratified_levels(num_rows: int, samples: int) -> np.ndarray:
    """[J, B] (read-only, cached: the same for every decision of a call) the standard normal
    quantile of row i in sample j of posterior_rate_samples: level (i + j) mod J of the J levels
    (l + 0.5) / J."""
    levels = scipy.special.ndtri((np.arange(samples) + 0.5) / samples)  # [J] standard normal quantiles
    rows = np.arange(num_rows)
    level = levels[(rows[None, :] + np.arange(samples)[:, None]) % samples]  # [J, B]
    level.flags.writeable = False
    return level


def row_bucket(num_rows: int) -> int:
    """The power of two >= num_rows: calibration keeps one correction per bucket of active rows."""
    return 1 << max(int(num_rows) - 1, 0).bit_length()


class StepTimeCalibration:
    """Online correction of a LinearStepTime by measured step wall times, per bucket of active
    rows (row_bucket), since what a model mis-predicts differs between 64 rows and 3. Two factors:

    - the host's **speed** (``base_scale``): the median of measured / predicted over the bucket's
      last WINDOW steps of either kind (MIN_SAMPLES at least; 1 before), the prediction with the
      current shape. It scales the whole step, so it moves no decision (but what a catch-up is
      worth against a step): a slow spell of the host, or a history served on a slower one, is
      not read as dear drafting;
    - the **shape** (``extra_scale``): what drafting adds against the model's prediction,
      relative to the speed, learnt only from drafting and plain steps measured close together
      (within PAIR_STEPS steps of the same call): a drafting step of m seconds, predicted plain
      part P0 and drafting part E, beside plain steps that ran p times their prediction, gives
      a sample (m / p - P0) / E (clipped to EXTRA_CLIP); the shape is the median of the bucket's
      last WINDOW samples once it holds MIN_SAMPLES, 1 (the model as profiled) before.

    Pairing matters: a drafting sample (m - plain scale x P0) / E that read the plain scale
    from whenever it was last measured would take a slow spell of the host for dear drafting
    (a step 20% slower reads as drafting 40% dearer where P0 and E are alike), and at a call's
    start every sample would be the history's.

    A bucket whose drafting is measured with no plain step beside it cannot tell a slow host
    from dear drafting. When its recent unpaired drafting steps (MIN_SAMPLES of them, median)
    ran more than PROBE_TOLERANCE off what the current shape predicts at the recent plain speed
    (the bucket's plain steps, else any bucket's, else 1), ``wants_plain_probe`` asks the policy
    for PROBE_STEPS plain steps, which pair with them; at most once per PROBE_EVERY of the
    bucket's steps. The test is on the whole step's time, which is what a decision weighs, not
    on the shape, which a small error of the speed moves a lot where drafting is cheap. So
    drafting that costs up to about PROBE_TOLERANCE more of the whole step than modelled, with
    no plain step beside it, goes uncorrected (the speed takes it up). A bucket's shape is
    forgotten after ``reprobe_after`` steps in a row that did not draft (GoodputPolicy), so
    drafting is measured again now and then (and pairs with the plain steps just taken) rather
    than ruled out for good. Steps whose time includes catch-up work (a model drafter reading
    the tokens it missed while its row did not draft: the whole prompt the first time), and
    steps that switch between drafting and plain decoding, are not fed in (``unmeasured``;
    GoodputPolicy._calibrate says why).

    Invariant: scales are positive; with no measurement the calibrated model is the model, and
    the shape moves only on drafting and plain steps measured within PAIR_STEPS of each other."""

    WINDOW = 8
    MIN_SAMPLES = 3
    EXTRA_CLIP = (0.05, 50.0)
    PAIR_STEPS = 16  # a drafting and a plain step this many steps apart or fewer are measured "together"
    PROBE_TOLERANCE = 0.25  # drafting steps this far off their prediction ask for a plain probe
    PROBE_EVERY = 64  # the bucket's steps between two plain probes, at the least
    PROBE_STEPS = CATCH_UP_STEPS  # plain steps of a probe (GoodputPolicy: the return is no catch-up)

    def __init__(self):
        self.base_scale: dict[int, float] = {}  # bucket -> the host's speed (median of MIN_SAMPLES or more)
        self.extra_scale: dict[int, float] = {}  # bucket -> the shape (median of its pair samples)
        self._base_samples: dict[int, deque[float]] = {}  # bucket -> its last WINDOW speed samples
        self._extra_samples: dict[int, deque[float]] = {}  # bucket -> its last WINDOW shape samples
        # bucket -> (clock, measured / predicted) of its last plain steps: as many as PAIR_STEPS ahead of a drafting step
        self._plain: dict[int, deque] = {}
        self._drafting: dict[int, deque] = {}  # bucket -> [clock, seconds, P0, E, paired] of its last WINDOW drafting steps
        self._bucket_steps: dict[int, int] = {}  # bucket -> its steps measured
        self._last_probe: dict[int, int] = {}  # bucket -> its step count at its last plain probe
        self._idle: dict[int, int] = {}  # steps without drafting since the bucket's last drafting step
        self._clock = 0  # steps measured, with a gap between calls (no pairs across calls)
        self._catch_up_samples: deque[float] = deque(maxlen=self.WINDOW)  # seconds a catch-up step cost beyond its prediction

    @property
    def catch_up_s(self) -> float:
        """What a catch-up step costs beyond an ordinary drafting step (the median of the last
        WINDOW measured ones; 0 before the first): the price of switching a row back on."""
        return statistics.median(self._catch_up_samples) if self._catch_up_samples else 0.0

    def observe_catch_up(self, excess_s: float) -> None:
        """One catch-up step's measured time minus the calibrated prediction of its drafting step."""
        self._catch_up_samples.append(max(float(excess_s), 0.0))

    def new_call(self) -> None:
        """A new generate() call: its steps pair with none of the last call's."""
        self._clock += 2 * self.PAIR_STEPS + 1

    def apply(self, step_time: LinearStepTime, num_rows: int) -> LinearStepTime:
        bucket = row_bucket(num_rows)
        speed = self.base_scale.get(bucket, 1.0)
        return step_time.calibrated(speed, speed * self.extra_scale.get(bucket, 1.0))

    def _add(self, samples: dict, scales: dict, bucket: int, new_samples: list[float]) -> None:
        """Append ``new_samples`` to the bucket's last WINDOW samples; its scale becomes their median
        once it holds MIN_SAMPLES (as adding them one by one would leave it: nothing reads the scale
        in between). None: nothing changes (no window is made for the bucket)."""
        if not new_samples:
            return
        held = samples.setdefault(bucket, deque(maxlen=self.WINDOW))
        held.extend(new_samples)
        if len(held) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(held)

    def idle(self, num_rows: int, forget_after: int, steps: int = 1) -> None:
        """Count ``steps`` steps that did not draft; after ``forget_after`` of them in a row,
        forget this bucket's shape and drafting steps, so the next decision uses the model again
        and, if it drafts, measures afresh beside the plain steps just taken: measurements cannot
        rule speculation out for good."""
        bucket = row_bucket(num_rows)
        if bucket not in self._extra_samples and bucket not in self._drafting:
            return
        self._idle[bucket] = self._idle.get(bucket, 0) + steps
        if self._idle[bucket] >= forget_after:
            self._extra_samples.pop(bucket, None)
            self._drafting.pop(bucket, None)
            self.extra_scale.pop(bucket, None)
            self._catch_up_samples.clear()  # and what switching back on costs: one slow catch-up cannot rule it out for good
            self._idle[bucket] = 0

    def _tick(self, bucket: int) -> None:
        """One more step on the clock and in the bucket's count."""
        self._clock += 1
        self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1

    def unmeasured(self, num_rows: int, drafting: bool) -> None:
        """A step not calibrated on (a catch-up, or a switch between drafting and plain
        decoding): the clock runs on, and a drafting one ends the bucket's run of idle steps."""
        bucket = row_bucket(num_rows)
        self._tick(bucket)
        if drafting:
            self._idle[bucket] = 0

    def measured(self, num_rows: int) -> bool:
        """Whether the bucket of ``num_rows`` active rows has drafting measurements (a shape, or
        MIN_SAMPLES drafting steps) since it was last forgotten."""
        bucket = row_bucket(num_rows)
        return bucket in self.extra_scale or len(self._drafting.get(bucket, ())) >= self.MIN_SAMPLES

    def observe(self, step_time: LinearStepTime, k: np.ndarray, measured_s: list[float]) -> None:
        """Steps of the same lengths k [A], one sample each; step_time: the uncalibrated model over
        their A active rows (the prediction computed once)."""
        bucket = row_bucket(len(k))
        base = step_time.base
        if base <= 0:
            return
        drafting = bool(k.any())
        extra = float(step_time.extra(k)) if drafting else 0.0
        predicted = base + self.extra_scale.get(bucket, 1.0) * extra
        speeds = []  # measured / predicted of each step
        for seconds in measured_s:
            self._tick(bucket)
            if seconds <= 0:
                continue
            speeds.append(seconds / predicted)
            if extra > 0:
                self._drafting.setdefault(bucket, deque(maxlen=self.WINDOW)).append([self._clock, seconds, base, extra, False])
            elif not drafting:
                self._plain.setdefault(bucket, deque(maxlen=self.PAIR_STEPS + 1)).append((self._clock, seconds / base))
        self._add(self._base_samples, self.base_scale, bucket, speeds)
        if drafting:
            self._idle[bucket] = 0
        self._pair(bucket)

    def _pair(self, bucket: int) -> None:
        """Shape samples from the bucket's drafting steps that have plain steps within PAIR_STEPS."""
        plain = self._plain.get(bucket, ())
        low, high = self.EXTRA_CLIP
        shapes = []
        for sample in self._drafting.get(bucket, ()):
            clock, seconds, base, extra, paired = sample
            if paired:
                continue
            near = [ratio for at, ratio in plain if abs(at - clock) <= self.PAIR_STEPS]
            if near:
                shape = (seconds / statistics.median(near) - base) / extra
                shapes.append(min(max(shape, low), high))
                sample[4] = True
        self._add(self._extra_samples, self.extra_scale, bucket, shapes)

    def _plain_speed(self, bucket: int) -> float:
        """The recent plain steps' measured / predicted: the bucket's (its last MIN_SAMPLES), else
        the latest of any bucket's, else 1."""
        own = self._plain.get(bucket)
        if own:
            return statistics.median(ratio for _, ratio in list(own)[-self.MIN_SAMPLES:])
        latest = max((held[-1] for held in self._plain.values() if held), default=None)
        return latest[1] if latest is not None else 1.0

    def wants_plain_probe(self, num_rows: int) -> bool:
        """Whether the bucket's recent unpaired drafting steps (MIN_SAMPLES or more, within
        PAIR_STEPS) ran more than PROBE_TOLERANCE off what the current shape predicts at the
        recent plain speed, and its last probe is PROBE_EVERY of its steps ago or more: a few
        plain steps then tell a slow host from dear drafting."""
        bucket = row_bucket(num_rows)
        steps = self._bucket_steps.get(bucket, 0)
        if bucket in self._last_probe and steps - self._last_probe[bucket] < self.PROBE_EVERY:
            return False
        recent = [s for s in self._drafting.get(bucket, ()) if not s[4] and self._clock - s[0] <= self.PAIR_STEPS]
        if len(recent) < self.MIN_SAMPLES:
            return False
        speed, shape = self._plain_speed(bucket), self.extra_scale.get(bucket, 1.0)
        off = statistics.median(seconds / (speed * (base + shape * extra)) for _, seconds, base, extra, _ in recent)
        return abs(off - 1.0) > self.PROBE_TOLERANCE

    def probed(self, num_rows: int) -> None:
        """The policy takes a plain probe in this bucket now."""
        bucket = row_bucket(num_rows)
        self._last_probe[bucket] = self._bucket_steps.get(bucket, 0)


class GoodputPolicy(Policy):
    def __init__(self, cost_model: CostModel, max_draft_tokens: int = 8, search: str = "exact", drafter_index: int = 0,
                 min_gain: float = 0.10, decide_every: int = 1, prior: float = 0.5, estimator: str = "ema",
                 window: int = 100, per_position: bool = False, calibrate: bool = True, revisit: float = 0.05,
                 reprobe_after: int = 64, learn_prior: bool = True, finish_rate_samples: int = FINISH_RATE_SAMPLES):
        """cost_model: predicted step times (its drafter ``drafter_index`` must be timed);
        search: "exact", "greedy" (per-row lengths), "uniform" (one length for the batch) or
        "finish" (one length, the one that finishes every active row soonest: call_times);
        min_gain: how much speculation must beat plain decoding by; decide_every: steps between
        decisions (lengths are kept, capped by each row's budget, in between, and the policy does
        no work until the next decision, which learns from the steps since; fewer steps while a
        probe of speculation lacks its measurements); prior, estimator
        ("ema" or "window"), window: acceptance estimation; per_position: use per-position
        acceptance rates (a position a row has never reached keeps the prior) rather than one
        rate per row; calibrate: correct the cost model online by the measured wall time of
        each step, less the policy's own plan (``StepRecord.step_time_s - plan_time_s``;
        StepTimeCalibration: the host's speed, and what drafting adds against the model, per
        bucket of active rows), so a model that under-predicts what speculation costs at this
        batch size stops speculating once it has measured it, and a slow host does not;
        revisit: each step a row does not draft, its acceptance estimate moves this fraction of
        the way back to the prior, so a row switched off by a run of rejections is tried again
        (after about 1 / revisit steps) when the prior says drafting pays; 0 never revisits;
        reprobe_after: after this many steps in a row without drafting at a batch size, forget
        the measured drafting cost there and let the model decide (and measure) again; 0 never;
        learn_prior: start each generate() call's rows at the acceptance learnt over the earlier
        calls (LearnedPrior) rather than at ``prior`` every time; finish_rate_samples ("finish"):
        time the call over this many stratified samples of the rows' posterior rates
        (posterior_rate_samples; 1: each row at its posterior mean)."""
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        if not is_int_at_least(max_draft_tokens, 1):
            raise ValueError(f"max_draft_tokens must be an integer >= 1, got {max_draft_tokens!r}")
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        if not 0 <= drafter_index < cost_model.num_drafters:
            raise ValueError(f"drafter_index {drafter_index} is not timed by the cost model ({cost_model.num_drafters} drafter(s))")
        if min_gain < 0 or decide_every < 1:
            raise ValueError(f"need min_gain >= 0 and decide_every >= 1, got {min_gain!r} and {decide_every!r}")
        if not 0.0 <= revisit <= 1.0:
            raise ValueError(f"revisit must lie in [0, 1], got {revisit!r}")
        if not is_int_at_least(finish_rate_samples, 1):
            raise ValueError(f"finish_rate_samples must be an integer >= 1, got {finish_rate_samples!r}")
        self.finish_rate_samples = int(finish_rate_samples)
        if not is_int_at_least(reprobe_after, 0):
            raise ValueError(f"reprobe_after must be an integer >= 0, got {reprobe_after!r}")
        self.cost_model, self.search, self.drafter_index = cost_model, search, int(drafter_index)
        self._max_draft_tokens = int(max_draft_tokens)
        self.min_gain, self.decide_every, self.per_position = float(min_gain), int(decide_every), per_position
        self.revisit, self.reprobe_after = float(revisit), int(reprobe_after)
        if isinstance(prior, bool) or not isinstance(prior, (int, float, np.integer, np.floating)) or not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be one acceptance rate in [0, 1], got {prior!r}")
        self._estimator_options = {"mode": estimator, "window": window, "positions": per_position}
        self.learned_prior = LearnedPrior(prior) if learn_prior else None
        # "finish": how much rows' rates differ, learnt from earlier calls' rows (the prior strength
        # of each row's posterior at a call's start, never below FINISH_SHRINK_TRIALS: finish_prior_trials)
        self.row_spread = RowRateSpread() if learn_prior and search == "finish" else None
        self._given_prior = float(prior)
        # the EMA of pooled rates learns from each interval's counts at once (StepCounts); the
        # other estimators replay the interval's steps one by one
        self._pooled = estimator == "ema" and not per_position
        self.estimator: AcceptanceEstimator | None = None
        self._batch = None
        self.predicted_goodput = self.predicted_plain_goodput = float("nan")  # of the last decision, tokens/s
        self.calibration = StepTimeCalibration() if calibrate else None  # kept across generate() calls
        self._decision = None  # (uncalibrated step time of the active rows, their decided lengths [A])
        self._next_decision = 0  # the step of the next decision
        self._records: list[StepRecord] = []  # the steps since the last decision
        self._row_trial_steps = np.zeros(0, dtype=np.int64)  # [B] "finish": each row's steps with a trial this call
        self._previous_ran: bool | None = None  # whether the call's last step ran the drafter (calibration)

    @property
    def max_draft_tokens(self) -> int:
        return self._max_draft_tokens

    @property
    def cold_start_rate(self) -> float:
        """The acceptance rate the current (or last) generate() call's rows started at and relax
        back to; a call's own counts enter it when the next call starts (LearnedPrior.new_call)."""
        return self.learned_prior.rate if self.learned_prior is not None else self._given_prior

    def plan(self, batch, num_drafters):
        if batch is not self._batch:
            if self.drafter_index >= num_drafters:
                raise ValueError(f"{self!r} drafts with drafter {self.drafter_index} but generate() was given {num_drafters}")
            self.end_call()  # the last call's last steps, unless already folded in: the calibration is kept across calls
            if self.calibration is not None:
                self.calibration.new_call()  # no calibration pairs across calls
            self._batch, self._steps, self._next_decision = batch, 0, 0
            self._lengths = np.zeros(batch.num_rows, dtype=np.int64)
            # the step each row last drafted: a model drafter's step also feeds it every token it
            # missed since (the whole prompt the first time), so such steps are not calibrated on
            self._last_drafted = np.full(batch.num_rows, -(1 << 40), dtype=np.int64)
            # "finish": each row's judged draft tokens, accepted and all, decayed by FINISH_COUNT_DECAY per step
            self._row_successes = np.zeros(batch.num_rows)  # [B]
            self._row_trials = np.zeros(batch.num_rows)  # [B]
            self._call_successes = np.zeros(batch.num_rows)  # [B] the call's counts, undecayed (RowRateSpread)
            self._call_trials = np.zeros(batch.num_rows)  # [B]
            self._row_trial_steps = np.zeros(batch.num_rows, dtype=np.int64)  # [B] the call's steps with a trial
            self._previous_ran = None  # whether the call's last step ran the drafter (calibration)
            self._bucket = row_bucket(batch.num_rows)  # the active rows' bucket at the last decision
            self.estimator = AcceptanceEstimator(batch.num_rows, num_drafters, self.max_draft_tokens,
                                                 prior=self.cold_start_rate, **self._estimator_options)
            self._decision, self._records = None, []
        if self._steps >= self._next_decision or (
                self.decide_every > 1 and row_bucket(batch.num_rows - int(np.count_nonzero(batch.finished))) != self._bucket):
            self._learn()
            self._plan = self._decide_interval(batch)
        self._steps += 1
        return self._plan  # the same object until the next decision (generate() caps a copy per step)

    def start_rows(self, batch, rows) -> None:
        """New requests in rows of the batch being served (an Engine refilling them): their
        estimates go back to the prior, their counts to zero, their first drafting step is a
        catch-up (the drafter reads the whole prompt), and the next plan decides for them. A new
        batch is handled by plan() (everything starts again)."""
        if batch is not self._batch:
            return
        self._learn()  # the rows' last requests' final steps are learnt now, not into the new requests
        rows = np.asarray(rows, dtype=np.int64)
        for d in range(self.estimator.num_drafters):
            self.estimator.relax(rows, d, 1.0)
        for counts in (self._row_successes, self._row_trials, self._call_successes, self._call_trials,
                       self._row_trial_steps):
            counts[rows] = 0
        self._last_drafted[rows] = -(1 << 40)
        self._next_decision = min(self._next_decision, self._steps)

    def end_call(self) -> None:
        """Fold the current call's last steps in now (the calibration, LearnedPrior) rather than
        at the next call's first plan, so that ``cold_start_rate`` reads what the next call will
        start from. Optional: plan() does the same on a new call."""
        if self._batch is not None:
            self._learn()
            if self.learned_prior is not None:
                self.learned_prior.new_call()
            if self.row_spread is not None:
                self.row_spread.add_rows(self._call_successes, self._call_trials)
            self._batch = None

    def _decide_interval(self, batch) -> Plan:
        """A decision: lengths for the active rows, kept (capped by each row's budget, which
        generate() applies each step) until the next one; the steps in between cost nothing."""
        remaining = np.asarray(batch.remaining)  # [B]
        caps = np.minimum(self.max_draft_tokens, np.maximum(remaining - 1, 0))
        active = batch.active_rows()
        self._bucket = row_bucket(len(active))  # a change of bucket (rows finishing) brings the next decision forward
        np.minimum(self._last_drafted, self._steps - 1, out=self._last_drafted)  # an interval cut short drafted until now
        step_time = LinearStepTime.from_cost_model(self.cost_model, batch.lengths[active], self.drafter_index) \
            if len(active) else None
        self._lengths = self._decide(active, caps, step_time, remaining)
        # drafting measured with no plain step beside it and read far off the model's shape: a few
        # plain steps first, so the calibration can tell a slow host from dear drafting
        probing = bool(self.calibration is not None and (self._lengths[active] > 0).any()
                       and self.calibration.wants_plain_probe(len(active)))
        if probing:
            self._lengths = np.zeros_like(self._lengths)
            self.calibration.probed(len(active))
            # the probe's plain steps are not idleness: a row's drafter reads the PROBE_STEPS tokens it
            # missed in its next drafting step, as after any plain step, so the return is not priced
            # as a catch-up (_calibrate leaves it out as it does every switch)
            was_drafting = self._last_drafted == self._steps - 1
            self._last_drafted[was_drafting] = self._steps + StepTimeCalibration.PROBE_STEPS - CATCH_UP_STEPS
        self._asked = np.minimum(self._lengths, caps)  # [B] this interval's lengths
        asked = self._asked > 0
        # a row switched on after more than CATCH_UP_STEPS idle steps makes the interval's first
        # step a catch-up (not calibrated on); the rows asked draft in every step of the interval
        self._catching_up = bool((asked & (self._steps - self._last_drafted > CATCH_UP_STEPS)).any())
        # drafting where the calibration holds too few measurements (a new bucket, or a re-probe
        # after reprobe_after idle steps): decide again as soon as they exist, not decide_every
        # steps later, so a probe of speculation that does not pay stays short
        interval = self.decide_every if self._steps > 0 else min(self.decide_every, FIRST_INTERVAL)
        if asked.any() and self.calibration is not None and not self.calibration.measured(len(active)):
            interval = min(interval, StepTimeCalibration.MIN_SAMPLES + int(self._catching_up))
        if probing:
            interval = StepTimeCalibration.PROBE_STEPS
        self._next_decision = self._steps + interval
        self._last_drafted[asked] = self._steps + interval - 1
        # the interval's calibration compares its measured steps with this prediction
        self._decision = (step_time, self._asked[active]) if step_time is not None else None
        return Plan(drafter_index=np.full(batch.num_rows, self.drafter_index, dtype=np.int64),
                    num_draft_tokens=self._asked.copy())

    def _learn(self) -> None:
        """At a decision: what the steps since the last one taught (the estimator: their counts
        at once, or step by step for the window and per-position estimators; the calibration:
        one sample per measured step, _calibrate)."""
        records, self._records = self._records, []
        if not records:
            return
        counts = None
        if self._pooled or self.learned_prior is not None or self.search == "finish":
            counts = StepCounts(len(self._asked))
            counts.add_steps(records, self._asked)
            if self.learned_prior is not None:
                self.learned_prior.add(counts)
            if self.search == "finish":
                # older evidence fades by FINISH_COUNT_DECAY per step with a trial, and by the revisit
                # rate per idle step (a row switched off drifts back to the batch's rate, as below, the
                # more slowly the more its prior has aged: finish_row_prior_trials)
                keep = FINISH_COUNT_DECAY ** counts.trial_steps * (1.0 - self.revisit) ** counts.idle_steps  # [B]
                self._row_successes = keep * self._row_successes + counts.successes
                self._row_trials = keep * self._row_trials + counts.trials
                self._call_successes += counts.successes
                self._call_trials += counts.trials
                self._row_trial_steps += counts.trial_steps
        if self._pooled:
            self.estimator.update_counts(counts, self.drafter_index)
            if self.revisit > 0:
                idle = np.flatnonzero(counts.idle_steps)
                self.estimator.relax(idle, self.drafter_index, 1.0 - (1.0 - self.revisit) ** counts.idle_steps[idle])
        else:
            idle = np.flatnonzero(self._asked == 0)
            asked_any = bool(self._asked.any())  # a step no row was asked to draft in teaches nothing
            for record in records:
                if asked_any:
                    self.estimator.update(record, asked=self._asked)
                if self.revisit > 0 and len(idle):
                    self.estimator.relax(idle, self.drafter_index, self.revisit)
        if self.calibration is not None and self._decision is not None:
            self._calibrate(records)

    def _calibrate(self, records: list[StepRecord]) -> None:
        """One calibration sample per measured step of the interval: a plain one where no
        drafter ran (none asked, or every asked row capped by its budget), a drafting one
        otherwise; but a catch-up first step, and a step of the other kind than the step before
        it in the call (or the call's first), are not calibrated on. Both kinds of switch cost
        more than the steps after them (the more so after longer plain stretches), so fed in
        they would skew both scales: a plain probe's speed, slowed by its switch step, reads
        drafting as cheaper than its clean pairs do."""
        step_time, decided = self._decision
        first = records[0]
        if self._catching_up and first.step_time_s and decided.any() and self._drafter_ran(first):
            # what the catch-up step cost beyond the drafting step it also was: the price of a switch-on
            predicted = float(self.calibration.apply(step_time, len(decided))(decided))
            self.calibration.observe_catch_up(self._decoding_s(first) - predicted)
        plain, drafting, idle_steps = [], [], 0
        for index, (record, ran) in enumerate(zip(records, self._drafters_ran(records))):
            switched, self._previous_ran = ran != self._previous_ran, ran  # a call's first step counts as switched
            if not record.step_time_s:
                continue
            catch_up = index == 0 and self._catching_up
            idle_steps += not ran and not catch_up
            if switched or catch_up:
                self.calibration.unmeasured(len(decided), drafting=ran)
            else:
                (drafting if ran else plain).append(self._decoding_s(record))
        if plain:
            self.calibration.observe(step_time, np.zeros_like(decided), plain)
        if idle_steps and self.reprobe_after:
            self.calibration.idle(len(decided), self.reprobe_after, steps=idle_steps)
        if drafting and decided.any():
            self.calibration.observe(step_time, decided, drafting)

    @staticmethod
    def _decoding_s(record: StepRecord) -> float:
        """The step's wall time less the policy's own plan (StepRecord.plan_time_s): what the cost
        model predicts. A decision's work lands on the first step of its interval whether that
        step drafts or not; at the tail of a call, where rows finishing bring decisions forward
        every few steps, it would fall on many of the few drafting samples and read as dear
        drafting."""
        return float(record.step_time_s) - float(record.plan_time_s)

    @staticmethod
    def _drafter_ran(record: StepRecord) -> bool:
        wall = record.drafter_wall_s
        return bool(wall.sum() > 0) if wall is not None else bool(record.num_drafted.any())

    @classmethod
    def _drafters_ran(cls, records: list[StepRecord]) -> list[bool]:
        """_drafter_ran of each record; at once where every record times its drafters alike ([n, D])."""
        walls = [record.drafter_wall_s for record in records]
        if any(wall is None for wall in walls) or len({wall.shape for wall in walls}) != 1:
            return [cls._drafter_ran(record) for record in records]
        return (np.array(walls).reshape(len(walls), -1).sum(axis=1) > 0).tolist()

    @property
    def finish_prior_trials(self) -> float:
        """"finish": what the batch's rate weighs in each row's at a call's start, in judged draft
        tokens (finish_row_prior_trials ages it): FINISH_SHRINK_TRIALS, or more where earlier
        calls' rows were more alike than that (RowRateSpread.prior_strength), never less (a
        weaker prior reads stragglers that are not)."""
        learnt = self.row_spread.prior_strength() if self.row_spread is not None else None
        return FINISH_SHRINK_TRIALS if learnt is None else max(learnt, FINISH_SHRINK_TRIALS)

    def finish_row_prior_trials(self) -> np.ndarray:
        """[B] "finish": the batch's weight in each row's rate this call, finish_prior_trials aged
        by FINISH_COUNT_DECAY per step in which the row had a trial, as its own counts are, and never
        below FINISH_PRIOR_FLOOR. A row's counts level off near (judged tokens per step) / (1 -
        FINISH_COUNT_DECAY): a straggler's well below an unaged prior, which would keep it near the
        batch's rate; a well-judged row's far above either. Empty before the
        first call."""
        steps = np.maximum(self._row_trial_steps - FINISH_PRIOR_GRACE, 0).astype(np.float64)  # [B]
        aged = self.finish_prior_trials * FINISH_COUNT_DECAY ** steps
        return np.maximum(aged, FINISH_PRIOR_FLOOR)

    def _row_rates(self, active: np.ndarray) -> np.ndarray:
        """[A] the i.i.d. acceptance rate of each active row: the estimator's, or for "finish"
        (which the lowest rows' rates decide) the mean of its posterior, shrunk_rates of the row's
        decayed counts."""
        if self.search != "finish":
            return self.estimator.rate(self.drafter_index)[active]
        return shrunk_rates(self._row_successes, self._row_trials, self.cold_start_rate,
                            self.finish_row_prior_trials())[active]

    def _decide(self, active: np.ndarray, caps: np.ndarray, step_time: LinearStepTime | None,
                remaining: np.ndarray) -> np.ndarray:
        """Lengths [B] for the active rows. A row switched back on after more than
        CATCH_UP_STEPS idle steps costs the drafter's catch-up (calibration.catch_up_s, measured),
        paid once: the choice with such rows, charged it over CATCH_UP_HORIZON steps (or the
        steps left), is weighed against the choice without them."""
        lengths = np.zeros(len(caps), dtype=np.int64)
        if len(active) == 0:
            return lengths
        coverage = self.estimator.coverage(self.drafter_index)[active]  # [A]
        if self.per_position:
            gains = marginal_gains(self.estimator.position_rates(self.drafter_index)[active])  # [A, K]
        elif self.search == "finish":  # samples of the batch: [J, A]
            rates = posterior_rate_samples(self._row_successes, self._row_trials, self.cold_start_rate,
                                           self.finish_row_prior_trials(), self.finish_rate_samples)[:, active]
            gains = iid_marginal_gains(rates, self.max_draft_tokens)  # [J, A, K]
        else:
            gains = iid_marginal_gains(self._row_rates(active), self.max_draft_tokens)  # [A, K]
        gains = gains * coverage[:, None]  # [A, K] or [J, A, K]
        if self.calibration is not None:
            step_time = self.calibration.apply(step_time, len(active))
        row_caps, row_remaining = caps[active], remaining[active]
        options = {"search": self.search, "min_gain": self.min_gain, "start": self._lengths[active], "remaining": row_remaining}
        switch_cost = self.calibration.catch_up_s if self.calibration is not None else 0.0
        last_drafted = self._last_drafted[active]  # [A]
        returning = (last_drafted >= 0) & (self._steps - last_drafted > CATCH_UP_STEPS) & (row_caps > 0)  # [A]
        if switch_cost > 0 and returning.any():
            horizon = int(max(1, min(max(self.decide_every, CATCH_UP_HORIZON), row_remaining.max())))
            with_returning = choose_lengths(gains, row_caps, step_time, switch_cost_s=switch_cost, switch_steps=horizon,
                                            **options)
            without = choose_lengths(gains, np.where(returning, 0, row_caps), step_time, **options)
            choice = with_returning if with_returning[1] > without[1] else without
        else:
            choice = choose_lengths(gains, row_caps, step_time, **options)
        chosen, self.predicted_goodput, self.predicted_plain_goodput = choice
        lengths[active] = chosen
        return lengths

    def observe(self, record: StepRecord) -> None:
        if self.estimator is not None:
            self._records.append(record)  # learnt from at the next decision (_learn)

    def __repr__(self) -> str:
        return (f"GoodputPolicy(max_draft_tokens={self.max_draft_tokens}, search={self.search!r}, "
                f"drafter_index={self.drafter_index}, min_gain={self.min_gain}, calibrate={self.calibration is not None}, "
                f"revisit={self.revisit}, per_position={self.per_position}, learn_prior={self.learned_prior is not None})")
