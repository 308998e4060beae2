"""What the policy experiments add to the policy package: profile() with the decoding loop's
per-step overhead folded into the target's fixed term (and saved with the model), a CostModel
restricted to some of its drafters, the acceptance rate fitted to measured tau per length (a
policy's prior), GoodputPolicy skipping the estimator when no row was asked to draft; and, on
a GPU, profile(cuda_graphs=True) timing the runner generate() then reuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.batch import BatchState
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import (
    CostModel,
    FixedPolicy,
    GoodputPolicy,
    ProfileGrid,
    expected_emitted,
    profile,
    rate_from_expected_tokens,
)
from specdec.policies.calibration import StepTimeCalibration
from specdec.policies.step_time import LinearStepTime
from specdec.runner import runners_of
from specdec.stats import StepRecord
from specdec.types import VerifyCost
from tests.tiny import make_model, perturbed_copy, random_prompts


def test_step_overhead_is_measured_and_folded_into_the_fixed_term(tmp_path, monkeypatch):
    """profile(step_overhead=True) adds what _step_overhead measured to the target's fixed term
    and records it. The measurement is a difference of timings (it can come out 0 on a loaded
    machine), so here it is replaced by a known value; the next test checks the measurement."""
    from specdec.policies import profiling

    target = make_model("llama", dtype=torch.float32)
    drafters = [ModelDrafter(perturbed_copy(target, 0.1)), PromptLookupDrafter()]
    grid = ProfileGrid.tiny()
    plain = profile(target, drafters, device="cpu", grid=grid)
    monkeypatch.setattr(profiling, "_step_overhead", lambda *args, **kwargs: 0.25)  # far above any CPU step here
    with_loop = profile(target, drafters, device="cpu", grid=grid, step_overhead=True)
    print(plain.describe(), with_loop.describe(), sep="\n")
    assert plain.step_overhead_s == 0.0 and with_loop.step_overhead_s == 0.25
    assert with_loop.target.coefficient("fixed") >= 0.25 > plain.target.coefficient("fixed")
    assert "per-step loop overhead" in with_loop.describe()
    with_loop.save(tmp_path / "model.json")
    loaded = CostModel.load(tmp_path / "model.json")
    assert loaded.step_overhead_s == with_loop.step_overhead_s and loaded.as_dict() == with_loop.as_dict()
    # files written before the field existed still load
    data = with_loop.as_dict()
    del data["step_overhead_s"]
    assert CostModel.from_dict(data).step_overhead_s == 0.0


def test_step_overhead_is_the_measured_step_beyond_the_predicted_forward():
    """Against a target model that predicts a free forward pass, the overhead is the whole
    measured plain step, which takes real time; against one that predicts an hour, it is 0."""
    from specdec.policies.cost_model import TARGET_FEATURES, LinearTimeModel
    from specdec.policies.profiling import _step_overhead

    target = make_model("llama", dtype=torch.float32)
    args = (target, None, 8, 4, [1, 2], target.config.vocab_size, torch.Generator().manual_seed(0), {})
    free = LinearTimeModel(list(TARGET_FEATURES), np.zeros(len(TARGET_FEATURES)))
    dear = LinearTimeModel(list(TARGET_FEATURES), np.array([3600.0] + [0.0] * (len(TARGET_FEATURES) - 1)))
    assert _step_overhead(*args[:1], free, *args[2:]) > 0
    assert _step_overhead(*args[:1], dear, *args[2:]) == 0.0


def test_subset_keeps_the_target_and_the_chosen_drafters():
    model = CostModel.from_coefficients(1.0, 0.1, drafters=[{"fixed": 1.0}, {"fixed": 2.0}, {"fixed": 3.0}],
                                        identity="x", device_name="y")
    model.step_overhead_s = 0.25
    part = model.subset([2, 0])
    assert [d.coefficient("fixed") for d in part.drafters] == [3.0, 1.0]
    assert part.target is model.target and part.key == model.key and part.step_overhead_s == 0.25


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.62, 0.9, 1.0])
def test_rate_from_expected_tokens_recovers_the_iid_rate(rate):
    measured = {s: float(expected_emitted(rate, s)) for s in (1, 2, 4, 8)}
    assert rate_from_expected_tokens(measured) == pytest.approx(rate, abs=1e-3)
    noisy = {s: v * (1.02 if s % 2 else 0.98) for s, v in measured.items()}
    assert rate_from_expected_tokens(noisy) == pytest.approx(rate, abs=0.05)
    with pytest.raises(ValueError):
        rate_from_expected_tokens({})


def test_goodput_policy_learns_nothing_from_a_step_without_drafting():
    model = CostModel.from_coefficients(1.0, 0.01, drafters=[{"steps": 5.0}])  # drafting never pays
    policy = GoodputPolicy(model, max_draft_tokens=4)
    batch = BatchState([np.arange(10)] * 3, 50, np.arange(3), np.zeros(0, dtype=np.int64))
    plan = policy.plan(batch, 1)
    assert plan.num_draft_tokens.tolist() == [0, 0, 0]
    before = policy.estimator._rate.copy(), policy.estimator._coverage.copy(), policy.estimator.observed.copy()
    zeros = np.zeros(3, dtype=np.int64)
    policy.observe(StepRecord(0, np.arange(3), zeros, zeros, zeros, zeros + 1, 0.0, 1.0, VerifyCost(3, 0)))
    after = policy.estimator._rate, policy.estimator._coverage, policy.estimator.observed
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.cuda
def test_profile_with_graphs_times_the_runner_generate_reuses():
    target = make_model("llama", dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True)
    prompts = random_prompts(4, target.config.vocab_size, seed=3, min_len=24, max_len=24)
    options = {"attention": "fast", "cuda_graphs": True}
    first = generate(target, prompts, drafter=drafter, policy=FixedPolicy(4), max_new_tokens=40, **options)  # builds the runners
    runner = runners_of(target)["target"]
    grid = ProfileGrid(batch_sizes=(1, 4), tokens_per_row=(1, 5), context_lengths=(8, 24), draft_lengths=(1, 4),
                       repeats=2, warmup=1)
    model = profile(target, [drafter], grid=grid, step_overhead=True, **options)
    assert runners_of(target)["target"] is runner  # covered: reused, not rebuilt, and not released
    assert runner.graphs is not None and model.num_drafters == 1
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(4), max_new_tokens=40, **options)
    assert runners_of(target)["target"] is runner
    assert out.sequences == first.sequences  # profiling over the same runner and cache left them sound


def _record(asked, emitted, seconds, plan_seconds=0.0):
    rows = np.arange(len(asked))
    asked, emitted = np.asarray(asked), np.asarray(emitted)
    return StepRecord(0, rows, np.zeros_like(asked), asked, emitted - 1, emitted, 0.0, 0.0, VerifyCost(0, 0),
                      step_time_s=seconds, plan_time_s=plan_seconds)


def _run_calibrated(policy, batch, steps, measured_time):
    """Plan and observe ``steps`` steps, each accepting min(k, 3) tokens per row and measured at
    measured_time(asked) seconds -> the lengths of every plan."""
    plans = []
    for _ in range(steps):
        asked = policy.plan(batch, 1).num_draft_tokens
        plans.append(asked.copy())
        policy.observe(_record(asked, np.minimum(asked, 3) + 1, measured_time(asked)))
    return plans


def test_goodput_calibration_switches_speculation_off_once_it_measures_what_it_costs():
    """The cost model promises cheap drafting (a k = 4 step predicted at 1.2 s against 1 s plain,
    for about 3.4 tokens per row); the measured drafting cost is 40x the prediction (k = 4: 3 s).
    After a few measured steps the policy decodes plainly; when the measurements match the
    model, it keeps drafting."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 200, np.arange(4), np.zeros(0, dtype=np.int64))

    def measured(slowdown):
        return lambda asked: 1.0 + (0.05 * asked.max() * slowdown if asked.any() else 0.0)

    def drafting_after(slowdown, steps=12):
        policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
        _run_calibrated(policy, batch, steps, measured(slowdown))
        return policy.plan(batch, 1).num_draft_tokens.max(), policy

    k, policy = drafting_after(slowdown=40.0)
    assert k == 0 and policy.calibration.extra_scale[4] > 10
    k, policy = drafting_after(slowdown=1.0)
    # drafting measured as modelled: the host's speed reads 1, and no plain probe was needed, so
    # the shape (learnt from drafting steps beside plain ones) stays the model's
    assert k == 4 and policy.calibration.base_scale[4] == pytest.approx(1.0) and 4 not in policy.calibration.extra_scale


def test_goodput_calibration_probes_again_now_and_then_but_mostly_decodes_plainly():
    """With drafting measured 40x dearer than modelled, the policy decodes plainly on most steps
    but measures speculation again after 64 steps without drafting (REPROBE_AFTER), so one slow
    measurement cannot rule it out for good."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 1000, np.arange(4), np.zeros(0, dtype=np.int64))

    assert StepTimeCalibration.REPROBE_AFTER == 64

    def drafting_steps():
        policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
        plans = _run_calibrated(policy, batch, 400, lambda asked: 1.0 + (2.0 * asked.max() if asked.any() else 0.0))
        return [i for i, p in enumerate(plans) if p.any()]

    probing = drafting_steps()
    assert min(probing) == 0 and 5 not in probing  # the first steps draft, then speculation goes off
    late = [i for i in probing if i >= 5]
    # a probe is four drafting steps: the first carries the drafter's catch-up and is not
    # measured, the next three give the median of three samples, which switches speculation off
    probes = [i for i in late if i - 1 not in late]
    assert all(all(i + j in late for j in (1, 2, 3)) and i + 4 not in late for i in probes)
    assert 4 <= len(probes) <= 400 // 64 + 1  # it comes back, once per 64 plain steps at most
    assert all(b - a >= 64 for a, b in zip(probes, probes[1:]))


def test_goodput_calibration_shortens_drafts_when_drafting_costs_more_than_modelled():
    """Calibrating what drafting adds (not the whole step) moves the argmax: with each draft
    pass measured at 10x its predicted cost, the policy drafts fewer tokens but still drafts."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.01}])
    batch = BatchState([np.arange(10)] * 4, 200, np.arange(4), np.zeros(0, dtype=np.int64))
    policy = GoodputPolicy(model, max_draft_tokens=8, prior=0.8)
    plans = _run_calibrated(policy, batch, 12, lambda asked: 1.0 + 0.1 * asked.max())
    assert plans[0].max() == 8  # the model as profiled: drafting is nearly free
    assert policy.calibration.extra_scale[4] == pytest.approx(10.0)
    # the next choice is the argmax of goodput with each draft pass at 0.1 s (10 x 0.01), from
    # the estimator's current acceptance: 4 rows x E[tau](k) / (1 + 0.1 k), over k = 0..8
    alpha = policy.estimator.rate(0)[0]
    coverage = policy.estimator.coverage(0)[0]
    goodput = [4 * (1 + coverage * sum(alpha ** (j + 1) for j in range(k))) / (1 + 0.1 * k) for k in range(9)]
    chosen = policy.plan(batch, 1).num_draft_tokens.tolist()
    assert chosen == [int(np.argmax(goodput))] * 4
    assert 1 <= chosen[0] < 8  # shorter than as profiled, but still drafting


def test_goodput_calibration_is_kept_per_bucket_of_active_rows():
    """Drafting measured 40x too slow at 64 active rows switches a batch of 64 to plain decoding
    (after a plain probe beside the drafting steps), and a batch of 2 rows, never measured, still
    drafts (its bucket starts at the model)."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    wide = BatchState([np.arange(10)] * 64, 200, np.arange(64), np.zeros(0, dtype=np.int64))
    plans = _run_calibrated(policy, wide, 8, lambda asked: 1.0 + (2.0 * asked.max() if asked.any() else 0.0))
    assert plans[0].max() == 4 and any(p.max() == 0 for p in plans)  # drafted, then probed plain steps
    assert policy.plan(wide, 1).num_draft_tokens.max() == 0 and set(policy.calibration.extra_scale) == {64}
    assert policy.calibration.extra_scale[64] == pytest.approx(40.0)
    narrow = BatchState([np.arange(10)] * 2, 200, np.arange(2), np.zeros(0, dtype=np.int64))
    assert policy.plan(narrow, 1).num_draft_tokens.max() == 4


def test_goodput_calibration_ignores_the_first_drafting_step():
    """A model drafter's first step also reads the whole prompt; that one slow step must not
    switch speculation off."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 200, np.arange(4), np.zeros(0, dtype=np.int64))
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    times = iter([50.0] + [1.2] * 10)
    plans = _run_calibrated(policy, batch, 6, lambda asked: next(times))
    # the host's speed reads 1 from the steps after it (the 50 s step left out), so no plain probe
    assert all(p.max() == 4 for p in plans) and policy.calibration.base_scale[4] == pytest.approx(1.0)


def test_goodput_calibration_leaves_out_the_policys_own_plan():
    """A step's wall time includes the policy's own plan (StepRecord.plan_time_s), which the cost
    model does not predict. With a 1.4 s plan in every step (seven times what k = 4 adds, 0.2 s),
    the calibration still reads the steps as modelled (speed 1) and the policy keeps drafting;
    fed the same steps as if the plan were decoding, the drafting steps run 2.2x their prediction
    at speed 1 and the policy takes a plain probe after its three samples (whose plain steps then
    carry the plan too, so the speed, not the shape, takes it up: a plan in every step does not
    make drafting dearer, where a calibration of residuals read it as 8x). (Deciding
    every 16 steps, as the bench does, a decision's work lands on one step in 16, but at a call's
    tail, where rows finishing bring decisions forward, on most of the few drafting steps a bucket
    of active rows gets.)"""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 200, np.arange(4), np.zeros(0, dtype=np.int64))

    def run_with(plan_reported):
        policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8, min_gain=0.5)
        plans = []
        for _ in range(6):
            asked = policy.plan(batch, 1).num_draft_tokens
            plans.append(asked.copy())
            seconds = 1.4 + 1.0 + 0.05 * asked.max()  # plan + decoding as modelled
            policy.observe(_record(asked, np.minimum(asked, 3) + 1, seconds, 1.4 if plan_reported else 0.0))
        return plans, policy

    plans, policy = run_with(plan_reported=True)
    assert all(p.max() == 4 for p in plans) and policy.calibration.base_scale[4] == pytest.approx(1.0)
    plans, policy = run_with(plan_reported=False)
    assert plans[3].max() == 4 and plans[4].max() == 0 and policy.calibration.base_scale[4] == pytest.approx(2.6 / 1.2)


def test_goodput_calibration_ignores_the_catch_up_step_after_a_pause():
    """After speculation was off for a while, the first step back also feeds the drafter every
    token it missed (slow); calibrating on it would switch speculation off again for good. Here
    drafting is measured slow three times, so the policy stops; when it tries again after 64 idle
    steps the catch-up step is ignored, and the accurate steps after it keep it drafting."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 1000, np.arange(4), np.zeros(0, dtype=np.int64))
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    state = {"step": 0, "previous": 0}

    def measured(asked):
        drafting = int(asked.max())
        if state["step"] in (1, 2, 3):
            seconds = 1.0 + 2.0 * drafting  # three slow measurements: speculation goes off
        elif drafting and not state["previous"]:
            seconds = 50.0  # catch-up on the missed tokens
        else:
            seconds = 1.0 + 0.05 * drafting  # as modelled
        state["step"] += 1
        state["previous"] = drafting
        return seconds

    plans = _run_calibrated(policy, batch, 120, measured)
    assert plans[3].max() == 4 and plans[4].max() == 0  # off after the third slow step
    assert all(p.max() == 4 for p in plans[-20:])  # back on, and staying on


def test_shrunk_rates_pull_thin_evidence_to_the_batch_and_keep_long_records():
    from specdec.policies.finish import POOLED_PRIOR_TRIALS as PRIOR_TRIALS, shrunk_rates

    successes = np.array([30.0, 0.0, 2.0, 0.0])
    trials = np.array([40.0, 1.0, 20.0, 0.0])
    rates = shrunk_rates(successes, trials, prior_rate=0.5, prior_trials=4.0)
    pooled = (32.0 + PRIOR_TRIALS * 0.5) / (61.0 + PRIOR_TRIALS)
    assert rates == pytest.approx((successes + 4.0 * pooled) / (trials + 4.0))
    assert rates[3] == pytest.approx(pooled)  # no evidence: the batch's rate
    assert rates[1] > 0.35  # one rejection is not a straggler
    assert rates[2] < 0.25  # twenty judged tokens, two accepted: it is
    assert np.all((rates >= 0) & (rates <= 1))
    assert shrunk_rates(np.zeros(3), np.zeros(3), prior_rate=0.7) == pytest.approx([0.7] * 3)


@pytest.mark.parametrize("seed", range(4))
def test_finish_reads_rows_of_one_rate_as_one_rate(seed):
    from specdec.policies.finish import shrunk_rates

    """64 rows of the same acceptance rate 0.75 (each step a geometric run of accepted tokens),
    16 steps: the "finish" search, which the lowest row's rate decides, reads every row within
    0.2 of the truth (shrunk decayed counts); the per-step EMA of rates, which "exact" uses,
    reads its lowest row below 0.5 (seen: 0.32-0.42), a straggler that is not."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.001, drafters=[{"steps": 0.05}])
    rng = np.random.default_rng(seed)
    batch = BatchState([np.arange(10)] * 64, 200, np.arange(64), np.zeros(0, dtype=np.int64))
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.75, search="finish")
    for _ in range(16):
        asked = policy.plan(batch, 1).num_draft_tokens
        accepted = np.minimum(rng.geometric(0.25, size=64) - 1, asked)
        policy.observe(_record(asked, accepted + 1, None))  # no wall time: the model stays as given
    policy.plan(batch, 1)  # the decision learns from the steps
    rates = policy.finish_rates
    finish_rates = shrunk_rates(rates.successes, rates.trials, 0.75, rates.row_prior_trials())
    ema_rates = policy.estimator.rate(0)
    assert np.all(np.abs(finish_rates - 0.75) < 0.2)
    assert ema_rates.min() < 0.5


def test_goodput_calibration_is_not_moved_by_one_slow_step():
    """A single step slowed down by something else (a garbage collection) neither switches
    speculation off nor shortens drafts: the calibration is a median of recent steps."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    batch = BatchState([np.arange(10)] * 4, 200, np.arange(4), np.zeros(0, dtype=np.int64))
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    times = iter([1.2] * 5 + [50.0] + [1.2] * 10)
    plans = _run_calibrated(policy, batch, 12, lambda asked: next(times))
    assert all(p.max() == 4 for p in plans) and policy.calibration.base_scale[4] == pytest.approx(1.0)


def test_goodput_calibration_reads_a_slow_host_as_slow_not_as_dear_drafting():
    """A history served on a host twice as slow in every step (plain and drafting alike, drafting
    as the model's shape says) keeps drafting, after one plain probe of PROBE_STEPS steps: the
    drafting steps alone run 2x their prediction at speed 1, which a slow host and drafting 7x
    dearer than modelled would both explain, and the plain steps beside them tell the two apart.
    The next call, on a host of normal speed, drafts from its first decision, and probes once more
    (its drafting steps run at half the speed the last plain steps showed). A calibration of
    residuals read drafting 7x dearer and decoded plainly (BENCHMARKS run 21)."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    probe = StepTimeCalibration.PROBE_STEPS

    def call(slowdown, steps=40):
        batch = BatchState([np.arange(10)] * 4, 1000, np.arange(4), np.zeros(0, dtype=np.int64))
        return _run_calibrated(policy, batch, steps, lambda asked: slowdown * (1.0 + 0.05 * int(asked.max())))

    slow = call(2.0)
    assert sum(p.max() == 0 for p in slow) == probe and slow[-1].max() == 4
    assert policy.calibration.extra_scale[4] == pytest.approx(1.0) and policy.calibration.base_scale[4] == pytest.approx(2.0)
    normal = call(1.0)
    assert normal[0].max() == 4 and sum(p.max() == 0 for p in normal) == probe and normal[-1].max() == 4
    assert policy.calibration.extra_scale[4] == pytest.approx(1.0) and policy.calibration.base_scale[4] == pytest.approx(1.0)


def test_goodput_calibration_leaves_out_the_steps_that_switch_between_drafting_and_plain():
    """Drafting costs 3x what the model says (k = 4: 1.6 s against a plain 1 s); the first plain
    step after a drafting one costs 1.6 s and the first drafting step after a plain one 1.44x
    (both as the GPU runs 21 and 22 measured at 16 and 64 rows). The plain probe pairs the
    drafting steps with its clean plain step only, so the shape reads 3; fed the switches, the
    probe's median plain speed read 1.3 and the shape about 1.2."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
    batch = BatchState([np.arange(10)] * 4, 1000, np.arange(4), np.zeros(0, dtype=np.int64))
    state = {"previous": None}

    def measured(asked):
        drafting, previous = bool(asked.any()), state["previous"]
        state["previous"] = drafting
        seconds = 1.0 + 0.15 * int(asked.max())
        if previous is not None and drafting != previous:
            seconds = 1.6 if not drafting else 1.44 * seconds
        return seconds

    plans = _run_calibrated(policy, batch, 40, measured)
    assert sum(p.max() == 0 for p in plans) == StepTimeCalibration.PROBE_STEPS and plans[-1].max() == 4
    assert policy.calibration.extra_scale[4] == pytest.approx(3.0)


def test_calibration_pairs_drafting_and_plain_steps_of_one_call_only():
    """The shape moves only on drafting and plain steps measured within PAIR_STEPS of each other
    in one call: plain steps of an earlier call pair with none; plain steps right after do, and
    give (m / p - P0) / E. A plain probe is asked for when unpaired drafting steps run more than
    PROBE_TOLERANCE off their prediction at the recent plain speed, at most once per PROBE_EVERY
    of the bucket's steps."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    step_time = LinearStepTime.from_cost_model(model, np.full(4, 10.0))  # plain 1 s, k = 4 adds 0.2 s
    wide_time = LinearStepTime.from_cost_model(model, np.full(8, 10.0))  # another bucket (8 rows)
    k, plain = np.full(4, 4), np.zeros(4, dtype=np.int64)
    calibration = StepTimeCalibration()
    calibration.observe(step_time, plain, [2.0] * 3)  # plain steps at twice the model
    calibration.new_call()
    calibration.observe(step_time, k, [2.4] * 3)  # drafting: 1.2 x 2
    assert calibration.extra_scale == {} and calibration.measured(4)  # no pair across calls
    assert not calibration.wants_plain_probe(4)  # at the last plain speed known (2), as predicted
    calibration.observe(step_time, k, [4.0] * 5)  # 1.67x the prediction at that speed
    assert calibration.wants_plain_probe(4)
    calibration.probed(4)
    assert not calibration.wants_plain_probe(4)  # once per PROBE_EVERY of the bucket's steps
    calibration.observe(step_time, plain, [1.0] * 2)  # the probe: the host is at speed 1
    assert sorted(calibration._extra_samples[4]) == pytest.approx([7.0] * 3 + [15.0] * 5)  # (2.4 - 1) / 0.2, (4 - 1) / 0.2
    assert calibration.extra_scale[4] == pytest.approx(15.0)
    assert calibration.apply(step_time, 4)(k) == pytest.approx(calibration.base_scale[4] * (1.0 + 15.0 * 0.2))
    for _ in range(StepTimeCalibration.PROBE_EVERY // 3):  # drafting 8x off, alone in calls of their own
        assert not calibration.wants_plain_probe(4)
        calibration.new_call()
        calibration.observe(step_time, k, [0.5] * 3)
    assert calibration.wants_plain_probe(4)  # PROBE_EVERY of the bucket's steps after the last probe

    within = StepTimeCalibration()
    within.observe(step_time, k, [2.4])
    within.observe(wide_time, plain[:1].repeat(8), [1.0] * (StepTimeCalibration.PAIR_STEPS - 1))  # the clock runs on
    within.observe(step_time, plain, [1.0])  # PAIR_STEPS steps after the drafting step: a pair
    assert list(within._extra_samples[4]) == pytest.approx([7.0])
    beyond = StepTimeCalibration()
    beyond.observe(step_time, k, [2.4])
    beyond.observe(wide_time, plain[:1].repeat(8), [1.0] * StepTimeCalibration.PAIR_STEPS)
    beyond.observe(step_time, plain, [1.0])  # one step too late
    assert 4 not in beyond._extra_samples


def test_goodput_revisits_a_row_switched_off_by_rejections(monkeypatch):
    """Rejections switch a row's drafting off; with REVISIT its estimate drifts back to the prior
    and it drafts again; with REVISIT 0 it never does (no new evidence reaches it)."""
    from specdec.policies import goodput

    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.2}])  # k = 1 pays above alpha ~0.32

    def drafting(revisit):
        monkeypatch.setattr(goodput, "REVISIT", revisit)
        batch = BatchState([np.arange(10)], 500, np.arange(1), np.zeros(0, dtype=np.int64))
        policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8)
        lengths = []
        for step in range(120):
            asked = policy.plan(batch, 1).num_draft_tokens
            lengths.append(int(asked[0]))
            accepted = np.zeros(1, dtype=np.int64) if step < 10 else np.minimum(asked, 3)
            policy.observe(_record(asked, accepted + 1, None))  # no wall time: the model stays as given
        return lengths

    with_revisit, without = drafting(0.05), drafting(0.0)
    assert 0 in with_revisit[:30] and 0 in without[:30]  # switched off by the rejections
    assert without[30:] == [0] * 90
    assert max(with_revisit[30:]) == 4


@pytest.mark.parametrize("decide_every", [1, 16])
def test_goodput_calibration_carries_over_short_calls(decide_every):
    """Ten generate() calls of 15 steps each, drafting measured 15x dearer than modelled: the
    calibration (kept across calls) learns it whatever decide_every is, including from each
    call's last steps before the next call's first decision, and speculation is off by the end."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8, decide_every=decide_every)
    for _ in range(10):
        batch = BatchState([np.arange(10)] * 4, 2000, np.arange(4), np.zeros(0, dtype=np.int64))
        plans = _run_calibrated(policy, batch, 15, lambda asked: 1.0 + (3.0 if asked.any() else 0.0))
    assert policy.calibration.measured(4) and policy.calibration.extra_scale[4] >= 10
    assert plans[-1].max() == 0


def test_goodput_probes_as_briefly_when_deciding_every_16_steps():
    """Deciding every 16 steps, a probe of speculation that does not pay (drafting 40x dearer
    than modelled) still ends once the calibration has its three measurements: the policy
    drafts in as many of 1000 steps as when it decides every step (60: the first steps, then
    four per probe after 64 plain steps)."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])

    def drafting_steps(decide_every):
        batch = BatchState([np.arange(10)] * 4, 2000, np.arange(4), np.zeros(0, dtype=np.int64))
        policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8, decide_every=decide_every)
        plans = _run_calibrated(policy, batch, 1000, lambda asked: 1.0 + (2.0 * asked.max() if asked.any() else 0.0))
        return sum(1 for p in plans if p.any())

    every_step = drafting_steps(1)
    assert every_step <= 80 and drafting_steps(16) <= every_step + 8


def test_goodput_policy_starts_a_new_call_at_its_prior():
    """One call in which every drafted token is accepted: the policy's rows learn a high rate,
    and the next call's rows start again at the given prior 0.3 (no cross-call prior)."""
    model = CostModel.from_coefficients(1.0, 0.01, drafters=[{"tokens": 0.01}])  # drafting pays at any rate
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.3)
    first = BatchState([np.arange(10)] * 2, 50, np.arange(2), np.zeros(0, dtype=np.int64))
    for _ in range(5):
        asked = policy.plan(first, 1).num_draft_tokens
        assert asked.min() > 0
        policy.observe(_record(asked, asked + 1, None))
    policy.plan(first, 1)  # learns the steps
    assert policy.estimator.rate(0).min() > 0.5
    second = BatchState([np.arange(10)] * 3, 50, np.arange(3), np.zeros(0, dtype=np.int64))
    policy.plan(second, 1)
    assert policy.estimator.rate(0).tolist() == pytest.approx([0.3] * 3)
    with pytest.raises(ValueError, match="prior"):
        GoodputPolicy(model, prior=[0.3])


@pytest.mark.parametrize("num_rows", [13, 54])
def test_finish_does_not_stop_drafting_on_a_first_probe_of_similar_rows(num_rows):
    """Run 9's k = 0 stretch: rows of similar acceptance (Beta(21.6, 8.4), mean 0.72, sd 0.08),
    a cost model with the H200 run's coefficients, "finish" deciding every 4 steps. After the
    first probe, the lowest rows' rates from 16 judged tokens decide. With the batch weighing 32
    judged tokens in each row's rate (finish.SHRINK_TRIALS, a prior of about the rows' true
    spread) the decision is k >= 2 in every one of 20 seeded batches (k with the known rates: 2
    or 3). At the weight 4 of point estimates, k = 0 came in 6 of 20 batches of 13 rows and 18 of
    20 of 54; at 16 with the rows' posterior samples (too wide a spread), in 1 and 9 of 20."""
    from specdec.policies.finish import SHRINK_TRIALS, shrunk_rates

    assert shrunk_rates.__defaults__ == (32.0,) and SHRINK_TRIALS == 32.0
    model = CostModel.from_coefficients(c_fixed=1.175e-3, c_tok=4.03e-7, c_kv=5.25e-9,
                                        drafters=[{"fixed": 2.0e-4, "rows": 1.2e-7, "steps": 1.88e-4, "tokens": 1.3e-7,
                                                   "kv_tokens": 2.3e-9, "context_tokens": 2.8e-9}])
    chosen = []
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        rates = np.clip(rng.beta(0.72 * 30, 0.28 * 30, size=num_rows), 0.05, 0.95)
        batch = BatchState([np.arange(300)] * num_rows, 128, np.arange(num_rows), np.zeros(0, dtype=np.int64))
        policy = GoodputPolicy(model, max_draft_tokens=8, prior=0.716, search="finish", decide_every=4)
        for _ in range(5):
            asked = policy.plan(batch, 1).num_draft_tokens
            accepted = np.minimum(rng.geometric(1.0 - rates) - 1, asked)
            policy.observe(_record(asked, accepted + 1, None))  # no wall time: the model stays as given
        chosen.append(int(asked.max()))  # the plan after the probe
    assert min(chosen) >= 2, chosen


def test_learn_now_folds_the_steps_since_the_last_decision_in_without_a_plan():
    """With decide_every = 16 the steps after a decision wait for the next one; learn_now learns
    from them at once (the calibration counts them), and a second call learns nothing more."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.0, drafters=[{"steps": 0.05}])
    policy = GoodputPolicy(model, max_draft_tokens=4, prior=0.8, decide_every=16)
    batch = BatchState([np.arange(10)] * 2, 500, np.arange(2), np.zeros(0, dtype=np.int64))
    _run_calibrated(policy, batch, 10, lambda asked: 1.0 + 0.05 * asked.max())
    before = policy.calibration.steps_measured
    policy.learn_now()
    after = policy.calibration.steps_measured
    assert after > before
    policy.learn_now()
    assert policy.calibration.steps_measured == after
