"""GoodputPolicy's ``search="finish"``: the one option kept for static batches (ours, not
SmartSpec's). ``generate()`` runs static batches, which last until their slowest row is done; a
longer draft that does not shorten the slowest row only makes every step dearer, which per-step
goodput does not see. "finish" takes one length for every row, the one that minimises the
predicted time until every active row is done (``call_times``). It is kept because on static
batches it measured ahead of per-step goodput (BENCHMARKS.md §3). Under the Engine, whose batch
stays full, "exact" is the paper's rule.

The lowest rows' rates decide it, so each row's rate is read as a Beta posterior
(``FinishRates``): its own counts, decayed by COUNT_DECAY per step with a trial (a memory of
about 20 steps), and a prior around the batch's pooled rate worth SHRINK_TRIALS judged tokens
(the lowest of many noisy per-row averages would otherwise pass for a straggler by chance),
which ages as the counts do after GRACE steps, to PRIOR_FLOOR at the least (unaged, a
straggler's counts level off below the prior's weight and it reads near the batch's rate for as
long as it drafts). The call is timed over RATE_SAMPLES stratified samples of those posteriors
(``posterior_rate_samples``).

Invariant: sampled rates lie in [0, 1]; ``call_times`` equals an event simulation of the call on
the cost model (tests/policies/test_goodput.py).
"""

from __future__ import annotations

import functools

import numpy as np
import scipy.special

from .acceptance import StepCounts
from .step_time import LinearStepTime

POOLED_PRIOR_TRIALS = 16.0  # what the given prior weighs in the batch's pooled rate, in judged draft tokens
SHRINK_TRIALS = 32.0  # what the batch's pooled rate weighs in each row's rate at the start, in judged tokens
COUNT_DECAY = 0.95  # what a row's counts keep per drafting step (a memory of about 20)
PRIOR_FLOOR = 2.0  # the aged prior's weight never falls below this
GRACE = round(1 / (1 - COUNT_DECAY))  # steps with a trial before the prior ages: the counts' memory
RATE_SAMPLES = 8  # stratified samples of the rows' posteriors a call is timed over
REVISIT = 0.05  # what an idle row's counts lose per step (it drifts back to the batch's rate)


def shortest_best(values: np.ndarray, tolerance: float = 1e-12) -> int:
    """The index of the largest of ``values`` [K+1]: the first unless a later one beats it by
    the relative ``tolerance`` (the shortest of the best lengths)."""
    values = np.asarray(values).tolist()
    best = 0
    for length in range(1, len(values)):
        if values[length] > values[best] * (1 + tolerance):
            best = length
    return best


def call_times(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, remaining: np.ndarray) -> np.ndarray:
    """[..., K + 1] predicted seconds until every active row is done, for each uniform length
    0..K (capped per row by ``caps`` [A]) kept from now on, for gains [..., A, K] (a leading axis:
    samples of the rows' rates). Row i needs remaining_i / E[tau_i](k_i) more steps; between two
    rows' finishing points a step costs the step time of the rows still active. A prediction:
    contexts and caps stay as they are now, and each row's expected steps stand for its random
    ones."""
    gains = np.asarray(gains, dtype=np.float64)
    num_rows, max_k = gains.shape[-2:]
    caps = np.minimum(np.asarray(caps, dtype=np.int64), max_k)  # [A]
    k = np.minimum(caps[None, :], np.arange(max_k + 1)[:, None])  # [K+1, A]
    rows = np.arange(num_rows)
    cumulative = np.zeros(gains.shape[:-1] + (max_k + 1,))
    np.cumsum(gains, axis=-1, out=cumulative[..., 1:])
    emitted = 1.0 + cumulative[..., rows[None, :], k]  # [..., K+1, A] E[tau_i](k_i)
    steps = np.asarray(remaining, dtype=np.float64) / emitted  # [..., K+1, A]
    # the stretches between finishing points add up, term by term, to: the fixed part of the step
    # for the slowest row's steps; each row's own part for its steps; the drafter's depth-d pass
    # for as long as a row drafting >= d tokens is active
    row_base = np.zeros(num_rows) if step_time.row_base is None else np.asarray(step_time.row_base, dtype=np.float64)
    fixed_base = step_time.base - row_base.sum()
    row_cost = np.broadcast_to(np.asarray(step_time.row_cost, dtype=np.float64), (num_rows,))  # [A]
    token_cost = np.broadcast_to(np.asarray(step_time.token_cost, dtype=np.float64), (num_rows,))  # [A]
    per_row = row_base[None, :] + row_cost[None, :] * (k > 0) + token_cost[None, :] * k  # [K+1, A]
    depths = np.arange(1, max_k + 1)  # [D]
    by_cap = np.argsort(-caps, kind="stable")  # [A] rows in order of decreasing cap
    running_max = np.maximum.accumulate(steps[..., by_cap], axis=-1)  # [..., K+1, A]
    seconds = fixed_base * running_max[..., -1] + (per_row * steps).sum(axis=-1)  # [..., K+1]
    capable = (caps[None, :] >= depths[:, None]).sum(axis=1)  # [D] rows of cap >= d
    longest = np.where(capable > 0, running_max[..., np.maximum(capable - 1, 0)], 0.0)  # [..., K+1, D]
    longest = longest * (np.arange(max_k + 1)[:, None] >= depths[None, :])  # only where l >= d
    depth_step = np.full(max_k, step_time.depth_cost)  # [D] what the d-th sequential pass adds
    depth_step[0] += step_time.draft_fixed  # the first also starts the drafter
    return seconds + longest @ depth_step


def shrunk_rates(successes: np.ndarray, trials: np.ndarray, prior_rate: float,
                 prior_trials: float | np.ndarray = SHRINK_TRIALS) -> np.ndarray:
    """[B] each row's posterior mean rate (S_i + w p) / (T_i + w), shrunk towards the batch's
    pooled rate p = (sum S + w0 prior) / (sum T + w0), w = prior_trials (scalar or [B]),
    w0 = POOLED_PRIOR_TRIALS."""
    successes, trials = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    pooled = (successes.sum() + POOLED_PRIOR_TRIALS * prior_rate) / (trials.sum() + POOLED_PRIOR_TRIALS)
    return (successes + prior_trials * pooled) / (trials + prior_trials)


def posterior_rate_samples(successes: np.ndarray, trials: np.ndarray, prior_rate: float,
                           prior_trials: float | np.ndarray = SHRINK_TRIALS,
                           samples: int = RATE_SAMPLES) -> np.ndarray:
    """[J, B] samples of the rows' rates: row i's posterior (mean m_i = shrunk_rates', variance
    m (1 - m) / (T_i + w + 1)) at the stratified normal quantiles (l + 0.5) / J, row i at level
    (i + j) mod J in sample j, so each sample is a whole batch and rows of one posterior spread
    over its quantiles; clipped to [0.005, 0.995]."""
    trials = np.asarray(trials, dtype=np.float64)
    mean = shrunk_rates(successes, trials, prior_rate, prior_trials)  # [B]
    spread = np.sqrt(mean * (1.0 - mean) / (trials + prior_trials + 1.0))  # [B]
    return np.clip(mean[None, :] + spread[None, :] * _stratified_levels(len(mean), samples), 0.005, 0.995)


@functools.lru_cache(maxsize=16)
def _stratified_levels(num_rows: int, samples: int) -> np.ndarray:
    """[J, B] (read-only, cached) the standard normal quantile of row i in sample j."""
    levels = scipy.special.ndtri((np.arange(samples) + 0.5) / samples)  # [J]
    level = levels[(np.arange(num_rows)[None, :] + np.arange(samples)[:, None]) % samples]  # [J, B]
    level.flags.writeable = False
    return level


class FinishRates:
    """Each row's decayed counts of accepted and judged draft tokens, and the posterior samples
    "finish" times a call over (module docstring). prior: the given cold-start rate."""

    def __init__(self, num_rows: int, prior: float):
        self.prior = float(prior)
        self.successes = np.zeros(num_rows)  # [B] decayed accepted draft tokens
        self.trials = np.zeros(num_rows)  # [B] decayed judged draft tokens
        self.trial_steps = np.zeros(num_rows, dtype=np.int64)  # [B] the row's steps with a trial

    def add(self, counts: StepCounts) -> None:
        """Steps since the last decision: older evidence keeps COUNT_DECAY per step with a trial
        and 1 - REVISIT per idle step."""
        keep = COUNT_DECAY ** counts.trial_steps * (1.0 - REVISIT) ** counts.idle_steps  # [B]
        self.successes = keep * self.successes + counts.successes
        self.trials = keep * self.trials + counts.trials
        self.trial_steps += counts.trial_steps

    def reset(self, rows: np.ndarray) -> None:
        """New requests in ``rows``: no evidence of their own."""
        self.successes[rows], self.trials[rows], self.trial_steps[rows] = 0.0, 0.0, 0

    def row_prior_trials(self) -> np.ndarray:
        """[B] the batch's weight in each row's rate: SHRINK_TRIALS aged by COUNT_DECAY per step
        with a trial after GRACE of them, PRIOR_FLOOR at the least."""
        steps = np.maximum(self.trial_steps - GRACE, 0).astype(np.float64)
        return np.maximum(SHRINK_TRIALS * COUNT_DECAY ** steps, PRIOR_FLOOR)

    def samples(self, active: np.ndarray) -> np.ndarray:
        """[J, A] posterior samples of the active rows' rates."""
        return posterior_rate_samples(self.successes, self.trials, self.prior, self.row_prior_trials())[:, active]
