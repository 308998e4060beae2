"""Run-ahead (run_ahead.py): plain decoding steps launched before the step before them commits
give every request the output it gets without running ahead (greedy: the target's own; sampled
and with log-probabilities: the same tokens and numbers on the CPU), with EOS, stop sequences,
min_new_tokens, budgets, arrivals, cancellation and per-request sampling; a row that ends at an
EOS costs exactly one pass it does not use; a repetition penalty turns it off. CPU, forced on
(``RUN_AHEAD = True``); the CUDA test runs it as shipped, under CUDA graphs."""

import numpy as np
import pytest
import torch

from specdec import Engine, SamplingParams, generate, run_ahead
from tests.test_engine import run_schedule
from tests.tiny import hf_greedy, make_model, random_prompts

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float64)


@pytest.fixture
def ahead(monkeypatch):
    """-> a function that runs ``call`` with run-ahead forced on and off -> (on's result, off's)."""
    def both(call):
        results = []
        for setting in (True, False):
            monkeypatch.setattr(run_ahead, "RUN_AHEAD", setting)
            results.append(call())
        return results
    return both


def launches_ahead(engine: Engine) -> bool:
    return engine._launched is not None


def test_greedy_output_is_the_targets_with_eos_and_ragged_budgets(target, ahead):
    prompts = random_prompts(5, VOCAB, seed=4, max_len=10)
    plain = generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    eos = [plain.sequences[0][3], plain.sequences[2][6]]  # rows 0 and 2 stop early, the others run on
    on, off = ahead(lambda: generate(target, prompts, max_new_tokens=12, eos_token_id=eos, return_logprobs=True))
    for prompt, sequence in zip(prompts, on.sequences):
        expected = hf_greedy(target, prompt, 12)
        ends = [i for i, token in enumerate(expected) if token in eos]
        assert sequence == (expected[: ends[0] + 1] if ends else expected)
    assert on.sequences == off.sequences and on.logprobs == off.logprobs
    assert len(on.sequences[0]) <= 4 and len(on.sequences[2]) <= 7
    assert [r.steps for r in on.stats.requests] == [r.steps for r in off.stats.requests]
    # each row that ended at an EOS while others still ran was in one more pass, launched before its EOS was known
    ended_early = sum(len(s) < 12 for s in on.sequences)
    assert on.stats.target_tokens == off.stats.target_tokens + ended_early


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_output_and_logprobs_equal_the_engines_without_run_ahead(target, ahead, seed):
    prompts = random_prompts(4, VOCAB, seed=20 + seed, max_len=9)
    sampling = SamplingParams(temperature=0.9, top_k=30, top_p=0.95)
    options = dict(max_new_tokens=10, sampling=sampling, seed=seed, return_logprobs=True, min_new_tokens=3,
                   eos_token_id=[5, 17, 33], stop_sequences=[[40, 41], [7]])
    on, off = ahead(lambda: generate(target, prompts, **options))
    assert on.sequences == off.sequences and on.logprobs == off.logprobs
    assert all(len(s) >= 3 for s in on.sequences)  # min_new_tokens holds on the predicted lengths


def test_arrivals_cancellation_and_per_request_sampling_match_the_engine_without_run_ahead(target, ahead):
    rng = np.random.default_rng(5)
    prompts = random_prompts(9, VOCAB, seed=6, max_len=12)
    requests = [(p, int(rng.integers(1, 11)), i, SamplingParams(temperature=0.7) if i % 3 == 0 else None)
                for i, p in enumerate(prompts)]
    arrivals = np.sort(rng.integers(0, 10, size=len(prompts))).tolist()

    def serve():
        with Engine(target, max_rows=3, max_len=32, eos_token_id=[11, 12]) as engine:
            seen_ahead = []

            def stream(request_id, tokens):  # the fifth request is cancelled from a stream callback
                if request_id == 4 and engine.cancel(4):
                    pass
                seen_ahead.append(launches_ahead(engine))
            ids, finished, step = [None] * len(requests), {}, 0
            while step <= max(arrivals) or engine.has_work():
                for i in np.flatnonzero(np.asarray(arrivals) == step):
                    prompt, budget, seed, sampling = requests[i]
                    ids[i] = engine.add_request(prompt, max_new_tokens=budget, seed=seed, sampling=sampling)
                if step == 6 and ids[1] is not None:
                    engine.cancel(ids[1])
                finished.update((done.id, done) for done in engine.step(stream))
                step += 1
            return [(finished[i].token_ids, finished[i].reason) for i in ids], any(seen_ahead)

    (on, ran_ahead), (off, ran_ahead_off) = ahead(serve)
    assert on == off
    assert ran_ahead and not ran_ahead_off
    assert sum(reason == "cancelled" for _, reason in on) >= 1


def test_rows_refilled_while_a_step_is_in_flight_get_their_own_greedy_output(target, ahead):
    """Short budgets over few rows: rows end and are refilled every few steps, while the step
    launched before their end is still to commit."""
    prompts = random_prompts(8, VOCAB, seed=8, max_len=11)
    budgets = [1, 5, 2, 7, 3, 1, 4, 6]

    def serve():
        with Engine(target, max_rows=2, max_len=24, eos_token_id=[]) as engine:
            finished, ids = run_schedule(engine, [(p, b, 0) for p, b in zip(prompts, budgets)], [0] * len(prompts))
        return [finished[i].token_ids for i in ids]

    on, off = ahead(serve)
    assert on == off
    for prompt, budget, sequence in zip(prompts, budgets, on):
        assert sequence == hf_greedy(target, prompt, budget)


def test_a_repetition_penalty_is_not_run_ahead(target, monkeypatch):
    monkeypatch.setattr(run_ahead, "RUN_AHEAD", True)
    prompts = random_prompts(2, VOCAB, seed=9, max_len=8)
    sampling = SamplingParams(repetition_penalty=1.3)
    with Engine(target, max_rows=2, max_len=24, sampling=sampling, eos_token_id=[]) as engine:
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens=6)
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
            assert not launches_ahead(engine)
    monkeypatch.setattr(run_ahead, "RUN_AHEAD", False)
    reference = generate(target, prompts, max_new_tokens=6, sampling=sampling, eos_token_id=[])
    assert [finished[i].token_ids for i in range(2)] == reference.sequences


def test_speculative_steps_are_not_run_ahead(target, monkeypatch):
    from specdec.drafters import PromptLookupDrafter
    from specdec.policies import FixedPolicy

    monkeypatch.setattr(run_ahead, "RUN_AHEAD", True)
    with Engine(target, PromptLookupDrafter(), policy=FixedPolicy(3), max_rows=1, max_len=30) as engine:
        engine.add_request([1, 2, 3, 1, 2], max_new_tokens=8)
        engine.step()
        assert not launches_ahead(engine)


@pytest.mark.cuda
def test_run_ahead_under_cuda_graphs_gives_the_output_without_it(monkeypatch):
    """As shipped (RUN_AHEAD "cuda"), float32, graphs and the fast attention, rows ending at EOS
    and refilled: the same tokens as with run-ahead off."""
    model = make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float32, device="cuda")
    prompts = random_prompts(6, VOCAB, seed=12, max_len=12)
    plain = generate(model, prompts, max_new_tokens=16, eos_token_id=[], attention="fast", cuda_graphs=True)
    eos = [plain.sequences[1][4], plain.sequences[3][9]]

    def serve():
        with Engine(model, max_rows=3, max_len=32, eos_token_id=eos, attention="fast", cuda_graphs=True) as engine:
            finished, ids = run_schedule(engine, [(p, 16, i) for i, p in enumerate(prompts)], [0, 0, 1, 2, 2, 5])
        return [finished[i].token_ids for i in ids]

    monkeypatch.setattr(run_ahead, "RUN_AHEAD", "cuda")
    on = serve()
    monkeypatch.setattr(run_ahead, "RUN_AHEAD", False)
    assert on == serve()


def test_a_request_admitted_while_a_step_is_in_flight_gets_its_tokens_at_the_same_steps(target, ahead):
    """Each step() commits what it commits without run-ahead, step for step: a request admitted
    while a step is in flight gets its first token in its admitting step (not one step later),
    so one cancelled after a given number of steps has the same tokens."""
    prompts = random_prompts(5, VOCAB, seed=31, max_len=9)
    arrivals = {0: [0], 1: [1], 3: [2, 3], 6: [4]}

    def serve():
        with Engine(target, max_rows=3, max_len=32, eos_token_id=[]) as engine:
            ids, steps, finished = [], [], {}
            for step in range(14):
                for i in arrivals.get(step, []):
                    ids.append(engine.add_request(prompts[i], max_new_tokens=6))
                if step == 3:
                    engine.cancel(ids[1])  # admitted at step 1, two steps in
                streamed = []
                finished.update((done.id, done.token_ids) for done in engine.step(lambda *s: streamed.append(s)))
                steps.append(streamed)
            return steps, [finished[i] for i in ids]

    (on_steps, on), (off_steps, off) = ahead(serve)
    assert on == off
    assert on_steps == off_steps


def test_a_steps_plan_time_is_a_share_of_its_step_time(target, monkeypatch):
    """StepRecord.plan_time_s is the policy's share of step_time_s (the bench's traces and
    load_stats rely on it): under run-ahead a step's time runs from the last commit, so the plan
    it counts is the one made in that time."""
    import time

    from specdec.policies import FixedPolicy

    class SlowPlain(FixedPolicy):
        def __init__(self):
            super().__init__(0)
            self.records = []

        def plan(self, batch, num_drafters):
            time.sleep(0.004)
            return super().plan(batch, num_drafters)

        def observe(self, record):
            self.records.append(record)

    monkeypatch.setattr(run_ahead, "RUN_AHEAD", True)
    policy = SlowPlain()
    with Engine(target, policy=policy, max_rows=2, max_len=16, eos_token_id=[]) as engine:
        for prompt, budget in zip(random_prompts(2, VOCAB, seed=13, max_len=6), [3, 5]):
            engine.add_request(prompt, max_new_tokens=budget)
        while engine.has_work():
            engine.step()
    assert len(policy.records) == 5
    assert all(r.step_time_s >= r.plan_time_s for r in policy.records)


def test_the_pass_launched_for_the_last_rows_ending_at_eos_is_counted(target, ahead):
    """A row that ends at an EOS costs one pass it does not use, counted in target_tokens, also
    when it is the last row running (the launched step then never commits)."""
    prompts = random_prompts(2, VOCAB, seed=4, max_len=8)
    plain = generate(target, prompts, max_new_tokens=8, eos_token_id=[])
    eos = [plain.sequences[0][3], plain.sequences[1][5]]  # row 0 ends while row 1 runs, row 1 ends last
    on, off = ahead(lambda: generate(target, prompts, max_new_tokens=8, eos_token_id=eos))
    assert on.sequences == off.sequences and [len(s) for s in on.sequences] == [4, 6]
    assert on.stats.target_tokens == off.stats.target_tokens + 2
