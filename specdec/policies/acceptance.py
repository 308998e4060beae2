"""Online acceptance estimates, per request, per drafter and per draft position, shared by the
adaptive policies (SmartSpec, Liu et al. 2024, arXiv 2406.14066, §4: an exponential moving
average 0.85 old / 0.15 new, or a window of the last 100 steps, starting from 0.5).

What is estimated. For row r drafting with drafter d, ``position_rates[r, d, i]`` is the
probability that draft token i is accepted *given that tokens 0..i-1 were* (the conditional
rate), and ``rate[r, d]`` pools those trials over positions (the alpha of the i.i.d. model).
One step that drafted n tokens and accepted a of them is one Bernoulli trial at each position
0..min(a, n-1): a successes, then one failure if a < n; positions after the first rejection are
not observed. A step cut short by EOS or the token budget (emitted <= accepted) is censored: its
accepted tokens count as successes and no failure is recorded. ``coverage[r, d]`` is the
fraction of steps in which the drafter proposed at least one token when asked (prompt lookup
finds no match in some), which discounts its expected gain.

Invariant: every estimate lies in [0, 1] and equals its prior until the (row, drafter, position)
it describes has been observed; an update reads only a ``StepRecord`` (host arrays), so it costs
O(B x K) numpy work per step and no device synchronisation.

Expected emitted tokens for k draft tokens (ALGORITHMS.md §1): with i.i.d. acceptance alpha,
E[tau](k) = (1 - alpha^(k+1)) / (1 - alpha) (k + 1 when alpha = 1); with per-position
conditional rates a_0, a_1, ..., E[tau](k) = 1 + sum_{j<k} prod_{i<=j} a_i.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..stats import StepRecord

EMA_OLD_WEIGHT = 0.85  # SmartSpec's moving average: 0.85 old, 0.15 new
DEFAULT_WINDOW = 100  # steps kept by the window estimator


def expected_emitted(rate, num_draft_tokens):
    """E[tau](k) = (1 - a^(k+1)) / (1 - a) under i.i.d. acceptance a; broadcasts over arrays."""
    rate = np.asarray(rate, dtype=np.float64)
    k = np.asarray(num_draft_tokens, dtype=np.float64)
    near_one = np.isclose(rate, 1.0)
    safe = np.where(near_one, 0.5, rate)
    return np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))


def rate_from_expected_tokens(expected_tokens, grid_points: int = 1001) -> float:
    """The i.i.d. acceptance rate a whose E[tau](s) = (1 - a^(s+1)) / (1 - a) best matches
    measured tokens per step ``expected_tokens`` {s: tau(s)} (least squares over a grid of a in
    [0, 1]): a prior for the estimators from a short profile."""
    lengths = np.array([int(s) for s in expected_tokens], dtype=np.float64)
    measured = np.array([float(v) for v in expected_tokens.values()])
    if len(lengths) == 0:
        raise ValueError("need measured tokens per step for at least one draft length")
    rates = np.linspace(0.0, 1.0, grid_points)[:, None]  # [R, 1]
    error = ((expected_emitted(rates, lengths[None, :]) - measured[None, :]) ** 2).sum(axis=1)
    return float(rates[np.argmin(error), 0])


def rate_matching_tokens(steps_by_length, tokens_by_length, grid_points: int = 1025) -> float:
    """The i.i.d. acceptance rate a with sum_s n_s E[tau](s) = sum_s t_s (E[tau] grows with a:
    the crossing on a grid of ``grid_points`` rates in [0, 1], interpolated linearly between its
    neighbours; one vectorised pass, not a bisection of scalar calls): n_s row-steps that
    drafted s tokens (index s), t_s the tokens they emitted. Pooled over rows of different
    rates, it predicts the batch's tokens per step at the lengths drafted, where accepted over
    judged tokens reads high: rows that accept long runs judge more tokens per step and weigh
    more. 0 steps: NaN; tokens beyond what a = 0 or 1 gives: 0 or 1."""
    steps = np.asarray(steps_by_length, dtype=np.float64)  # [S]
    target = float(np.sum(tokens_by_length))
    if steps.sum() <= 0:
        return float("nan")
    rates, table = _expected_emitted_grid(grid_points, len(steps))  # [G], [G, S]
    predicted = table @ steps  # [G] non-decreasing in a
    above = int(np.searchsorted(predicted, target, side="left"))
    if above == 0:
        return 0.0
    if above >= grid_points:
        return 1.0
    low, high = predicted[above - 1], predicted[above]
    fraction = (target - low) / (high - low) if high > low else 0.0
    return float(rates[above - 1] + fraction * (rates[above] - rates[above - 1]))


@functools.lru_cache(maxsize=16)
def _expected_emitted_grid(grid_points: int, num_lengths: int) -> tuple[np.ndarray, np.ndarray]:
    """rate_matching_tokens' grid of rates [G] in [0, 1] and E[tau](s) at each [G, S] for s = 0..S-1
    (read-only, cached: the same at every call)."""
    rates = np.linspace(0.0, 1.0, grid_points)  # [G]
    table = expected_emitted(rates[:, None], np.arange(num_lengths)[None, :])  # [G, S]
    rates.flags.writeable = table.flags.writeable = False
    return rates, table


def add_padded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b for 1-D arrays of different lengths, the shorter padded with zeros (counts by draft length)."""
    out = np.zeros(max(len(a), len(b)), dtype=np.result_type(a, b, np.float64))
    out[: len(a)] += a
    out[: len(b)] += b
    return out


def _is_one_index(index) -> bool:
    """Whether ``index`` is one integer (one drafter for every row) rather than one per row."""
    return isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_))


def marginal_gains(position_rates: np.ndarray) -> np.ndarray:
    """[..., K] conditional rates -> [..., K] expected tokens the j-th draft token adds,
    prod_{i<=j} a_i (non-increasing in j, since every a_i <= 1)."""
    return np.cumprod(np.clip(position_rates, 0.0, 1.0), axis=-1)


def iid_marginal_gains(rate, max_draft_tokens: int) -> np.ndarray:
    """marginal_gains(iid_rates(rate, K)) without repeating the rates: [...] -> [..., K], gain j
    = a^(j+1), multiplied out position by position (the products np.cumprod forms, in its order)."""
    rate = np.clip(np.asarray(rate, dtype=np.float64), 0.0, 1.0)
    gains = np.empty((max_draft_tokens,) + rate.shape)  # [K, ...]: each position's gains in one block
    if max_draft_tokens:
        gains[0] = rate
    for position in range(1, max_draft_tokens):
        np.multiply(gains[position - 1], rate, out=gains[position])
    return gains.transpose(tuple(range(1, gains.ndim)) + (0,))  # [..., K]


def expected_emitted_table(position_rates: np.ndarray) -> np.ndarray:
    """[..., K] conditional rates -> [..., K+1] E[tau](k) for k = 0..K:
    1 + sum_{j<k} prod_{i<=j} a_i."""
    gains = marginal_gains(np.asarray(position_rates, dtype=np.float64))
    zero = np.zeros(gains.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(gains, axis=-1)], axis=-1)


def iid_rates(rate, max_draft_tokens: int) -> np.ndarray:
    """The per-position view of an i.i.d. rate: [...] -> [..., K] with every a_i = rate."""
    rate = np.asarray(rate, dtype=np.float64)
    return np.repeat(rate[..., None], max_draft_tokens, axis=-1)


class AcceptanceEstimator:
    """Acceptance rates per (row, drafter, position), updated from StepRecords.

    num_rows: requests of the generate() call; num_drafters: drafters given to it;
    max_draft_tokens: positions tracked; prior: cold-start rate, one number or one per drafter;
    mode: "ema" (old * 0.85 + step * 0.15 for every observed quantity) or "window" (ratio of
    successes to trials over the last ``window`` steps in which that row used that drafter);
    positions: track the per-position rates (EMA mode; False keeps only the pooled rate, which
    halves the update's cost, and ``position_rates`` repeats the pooled rate; the window mode
    always tracks them).
    """

    def __init__(self, num_rows: int, num_drafters: int, max_draft_tokens: int,
                 prior: float | Sequence[float] = 0.5, mode: str = "ema", window: int = DEFAULT_WINDOW,
                 old_weight: float = EMA_OLD_WEIGHT, positions: bool = True):
        if mode not in ("ema", "window"):
            raise ValueError(f"mode must be 'ema' or 'window', got {mode!r}")
        if num_drafters < 1 or max_draft_tokens < 1:
            raise ValueError("an AcceptanceEstimator needs at least one drafter and one draft position")
        priors = np.broadcast_to(np.asarray(prior, dtype=np.float64), (num_drafters,)).copy()
        if np.any((priors < 0) | (priors > 1)):
            raise ValueError(f"acceptance priors must lie in [0, 1], got {prior!r}")
        if not 0.0 <= old_weight < 1.0:
            raise ValueError(f"old_weight must lie in [0, 1), got {old_weight!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.num_rows, self.num_drafters, self.max_draft_tokens = num_rows, num_drafters, max_draft_tokens
        self.mode, self.window, self.old_weight = mode, window, old_weight
        self.positions = bool(positions) or mode == "window"
        self.prior = priors  # [D]
        shape = (num_rows, num_drafters)
        if mode == "ema":
            self._position = np.broadcast_to(priors[None, :, None], shape + (max_draft_tokens,)).copy()  # [B, D, K]
            self._rate = np.broadcast_to(priors[None, :], shape).copy()  # [B, D]
            self._coverage = np.ones(shape)  # [B, D]
        else:
            self._slot = np.zeros(shape, dtype=np.int64)  # [B, D] next ring slot
            self._filled = np.zeros(shape, dtype=np.int64)  # [B, D] entries held (<= window)
            self._successes = np.zeros(shape + (window, max_draft_tokens))  # [B, D, W, K]
            self._trials = np.zeros(shape + (window, max_draft_tokens))  # [B, D, W, K]
            self._asked = np.zeros(shape + (window,))  # [B, D, W] 1 where the step asked the drafter
            self._proposed = np.zeros(shape + (window,))  # [B, D, W] 1 where it proposed something
        self.observed = np.zeros(shape, dtype=np.int64)  # [B, D] steps with at least one trial

    # --- reading -------------------------------------------------------------------------
    def position_rates(self, drafter_index) -> np.ndarray:
        """[B, K] conditional acceptance per position, for each row's drafter
        (``drafter_index``: one index for all rows or [B])."""
        d = np.broadcast_to(np.asarray(drafter_index, dtype=np.int64), (self.num_rows,))
        rows = np.arange(self.num_rows)
        if self.mode == "ema":
            return self._position[rows, d].copy() if self.positions else iid_rates(self._rate[rows, d], self.max_draft_tokens)
        successes = self._successes[rows, d].sum(axis=1)  # [B, K]
        trials = self._trials[rows, d].sum(axis=1)
        return np.where(trials > 0, successes / np.maximum(trials, 1), self.prior[d][:, None])

    def rate(self, drafter_index) -> np.ndarray:
        """[B] pooled per-token acceptance (the i.i.d. alpha) for each row's drafter."""
        if self.mode == "ema" and _is_one_index(drafter_index):
            return self._rate[:, drafter_index].copy()
        d = np.broadcast_to(np.asarray(drafter_index, dtype=np.int64), (self.num_rows,))
        rows = np.arange(self.num_rows)
        if self.mode == "ema":
            return self._rate[rows, d].copy()
        successes = self._successes[rows, d].sum(axis=(1, 2))
        trials = self._trials[rows, d].sum(axis=(1, 2))
        return np.where(trials > 0, successes / np.maximum(trials, 1), self.prior[d])

    def coverage(self, drafter_index) -> np.ndarray:
        """[B] fraction of asked steps in which the row's drafter proposed at least one token."""
        if self.mode == "ema" and _is_one_index(drafter_index):
            return self._coverage[:, drafter_index].copy()
        d = np.broadcast_to(np.asarray(drafter_index, dtype=np.int64), (self.num_rows,))
        rows = np.arange(self.num_rows)
        if self.mode == "ema":
            return self._coverage[rows, d].copy()
        asked = self._asked[rows, d].sum(axis=1)
        return np.where(asked > 0, self._proposed[rows, d].sum(axis=1) / np.maximum(asked, 1), 1.0)

    def expected_emitted(self, drafter_index, num_draft_tokens, per_position: bool = False) -> np.ndarray:
        """[B] E[tau] of drafting ``num_draft_tokens`` (scalar or [B]) with each row's drafter,
        discounted by its coverage: 1 + coverage * (E[tau](k) - 1)."""
        k = np.broadcast_to(np.asarray(num_draft_tokens, dtype=np.int64), (self.num_rows,))
        if per_position:
            table = expected_emitted_table(self.position_rates(drafter_index))  # [B, K+1]
            tau = table[np.arange(self.num_rows), np.minimum(k, self.max_draft_tokens)]
        else:
            tau = expected_emitted(self.rate(drafter_index), k)
        return 1.0 + self.coverage(drafter_index) * (tau - 1.0)

    # --- learning ------------------------------------------------------------------------
    def update(self, record: StepRecord, asked: np.ndarray | None = None) -> None:
        """Learn from one step. ``asked`` ([B], optional): the draft lengths the policy planned
        (after the row's budget cap), to track coverage; without it coverage stays as it is."""
        rows = np.asarray(record.rows, dtype=np.int64)
        if len(rows) == 0:
            return
        drafter = np.asarray(record.drafter_index, dtype=np.int64)[rows]
        drafted = np.asarray(record.num_drafted, dtype=np.int64)[rows]
        accepted = np.minimum(np.asarray(record.num_accepted, dtype=np.int64)[rows], drafted)
        emitted = np.asarray(record.num_emitted, dtype=np.int64)[rows]
        drafted = np.minimum(drafted, self.max_draft_tokens)
        accepted = np.minimum(accepted, drafted)
        rejected = (accepted < drafted) & (emitted > accepted)  # a real rejection, not a cut-short step
        was_asked = None
        if asked is not None:
            was_asked = np.asarray(asked, dtype=np.int64)[rows] > 0
        if not self.positions:  # pooled counts only: accepted successes, one failure if rejected
            trials = accepted + rejected  # [A]
            has_trial = trials > 0
            self.observed[rows, drafter] += has_trial
            self._update_ema_pooled(rows, drafter, accepted / np.maximum(trials, 1), has_trial, was_asked, drafted)
            return
        position = np.arange(self.max_draft_tokens)
        success = (position[None, :] < accepted[:, None]).astype(np.float64)  # [A, K]
        trial = success + ((position[None, :] == accepted[:, None]) & rejected[:, None])  # [A, K]
        has_trial = trial.sum(axis=1) > 0  # [A]
        self.observed[rows, drafter] += has_trial
        if self.mode == "ema":
            self._position[rows, drafter] = np.where(trial > 0, self.old_weight * self._position[rows, drafter]
                                                     + (1.0 - self.old_weight) * success, self._position[rows, drafter])
            step_rate = success.sum(axis=1) / np.maximum(trial.sum(axis=1), 1)  # [A]
            self._update_ema_pooled(rows, drafter, step_rate, has_trial, was_asked, drafted)
        else:
            self._update_window(rows, drafter, success, trial, has_trial, was_asked, drafted)

    def _update_ema_pooled(self, rows, drafter, step_rate, has_trial, was_asked, drafted) -> None:
        """The pooled rate and the coverage: old * 0.85 + this step * 0.15 where observed."""
        old, new = self.old_weight, 1.0 - self.old_weight
        current_rate = self._rate[rows, drafter]
        self._rate[rows, drafter] = np.where(has_trial, old * current_rate + new * step_rate, current_rate)
        if was_asked is not None:
            current_cov = self._coverage[rows, drafter]
            proposed = (drafted > 0).astype(np.float64)
            self._coverage[rows, drafter] = np.where(was_asked, old * current_cov + new * proposed, current_cov)

    def _update_window(self, rows, drafter, success, trial, has_trial, was_asked, drafted) -> None:
        counted = has_trial if was_asked is None else (has_trial | was_asked)
        rows, drafter = rows[counted], drafter[counted]
        slot = self._slot[rows, drafter]
        self._successes[rows, drafter, slot] = success[counted]
        self._trials[rows, drafter, slot] = trial[counted]
        if was_asked is not None:
            self._asked[rows, drafter, slot] = was_asked[counted]
            self._proposed[rows, drafter, slot] = was_asked[counted] & (drafted[counted] > 0)
        else:
            self._asked[rows, drafter, slot] = 0.0
            self._proposed[rows, drafter, slot] = 0.0
        self._slot[rows, drafter] = (slot + 1) % self.window
        self._filled[rows, drafter] = np.minimum(self._filled[rows, drafter] + 1, self.window)

    def update_counts(self, counts: "StepCounts", drafter_index: int) -> None:
        """Learn from several steps at once (EMA mode, pooled rate only): for each row, the
        steps' pooled counts enter as one observation of weight 1 - 0.85^n, n the steps that
        observed it, the same weight n per-step updates would give a constant observation; with
        one step in ``counts`` this is exactly ``update``. Relaxation of the rows' idle steps
        (``relax`` with ``revisit``) is the caller's, as after ``update``."""
        if self.mode != "ema" or self.positions:
            raise ValueError("update_counts needs the EMA estimator without per-position rates (positions=False)")
        d = int(drafter_index)
        observed = counts.trial_steps > 0  # [B]
        weight = self.old_weight ** counts.trial_steps  # [B] what the old estimate keeps
        step_rate = counts.successes / np.maximum(counts.trials, 1)
        self._rate[:, d] = np.where(observed, weight * self._rate[:, d] + (1.0 - weight) * step_rate, self._rate[:, d])
        asked = counts.asked_steps > 0
        weight = self.old_weight ** counts.asked_steps
        proposed = counts.proposed_steps / np.maximum(counts.asked_steps, 1)
        self._coverage[:, d] = np.where(asked, weight * self._coverage[:, d] + (1.0 - weight) * proposed, self._coverage[:, d])
        self.observed[:, d] += counts.trial_steps

    # --- forgetting ----------------------------------------------------------------------
    def relax(self, rows: np.ndarray, drafter_index: int, weight: float | np.ndarray) -> None:
        """Move the estimates of ``rows`` for one drafter ``weight`` of the way back to the prior
        (a row that has stopped drafting gets no new evidence; without this, a run of rejections
        would keep it from drafting for good). EMA: a convex step towards the prior (coverage
        towards 1), ``weight`` one number or one per row (n steps of weight w compose to one of
        1 - (1 - w)^n); window: the oldest max(1, round(weight * window)) entries it holds are
        forgotten (a window not yet full holds fewer than ``window``), so an emptied window reads
        the prior."""
        rows = np.asarray(rows, dtype=np.int64)
        weight = np.asarray(weight, dtype=np.float64)
        if len(rows) == 0 or (weight <= 0).all():
            return
        if self.mode == "window" and weight.ndim:
            raise ValueError("the window estimator relaxes every row by one weight")
        d = int(drafter_index)
        prior = self.prior[d]
        if self.mode == "ema":
            if self.positions:
                self._position[rows, d] += weight * (prior - self._position[rows, d])
            self._rate[rows, d] += weight * (prior - self._rate[rows, d])
            self._coverage[rows, d] += weight * (1.0 - self._coverage[rows, d])
            return
        count = min(max(1, round(float(weight) * self.window)), self.window)
        forget = np.minimum(self._filled[rows, d], count)  # [A] entries each row forgets
        first = self._slot[rows, d] - self._filled[rows, d]  # [A] its oldest entry's slot (mod W)
        which = np.arange(count)[None, :] < forget[:, None]  # [A, count]
        held_rows = np.broadcast_to(rows[:, None], which.shape)[which]
        slots = ((first[:, None] + np.arange(count)[None, :]) % self.window)[which]
        for table in (self._successes, self._trials, self._asked, self._proposed):
            table[held_rows, d, slots] = 0.0
        self._filled[rows, d] -= forget


class StepCounts:
    """Per-row counts of some steps (GoodputPolicy: those between two decisions, counted at the
    second): accepted draft tokens (successes), judged draft tokens (trials: successes, plus one
    if a token was rejected), steps with a trial, steps asked to draft, steps in which the drafter
    proposed when asked, and steps not asked to draft; pooled over rows, by draft length, the
    row-steps judged to the end and the tokens they emitted (rate_matching_tokens)."""

    def __init__(self, num_rows: int):
        self.successes = np.zeros(num_rows)  # [B]
        self.trials = np.zeros(num_rows)  # [B]
        self.trial_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.asked_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.proposed_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.idle_steps = np.zeros(num_rows, dtype=np.int64)  # [B] steps the row took part in without being asked
        self.length_steps = np.zeros(1)  # [S] row-steps, pooled over rows, that drafted s tokens and were not cut short
        self.length_tokens = np.zeros(1)  # [S] the tokens those row-steps emitted
        self.steps = 0

    def add(self, record: StepRecord, asked: np.ndarray) -> None:
        """One step; asked: [B] the lengths the policy planned (after budget caps). The same
        counting rules as AcceptanceEstimator.update (a step cut short is censored)."""
        self.add_steps([record], asked)

    def add_steps(self, records: list[StepRecord], asked: np.ndarray) -> None:
        """Several steps planned with the same lengths ``asked`` [B], at once ([n, B] arrays).
        A row that took no part in a step (finished) counts nothing for it."""
        rows = [np.asarray(record.rows, dtype=np.int64) for record in records]  # each step's [A]
        taking_part = np.zeros((len(records), len(self.successes)), dtype=bool)  # [n, B]
        taking_part[np.repeat(np.arange(len(records)), [len(r) for r in rows]), np.concatenate(rows)] = True
        # np.array of the steps' [B] arrays is np.stack's [n, B], without its per-array checks
        drafted = np.where(taking_part, np.array([r.num_drafted for r in records]), 0)  # [n, B]
        accepted = np.where(taking_part, np.minimum(np.array([r.num_accepted for r in records]), drafted), 0)
        emitted = np.array([r.num_emitted for r in records])  # [n, B]
        rejected = (accepted < drafted) & (emitted > accepted)  # a real rejection, not a cut-short step
        trials = accepted + rejected  # [n, B]
        proposing = drafted > 0  # [n, B] (drafted is 0 where the row took no part)
        # a row asked to draft was asked in every step it took part in, or in none
        asked_row = np.asarray(asked) > 0  # [B]
        took_part = taking_part.sum(axis=0)  # [B] steps
        self.successes += accepted.sum(axis=0)
        self.trials += trials.sum(axis=0)
        self.trial_steps += (trials > 0).sum(axis=0)
        self.asked_steps += np.where(asked_row, took_part, 0)
        self.proposed_steps += np.where(asked_row, proposing.sum(axis=0), 0)
        self.idle_steps += np.where(asked_row, 0, took_part)
        whole = proposing & (emitted == accepted + 1)  # [n, B] judged to the end
        if whole.any():
            lengths = drafted[whole]  # [W] each such row-step's draft length
            self.length_steps = add_padded(self.length_steps, np.bincount(lengths))
            self.length_tokens = add_padded(self.length_tokens, np.bincount(lengths, weights=emitted[whole].astype(np.float64)))
        self.steps += len(records)


class RowRateSpread:
    """How much requests' acceptance rates differ, learnt from the rows of earlier generate()
    calls (empirical Bayes, method of moments): each finished row that judged at least
    MIN_ROW_TRIALS draft tokens adds its rate r = accepted / judged and its trials t; over the
    last ``capacity`` such rows, the between-row variance is the variance of the r's less their
    mean sampling variance r (1 - r) / t. As a Beta prior of that variance around mean m, a
    row's rate is worth w = m (1 - m) / v - 1 judged tokens of the batch's rate
    (``prior_strength``): the shrinkage a row's own evidence must outweigh.

    Invariant: prior_strength is None until MIN_ROWS rows are held, and lies in
    [MIN_STRENGTH, MAX_STRENGTH] after."""

    MIN_ROW_TRIALS = 8
    MIN_ROWS = 8
    MIN_STRENGTH, MAX_STRENGTH = 2.0, 1000.0

    def __init__(self, capacity: int = 256):
        if capacity < self.MIN_ROWS:
            raise ValueError(f"capacity must be at least {self.MIN_ROWS} rows, got {capacity!r}")
        self._rates: deque[float] = deque(maxlen=capacity)
        self._trials: deque[float] = deque(maxlen=capacity)
        self._strength: float | None = None  # prior_strength, computed once per add_rows
        self._stale = False

    def __len__(self) -> int:
        return len(self._rates)

    def add_rows(self, successes: np.ndarray, trials: np.ndarray) -> None:
        """One call's rows: [B] accepted and judged draft tokens of each (rows that judged fewer
        than MIN_ROW_TRIALS are left out: their rate is mostly noise)."""
        successes, trials = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
        kept = trials >= self.MIN_ROW_TRIALS  # [B]
        self._rates.extend((successes[kept] / trials[kept]).tolist())
        self._trials.extend(trials[kept].tolist())
        self._stale = self._stale or bool(kept.any())

    def between_row_variance(self) -> float:
        """The variance of the rows' true rates (observed variance less sampling variance; >= 0);
        NaN until MIN_ROWS rows are held."""
        if len(self._rates) < self.MIN_ROWS:
            return float("nan")
        rates, trials = np.array(self._rates), np.array(self._trials)  # [R]
        sampling = float(np.mean(rates * (1.0 - rates) / trials))
        return max(float(np.var(rates, ddof=1)) - sampling, 0.0)

    def prior_strength(self) -> float | None:
        """w = m (1 - m) / v - 1 (clipped), the Beta prior's weight in judged tokens; None until
        MIN_ROWS rows are held."""
        if self._stale:
            self._strength, self._stale = self._estimate_strength(), False
        return self._strength

    def _estimate_strength(self) -> float | None:
        variance = self.between_row_variance()
        if not variance == variance:  # NaN
            return None
        mean = float(np.mean(self._rates))
        if variance <= 0:
            return self.MAX_STRENGTH
        return float(np.clip(mean * (1.0 - mean) / variance - 1.0, self.MIN_STRENGTH, self.MAX_STRENGTH))
