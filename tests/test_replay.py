"""Replaying an arrival trace against the Engine in real time (specdec/replay.py)."""

import pytest
import torch

from specdec import Engine
from specdec.drafters import ModelDrafter
from specdec.load import summarize
from specdec.policies import FixedPolicy
from specdec.replay import replay
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=7, dtype=torch.float64)


def test_a_trace_is_served_exactly_and_each_request_waits_for_its_arrival(target):
    prompts = random_prompts(6, 96, seed=5)
    arrivals = [0.0, 0.02, 0.02, 0.25, 0.26, 0.5]
    with Engine(target, ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(2), max_rows=2, max_len=32,
                eos_token_id=[]) as engine:
        served = replay(engine, prompts, arrivals, max_new_tokens=8)
    assert [s.result.token_ids for s in served] == [hf_greedy(target, p, 8) for p in prompts]
    for s, arrival in zip(served, arrivals):
        assert s.timing.arrival_s == arrival
        assert arrival <= s.timing.first_token_s <= s.timing.finish_s  # no token before its arrival
        assert s.timing.output_tokens == 8
    assert served[-1].timing.finish_s >= 0.5  # the replay waited for the last arrival
    summary = summarize([s.timing for s in served])
    assert summary["requests"] == 6 and summary["output_tokens"] == 48 and summary["span_s"] >= 0.5


def test_each_request_samples_with_its_own_params(target):
    """A greedy request beside sampled ones is the target's greedy output; a sampled one is what
    generate() gives it alone with its params and seed."""
    from specdec import SamplingParams, generate

    prompts = random_prompts(3, 96, seed=8)
    hot = SamplingParams(temperature=1.5)
    with Engine(target, policy=FixedPolicy(0), max_rows=3, max_len=32, eos_token_id=[]) as engine:
        served = replay(engine, prompts, [0.0, 0.0, 0.01], max_new_tokens=8, seeds=[3, 4, 5],
                        sampling=[hot, None, hot])
    assert served[1].result.token_ids == hf_greedy(target, prompts[1], 8)
    for i in (0, 2):
        alone = generate(target, [prompts[i]], max_new_tokens=8, sampling=hot, seed=[3 + i], eos_token_id=[])
        assert served[i].result.token_ids == alone.sequences[0]
    assert served[0].result.token_ids != hf_greedy(target, prompts[0], 8)  # it did sample


def test_bad_traces_are_refused(target):
    with Engine(target, max_rows=1, max_len=16, policy=FixedPolicy(0)) as engine:
        with pytest.raises(ValueError, match="in order"):
            replay(engine, [[1], [2]], [0.2, 0.1], max_new_tokens=2)
        with pytest.raises(ValueError, match="one arrival time per prompt"):
            replay(engine, [[1], [2]], [0.1], max_new_tokens=2)
        with pytest.raises(ValueError, match="one seed and one sampling"):
            replay(engine, [[1], [2]], [0.0, 0.1], max_new_tokens=2, sampling=[None])
        with pytest.raises(ValueError, match="at least one token"):
            replay(engine, [[1]], [0.0], max_new_tokens=0)
        with pytest.raises(ValueError, match="positions"):  # the second prompt does not fit
            replay(engine, [[1], list(range(20))], [0.0, 0.0], max_new_tokens=2)
        assert not engine.has_work()  # the first request was withdrawn
