"""The Engine (continuous batching): a request's output does not depend on what else is in flight
or when it arrived; cancelled requests and requests finishing beside new admissions leave the
others exact; rows are reused without growth. CPU, float64 (greedy) and float32 (sampled)."""

import tracemalloc

import numpy as np
import pytest
import torch

from specdec import Engine, SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter, SelfSpeculativeDrafter, SpireDraft, SPIReDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy
from specdec.verifiers import TreeVerifier
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float64)


def drafter_of(kind, target):
    return {"model": lambda: ModelDrafter(perturbed_copy(target, 0.1)), "lookup": PromptLookupDrafter,
            "tree": lambda: ModelDrafter(perturbed_copy(target, 0.1), tree=TreeSpec(depth=3, branching=2)),
            "self": lambda: SelfSpeculativeDrafter(sink=1, window=3),
            "spire": lambda: SPIReDrafter(SpireDraft.from_target(target, window=3)),
            "none": lambda: None}[kind]()


def run_schedule(engine, requests, arrivals):
    """Add request i (prompt, budget, seed[, its SamplingParams]) before step arrivals[i] (steps
    counted from 0); step until all are done -> {id: FinishedRequest}, and the ids in request order."""
    ids, finished, step = [None] * len(requests), {}, 0
    while step <= max(arrivals) or engine.has_work():
        for i in np.flatnonzero(np.asarray(arrivals) == step):
            prompt, budget, seed, *sampling = requests[i]
            ids[i] = engine.add_request(prompt, max_new_tokens=budget, seed=seed, sampling=(sampling or [None])[0])
        finished.update((done.id, done) for done in engine.step())
        step += 1
    return finished, ids


@pytest.mark.parametrize("kind,schedule_seed", [(kind, seed) for kind in ("model", "lookup", "none") for seed in (0, 1)]
                         + [("tree", 2), ("self", 3), ("spire", 4)])
def test_every_request_gets_the_targets_greedy_output_whatever_arrives_beside_it(target, kind, schedule_seed):
    """Trees, the self-speculative drafter (which reads the target's cache) and SPIRe (fed the
    target's states of every verification) included: refilled rows hold nothing of the last request."""
    rng = np.random.default_rng(schedule_seed)
    prompts = random_prompts(9, VOCAB, seed=10 + schedule_seed, max_len=14)
    budgets = rng.integers(1, 13, size=len(prompts)).tolist()
    arrivals = np.sort(rng.integers(0, 12, size=len(prompts))).tolist()
    policy = FixedPolicy(0 if kind == "none" else 4 if kind == "tree" else 3)
    verifier = TreeVerifier() if kind == "tree" else None
    with Engine(target, drafter_of(kind, target), verifier, policy=policy, max_rows=3, max_len=40,
                eos_token_id=[]) as engine:
        finished, ids = run_schedule(engine, [(p, b, 0) for p, b in zip(prompts, budgets)], arrivals)
    if kind != "none":  # the drafters draft something the target keeps, so the check below has teeth
        assert sum(finished[i].stats.accepted for i in ids) > 0
    for prompt, budget, request_id in zip(prompts, budgets, ids):
        done = finished[request_id]
        assert done.token_ids == hf_greedy(target, prompt, budget)
        if kind != "none":  # the drafter forgot the row's last request: it drafts as for this one alone
            alone = generate(target, [prompt], drafter=drafter_of(kind, target), verifier=verifier, policy=policy,
                             max_new_tokens=budget, eos_token_id=[])
            assert done.stats.accepted == alone.stats.requests[0].accepted
        assert done.reason == "length" and done.stats.emitted == budget
        assert done.arrival_s <= done.first_token_s <= done.finish_s


def test_sampled_output_depends_only_on_the_requests_seed(target):
    """Bit-identical on CPU: a request alone through generate() and the same request among
    others arriving at other steps, under the same seed."""
    model = make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float32)
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    prompts = random_prompts(6, VOCAB, seed=4)
    seeds = [11, 22, 33, 44, 55, 66]
    drafter = ModelDrafter(perturbed_copy(model, 0.5))
    runs = [generate(model, [p], drafter=drafter, policy=FixedPolicy(3), max_new_tokens=10, sampling=sampling,
                     seed=[s], eos_token_id=[]) for p, s in zip(prompts, seeds)]
    with Engine(model, drafter, policy=FixedPolicy(3), max_rows=2, max_len=40, sampling=sampling,
                eos_token_id=[]) as engine:
        finished, ids = run_schedule(engine, [(p, 10, s) for p, s in zip(prompts, seeds)], [0, 0, 1, 4, 4, 7])
    alone = [run.sequences[0] for run in runs]
    assert [finished[i].token_ids for i in ids] == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # the seeds do matter
    # the drafter too drafts from the request's own seed: the same drafts, so the same acceptances
    assert [finished[i].stats.accepted for i in ids] == [run.stats.requests[0].accepted for run in runs]


def test_a_cancelled_request_frees_its_row_and_the_others_stay_exact(target):
    prompts = random_prompts(4, VOCAB, seed=21, min_len=3)
    with Engine(target, drafter_of("model", target), policy=FixedPolicy(2), max_rows=2, max_len=40,
                eos_token_id=[]) as engine:
        ids = [engine.add_request(p, max_new_tokens=12) for p in prompts]
        first = engine.step()
        assert first == [] and engine.num_running == 2 and engine.num_waiting == 2
        assert engine.cancel(ids[0]) and engine.cancel(ids[3])  # one running, one waiting
        assert not engine.cancel(ids[3])
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
    assert finished[ids[3]].reason == "cancelled" and finished[ids[3]].token_ids == []
    cancelled = finished[ids[0]]
    expected = hf_greedy(target, prompts[0], 12)
    assert cancelled.reason == "cancelled" and 1 <= len(cancelled.token_ids) < 12
    assert cancelled.token_ids == expected[: len(cancelled.token_ids)]
    for i in (1, 2):  # request 2 ran in the cancelled request's row
        assert finished[ids[i]].token_ids == hf_greedy(target, prompts[i], 12)


def test_requests_finishing_on_eos_as_others_are_admitted(target):
    """EOS is a token the first request emits early, so rows free up (and are refilled) while
    the others run; every output is the target's, cut after its first EOS."""
    prompts = random_prompts(6, VOCAB, seed=31, min_len=2)
    eos = hf_greedy(target, prompts[0], 12)[2]
    with Engine(target, drafter_of("model", target), policy=FixedPolicy(3), max_rows=2, max_len=40,
                eos_token_id=eos) as engine:
        finished, ids = run_schedule(engine, [(p, 12, 0) for p in prompts], [0, 0, 1, 1, 2, 2])
    reasons = set()
    for prompt, request_id in zip(prompts, ids):
        done = finished[request_id]
        assert done.token_ids == hf_greedy(target, prompt, 12, eos_token_id=eos)
        reasons.add(done.reason)
        assert done.reason == ("eos" if done.token_ids[-1] == eos else "length")
    assert reasons == {"eos", "length"}


def test_rows_are_reused_without_growth(target):
    """Forty requests through two rows: the caches are never reallocated and what the engine
    keeps does not grow with the number of requests served."""
    prompts = random_prompts(40, VOCAB, seed=41, max_len=10)
    with Engine(target, drafter_of("model", target), policy=FixedPolicy(2), max_rows=2, max_len=24,
                eos_token_id=[]) as engine:
        def serve(chunk):
            for p in chunk:
                engine.add_request(p, max_new_tokens=6)
            count = 0
            while engine.has_work():
                count += len(engine.step())
            return count

        assert serve(prompts[:10]) == 10
        cache = engine.runner.cache
        pointers = [t.data_ptr() for t in cache.keys + cache.values]
        tracemalloc.start()
        serve(prompts[10:20])
        before = tracemalloc.take_snapshot()
        assert serve(prompts[20:]) == 20
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        assert [t.data_ptr() for t in cache.keys + cache.values] == pointers
        assert engine.batch.token_ids.shape == (2, 24) and engine.num_running == engine.num_waiting == 0
    assert grown < 200_000, f"the engine's host memory grew by {grown} bytes over 20 requests"


def test_a_request_that_asks_for_no_tokens_finishes_at_admission(target):
    with Engine(target, max_rows=1, max_len=20, policy=FixedPolicy(0)) as engine:
        request = engine.add_request([1, 2, 3], max_new_tokens=0)
        (done,) = engine.step()
    assert done.id == request and done.token_ids == [] and done.reason == "length"


def test_bad_requests_and_engines_get_clear_errors(target):
    with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
        Engine(target, max_rows=0)
    with pytest.raises(ValueError, match="does not fit rows of max_len=8"):
        Engine(target, max_len=8, max_new_tokens=9)
    with Engine(target, max_rows=1, max_len=10, max_new_tokens=6, policy=FixedPolicy(0)) as engine:
        with pytest.raises(ValueError, match="needs 12 positions, but the engine's rows hold max_len=10"):
            engine.add_request(list(range(6)), max_new_tokens=6)
        with pytest.raises(ValueError, match="more than this engine's max_new_tokens=6"):
            engine.add_request([1], max_new_tokens=7)
        with pytest.raises(ValueError, match="vocabulary|token id"):
            engine.add_request([VOCAB + 5], max_new_tokens=2)


def test_a_second_user_of_the_same_target_on_the_thread_is_refused_while_an_engine_is_open(target):
    with Engine(target, max_rows=1, max_len=20, policy=FixedPolicy(0)) as engine:
        engine.add_request([1, 2, 3], max_new_tokens=4)
        engine.step()
        with pytest.raises(RuntimeError, match="already in use by an open Engine"):
            generate(target, [[4, 5]], max_new_tokens=2)
        done = []
        while engine.has_work():
            done += engine.step()
    assert [d.token_ids for d in done] == [hf_greedy(target, [1, 2, 3], 4)]
    assert generate(target, [[4, 5]], max_new_tokens=2).sequences == [hf_greedy(target, [4, 5], 2)]


def test_stream_callbacks_may_cancel_or_raise_and_the_engine_stays_whole(target):
    prompts = random_prompts(3, VOCAB, seed=51, min_len=2)
    with Engine(target, drafter_of("model", target), policy=FixedPolicy(2), max_rows=3, max_len=40,
                eos_token_id=[]) as engine:
        ids = [engine.add_request(p, max_new_tokens=10) for p in prompts]
        seen = {i: [] for i in ids}

        def cancelling(request_id, tokens):
            seen[request_id] += tokens
            if request_id == ids[0]:
                engine.cancel(ids[0])
                engine.cancel(ids[1])

        finished = {done.id: done for done in engine.step(stream=cancelling)}
        record = lambda i, t: seen[i].extend(t)  # noqa: E731
        finished.update((done.id, done) for done in engine.step(stream=record))  # the cancellations come here

        def failing(request_id, tokens):
            seen[request_id] += tokens
            raise KeyError("a callback's own error")

        with pytest.raises(KeyError):
            engine.step(stream=failing)
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step(stream=record))
    assert finished[ids[0]].reason == finished[ids[1]].reason == "cancelled"
    assert finished[ids[2]].token_ids == seen[ids[2]] == hf_greedy(target, prompts[2], 10)
    for i in ids[:2]:
        assert finished[i].token_ids == seen[i] == hf_greedy(target, prompts[i], 10)[: len(seen[i])]


def test_a_failed_prefill_puts_its_requests_back_in_the_queue(target, monkeypatch):
    prompts = random_prompts(2, VOCAB, seed=61, min_len=3)
    with Engine(target, max_rows=2, max_len=30, policy=FixedPolicy(0), eos_token_id=[]) as engine:
        ids = [engine.add_request(p, max_new_tokens=5) for p in prompts]
        real = Engine._prefill

        def out_of_memory(self, rows):
            monkeypatch.setattr(Engine, "_prefill", real)
            raise MemoryError("no room")

        monkeypatch.setattr(Engine, "_prefill", out_of_memory)
        with pytest.raises(MemoryError):
            engine.step()
        assert engine.num_waiting == 2 and engine.num_running == 0
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
    assert [finished[i].token_ids for i in ids] == [hf_greedy(target, p, 5) for p in prompts]


def test_eos_on_the_last_budgeted_token_is_reported_as_eos(target):
    prompt = random_prompts(1, VOCAB, seed=71, min_len=3)[0]
    expected = hf_greedy(target, prompt, 4)
    with Engine(target, max_rows=1, max_len=30, policy=FixedPolicy(0), eos_token_id=expected[3]) as engine:
        engine.add_request(prompt, max_new_tokens=4)
        done = []
        while engine.has_work():
            done += engine.step()
    assert expected[3] not in expected[:3]  # so the request ends on its fourth token, its last
    assert done[0].token_ids == expected and done[0].reason == "eos"


def test_a_drafter_drafting_for_an_open_engine_is_refused_elsewhere(target):
    drafter = drafter_of("model", target)
    other = make_model("llama", vocab_size=VOCAB, seed=9, dtype=torch.float64)
    with Engine(target, drafter, policy=FixedPolicy(2), max_rows=1, max_len=20):
        with pytest.raises(RuntimeError, match="already drafting for an open Engine"):
            generate(other, [[1, 2]], drafter=drafter, max_new_tokens=2)
    assert generate(other, [[1, 2]], drafter=drafter, max_new_tokens=2).sequences == [hf_greedy(other, [1, 2], 2)]


def test_learning_policies_start_a_refilled_rows_request_afresh_and_stay_exact(target):
    """GoodputPolicy: the new request's acceptance estimate is the population's again; BanditPolicy
    (request scope): its bandit has no pulls of the last request's."""
    from specdec.policies import BanditPolicy, GoodputPolicy
    from specdec.policies.cost_model import CostModel

    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.02, drafters=[{"tokens": 0.05}, {"tokens": 0.01}])
    prompts = random_prompts(4, VOCAB, seed=81, min_len=3)
    drafters = [ModelDrafter(perturbed_copy(target, 0.1)), ModelDrafter(perturbed_copy(target, 0.4, seed=2))]
    for policy in (GoodputPolicy(model, max_draft_tokens=3), BanditPolicy(num_draft_tokens=3)):
        with Engine(target, drafters, policy=policy, max_rows=1, max_len=64, eos_token_id=[]) as engine:
            engine.add_request(prompts[0], max_new_tokens=40)
            while engine.has_work():
                engine.step()
            if isinstance(policy, GoodputPolicy):
                assert policy.estimator.rate(0)[0] != pytest.approx(0.5)  # the first request taught it
            else:
                assert policy.bandits.counts[0].sum() > policy.warm_start * 2
            outputs = []
            for prompt in prompts[1:]:
                engine.add_request(prompt, max_new_tokens=10)
                engine.admit()  # admitted, not yet stepped
                if isinstance(policy, GoodputPolicy):  # and nothing of the last request is left to learn
                    assert policy.estimator.rate(0)[0] == pytest.approx(policy.population_rate)
                    assert not policy._records
                else:  # the population's warm start, a few pseudo-pulls, not the last request's pulls
                    warm = np.minimum(policy.population.counts[0], policy.warm_start)
                    assert np.array_equal(policy.bandits.counts[0], warm) and policy._previous[0] == -1
                while engine.has_work():
                    outputs += [done.token_ids for done in engine.step()]
        assert outputs == [hf_greedy(target, p, 10) for p in prompts[1:]]


def test_goodput_starts_a_refilled_row_at_the_pooled_acceptance_of_the_rows_so_far(target):
    """Two rows; when the shorter request ends, a new one takes its row. Its acceptance estimate
    starts at the accepted / judged draft tokens of every step of both rows so far (counted here
    from the step records: a rejected draft token is judged, the tokens after it are not, and a
    step cut short by the budget judges none beyond those accepted), not at the prior."""
    from specdec.policies import GoodputPolicy
    from specdec.policies.cost_model import CostModel

    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.02, drafters=[{"tokens": 0.001}])  # drafting pays
    prior = 0.2
    policy = GoodputPolicy(model, max_draft_tokens=3, prior=prior, min_gain=0.0)
    records, observe = [], policy.observe
    policy.observe = lambda record: (records.append(record), observe(record))
    prompts = random_prompts(3, VOCAB, seed=83, min_len=3)
    with Engine(target, drafter_of("model", target), policy=policy, max_rows=2, max_len=80, eos_token_id=[]) as engine:
        engine.add_request(prompts[0], max_new_tokens=40)
        engine.add_request(prompts[1], max_new_tokens=12)
        while len(engine.step()) == 0:
            pass
        accepted = judged = 0
        for record in records:
            for row in record.rows:
                drafted, emitted = int(record.num_drafted[row]), int(record.num_emitted[row])
                taken = min(int(record.num_accepted[row]), drafted)
                accepted += taken
                judged += taken + int(taken < drafted and emitted > taken)
        assert judged > 0 and abs(accepted / judged - prior) > 0.1
        engine.add_request(prompts[2], max_new_tokens=10)
        engine.admit()
        rates = policy.estimator.rate(0)
        assert min(abs(rates - accepted / judged)) < 1e-9, (rates, accepted / judged)
        assert policy.population_rate == pytest.approx(accepted / judged)


def test_each_request_stops_at_its_own_eos_and_min_new_tokens_blocks_only_its_own(target):
    """Three requests on one prompt-set, each with other EOS ids, beside each other: each output
    is Hugging Face's greedy decoding with that request's EOS (and the engine's min_new_tokens)."""
    prompts = random_prompts(3, VOCAB, seed=91, min_len=3)
    plain = [hf_greedy(target, p, 12) for p in prompts]
    eos_of = [[plain[0][1]], [], [plain[2][4], plain[2][6]]]  # an early EOS, none, two ids
    min_new = 3

    def expected(prompt, eos):
        input_ids = torch.tensor([prompt])
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=12,
                              min_new_tokens=min_new if eos else 0, eos_token_id=eos or None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    with Engine(target, drafter_of("model", target), policy=FixedPolicy(3), max_rows=3, max_len=40,
                eos_token_id=[], min_new_tokens=min_new) as engine:
        ids = [engine.add_request(p, max_new_tokens=12, eos_token_id=e) for p, e in zip(prompts, eos_of)]
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
    got = [finished[i].token_ids for i in ids]
    assert got == [expected(p, e) for p, e in zip(prompts, eos_of)]
    assert len(got[1]) == 12 and got[2][-1] in eos_of[2] and len(got[2]) < 12
    assert len(got[0]) >= min_new  # its EOS came at token 2: blocked until min_new_tokens
