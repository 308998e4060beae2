"""GoodputPolicy's choice against brute force over every per-row length vector, on many random
small instances of the cost model (step times computed independently by CostModel.step_time):

- "exact" search equals the brute-force optimum on every instance, with or without the
  per-row, per-pass and fixed drafting terms;
- "finish" (call_times) equals an event simulation of the call on the cost model, and picks its
  fastest length;
- the 10% margin switches speculation off when it does not pay;
- the Python-loop search of up to SMALL_SEARCH rows (choose_rows) and the numpy one decide and
  predict bit for bit alike, both equal brute force, and their sums are numpy's to the bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specdec.policies.acceptance import marginal_gains
from specdec.policies.cost_model import CostModel
from specdec.policies.goodput import GoodputPolicy
from specdec.policies.goodput_search import (
    SMALL_SEARCH,
    _goodput,
    _search_exact,
    choose_lengths,
    choose_rows,
    cumulative_gains,
    goodput_of,
    search_exact,
)
from specdec.policies.step_time import LinearStepTime, numpy_sum

NUM_INSTANCES = 300


def random_instance(rng, per_token_only: bool):
    num_rows, max_k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    if per_token_only:
        drafter = {"tokens": rng.uniform(0, 0.5)}
    else:
        drafter = {"fixed": rng.uniform(0, 2), "rows": rng.uniform(0, 0.5), "steps": rng.uniform(0, 3),
                   "tokens": rng.uniform(0, 0.5), "kv_tokens": rng.uniform(0, 0.002),
                   "context_tokens": rng.uniform(0, 0.005)}
    model = CostModel.from_coefficients(c_fixed=rng.uniform(1, 10), c_tok=rng.uniform(0, 1), c_kv=rng.uniform(0, 0.01),
                                        c_row=rng.uniform(0, 0.5), drafters=[drafter])
    lengths = rng.integers(5, 200, size=num_rows)
    if rng.random() < 0.5:
        rates = np.repeat(rng.uniform(0, 1, size=(num_rows, 1)), max_k, axis=1)  # i.i.d. per row
    else:
        rates = rng.uniform(0, 1, size=(num_rows, max_k))  # per position
    caps = rng.integers(0, max_k + 1, size=num_rows)
    return model, lengths, marginal_gains(rates), caps


def brute_force(model, lengths, gains, caps):
    """max over all k with 0 <= k_i <= caps_i of sum_i (1 + sum_{j<k_i} gains_ij) / step_time."""
    candidates = [np.array(k) for k in itertools.product(*[range(c + 1) for c in caps])]
    best = 0.0
    for k in candidates:
        tokens = len(k) + sum(gains[i, : k[i]].sum() for i in range(len(k)))
        best = max(best, tokens / model.step_time(lengths, k))
    return best


def achieved(model, lengths, gains, caps, search):
    k, predicted, _ = choose_lengths(gains, caps, LinearStepTime.from_cost_model(model, lengths), search, min_gain=0.0)
    assert np.all((0 <= k) & (k <= caps))
    tokens = len(k) + sum(gains[i, : k[i]].sum() for i in range(len(k)))
    value = tokens / model.step_time(lengths, k)
    assert predicted == pytest.approx(value, rel=1e-9)  # the search's own goodput is the model's
    return value


def test_step_time_decomposition_matches_the_cost_model():
    rng = np.random.default_rng(5)
    for _ in range(50):
        model, lengths, _gains, _caps = random_instance(rng, per_token_only=False)
        step_time = LinearStepTime.from_cost_model(model, lengths)
        k = rng.integers(0, 5, size=len(lengths))
        assert step_time(k) == pytest.approx(model.step_time(lengths, k), rel=1e-12)


@pytest.mark.parametrize("per_token_only", [True, False], ids=["per-token-costs-only", "general"])
def test_exact_search_equals_brute_force(per_token_only):
    rng = np.random.default_rng(0)
    for _ in range(NUM_INSTANCES):
        model, lengths, gains, caps = random_instance(rng, per_token_only)
        assert achieved(model, lengths, gains, caps, "exact") == pytest.approx(
            brute_force(model, lengths, gains, caps), rel=1e-12)


@pytest.mark.parametrize("per_token_only", [True, False], ids=["per-token-costs-only", "general"])
def test_numpy_exact_search_equals_brute_force(per_token_only):
    """search_exact, the [depths, rows, lengths] search choose_lengths runs above SMALL_SEARCH rows,
    on the same instances."""
    rng = np.random.default_rng(0)
    for _ in range(NUM_INSTANCES):
        model, lengths, gains, caps = random_instance(rng, per_token_only)
        k = search_exact(gains, caps, LinearStepTime.from_cost_model(model, lengths))
        assert np.all((0 <= k) & (k <= caps))
        tokens = len(k) + sum(gains[i, : k[i]].sum() for i in range(len(k)))
        assert tokens / model.step_time(lengths, k) == pytest.approx(brute_force(model, lengths, gains, caps), rel=1e-12)


def test_the_list_search_decides_as_the_numpy_search_bit_for_bit():
    """choose_rows (Python loops) and the numpy search take the same float operations: the same
    lengths and goodputs to the bit, up to SMALL_SEARCH rows, with equal rows (ties), warm starts
    (the last choice), per-position gains and calibrated step times."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        num_rows, max_k = int(rng.integers(1, SMALL_SEARCH + 1)), int(rng.integers(1, 9))
        model = random_instance(rng, per_token_only=trial % 4 == 0)[0]
        lengths = rng.integers(5, 2000, size=num_rows)
        if trial % 3:  # i.i.d. per row, else per position
            rates = np.repeat(rng.uniform(0, 1, size=(num_rows, 1)), max_k, axis=1)
        else:
            rates = rng.uniform(0, 1, size=(num_rows, max_k))
        if trial % 5 == 0:  # every row alike: ties everywhere
            rates, lengths = np.repeat(rates[:1], num_rows, axis=0), np.full(num_rows, lengths[0])
        cumulative = cumulative_gains(marginal_gains(rates) * rng.uniform(0.5, 1.0, size=(num_rows, 1)))
        step_time = LinearStepTime.from_cost_model(model, lengths).calibrated(rng.uniform(0.5, 2), rng.uniform(0.2, 5))
        caps = rng.integers(0, max_k + 1, size=num_rows)
        plain = _goodput(cumulative, np.zeros(num_rows, dtype=np.int64), step_time)
        start = rng.integers(0, max_k + 1, size=num_rows)
        if trial % 2:
            start = _search_exact(cumulative, caps, step_time, plain=plain)
        k = _search_exact(cumulative, caps, step_time, start=start, plain=plain)
        listed, chosen, listed_plain = choose_rows(cumulative.tolist(), caps.tolist(), step_time, 0.0, start.tolist())
        assert listed == k.tolist()
        assert (chosen, listed_plain) == (_goodput(cumulative, k, step_time), plain)  # floats compared exactly


def test_sums_over_lists_are_numpys_to_the_bit():
    """numpy_sum adds as np.add.reduce does (also along the last axis of [M, A] arrays, the numpy
    search's), and the step time of one choice (Python floats) is the batched one's."""
    rng = np.random.default_rng(3)
    for n in range(300):
        values = rng.random(n) * 10.0 ** rng.uniform(-8, 8, n) * rng.choice([-1.0, 1.0], n)
        for summed in (values, -0.0 * values):  # zeros' signs too
            assert np.float64(numpy_sum(summed.tolist())).tobytes() == np.add.reduce(summed).tobytes()
        assert np.stack([values, values[::-1]]).sum(axis=1).tolist() == [numpy_sum(values.tolist()),
                                                                          numpy_sum(values[::-1].tolist())]
    for _ in range(100):
        model, _, _, _ = random_instance(rng, per_token_only=False)
        num_rows = int(rng.integers(1, 40))
        step_time = LinearStepTime.from_cost_model(model, rng.integers(5, 2000, size=num_rows))
        k = rng.integers(0, 6, size=num_rows) * (rng.random(num_rows) < 0.7)
        assert step_time(k) == step_time(k[None])[0] and step_time.extra(k) == step_time.extra(k[None])[0]


def test_rows_get_lengths_by_their_acceptance():
    """Cheap tokens, expensive step: a row that accepts everything drafts to the cap, a row
    that accepts nothing drafts nothing."""
    model = CostModel.from_coefficients(c_fixed=10.0, c_tok=0.1, drafters=[{"tokens": 0.1}])
    gains = marginal_gains(np.array([[1.0] * 6, [0.0] * 6, [0.6] * 6]))
    k, _, _ = choose_lengths(gains, np.array([6, 6, 6]), LinearStepTime.from_cost_model(model, np.array([10, 10, 10])))
    assert k[0] == 6 and k[1] == 0 and 0 < k[2] < 6


def test_speculation_is_switched_off_unless_it_beats_plain_decoding_by_the_margin():
    """One row whose second draft token is never accepted; k = 1: E[tau] 1.5 in 1.3 s against
    1 token in 1 s, goodput 15.4% above plain decoding. With a 10% margin it drafts, with 20%
    it does not."""
    model = CostModel.from_coefficients(c_fixed=0.9, c_tok=0.1, drafters=[{"tokens": 0.2, "steps": 10.0}])
    gains = marginal_gains(np.array([[0.5, 0.0]]))
    step_time = LinearStepTime.from_cost_model(model, np.array([0]))
    assert goodput_of(gains, np.array([0]), step_time) == pytest.approx(1.0)
    assert goodput_of(gains, np.array([1]), step_time) == pytest.approx(1.5 / 11.3)
    # a drafter pass costing 10 s makes drafting lose: off with any margin
    assert choose_lengths(gains, np.array([2]), step_time, "exact", min_gain=0.0)[0].tolist() == [0]
    model = CostModel.from_coefficients(c_fixed=0.9, c_tok=0.1, drafters=[{"tokens": 0.2}])
    step_time = LinearStepTime.from_cost_model(model, np.array([0]))
    assert goodput_of(gains, np.array([1]), step_time) == pytest.approx(1.5 / 1.3)
    assert choose_lengths(gains, np.array([2]), step_time, "exact", min_gain=0.10)[0].tolist() == [1]
    assert choose_lengths(gains, np.array([2]), step_time, "exact", min_gain=0.20)[0].tolist() == [0]


def test_policy_refuses_what_it_cannot_time():
    model = CostModel.from_coefficients(1.0, 0.1)  # no drafter timed
    with pytest.raises(ValueError, match="not timed"):
        GoodputPolicy(model)
    with pytest.raises(ValueError, match="search"):
        GoodputPolicy(CostModel.from_coefficients(1.0, 0.1, drafters=[{}]), search="beam")
    with pytest.raises(TypeError):
        GoodputPolicy({"c_fixed": 1.0})


def simulated_call_time(model, lengths, gains, caps, remaining, length):
    """Seconds until every row is done with one length (capped per row) kept throughout: rows
    finish after remaining_i / E[tau_i] steps, and each stretch between finishing points costs
    CostModel.step_time over the rows still active (computed here from the model directly)."""
    k = np.minimum(caps, length)
    expected = 1 + np.array([gains[i, : k[i]].sum() for i in range(len(k))])
    steps = remaining / expected
    total, done = 0.0, 0.0
    for point in sorted(set(steps.tolist())):
        active = steps >= point
        total += (point - done) * model.step_time(lengths[active], k[active])
        done = point
    return total


def best_uniform_per_step(model, lengths, gains, caps):
    """The single length (capped per row) of highest per-step goodput, by enumeration on the
    cost model (the shortest of the best)."""
    candidates = [np.minimum(caps, k) for k in range(gains.shape[1] + 1)]
    values = [(len(k) + sum(gains[i, : k[i]].sum() for i in range(len(k)))) / model.step_time(lengths, k)
              for k in candidates]
    best = 0
    for index, value in enumerate(values):
        if value > values[best] * (1 + 1e-12):
            best = index
    return candidates[best]


def test_finish_search_minimises_the_simulated_call_time():
    """call_times equals the event simulation for every length on random instances, and
    "finish" picks its argmin (it may differ from per-step goodput's uniform choice)."""
    from specdec.policies.finish import call_times

    rng = np.random.default_rng(7)
    differs = 0
    for _ in range(NUM_INSTANCES):
        model, lengths, gains, caps = random_instance(rng, per_token_only=False)
        if rng.random() < 0.5:
            caps = np.maximum(caps, 1)  # else some rows may not draft at all (a budget of one token)
        remaining = rng.integers(1, 64, size=len(caps)).astype(np.float64)
        step_time = LinearStepTime.from_cost_model(model, lengths)
        predicted = call_times(gains, caps, step_time, remaining)
        simulated = [simulated_call_time(model, lengths, gains, caps, remaining, s) for s in range(gains.shape[1] + 1)]
        assert predicted == pytest.approx(simulated, rel=1e-9)
        samples = np.stack([gains, 0.5 * gains])  # [2, A, K] samples of the gains: one call time each
        assert call_times(samples, caps, step_time, remaining) == pytest.approx(
            np.stack([predicted, call_times(0.5 * gains, caps, step_time, remaining)]), rel=1e-12)
        k, goodput, _ = choose_lengths(gains, caps, step_time, "finish", min_gain=0.0, remaining=remaining)
        best = int(np.argmin(simulated))
        assert simulated[int(k.max())] == pytest.approx(simulated[best], rel=1e-9)
        assert goodput == pytest.approx(remaining.sum() / min(simulated), rel=1e-9)
        uniform = best_uniform_per_step(model, lengths, gains, caps)
        differs += int(not np.array_equal(uniform, k))
    assert differs > 0  # the two objectives are not the same choice in disguise


def test_finish_search_shortens_drafts_when_the_slowest_row_sets_the_call():
    """Seven rows accept 95% of draft tokens, one 60%, all with 64 tokens to go; each drafter
    pass and drafted token costs time. Per-step goodput drafts 8 tokens (the seven gain most);
    the call lasts as long as the eighth row, which long drafts hardly speed up, so "finish"
    drafts 3 (call_times itself is checked against the event simulation above)."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.01, drafters=[{"steps": 0.05, "tokens": 0.01}])
    rates = np.array([0.95] * 7 + [0.6])[:, None].repeat(8, axis=1)
    gains = marginal_gains(rates)
    caps, remaining = np.full(8, 8), np.full(8, 64.0)
    step_time = LinearStepTime.from_cost_model(model, np.full(8, 100))
    uniform = best_uniform_per_step(model, np.full(8, 100), gains, caps)
    finish = choose_lengths(gains, caps, step_time, "finish", min_gain=0.0, remaining=remaining)[0]
    assert uniform.tolist() == [8] * 8 and finish.tolist() == [3] * 8
    with pytest.raises(ValueError, match="remaining"):
        choose_lengths(gains, caps, step_time, "finish")
