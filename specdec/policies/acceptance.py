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
work for n steps, no device synchronisation.
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
    """[...] i.i.d. rates -> [..., K] gains, gain j = a^(j+1)."""
    rate = np.clip(np.asarray(rate, dtype=np.float64), 0.0, 1.0)
    return marginal_gains(np.repeat(rate[..., None], max_draft_tokens, axis=-1))


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
        """Steps planned with lengths ``asked`` [B] (after budget caps), at once ([n, B] arrays).
        A row that took no part in a step (finished, or not yet admitted) counts nothing for it."""
        if not records:
            return
        rows = [np.asarray(record.rows, dtype=np.int64) for record in records]  # each step's [A]
        taking_part = np.zeros((len(records), len(self.successes)), dtype=bool)  # [n, B]
        taking_part[np.repeat(np.arange(len(records)), [len(r) for r in rows]), np.concatenate(rows)] = True
        drafted = np.where(taking_part, np.array([r.num_drafted for r in records]), 0)  # [n, B]
        accepted = np.where(taking_part, np.minimum(np.array([r.num_accepted for r in records]), drafted), 0)
        emitted = np.array([r.num_emitted for r in records])  # [n, B]
        rejected = (accepted < drafted) & (emitted > accepted)  # a real rejection, not a cut-short step
        trials = accepted + rejected  # [n, B]
        asked_row = np.asarray(asked) > 0  # [B]
        took_part = taking_part.sum(axis=0)  # [B]
        self.successes += accepted.sum(axis=0)
        self.trials += trials.sum(axis=0)
        self.trial_steps += (trials > 0).sum(axis=0)
        self.asked_steps += np.where(asked_row, took_part, 0)
        self.proposed_steps += np.where(asked_row, (drafted > 0).sum(axis=0), 0)
        self.idle_steps += np.where(asked_row, 0, took_part)


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
        observed = counts.trial_steps > 0  # [B]
        weight = self.old_weight ** counts.trial_steps  # [B] what the old estimate keeps
        step_rate = counts.successes / np.maximum(counts.trials, 1)
        self._rate[:, d] = np.where(observed, weight * self._rate[:, d] + (1.0 - weight) * step_rate, self._rate[:, d])
        asked = counts.asked_steps > 0
        weight = self.old_weight ** counts.asked_steps
        proposed = counts.proposed_steps / np.maximum(counts.asked_steps, 1)
        self._coverage[:, d] = np.where(asked, weight * self._coverage[:, d] + (1.0 - weight) * proposed,
                                        self._coverage[:, d])
        self.observed[:, d] += counts.trial_steps

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
