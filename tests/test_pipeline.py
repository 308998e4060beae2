"""PipelinedEngine (SPIN's pipelined speculation): the rows are split into micro-batches and the
drafters draft for one while the target verifies another. Outputs equal the unpipelined
engine's (greedy: the target's own; sampled: the same tokens on the CPU), each verify pass holds one
micro-batch, and the next micro-batch is drafted between a verification's launch and its
commit. CPU, float64 (greedy) and float32 (sampled); the CUDA tests run the streams."""

import math

import numpy as np
import pytest
import torch

from specdec import Engine, PipelinedEngine, SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter, SelfSpeculativeDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import BanditPolicy, CostModel, FixedPolicy
from specdec.verifiers import DecomposedVerifier, PaddingFreeVerifier, TreeVerifier
from tests.test_engine import run_schedule
from tests.test_engine_sampling import mixed_steps  # noqa: F401 (a fixture)
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float64)


def components(kind, target):
    """-> (drafter(s), verifier, policy) of a kind of run."""
    small = lambda: ModelDrafter(perturbed_copy(target, 0.1))  # noqa: E731
    return {"model": lambda: (small(), None, FixedPolicy(3)),
            "lookup": lambda: (PromptLookupDrafter(), None, FixedPolicy(4)),
            "bandit": lambda: ([small(), PromptLookupDrafter()], None, BanditPolicy(num_draft_tokens=3)),
            "tree": lambda: (ModelDrafter(perturbed_copy(target, 0.1), tree=TreeSpec(depth=3, branching=2)),
                             TreeVerifier(), FixedPolicy(5)),
            "decomposed": lambda: (small(), DecomposedVerifier(0.0), FixedPolicy(4))}[kind]()


@pytest.mark.parametrize("kind", ["model", "lookup", "bandit", "tree", "decomposed"])
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_pipelined_greedy_output_is_the_targets(target, kind, micro_batches):
    prompts = random_prompts(7, VOCAB, seed=20 + micro_batches, min_len=2, max_len=16)
    drafter, verifier, policy = components(kind, target)
    out = generate(target, prompts, drafter=drafter, verifier=verifier, policy=policy, max_new_tokens=14,
                   eos_token_id=[5], pipeline=micro_batches)
    assert out.sequences == [hf_greedy(target, p, 14, eos_token_id=5) for p in prompts]


@pytest.mark.parametrize("kind", ["model", "tree"])
def test_pipelined_sampling_draws_the_unpipelined_engines_tokens(kind):
    """A fixed length: each row's drafts, its draft distributions and the target's draws are
    computed by the same operations on the same data as without pipelining."""
    target = make_model("llama", vocab_size=VOCAB, seed=4, dtype=torch.float32)
    prompts = random_prompts(6, VOCAB, seed=8, min_len=2, max_len=12)
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    outputs = []
    for pipeline in (1, 2):
        drafter, verifier, policy = components(kind, target)
        outputs.append(generate(target, prompts, drafter=drafter, verifier=verifier, policy=policy, max_new_tokens=16,
                                sampling=sampling, seed=11, eos_token_id=[], pipeline=pipeline, return_logprobs=True))
    assert outputs[0].sequences == outputs[1].sequences
    # log-probabilities to float32 rounding: a pass of other rows rounds a row's logits otherwise
    # in the last bit on the CPU too (plain decoding of 3 rows against 6 does)
    for ours, theirs in zip(outputs[0].logprobs, outputs[1].logprobs):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    # the requests did sample: a flat random model's draws differ from its greedy choices
    assert any(seq != hf_greedy(target, p, 16) for seq, p in zip(outputs[0].sequences, prompts))


class LoggingLookup(PromptLookupDrafter):
    """Prompt lookup that logs its commits (the rows each verified) into a shared list."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def commit(self, lengths_before, num_accepted):
        self.log.append(("commit", frozenset(np.flatnonzero(num_accepted >= 0).tolist())))


class LoggingPolicy(FixedPolicy):
    def __init__(self, k, log):
        super().__init__(k)
        self.log = log

    def plan(self, batch, num_drafters):
        self.log.append(("plan", frozenset(batch.active_rows().tolist())))
        return super().plan(batch, num_drafters)


class LoggingVerifier(PaddingFreeVerifier):
    def __init__(self, log):
        self.log = log

    def verify(self, runner, batch, draft, sampling, logprobs=False):
        self.log.append(("verify", frozenset(batch.active_rows().tolist())))
        return super().verify(runner, batch, draft, sampling, logprobs=logprobs)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_each_pass_holds_one_micro_batch_and_the_next_is_drafted_during_its_verification(target, micro_batches):
    rows = 7
    prompts = [p * 3 for p in random_prompts(rows, VOCAB, seed=5, min_len=3, max_len=6)]  # lookup finds matches
    log = []
    out = generate(target, prompts, drafter=LoggingLookup(log), verifier=LoggingVerifier(log),
                   policy=LoggingPolicy(3, log), max_new_tokens=12, eos_token_id=[], pipeline=micro_batches)
    assert out.sequences == [hf_greedy(target, p, 12) for p in prompts]
    verifies = [i for i, (what, _) in enumerate(log) if what == "verify"]
    assert len(verifies) >= 2 * micro_batches
    overlapped = 0
    for i in verifies:
        verified = log[i][1]
        assert 0 < len(verified) <= math.ceil(rows / micro_batches)
        # the draft it checks was planned for exactly these rows, in the step before
        assert next(r for what, r in reversed(log[:i]) if what == "plan" and r & verified) == verified
        commit = next(j for j in range(i + 1, len(log)) if log[j][0] == "commit")
        assert log[commit][1] == verified
        between = [r for what, r in log[i + 1:commit] if what == "plan"]  # drafted while it was verified
        assert len(between) <= 1 and not any(r & verified for r in between)
        overlapped += len(between)
    # every step overlaps but the first and those after a micro-batch has emptied
    assert overlapped >= len(verifies) - 2 * micro_batches
    assert set().union(*(log[i][1] for i in verifies)) == set(range(rows))


@pytest.mark.parametrize("schedule_seed", [0, 1, 2])
def test_pipelined_engine_serves_arrivals_and_cancellations_exactly(target, schedule_seed):
    """Requests arrive while others run, some are cancelled mid-flight (by a stream callback, in
    another micro-batch than the one just committed, too); every other request gets the
    target's greedy output, a cancelled one a prefix of it."""
    rng = np.random.default_rng(schedule_seed)
    prompts = random_prompts(10, VOCAB, seed=30 + schedule_seed, max_len=14)
    budgets = rng.integers(1, 13, size=len(prompts)).tolist()
    arrivals = np.sort(rng.integers(0, 14, size=len(prompts))).tolist()
    to_cancel = set(rng.choice(len(prompts), size=2, replace=False).tolist())
    with PipelinedEngine(target, ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(3), max_rows=4,
                         max_len=40, eos_token_id=[], micro_batches=2) as engine:
        ids, finished, step = [None] * len(prompts), {}, 0

        def cancel_some(request_id, tokens):
            for i in list(to_cancel):
                if ids[i] is not None and ids[i] != request_id:
                    engine.cancel(ids[i])
                    to_cancel.discard(i)
                    return

        while step <= max(arrivals) or engine.has_work():
            for i in np.flatnonzero(np.asarray(arrivals) == step):
                ids[i] = engine.add_request(prompts[i], max_new_tokens=budgets[i])
            finished.update((done.id, done) for done in engine.step(cancel_some if step % 3 == 2 else None))
            step += 1
        assert engine.num_running == 0 and not engine.num_waiting
    cancelled = 0
    for i, prompt in enumerate(prompts):
        done = finished[ids[i]]
        expected = hf_greedy(target, prompt, budgets[i])
        if done.reason == "cancelled":
            cancelled += 1
            assert done.token_ids == expected[: len(done.token_ids)]
        else:
            assert done.token_ids == expected, f"request {i}"
    assert cancelled >= 1


def test_schedule_reuse_in_a_long_run_frees_every_row(target):
    prompts = random_prompts(24, VOCAB, seed=9, max_len=10)
    with PipelinedEngine(target, PromptLookupDrafter(), policy=FixedPolicy(3), max_rows=5, max_len=30,
                         eos_token_id=[], micro_batches=2) as engine:
        finished, ids = run_schedule(engine, [(p, 6, 0) for p in prompts], [i // 3 for i in range(len(prompts))])
        assert engine.num_running == 0 and engine.batch.finished.all()
    assert [finished[i].token_ids for i in ids] == [hf_greedy(target, p, 6) for p in prompts]


def test_bad_pipelines_are_refused_clearly(target):
    with pytest.raises(ValueError, match="pipeline must be an int >= 1"):
        generate(target, [[1, 2]], pipeline=0)
    with pytest.raises(ValueError, match="pipeline must be an int >= 1"):
        generate(target, [[1, 2]], pipeline=True)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 2"):
        PipelinedEngine(target, micro_batches=1)
    with pytest.raises(ValueError, match="pipeline must be an int >= 1"):
        generate(target, [[1, 2]], pipeline=2.0)
    # a numpy integer is an int (a value from a sweep, say)
    assert generate(target, [[1, 2, 3]], max_new_tokens=3, eos_token_id=[], pipeline=np.int64(2)).sequences == \
        [hf_greedy(target, [1, 2, 3], 3)]
    with pytest.raises(ValueError, match="drafts from the target's own runner"):
        generate(target, [[1, 2, 3]], drafter=SelfSpeculativeDrafter(sink=1, window=3), pipeline=2)
    # the refused engine released the target: a plain call runs
    assert generate(target, [[1, 2, 3]], max_new_tokens=3, eos_token_id=[]).sequences == [hf_greedy(target, [1, 2, 3], 3)]


# ---- CUDA: the drafting stream, and drafters on a second GPU ------------------------------------
def _pipelined_against_plain(target, make_drafter, dtype_note):
    prompts = random_prompts(16, target.config.vocab_size, seed=40, min_len=8, max_len=40)
    outputs = {}
    for pipeline in (1, 2):
        outputs[pipeline] = generate(target, prompts, drafter=make_drafter(), policy=FixedPolicy(4), max_new_tokens=24,
                                     eos_token_id=[], attention="fast", cuda_graphs=True, pipeline=pipeline).sequences
    assert outputs[1] == outputs[2], dtype_note


@pytest.mark.cuda
def test_pipelined_on_one_gpu_with_graphs_equals_the_plain_engine():
    """float32, the drafting on a side stream while the target's graphs verify."""
    target = make_model("llama", vocab_size=512, num_layers=4, hidden=128, dtype=torch.float32, device="cuda")
    _pipelined_against_plain(target, lambda: ModelDrafter(perturbed_copy(target, 0.05), cuda_graphs=True),
                             "float32 on one GPU")


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_pipelined_serving_on_a_gpu_matches_the_plain_engine(graphs):
    """float32 on one GPU: arrivals over time, greedy and sampled requests side by side
    (per-request SamplingParams), with and without CUDA graphs: each request's tokens are those
    the plain Engine gives it under the same schedule."""
    target = make_model("llama", vocab_size=512, num_layers=4, hidden=128, dtype=torch.float32, device="cuda")
    small = perturbed_copy(target, 0.05)
    prompts = random_prompts(10, 512, seed=41, min_len=4, max_len=30)
    sampled = SamplingParams(temperature=0.8, top_p=0.9)
    requests = [(p, 6 + 2 * (i % 5), 100 + i, sampled if i % 2 else None) for i, p in enumerate(prompts)]
    arrivals = [0, 0, 0, 1, 2, 2, 4, 5, 7, 9]
    results = {}
    for engine_class, options in ((PipelinedEngine, {"micro_batches": 2}), (Engine, {})):
        with engine_class(target, ModelDrafter(small, cuda_graphs=graphs), policy=FixedPolicy(3), max_rows=4,
                          max_len=64, eos_token_id=[], attention="fast", cuda_graphs=graphs, **options) as engine:
            finished, ids = run_schedule(engine, requests, arrivals)
            results[engine_class] = [finished[i].token_ids for i in ids]
    assert results[PipelinedEngine] == results[Engine]
    assert any(results[Engine][i] != results[Engine][i - 1] for i in range(1, len(prompts)))  # not all alike


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (run `pytest -m cuda` on a machine "
                    "with two)")
def test_pipelined_with_the_drafter_on_a_second_gpu_equals_the_plain_engine():
    target = make_model("llama", vocab_size=512, num_layers=4, hidden=128, dtype=torch.float32, device="cuda:0")
    _pipelined_against_plain(target, lambda: ModelDrafter(perturbed_copy(target, 0.05).to("cuda:1"), cuda_graphs=True),
                             "float32, drafter on cuda:1")


# ---- review: stats, admission, per-request sampling, policies under pipelining --------------------
def _own_stats(stats):
    return (stats.steps, stats.drafted, stats.accepted, stats.emitted, stats.drafted_by_position,
            stats.accepted_by_position)


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("budget", [1, 3])
def test_generate_reports_each_requests_own_stats(target, micro_batches, budget):
    """generate() says request i holds row i, and its stats are read by row: a pipelined run must
    not hand a row freed early to a later request (with 3 micro-batches the third group's
    requests used to be admitted after the first group's had finished, into their rows). Each
    request's counts are the unpipelined run's (a fixed draft length over greedy rows: every
    count is the request's own)."""
    prompts = random_prompts(6, VOCAB, seed=5, min_len=3, max_len=10)
    outs = {}
    for pipeline in (1, micro_batches):
        outs[pipeline] = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)),
                                  policy=FixedPolicy(3), max_new_tokens=budget, eos_token_id=[], pipeline=pipeline)
    plain, piped = outs[1], outs[micro_batches]
    assert piped.sequences == plain.sequences
    assert [_own_stats(r) for r in piped.stats.requests] == [_own_stats(r) for r in plain.stats.requests]
    assert piped.stats.emitted == sum(map(len, piped.sequences))


def test_an_idle_engine_spreads_what_it_admits_over_every_micro_batch(target):
    """No draft is pending while nothing runs, so every group may take rows: generate() admits and
    prefills every prompt before its first step (prefill_time_s covers them all), and the first
    step verifies a group instead of only drafting one."""
    with PipelinedEngine(target, PromptLookupDrafter(), policy=FixedPolicy(3), max_rows=6, max_len=30,
                         eos_token_id=[], micro_batches=3) as engine:
        for p in random_prompts(6, VOCAB, seed=2, max_len=8):
            engine.add_request(p, max_new_tokens=4)
        assert len(engine.admit()) == 6 and engine.num_waiting == 0
        assert sorted(np.bincount(engine._group_of, minlength=3).tolist()) == [2, 2, 2]


def test_a_request_admitted_into_a_row_whose_cancelled_draft_is_pending_counts_only_its_own_drafts(target):
    """Row 1's request is cancelled while its draft awaits verification in the other group; a new
    request takes row 1 (in the drafting group) before that group is verified. The verification
    leaves row 1 out, and the new request's stats count none of its predecessor's draft tokens:
    they equal its stats alone."""
    prompts = random_prompts(5, VOCAB, seed=12, min_len=3, max_len=9)
    make = lambda: ModelDrafter(perturbed_copy(target, 0.1))  # noqa: E731
    with PipelinedEngine(target, make(), policy=FixedPolicy(3), max_rows=4, max_len=40, eos_token_id=[],
                         micro_batches=2) as engine:
        ids = [engine.add_request(p, max_new_tokens=1 if i == 2 else 8) for i, p in enumerate(prompts[:4])]
        late = []

        def cancel_and_add(request_id, tokens):
            if not late:
                assert engine._pending[1] is not None and engine._pending[1].draft.num_tokens[1] > 0
                assert engine.cancel(ids[1])  # its draft is pending in group 1
                late.append(engine.add_request(prompts[4], max_new_tokens=8))

        finished = {done.id: done for done in engine.step(cancel_and_add)}  # step 0: verifies group 0 (row 2 ends)
        finished.update((done.id, done) for done in engine.step())  # step 1: admits into row 1, verifies group 1
        assert engine._rows[1] is not None and engine._rows[1].id == late[0]  # the scenario happened
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
    alone = generate(target, [prompts[4]], drafter=make(), policy=FixedPolicy(3), max_new_tokens=8, eos_token_id=[])
    done = finished[late[0]]
    assert done.token_ids == alone.sequences[0] == hf_greedy(target, prompts[4], 8)
    assert _own_stats(done.stats) == _own_stats(alone.stats.requests[0])


@pytest.mark.parametrize("scope", ["request", "batch"])
def test_bandit_learns_under_pipelining_from_the_arms_its_rows_played(target, scope, monkeypatch):
    """BanditPolicy keeps each plan's arms, lengths and switches to reward the step that plan
    led to; under pipelining the next micro-batch is planned before the last one's step is
    observed, so those must be the observed rows' own (their last plan's), not the newest plan's
    (whose rows were the other group's: all asked for 0 tokens, nothing was ever learnt). Every
    reward goes to the arm the step's rows were planned with, and about as many are learnt as
    unpipelined."""
    from specdec.policies import bandit_state

    prompts = random_prompts(6, VOCAB, seed=5, min_len=3, max_len=10)
    original = bandit_state.BanditState.update
    pulls, wrong = {}, []
    for pipeline in (1, 2):
        policy = BanditPolicy(num_draft_tokens=3, scope=scope, cost_model=CostModel.from_coefficients(  # no clock
            c_fixed=1e-2, c_tok=1e-4, drafters=[{"steps": 2e-3}, {"fixed": 1e-4}]))
        step = {}  # the step being observed: {row: the arm its plan chose}
        learnt = []

        def spy(self, bandits, arms, rewards):
            if self is policy.bandits:
                for bandit, arm in zip(np.asarray(bandits).tolist(), np.asarray(arms).tolist()):
                    learnt.append(arm)
                    expected = {step[bandit]} if scope == "request" else set(step.values())
                    if arm not in expected:
                        wrong.append((pipeline, bandit, arm, dict(step)))
            return original(self, bandits, arms, rewards)

        monkeypatch.setattr(bandit_state.BanditState, "update", spy)
        observe = policy.observe

        def watch(record):
            step.clear()
            step.update({int(r): int(record.drafter_index[r]) for r in record.rows})  # the arm its plan chose
            return observe(record)

        policy.observe = watch
        out = generate(target, prompts, drafter=[ModelDrafter(perturbed_copy(target, 0.1)), PromptLookupDrafter()],
                       policy=policy, max_new_tokens=20, eos_token_id=[], pipeline=pipeline)
        assert out.sequences == [hf_greedy(target, p, 20) for p in prompts]
        pulls[pipeline] = len(learnt)
    assert not wrong
    assert pulls[2] >= pulls[1] // 2 > 0, pulls


def _goodput_run(target, pipeline, decide_every, spy=None):
    from specdec.policies import GoodputPolicy
    from tests.policies.test_policies_generate import Recording

    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.02, drafters=[{"tokens": 0.05}])  # drafting pays
    recording = Recording(GoodputPolicy(model, max_draft_tokens=4, prior=0.9, decide_every=decide_every),
                          withhold_times=True)  # synthetic seconds: no calibration against this host
    prompts = random_prompts(6, VOCAB, seed=5, min_len=3, max_len=10)
    out = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)), policy=recording,
                   max_new_tokens=16, eos_token_id=[], pipeline=pipeline)
    assert out.sequences == [hf_greedy(target, p, 16) for p in prompts]
    return recording


def test_goodput_with_decisions_every_two_steps_drafts_for_every_micro_batch(target):
    """decide_every=2 over two micro-batches: each micro-batch has its own GoodputPolicy copy
    (one_per_micro_batch), so a decision made for one group is never handed to the other's step
    (with one shared copy, the other group's rows got 0 tokens and drafting fell to 61%)."""
    shares = {}
    for pipeline in (1, 2):
        recording = _goodput_run(target, pipeline, decide_every=2)
        drafting = [r.num_drafted[r.rows] > 0 for r in recording.records]
        shares[pipeline] = np.concatenate(drafting).mean()
    assert shares[1] > 0.9  # drafting pays at every step unpipelined...
    assert shares[2] > 0.9, shares  # ...and pipelined


def test_goodput_learns_each_step_against_the_lengths_planned_for_its_rows(target, monkeypatch):
    """Each step is learnt against the lengths planned for its own rows (with one shared copy,
    the newest decision was the other micro-batch's, 0 for every row of the step: each row was
    taken for an idle one, pulled back towards the prior, its coverage never learnt)."""
    from specdec.policies import acceptance

    checked, mismatched = [0], []
    learn_step = acceptance.AcceptanceEstimator.learn_step

    def spy(self, record, asked, drafter_index, idle_weight):
        for row in record.rows:
            checked[0] += 1
            if (record.num_drafted[row] > 0) != (asked[row] > 0):
                mismatched.append((int(row), int(record.num_drafted[row]), int(asked[row])))
        return learn_step(self, record, asked, drafter_index, idle_weight)

    monkeypatch.setattr(acceptance.AcceptanceEstimator, "learn_step", spy)
    _goodput_run(target, 1, decide_every=1)
    assert checked[0] > 0 and not mismatched  # unpipelined: every row drafted as asked
    _goodput_run(target, 2, decide_every=1)
    assert not mismatched, mismatched[:5]


@pytest.mark.parametrize("kind,micro_batches,schedule_seed", [("model", 2, 0), ("model", 3, 1), ("lookup", 2, 2),
                                                             ("sampled tree", 2, 3), ("tree", 3, 4)])
def test_each_request_gets_what_it_gets_alone_with_its_own_sampling_params_under_pipelining(mixed_steps, kind,
                                                                                          micro_batches, schedule_seed):
    """Per-request SamplingParams (types.RowSampling) beside one another, in micro-batches, with
    staggered arrivals and log-probabilities: each request's tokens and accepted drafts are
    bit-identical to generate() on it alone (CPU, float32), its log-probabilities equal to
    rounding; greedy ones are the target's own."""
    from tests.test_engine_sampling import ENGINE_DEFAULT, GREEDY, PARAMS, drafter_of

    model = make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float32)
    rng = np.random.default_rng(schedule_seed)
    prompts = random_prompts(9, VOCAB, seed=60 + schedule_seed, min_len=2, max_len=14)
    budgets = (rng.integers(4, 13, size=len(prompts)) + (12 if kind == "lookup" else 0)).tolist()
    seeds = rng.integers(0, 2**31, size=len(prompts)).tolist()
    arrivals = np.sort(rng.integers(0, 8, size=len(prompts))).tolist()
    params = [PARAMS[(i + schedule_seed) % len(PARAMS)] for i in range(len(prompts))]
    trees = kind in ("tree", "sampled tree")
    policy, verifier = FixedPolicy(4 if trees else 3), TreeVerifier() if trees else None
    with PipelinedEngine(model, drafter_of(kind, model), verifier, policy=policy, max_rows=4, max_len=64,
                         sampling=ENGINE_DEFAULT, eos_token_id=[], return_logprobs=True,
                         micro_batches=micro_batches) as engine:
        finished, ids = run_schedule(engine, list(zip(prompts, budgets, seeds, params)), arrivals)
    assert mixed_steps, "no pass held rows with different sampling parameters: the test checks nothing"
    accepted = 0
    for prompt, budget, seed, own, request_id in zip(prompts, budgets, seeds, params, ids):
        done = finished[request_id]
        own = ENGINE_DEFAULT if own is None else own
        alone = generate(model, [prompt], drafter=drafter_of(kind, model), verifier=verifier, policy=policy,
                         max_new_tokens=budget, sampling=own, seed=[seed], eos_token_id=[], return_logprobs=True)
        assert done.token_ids == alone.sequences[0], own
        assert done.stats.accepted == alone.stats.requests[0].accepted, own
        np.testing.assert_allclose(done.logprobs, alone.logprobs[0], rtol=0, atol=1e-5)
        if own == GREEDY:
            assert done.token_ids == hf_greedy(model, prompt, budget)
        accepted += done.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("max_rows,micro_batches,kind", [(1, 2, "model"), (2, 3, "model"), (1, 3, "model"),
                                                          (3, 2, "model"), (5, 2, "model"), (3, 2, "tree"),
                                                          (2, 3, "decomposed"), (4, 2, "bandit")])
def test_small_engines_serve_every_request_as_the_plain_engine_does(target, max_rows, micro_batches, kind):
    """Fewer rows than micro-batches (a group's share is one row, some groups stay empty), one
    row, and odd shares; chains, token trees, decomposed verification, two drafters under a
    bandit; requests with budget 0, an EOS token, a stop sequence and
    min_new_tokens, arrivals while others run and one cancellation from a stream callback: every
    request is served, in a bounded number of steps, with the plain Engine's tokens, reason and
    log-probabilities (the plain Engine's outputs are the target's own: test_engine.py)."""
    rng = np.random.default_rng(max_rows * 10 + micro_batches)
    prompts = random_prompts(9, VOCAB, seed=70 + max_rows, min_len=2, max_len=12)
    budgets = [0 if i % 4 == 3 else int(b) for i, b in enumerate(rng.integers(1, 12, size=len(prompts)))]
    budgets[0] = budgets[1] = 10  # they reach their EOS and stop sequence
    budgets[-1] = 20  # it runs past its first step, where the stream callback cancels it
    arrivals = np.sort(rng.integers(0, 10, size=len(prompts))).tolist()
    eos = hf_greedy(target, prompts[0], 6)[4]  # the first request stops early, after min_new_tokens
    stop = hf_greedy(target, prompts[1], 8)[2:4]
    options = dict(max_rows=max_rows, max_len=40, eos_token_id=[eos], min_new_tokens=2, stop_sequences=[stop],
                   return_logprobs=True)
    results = []
    for engine_class, extra in ((PipelinedEngine, {"micro_batches": micro_batches}), (Engine, {})):
        cancel_id = []
        drafter, verifier, policy = components(kind, target)
        with engine_class(target, drafter, verifier, policy, **options, **extra) as engine:
            ids, finished, step = [None] * len(prompts), {}, 0

            def cancel_one(request_id, tokens):  # the last request, once it has a token or two
                if ids[-1] is not None and request_id == ids[-1] and not cancel_id:
                    cancel_id.append(request_id)
                    engine.cancel(request_id)

            while step <= max(arrivals) or engine.has_work():
                assert step < 500, "the engine stopped making progress"
                for i in np.flatnonzero(np.asarray(arrivals) == step):
                    ids[i] = engine.add_request(prompts[i], max_new_tokens=budgets[i])
                finished.update((done.id, done) for done in engine.step(cancel_one))
                step += 1
            assert engine.num_running == 0 and not engine.num_waiting and engine.batch.finished.all()
        results.append([finished[i] for i in ids])
    for ours, plain in zip(*results):
        assert ours.reason == plain.reason
        if plain.reason == "cancelled":  # at its first tokens: as many as its first draft kept (a bandit's choice)
            n = min(len(ours.token_ids), len(plain.token_ids))
            assert n > 0 and ours.token_ids[:n] == plain.token_ids[:n]
            np.testing.assert_allclose(ours.logprobs[:n], plain.logprobs[:n], rtol=0, atol=1e-9)
            continue
        assert ours.token_ids == plain.token_ids
        np.testing.assert_allclose(ours.logprobs, plain.logprobs, rtol=0, atol=1e-9)
    plain = results[1]
    assert plain[0].reason == "eos" and len(plain[0].token_ids) <= 5  # its EOS (or the stop sequence before it)
    assert plain[1].reason == "eos" and len(plain[1].token_ids) <= 4  # the stop sequence (or an EOS before it)
    assert plain[-1].reason == "cancelled" and len(plain[-1].token_ids) < 20
    assert [len(plain[i].token_ids) for i in range(3, len(prompts), 4)] == [0, 0]  # budget 0


def test_a_micro_batch_that_empties_gives_its_turn_away(target):
    """Two short requests in one micro-batch and two long ones in the other: once the short ones
    finish, every step still verifies (no step that only drafts), and outputs stay exact."""
    log = []
    prompts = random_prompts(4, VOCAB, seed=17, min_len=3, max_len=8)
    budgets = [2, 14, 2, 14]  # the idle engine admits round robin: rows 0 and 2 share a micro-batch
    with PipelinedEngine(target, LoggingLookup(log), LoggingVerifier(log), policy=FixedPolicy(3), max_rows=4,
                         max_len=40, eos_token_id=[], micro_batches=2) as engine:
        ids = [engine.add_request(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
        finished, steps, verifies_before = {}, 0, 0
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
            steps += 1
            verifies = sum(what == "verify" for what, _ in log)
            assert verifies == verifies_before + 1, f"step {steps} verified {verifies - verifies_before} passes"
            verifies_before = verifies
    assert [finished[i].token_ids for i in ids] == [hf_greedy(target, p, b) for p, b in zip(prompts, budgets)]
