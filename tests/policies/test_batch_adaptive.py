"""BatchAdaptivePolicy's table (Synergy): s*(b) = argmax_s b l(s) / T(b, s) equals brute force on
random synthetic profiles; a cost model shaped like a real GPU (memory-bound at small batch,
compute-bound at large) gives long drafts at small batch and short ones at large; lookups take
the largest tabulated batch size not above the active rows."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from specdec.batch import BatchState
from specdec.policies.acceptance import expected_emitted
from specdec.policies.batch_adaptive import (
    BatchAdaptivePolicy,
    build_table,
    cost_model_round_time,
    expected_tokens_from_rate,
    lookup,
)
from specdec.policies.cost_model import CostModel


def brute_force_table(batch_sizes, expected_tokens, draft_time, target_time):
    """Nested loops over the paper's formula T(b, s) = s T_draft(b) + T_target(b, s + 1);
    ties to the shorter draft."""
    table = {}
    for b in batch_sizes:
        best_length, best_rate = None, -1.0
        for s in sorted({0, *expected_tokens}):
            tokens = 1.0 if s == 0 else expected_tokens[s]
            rate = b * tokens / (s * draft_time(b) + target_time(b, s + 1))
            if rate > best_rate:
                best_length, best_rate = s, rate
        table[b] = best_length
    return table


@pytest.mark.parametrize("seed", range(200))
def test_table_equals_brute_force_on_random_profiles(seed):
    rng = np.random.default_rng(seed)
    lengths = sorted(rng.choice(np.arange(1, 9), size=int(rng.integers(1, 6)), replace=False).tolist())
    if rng.random() < 0.5:  # measured tau per length: increasing, with noise
        expected = {s: 1.0 + float(np.sum(rng.uniform(0.2, 1.0, size=s))) for s in lengths}
    else:
        expected = expected_tokens_from_rate(rng.uniform(0, 1), lengths)
    draft_fixed, draft_per_row = rng.uniform(0.1, 2.0), rng.uniform(0, 0.1)
    target_fixed, target_per_token = rng.uniform(1.0, 10.0), rng.uniform(0.001, 0.5)
    batch_sizes = [1, 2, 3, 4, 8, 16, 32, 64, 128]

    def draft_time(b):
        return draft_fixed + draft_per_row * b

    def target_time(b, tokens_per_row):
        return target_fixed + target_per_token * b * tokens_per_row

    table = build_table(batch_sizes, expected, lambda b, s: s * draft_time(b) + target_time(b, s + 1))
    assert table == brute_force_table(batch_sizes, expected, draft_time, target_time)


def test_cost_model_table_shortens_drafts_as_the_batch_grows():
    """A target of 10 ms plus 0.04 ms per token (memory-bound at small batch, compute-bound at
    large) and a drafter pass of 1 ms plus 0.01 ms per drafted token, acceptance 0.8: long
    drafts at batch 1 (>= 4), none at batch 512, never longer as the batch grows; every entry
    equals brute force over the cost model's own step time."""
    model = CostModel.from_coefficients(c_fixed=10e-3, c_tok=4e-5, c_kv=1e-8,
                                        drafters=[{"steps": 1e-3, "tokens": 1e-5}])
    batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    policy = BatchAdaptivePolicy.from_cost_model(model, acceptance_rate=0.8, draft_lengths=range(9),
                                                 batch_sizes=batch_sizes, context_len=256)
    table = policy.table
    assert table[1] >= 4 and table[512] == 0, table
    assert all(table[a] >= table[b] for a, b in itertools.pairwise(batch_sizes)), table
    for b in batch_sizes:
        rates = [b * float(expected_emitted(0.8, s)) / model.step_time(np.full(b, 256), np.full(b, s)) for s in range(9)]
        assert table[b] == int(np.argmax(rates))
    assert policy.max_draft_tokens == table[1]


def test_round_time_is_the_papers_formula():
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.1, c_kv=0.001, drafters=[{"steps": 0.5, "rows": 0.01}])
    round_time = cost_model_round_time(model, context_len=100)
    # s passes of 0.5 s, a per-row term of 0.01 s, then the target over b (s + 1) tokens
    assert round_time(4, 3) == pytest.approx(3 * 0.5 + 0.01 * 4 + 1.0 + 0.1 * 4 * 4 + 0.001 * 4 * 103)
    assert round_time(4, 0) == pytest.approx(1.0 + 0.1 * 4 + 0.001 * 4 * 100)


@pytest.mark.parametrize("num_rows,expected", [(1, 5), (2, 5), (3, 3), (4, 3), (5, 3), (7, 1), (8, 1), (22, 1),
                                               (23, 0), (60, 0), (100, 0), (0, 5)])
def test_lookup_takes_the_nearest_entry_on_a_log_scale(num_rows, expected):
    table = {2: 5, 4: 3, 8: 1, 64: 0}
    assert lookup(table, num_rows) == expected
    # the policy's precomputed lookup agrees, and a tie on the log scale goes to the larger size
    batch = BatchState([np.arange(3)] * max(num_rows, 1), 8, np.arange(max(num_rows, 1)), np.zeros(0, dtype=np.int64))
    if num_rows == 0:
        batch.finished[:] = True
    assert BatchAdaptivePolicy(table).plan(batch, 1).num_draft_tokens[0] == expected
    assert lookup({16: 6, 64: 4}, 32) == 4 and lookup({16: 6, 64: 4}, 31) == 6


def fake_stats(requests, **fields):
    """A stand-in for GenerationStats: the fields given, with emitted and row_steps summed over
    ``requests`` as GenerationStats sums them."""
    return SimpleNamespace(requests=requests, emitted=sum(r.emitted for r in requests),
                           row_steps=sum(r.steps for r in requests), **fields)


def test_bad_tables():
    with pytest.raises(ValueError):
        BatchAdaptivePolicy({})
    with pytest.raises(ValueError):
        BatchAdaptivePolicy({0: 3})
    with pytest.raises(ValueError):
        build_table([1], {2: 0.0}, lambda b, s: 1.0)
    with pytest.raises(ValueError, match="either"):
        BatchAdaptivePolicy.from_cost_model(CostModel.from_coefficients(1.0, 0.1, drafters=[{}]))


@pytest.mark.parametrize("objective", ["calls", "steps"])
def test_the_table_from_measurements_is_the_measured_argmax(objective):
    """from_measurements times real generate() rounds (tiny CPU models) and picks, per batch
    size, the length of highest measured throughput: of whole calls (objective "calls"), or
    b * l(s) / T(b, s) from tau and seconds per step ("steps")."""
    import torch

    from specdec.drafters import ModelDrafter
    from tests.tiny import make_model, perturbed_copy, random_prompts

    target = make_model("llama", dtype=torch.float32)
    drafter = ModelDrafter(perturbed_copy(target, 0.05))
    prompts = random_prompts(4, target.config.vocab_size, seed=3)
    policy = BatchAdaptivePolicy.from_measurements(target, drafter, prompts, batch_sizes=(1, 4), draft_lengths=(0, 2, 4),
                                                   max_new_tokens=8, objective=objective, drafter_index=1)
    assert policy.drafter_index == 1  # where the profiled drafter sits among generate()'s drafters
    expected, seconds = policy.profile["expected_tokens"], policy.profile["seconds_per_step"]
    assert set(expected) == {0, 2, 4} and expected[0] == 1.0 and expected[4] > 1.0
    assert policy.profile["objective"] == objective
    for b in (1, 4):
        if objective == "steps":
            throughput = {s: b * expected[s] / seconds[f"{b},{s}"] for s in (0, 2, 4)}
        else:
            throughput = {s: policy.profile["tokens_per_s"][f"{b},{s}"] for s in (0, 2, 4)}
        assert policy.table[b] == max(throughput, key=throughput.get)
    with pytest.raises(ValueError, match="objective"):
        BatchAdaptivePolicy.from_measurements(target, drafter, prompts, objective="rows")


def test_the_table_from_call_throughput_counts_the_slowest_row(monkeypatch):
    """Static batches: at batch 4 a longer draft raises tau (every row but one emits more per
    step) but the slowest row still needs 10 steps, and each step costs more. Per step the
    longer draft looks better; per call it is slower. The "calls" table picks the shorter one,
    the "steps" table the longer; at batch 1 (no other rows to wait for) both agree."""
    import sys

    from specdec.policies.batch_adaptive import table_from_throughput
    from specdec.policies.batch_profile import measure_round_times

    def fake_generate(target, prompts, drafter=None, policy=None, max_new_tokens=0, **_):
        s = policy.num_draft_tokens
        fast_steps = {0: 20, 2: 5, 6: 3}[s]  # the other rows finish sooner with the longer draft
        slow_steps = {0: 20, 2: 10, 6: 10}[s]  # the slowest row needs 10 steps with either draft
        per_step = {0: 0.8, 2: 1.0, 6: 1.25}[s]
        rows = [SimpleNamespace(emitted=20, steps=fast_steps) for _ in prompts[1:]]
        if len(prompts) == 1:
            rows.append(SimpleNamespace(emitted=20, steps=fast_steps))
        else:
            rows.append(SimpleNamespace(emitted=20, steps=slow_steps))
        steps = max(r.steps for r in rows)
        return SimpleNamespace(stats=fake_stats(rows, wall_time_s=steps * per_step, prefill_time_s=0.0, steps=steps))

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", fake_generate)
    prompts = [[1, 2]] * 4
    expected, seconds, tokens_per_s = measure_round_times(None, object(), prompts, batch_sizes=(1, 4),
                                                          draft_lengths=(0, 2, 6), max_new_tokens=20)
    assert tokens_per_s[(4, 2)] == pytest.approx(80 / 10.0) and tokens_per_s[(4, 6)] == pytest.approx(80 / 12.5)
    assert table_from_throughput(tokens_per_s) == {1: 6, 4: 2}
    assert build_table((1, 4), expected, lambda b, s: seconds[(b, s)]) == {1: 6, 4: 6}
    assert table_from_throughput({(4, 2): 3.0, (4, 6): 3.0}) == {4: 2}  # ties: the shorter draft
    with pytest.raises(ValueError, match="positive"):
        table_from_throughput({(4, 2): 0.0})


def test_measured_rounds_at_batch_1_cover_every_prompt():
    """At batch size 1 the profile decodes every prompt (one call each), not the first one only:
    its tau is that of all the prompts together."""
    import torch

    from specdec import generate
    from specdec.drafters import ModelDrafter
    from specdec.policies import FixedPolicy
    from specdec.policies.batch_profile import measure_round_times
    from tests.tiny import make_model, perturbed_copy, random_prompts

    target = make_model("llama", dtype=torch.float32)
    drafter = ModelDrafter(perturbed_copy(target, 0.3))
    prompts = random_prompts(5, target.config.vocab_size, seed=8)
    expected, seconds, _ = measure_round_times(target, drafter, prompts, batch_sizes=(1,), draft_lengths=(3,),
                                               max_new_tokens=10)
    whole = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=10).stats
    single = generate(target, prompts[:1], drafter=drafter, policy=FixedPolicy(3), max_new_tokens=10).stats
    assert expected[3] == pytest.approx(whole.tau) and single.tau != pytest.approx(whole.tau)
    assert set(seconds) == {(1, 3)} and seconds[(1, 3)] > 0


def test_measured_rounds_repeat_in_turn_and_take_the_median(monkeypatch):
    """repeats=3: the lengths are measured in turn within each round (0, 2, 0, 2, 0, 2), and a
    length's seconds per step is the median of its rounds, so one slow round does not move it."""
    import sys

    from specdec.policies.batch_profile import measure_round_times

    order, slow = [], {(2, 1): 5.0}  # (length, round) -> seconds per step of that round
    per_step = {0: 1.0, 2: 1.5}

    def fake_generate(target, prompts, drafter=None, policy=None, max_new_tokens=0, **_):
        s = policy.num_draft_tokens
        round_number = sum(1 for o in order if o == s)
        order.append(s)
        steps = 4
        requests = [SimpleNamespace(emitted=4 * (s + 1) // 2 + 1, steps=steps) for _ in prompts]
        wall = 0.5 + steps * slow.get((s, round_number), per_step[s])
        return SimpleNamespace(stats=fake_stats(requests, wall_time_s=wall, prefill_time_s=0.5, steps=steps))

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", fake_generate)
    _, seconds, tokens_per_s = measure_round_times(None, object(), [[1, 2]], batch_sizes=(1,),
                                                          draft_lengths=(0, 2), max_new_tokens=4, repeats=3)
    assert order == [0, 2, 0, 2, 0, 2]
    assert seconds == {(1, 0): pytest.approx(1.0), (1, 2): pytest.approx(1.5)}  # the 5.0 round is out
    mean_of_rounds = (1.5 + 5.0 + 1.5) / 3
    assert seconds[(1, 2)] != pytest.approx(mean_of_rounds)
    assert tokens_per_s[(1, 2)] == pytest.approx(7 / (4 * 1.5))  # the median round: 7 tokens in 4 steps of 1.5 s
    with pytest.raises(ValueError, match="repeats"):
        measure_round_times(None, object(), [[1, 2]], batch_sizes=(1,), draft_lengths=(0,), repeats=0)


def test_the_tau_profile_in_small_calls_pools_every_prompt():
    """batch_size=1 decodes each prompt alone and pools them: the same tau as one call of all
    (greedy outputs do not depend on the batch), not the first prompt's."""
    import torch

    from specdec.drafters import ModelDrafter
    from specdec.policies import profile_expected_tokens
    from tests.tiny import make_model, perturbed_copy, random_prompts

    target = make_model("llama", dtype=torch.float32)
    drafter = ModelDrafter(perturbed_copy(target, 0.3))
    prompts = random_prompts(4, target.config.vocab_size, seed=5)
    whole = profile_expected_tokens(target, drafter, prompts, (2, 4), max_new_tokens=10)
    alone = profile_expected_tokens(target, drafter, prompts, (2, 4), max_new_tokens=10, batch_size=1)
    uneven = profile_expected_tokens(target, drafter, prompts, (2, 4), max_new_tokens=10, batch_size=3)  # 3 + 1
    first = profile_expected_tokens(target, drafter, prompts[:1], (2, 4), max_new_tokens=10)
    assert alone == pytest.approx(whole) and uneven == pytest.approx(whole)
    assert first != pytest.approx(whole)
    with pytest.raises(ValueError, match="at least one prompt"):
        profile_expected_tokens(target, drafter, [], (2,))
    with pytest.raises(ValueError, match="batch_size"):
        profile_expected_tokens(target, drafter, prompts, (2,), batch_size=0)


def test_a_profile_round_without_steps_is_refused(monkeypatch):
    """A round that decoded nothing (no new tokens, or a clock that did not move) has no step
    time or throughput: a clear error, not a division by zero."""
    import sys

    from specdec.policies.batch_profile import measure_round_times

    def no_steps(target, prompts, drafter=None, policy=None, max_new_tokens=0, **_):
        requests = [SimpleNamespace(emitted=0, steps=0) for _ in prompts]
        return SimpleNamespace(stats=fake_stats(requests, wall_time_s=0.5, prefill_time_s=0.5, steps=0))

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", no_steps)
    with pytest.raises(ValueError, match="measured 0 steps"):
        measure_round_times(None, object(), [[1, 2]], batch_sizes=(1,), draft_lengths=(0,), max_new_tokens=4)


def test_measured_rounds_take_distinct_requests_up_to_each_batch_size(monkeypatch):
    """requests_per_size=2 with 8 prompts: batch 1 and 2 measure the first 2 prompts (2 calls
    and 1 call), batch 8 all 8 distinct prompts in one call, not 2 of them cycled; a bad value
    is refused."""
    import sys

    from specdec.policies.batch_profile import measure_round_times

    calls = []

    def fake_generate(target, prompts, drafter=None, policy=None, max_new_tokens=0, **_):
        calls.append([p[0] for p in prompts])
        requests = [SimpleNamespace(emitted=4, steps=4) for _ in prompts]
        return SimpleNamespace(stats=fake_stats(requests, wall_time_s=1.0, prefill_time_s=0.0, steps=4))

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", fake_generate)
    prompts = [[i, 0] for i in range(8)]
    measure_round_times(None, object(), prompts, batch_sizes=(1, 2, 8), draft_lengths=(0,), max_new_tokens=4,
                        requests_per_size=2)
    assert calls == [[0], [1], [0, 1], list(range(8))]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="requests_per_size"):
            measure_round_times(None, object(), prompts, batch_sizes=(1,), draft_lengths=(0,), requests_per_size=bad)
