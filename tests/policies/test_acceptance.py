"""Acceptance estimates: the expected-tokens formulas (table tests) and the online estimator's
updates from StepRecords (EMA 0.85/0.15), with censoring, coverage and relaxation."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.policies.acceptance import (
    AcceptanceEstimator,
    expected_emitted,
    expected_emitted_table,
    marginal_gains,
)
from specdec.stats import StepRecord
from specdec.types import VerifyCost


def record(drafted, accepted, emitted=None, drafter=None, rows=None):
    drafted = np.asarray(drafted)
    accepted = np.asarray(accepted)
    emitted = accepted + 1 if emitted is None else np.asarray(emitted)
    num_rows = len(drafted)
    return StepRecord(
        step=0, rows=np.arange(num_rows) if rows is None else np.asarray(rows),
        drafter_index=np.zeros(num_rows, dtype=np.int64) if drafter is None else np.asarray(drafter),
        num_drafted=drafted, num_accepted=accepted, num_emitted=emitted,
        draft_time_s=0.0, verify_time_s=0.0, cost=VerifyCost(0, 0),
    )


@pytest.mark.parametrize("rate,k,expected", [
    (0.5, 0, 1.0),
    (0.5, 1, 1.5),
    (0.5, 3, 1.875),
    (0.8, 4, (1 - 0.8 ** 5) / 0.2),
    (1.0, 4, 5.0),
    (0.0, 6, 1.0),
])
def test_expected_emitted_iid(rate, k, expected):
    assert expected_emitted(rate, k) == pytest.approx(expected)


def test_expected_emitted_per_position_equals_iid_when_rates_are_equal():
    table = expected_emitted_table(np.full((2, 5), 0.7))
    assert np.allclose(table, expected_emitted(0.7, np.arange(6))[None, :])


@pytest.mark.parametrize("rates,expected", [
    ([0.9, 0.5, 0.0], [1.0, 1.9, 2.35, 2.35]),
    ([1.0, 1.0], [1.0, 2.0, 3.0]),
    ([0.0, 1.0], [1.0, 1.0, 1.0]),
])
def test_expected_emitted_per_position(rates, expected):
    assert np.allclose(expected_emitted_table(np.array(rates)), expected)


def test_marginal_gains_never_increase():
    rates = np.random.default_rng(0).uniform(0, 1, size=(50, 8))
    assert np.all(np.diff(marginal_gains(rates), axis=1) <= 0)


def test_counts_of_one_step_learn_exactly_what_the_step_update_learns():
    """StepCounts + update_counts, one step at a time, equals update step by step; several steps
    that each observe the same thing equal as many step updates (weight 1 - 0.85^n)."""
    from specdec.policies.acceptance import StepCounts

    generator = np.random.default_rng(5)
    by_step = AcceptanceEstimator(num_rows=5, num_drafters=1, prior=0.6)
    by_counts = AcceptanceEstimator(num_rows=5, num_drafters=1, prior=0.6)
    for _ in range(30):
        asked = generator.integers(0, 5, size=5)
        drafted = np.where(generator.random(5) < 0.8, asked, 0)
        accepted = np.array([generator.integers(0, d + 1) for d in drafted])
        emitted = np.where(generator.random(5) < 0.1, accepted, accepted + 1)
        step = record(drafted, accepted, emitted, rows=np.flatnonzero(generator.random(5) < 0.9))
        by_step.update(step, asked=asked)
        counts = StepCounts(5)
        counts.add_steps([step], asked)
        by_counts.update_counts(counts, 0)
        assert np.allclose(by_counts.rate(0), by_step.rate(0)) and np.allclose(by_counts.coverage(0), by_step.coverage(0))
    same, counts = record(drafted=[4, 2], accepted=[1, 2]), StepCounts(2)
    for _ in range(3):
        counts.add_steps([same], np.array([4, 2]))
    steps = AcceptanceEstimator(num_rows=2, num_drafters=1, prior=0.6)
    at_once = AcceptanceEstimator(num_rows=2, num_drafters=1, prior=0.6)
    for _ in range(3):
        steps.update(same, asked=np.array([4, 2]))
    at_once.update_counts(counts, 0)
    assert np.allclose(at_once.rate(0), steps.rate(0)) and not np.allclose(at_once.rate(0), 0.6)


def test_one_step_learnt_row_by_row_is_the_counts_update_to_the_bit():
    """learn_step (Python floats, row by row) learns what StepCounts.add_steps([step]) with
    update_counts and relax of the rows not asked learn, bit for bit; add_steps of several steps
    counts what adding each does."""
    from specdec.policies.acceptance import StepCounts
    from specdec.policies.finish import REVISIT

    generator = np.random.default_rng(9)
    for _ in range(40):
        num_rows = int(generator.integers(1, 20))
        by_counts = AcceptanceEstimator(num_rows=num_rows, num_drafters=2, prior=[0.6, 0.3])
        by_rows = AcceptanceEstimator(num_rows=num_rows, num_drafters=2, prior=[0.6, 0.3])
        steps, each = [], StepCounts(num_rows)
        asked = generator.integers(0, 5, size=num_rows) * (generator.random(num_rows) < 0.7)
        for _ in range(20):
            drafted = np.where(generator.random(num_rows) < 0.8, asked, 0)
            accepted = np.array([generator.integers(0, d + 1) for d in drafted])
            emitted = np.where(generator.random(num_rows) < 0.1, accepted, accepted + 1)
            step = record(drafted, accepted, emitted, rows=np.flatnonzero(generator.random(num_rows) < 0.8))
            counts = StepCounts(num_rows)
            counts.add_steps([step], asked)
            by_counts.update_counts(counts, 1)
            idle = counts.idle_steps.nonzero()[0]
            by_counts.relax(idle, 1, 1.0 - (1.0 - REVISIT) ** counts.idle_steps[idle])
            learnt = by_rows.learn_step(step, asked.tolist(), 1, 1.0 - (1.0 - REVISIT) ** 1)
            assert learnt == (counts.successes.sum(), counts.trials.sum())
            for name in ("_rate", "_coverage", "observed"):
                assert getattr(by_rows, name).tobytes() == getattr(by_counts, name).tobytes()
            steps.append(step)
            each.add_steps([step], asked)
        several = StepCounts(num_rows)
        several.add_steps(steps, asked)
        for name in ("successes", "trials", "trial_steps", "asked_steps", "proposed_steps", "idle_steps"):
            assert np.array_equal(getattr(several, name), getattr(each, name))


def test_iid_cumulative_rows_are_the_numpy_gains_to_the_bit():
    from specdec.policies.acceptance import iid_cumulative_rows, iid_marginal_gains
    from specdec.policies.goodput_search import cumulative_gains

    generator = np.random.default_rng(4)
    for max_k in range(1, 9):
        rates = np.concatenate([generator.uniform(-0.2, 1.2, size=30), [0.0, 1.0, -0.0]])
        coverage = generator.uniform(0, 1, size=len(rates))
        expected = cumulative_gains(iid_marginal_gains(rates, max_k) * coverage[:, None])
        assert np.array(iid_cumulative_rows(rates.tolist(), coverage.tolist(), max_k)).tobytes() == expected.tobytes()


def test_censored_step_records_no_rejection():
    """EOS inside the draft: emitted == accepted, so the unaccepted tail was never judged."""
    est = AcceptanceEstimator(num_rows=1, num_drafters=1, prior=0.5)
    est.update(record(drafted=[4], accepted=[2], emitted=[2]))
    assert est.rate(0)[0] == pytest.approx(0.575)


def test_per_drafter_priors_and_separate_estimates():
    est = AcceptanceEstimator(num_rows=2, num_drafters=2, prior=[0.9, 0.2])
    est.update(record(drafted=[2, 2], accepted=[0, 2], drafter=[0, 1]))
    assert np.allclose(est.rate(0), [0.85 * 0.9, 0.9])  # row 1 never used drafter 0
    assert np.allclose(est.rate(1), [0.2, 0.85 * 0.2 + 0.15])


def test_rows_that_took_no_part_are_left_alone():
    est = AcceptanceEstimator(num_rows=3, num_drafters=1)
    est.update(record(drafted=[2, 2, 2], accepted=[0, 0, 0], rows=[1]))
    assert np.allclose(est.rate(0), [0.5, 0.85 * 0.5, 0.5])


def test_relax_moves_ema_estimates_back_to_the_prior_for_the_given_rows_only():
    est = AcceptanceEstimator(num_rows=2, num_drafters=2, prior=[0.8, 0.5])
    for _ in range(10):
        est.update(record(drafted=[2, 2], accepted=[0, 0]))
    low = est.rate(0).copy()
    assert np.all(low < 0.2)
    est.relax(np.array([0]), drafter_index=0, weight=0.5)
    assert est.rate(0)[0] == pytest.approx(low[0] + 0.5 * (0.8 - low[0]))
    assert est.rate(0)[1] == low[1]  # row 1 not relaxed
    assert est.rate(1)[0] == 0.5  # drafter 1 untouched (still its prior)
    for _ in range(200):
        est.relax(np.array([0]), drafter_index=0, weight=0.5)
    assert est.rate(0)[0] == pytest.approx(0.8)
    est.relax(np.array([1]), drafter_index=0, weight=1.0, target=0.3)  # to another rate: there at once
    assert est.rate(0)[1] == pytest.approx(0.3) and est.rate(0)[0] == pytest.approx(0.8)


def test_coverage_discounts_expected_tokens():
    est = AcceptanceEstimator(num_rows=2, num_drafters=1, prior=1.0)
    asked = np.array([3, 3])
    est.update(record(drafted=[0, 3], accepted=[0, 3]), asked=asked)  # row 0 found no match
    assert np.allclose(est.coverage(0), [0.85, 1.0])
    assert np.allclose(est.expected_emitted(0, 3), [1 + 0.85 * 3, 4.0])


@pytest.mark.parametrize("kwargs", [{"old_weight": 1.0}, {"prior": 1.5}, {"num_drafters": 0}, {"prior": [0.5, 0.5]}])
def test_bad_estimator_options(kwargs):
    with pytest.raises(ValueError):
        AcceptanceEstimator(**{"num_rows": 1, "num_drafters": 1, **kwargs})
