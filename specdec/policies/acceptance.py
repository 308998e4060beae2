"""Online acceptance estimates per request and drafter (SmartSpec, Liu et al. 2024, arXiv
2406.14066, §4: an exponential moving average, 0.85 old / 0.15 new, starting from a prior).

What is estimated. For row r drafting with drafter d, ``rate[r, d]`` is the per-token acceptance
alpha of the i.i.d. model. One step that drafted n tokens and accepted a of them gives a
successes and, if a < n, one failure (positions after the first rejection are not observed). A
step cut short by EOS or the token budget (emitted <= accepted) is censored: its accepted tokens
count as successes and no failure is recorded. ``coverage[r, d]`` is the fraction of asked
steps in which the drafter proposed at least one token (prompt lookup finds no match in some),
which discounts its expected gain.

Expected emitted tokens for k draft tokens (ALGORITHMS.md §1): E[tau](k) = (1 - a^(k+1)) /
(1 - a) (k + 1 when a = 1); with per-position conditional rates a_0, a_1, ...,
E[tau](k) = 1 + sum_{j<k} prod_{i<=j} a_i.

Invariant: every estimate lies in [0, 1] and equals its prior until the (row, drafter) it
describes has been observed; an update reads only ``StepRecord``s (host arrays): O(n x B) numpy
work for n steps (one step: a Python loop over its rows, ``learn_step``), no device
synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..stats import StepRecord

EMA_OLD_WEIGHT = 0.85  # SmartSpec's moving average: 0.85 old, 0.15 new


def expected_emitted(rate, num_draft_tokens):
    """E[tau](k) = (1 - a^(k+1)) / (1 - a) under i.i.d. acceptance a; broadcasts over arrays."""
    rate = np.asarray(rate, dtype=np.float64)
    k = np.asarray(num_draft_tokens, dtype=np.float64)
    near_one = np.isclose(rate, 1.0)
    safe = np.where(near_one, 0.5, rate)
    return np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))


def rate_from_expected_tokens(expected_tokens, grid_points: int = 1001) -> float:
    """The i.i.d. acceptance rate a whose E[tau](s) best matches measured tokens per step
    ``expected_tokens`` {s: tau(s)} (least squares over a grid of a in [0, 1]): a prior for the
    estimator from a short profile."""
    lengths = np.array([int(s) for s in expected_tokens], dtype=np.float64)
    measured = np.array([float(v) for v in expected_tokens.values()])
    if len(lengths) == 0:
        raise ValueError("need measured tokens per step for at least one draft length")
    rates = np.linspace(0.0, 1.0, grid_points)[:, None]  # [R, 1]
    error = ((expected_emitted(rates, lengths[None, :]) - measured[None, :]) ** 2).sum(axis=1)
    return float(rates[np.argmin(error), 0])


def marginal_gains(position_rates: np.ndarray) -> np.ndarray:
    """[..., K] conditional rates -> [..., K] expected tokens the j-th draft token adds,
    prod_{i<=j} a_i (non-increasing in j, since every a_i <= 1)."""
    return np.cumprod(np.clip(position_rates, 0.0, 1.0), axis=-1)


def iid_marginal_gains(rate, max_draft_tokens: int) -> np.ndarray:
    """[...] i.i.d. rates -> [..., K] gains, gain j = a^(j+1) (marginal_gains of K equal rates)."""
    rate = np.clip(np.asarray(rate, dtype=np.float64), 0.0, 1.0)
    return np.multiply.accumulate(np.repeat(rate[..., None], max_draft_tokens, axis=-1), axis=-1)


def iid_cumulative_rows(rates: list[float], coverage: list[float], max_draft_tokens: int) -> list[list[float]]:
    """The cumulative gains [A][K+1] of iid_marginal_gains(rates, K) * coverage[:, None] (as
    goodput_search.cumulative_gains sums them) as lists, in the same float operations: for a
    handful of rows, loops cost less than numpy's fixed cost per call."""
    rows = []
    for rate, share in zip(rates, coverage):
        rate = min(max(rate, 0.0), 1.0)  # np.clip's, NaN and -0.0 included
        power = rate
        total = power * share
        row = [0.0, total]
        for _ in range(1, max_draft_tokens):
            power *= rate
            total += power * share
            row.append(total)
        rows.append(row)
    return rows


def expected_emitted_table(position_rates: np.ndarray) -> np.ndarray:
    """[..., K] conditional rates -> [..., K+1] E[tau](k) for k = 0..K."""
    gains = marginal_gains(np.asarray(position_rates, dtype=np.float64))
    zero = np.zeros(gains.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(gains, axis=-1)], axis=-1)


class StepCounts:
    """Per-row counts of some steps planned with the same lengths (GoodputPolicy: those between
    two decisions): accepted draft tokens (successes), judged draft tokens (trials: successes,
    plus one if a token was rejected), steps with a trial, steps asked to draft, steps in which
    the drafter proposed when asked, and steps the row took part in without being asked."""

    def __init__(self, num_rows: int):
        self.successes = np.zeros(num_rows)  # [B]
        self.trials = np.zeros(num_rows)  # [B]
        self.trial_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.asked_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.proposed_steps = np.zeros(num_rows, dtype=np.int64)  # [B]
        self.idle_steps = np.zeros(num_rows, dtype=np.int64)  # [B]

    def add_steps(self, records: list[StepRecord], asked: np.ndarray) -> None:
        """Steps planned with lengths ``asked`` [B] (after budget caps), at once ([n, B] arrays;
        one step: its rows' [A] arrays). A row that took no part in a step (finished, or not yet
        admitted) counts nothing for it."""
        if len(records) == 1:
            self._add_step(records[0], asked)
            return
        if not records:
            return
        taking_part = np.zeros((len(records), len(self.successes)), dtype=bool)  # [n, B]
        for step, record in enumerate(records):
            taking_part[step, record.rows] = True
        drafted = np.array([r.num_drafted for r in records]) * taking_part  # [n, B] 0 where a row took no part
        accepted = np.minimum(np.array([r.num_accepted for r in records]), drafted) * taking_part
        emitted = np.array([r.num_emitted for r in records])  # [n, B]
        trials = accepted + ((accepted < drafted) & (emitted > accepted))  # a rejection, unless cut short
        asked_row = np.asarray(asked) > 0  # [B]
        took_part = taking_part.sum(axis=0)  # [B]
        self.successes += accepted.sum(axis=0)
        self.trials += trials.sum(axis=0)
        self.trial_steps += (trials > 0).sum(axis=0)
        self.asked_steps += took_part * asked_row
        self.proposed_steps += (drafted > 0).sum(axis=0) * asked_row
        self.idle_steps += took_part * ~asked_row

    def _add_step(self, record: StepRecord, asked: np.ndarray) -> None:
        """add_steps of one step: the same counts, from its rows' [A] arrays."""
        rows = np.asarray(record.rows, dtype=np.int64)  # [A]
        drafted = np.asarray(record.num_drafted)[rows]  # [A]
        accepted = np.minimum(np.asarray(record.num_accepted)[rows], drafted)  # [A]
        trials = accepted + ((accepted < drafted) & (np.asarray(record.num_emitted)[rows] > accepted))  # [A]
        asked_row = np.asarray(asked)[rows] > 0  # [A]
        self.successes[rows] += accepted
        self.trials[rows] += trials
        self.trial_steps[rows] += trials > 0
        self.asked_steps[rows] += asked_row
        self.proposed_steps[rows] += asked_row & (drafted > 0)
        self.idle_steps[rows] += ~asked_row


class AcceptanceEstimator:
    """Acceptance rate and coverage per (row, drafter): exponential moving averages.

    num_rows: rows of the batch; num_drafters: drafters given to it; prior: cold-start rate,
    one number or one per drafter; old_weight: what the old estimate keeps per observed step.
    """

    def __init__(self, num_rows: int, num_drafters: int, prior: float | Sequence[float] = 0.5,
                 old_weight: float = EMA_OLD_WEIGHT):
        if num_drafters < 1:
            raise ValueError("an AcceptanceEstimator needs at least one drafter")
        priors = np.broadcast_to(np.asarray(prior, dtype=np.float64), (num_drafters,)).copy()
        if np.any((priors < 0) | (priors > 1)):
            raise ValueError(f"acceptance priors must lie in [0, 1], got {prior!r}")
        if not 0.0 <= old_weight < 1.0:
            raise ValueError(f"old_weight must lie in [0, 1), got {old_weight!r}")
        self.num_rows, self.num_drafters, self.old_weight = num_rows, num_drafters, float(old_weight)
        self.prior = priors  # [D]
        self._rate = np.broadcast_to(priors[None, :], (num_rows, num_drafters)).copy()  # [B, D]
        self._coverage = np.ones((num_rows, num_drafters))  # [B, D]
        self.observed = np.zeros((num_rows, num_drafters), dtype=np.int64)  # [B, D] steps with a trial

    def rate(self, drafter_index: int) -> np.ndarray:
        """[B] per-token acceptance (the i.i.d. alpha) of each row with drafter ``drafter_index``."""
        return self._rate[:, int(drafter_index)].copy()

    def coverage(self, drafter_index: int) -> np.ndarray:
        """[B] fraction of asked steps in which the drafter proposed at least one token."""
        return self._coverage[:, int(drafter_index)].copy()

    def expected_emitted(self, drafter_index: int, num_draft_tokens) -> np.ndarray:
        """[B] E[tau] of drafting ``num_draft_tokens`` (scalar or [B]), discounted by coverage:
        1 + coverage * (E[tau](k) - 1)."""
        tau = expected_emitted(self.rate(drafter_index), num_draft_tokens)
        return 1.0 + self.coverage(drafter_index) * (tau - 1.0)

    def update(self, record: StepRecord, asked: np.ndarray | None = None) -> None:
        """Learn from one step, each row for the drafter the record says it used. ``asked`` ([B],
        optional): the lengths the policy planned (after budget caps), to track coverage."""
        rows = np.asarray(record.rows, dtype=np.int64)  # [A]
        if len(rows) == 0:
            return
        drafter = np.asarray(record.drafter_index, dtype=np.int64)[rows]  # [A]
        drafted = np.asarray(record.num_drafted, dtype=np.int64)[rows]
        accepted = np.minimum(np.asarray(record.num_accepted, dtype=np.int64)[rows], drafted)
        emitted = np.asarray(record.num_emitted, dtype=np.int64)[rows]
        trials = accepted + ((accepted < drafted) & (emitted > accepted))  # a rejection, unless cut short
        has_trial = trials > 0
        self.observed[rows, drafter] += has_trial
        old, new = self.old_weight, 1.0 - self.old_weight
        rate = self._rate[rows, drafter]
        self._rate[rows, drafter] = np.where(has_trial, old * rate + new * accepted / np.maximum(trials, 1), rate)
        if asked is not None:
            was_asked = np.asarray(asked, dtype=np.int64)[rows] > 0
            coverage = self._coverage[rows, drafter]
            self._coverage[rows, drafter] = np.where(was_asked, old * coverage + new * (drafted > 0), coverage)

    def update_counts(self, counts: StepCounts, drafter_index: int) -> None:
        """Learn from several steps at once: each row's pooled counts enter as one observation of
        weight 1 - 0.85^n, n the steps that observed it (the weight n per-step updates give a
        constant observation; with one step this is the per-step update)."""
        d = int(drafter_index)
        rate, coverage = self._rate[:, d], self._coverage[:, d]  # [B] views
        weight = self.old_weight ** counts.trial_steps  # [B] what the old estimate keeps
        step_rate = counts.successes / np.maximum(counts.trials, 1)
        np.copyto(rate, weight * rate + (1.0 - weight) * step_rate, where=counts.trial_steps > 0)
        weight = self.old_weight ** counts.asked_steps
        proposed = counts.proposed_steps / np.maximum(counts.asked_steps, 1)
        np.copyto(coverage, weight * coverage + (1.0 - weight) * proposed, where=counts.asked_steps > 0)
        self.observed[:, d] += counts.trial_steps

    def learn_step(self, record: StepRecord, asked, drafter_index: int, idle_weight: float) -> tuple[int, int]:
        """One step's lesson for drafter ``drafter_index``, planned with lengths ``asked`` [B] (a
        list or an array): what update_counts of its StepCounts (add_steps([record], asked)) and
        then relax(its rows not asked, ``idle_weight``) learn, in the same float operations, row
        by row (for a handful of rows, cheaper than numpy's fixed cost per call). Returns the
        step's accepted and judged draft tokens."""
        d = int(drafter_index)
        rows = np.asarray(record.rows, dtype=np.int64).tolist()  # [A]
        drafted, accepted, emitted = (np.asarray(x).tolist() for x in (record.num_drafted, record.num_accepted,
                                                                        record.num_emitted))  # [B] each
        rate, coverage = self._rate[:, d], self._coverage[:, d]  # [B] views
        rates, coverages = rate.tolist(), coverage.tolist()  # [B]
        weight = self.old_weight ** 1  # what the old estimate keeps of one observation (update_counts' power)
        goal = float(self.prior[d])
        successes = trials = 0
        observed = []  # rows with a trial
        for row in rows:
            row_drafted = drafted[row]
            row_accepted = min(accepted[row], row_drafted)
            row_trials = row_accepted + (row_accepted < row_drafted and emitted[row] > row_accepted)
            successes, trials = successes + row_accepted, trials + row_trials
            if row_trials > 0:
                rates[row] = weight * rates[row] + (1.0 - weight) * (row_accepted / row_trials)
                observed.append(row)
            if asked[row] > 0:
                coverages[row] = weight * coverages[row] + (1.0 - weight) * float(row_drafted > 0)
            else:
                rates[row] += idle_weight * (goal - rates[row])
                coverages[row] += idle_weight * (1.0 - coverages[row])
        rate[rows] = [rates[row] for row in rows]
        coverage[rows] = [coverages[row] for row in rows]
        if observed:
            self.observed[observed, d] += 1
        return successes, trials

    def relax(self, rows: np.ndarray, drafter_index: int, weight, target: float | None = None) -> None:
        """Move the estimates of ``rows`` for one drafter ``weight`` (one number or [R]) of the way
        to ``target`` (default: the drafter's prior), coverage towards 1; n steps of weight w
        compose to one of 1 - (1 - w)^n. A row that stopped drafting gets no evidence, so without
        this a run of rejections would keep it off for good."""
        rows = np.asarray(rows, dtype=np.int64)
        weight = np.asarray(weight, dtype=np.float64)
        if len(rows) == 0 or (weight <= 0).all():
            return
        d = int(drafter_index)
        goal = self.prior[d] if target is None else float(target)
        if not 0.0 <= goal <= 1.0:
            raise ValueError(f"an acceptance rate to relax to must lie in [0, 1], got {target!r}")
        self._rate[rows, d] += weight * (goal - self._rate[rows, d])
        self._coverage[rows, d] += weight * (1.0 - self._coverage[rows, d])
