"""Exactness with the adaptive policies: generate() with BanditPolicy (UCB and epoch, per request
and per batch), GoodputPolicy (exact and finish searches) and BatchAdaptivePolicy gives
the target's own greedy output (float64 on the CPU, against Hugging Face generate), while the
policies really switch mid-generation: rows change drafter, rows drop to draft length 0 when
speculation stops paying, the draft length follows the number of active rows. The switches are
asserted from the plans and step records the policy saw, so a policy that never switches fails."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import time

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import (
    BanditPolicy,
    BatchAdaptivePolicy,
    CostModel,
    GoodputPolicy,
    Policy,
    profile_expected_tokens,
)
from tests.tiny import (
    cached_model,
    hf_greedy,
    make_model,
    perturbed_copy,
    random_prompts,
)

MAX_NEW_TOKENS = 24
DTYPE = torch.float64


def target():
    return cached_model("llama", "cpu", DTYPE)


@functools.cache
def good_drafter_model():
    return perturbed_copy(target(), scale=0.1)


@functools.cache
def poor_drafter_model():
    """Another random model: it rarely agrees with the target."""
    return make_model("llama", seed=7, dtype=DTYPE)


@functools.cache
def reference(prompt: tuple, eos_token_id):
    return hf_greedy(target(), list(prompt), MAX_NEW_TOKENS, eos_token_id)


def prompts_and_eos(num_prompts: int, seed: int):
    """Prompts, and an EOS token the first prompt's output emits at index 8 (that row stops early)."""
    prompts = random_prompts(num_prompts, target().config.vocab_size, seed=seed, min_len=3)
    eos = reference(tuple(prompts[0]), None)[8]
    return prompts, eos


class Recording(Policy):
    """Passes everything to ``inner`` and keeps what it planned and observed. withhold_times: the
    inner policy sees the records without their wall times (``step_time_s`` None), so a policy
    that calibrates a synthetic cost model by measured steps keeps the model as given."""

    def __init__(self, inner: Policy, withhold_times: bool = False):
        self.inner, self.withhold_times = inner, withhold_times
        self.plans, self.remaining, self.records = [], [], []

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens

    @property
    def one_per_micro_batch(self) -> bool:  # a PipelinedEngine then copies this recording, inner policy and all
        return self.inner.one_per_micro_batch

    def __deepcopy__(self, memo):
        """A copy of the inner policy that records into the same lists (every micro-batch's plans
        and steps, in the order they happened)."""
        twin = Recording(copy.deepcopy(self.inner, memo), self.withhold_times)
        twin.plans, twin.remaining, twin.records = self.plans, self.remaining, self.records
        return twin

    def start_rows(self, batch, rows):
        self.inner.start_rows(batch, rows)

    def plan(self, batch, num_drafters):
        plan = self.inner.plan(batch, num_drafters)
        self.plans.append(plan)
        self.remaining.append(batch.remaining.copy())
        return plan

    def observe(self, record):
        self.records.append(record)
        self.inner.observe(dataclasses.replace(record, step_time_s=None) if self.withhold_times else record)

    def __repr__(self) -> str:
        return f"Recording({self.inner!r})"


def run(policy: Policy, drafters, prompts, eos, withhold_times: bool = False):
    recording = Recording(policy, withhold_times)
    out = generate(target(), prompts, drafter=drafters, policy=recording, max_new_tokens=MAX_NEW_TOKENS,
                   eos_token_id=eos)
    assert out.sequences == [reference(tuple(p), eos) for p in prompts]
    assert len(recording.records) == out.stats.steps
    return out, recording


def two_drafters():
    return [ModelDrafter(good_drafter_model()), PromptLookupDrafter(min_ngram=1, max_ngram=3)]


BANDIT_VARIANTS = [(strategy, scope) for scope in ("request", "batch") for strategy in ("ucb", "epoch")]


@pytest.mark.parametrize(("strategy", "scope"), BANDIT_VARIANTS)
def test_bandit_is_exact_and_switches_drafters(strategy, scope):
    prompts, eos = prompts_and_eos(5, seed=3)
    policy = BanditPolicy(num_draft_tokens=3, strategy=strategy, scope=scope)
    policy.hold_steps = 2  # batch scope's 4 switches too rarely in a call this short
    out, recording = run(policy, two_drafters(), prompts, eos)
    for row in range(len(prompts)):
        used = [int(r.drafter_index[row]) for r in recording.records if row in r.rows]
        assert set(used) == {0, 1}, (row, used)  # every row drafted with both drafters
        assert any(a != b for a, b in itertools.pairwise(used))
    if scope == "batch":
        assert all(len(set(r.drafter_index[r.rows].tolist())) == 1 for r in recording.records)
    assert out.stats.accepted > 0
    assert all(r.drafter_time_s is not None and len(r.drafter_time_s) == 2 for r in recording.records)
    # each drafter's host-clock time: positive in a step it drafted in, within the step's wall time
    for r in recording.records:
        ran = np.isin([0, 1], r.drafter_index[r.rows][r.num_drafted[r.rows] > 0])
        assert r.drafter_wall_s.shape == (2,) and np.all(r.drafter_wall_s[ran] > 0)
        assert r.drafter_wall_s.sum() < r.step_time_s


class SlowPlanning(Recording):
    """Takes ``seconds`` (busy, on the host clock) over each plan."""

    def __init__(self, inner: Policy, seconds: float):
        super().__init__(inner)
        self.seconds = seconds

    def plan(self, batch, num_drafters):
        until = time.perf_counter() + self.seconds
        while time.perf_counter() < until:
            pass
        return super().plan(batch, num_drafters)


def test_step_records_time_the_policys_plan_apart():
    """StepRecord.plan_time_s: the host time of the policy's plan, a part of step_time_s (what
    GoodputPolicy's calibration takes out of a step's time)."""
    prompts, eos = prompts_and_eos(3, seed=5)
    recording = SlowPlanning(BatchAdaptivePolicy({1: 2, 4: 3}), seconds=0.02)
    out = generate(target(), prompts, drafter=ModelDrafter(good_drafter_model()), policy=recording,
                   max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert out.sequences == [reference(tuple(p), eos) for p in prompts]
    assert len(recording.records) == out.stats.steps > 1
    assert all(0.02 <= r.plan_time_s < r.step_time_s for r in recording.records)


def test_bandit_one_drafter_per_call_is_exact_and_moves_between_calls():
    """objective="call": each call exact and on one drafter throughout; the second call plays the
    drafter the first did not (untried first), and the first call's reward is learnt."""
    prompts, eos = prompts_and_eos(5, seed=3)
    policy = BanditPolicy(num_draft_tokens=3, scope="batch", objective="call")
    drafters = two_drafters()
    played = []
    for _ in range(2):
        _, recording = run(policy, drafters, prompts, eos)
        played.append({int(r.drafter_index[row]) for r in recording.records for row in r.rows})
    assert played == [{0}, {1}]
    assert policy.bandits.counts.tolist() == [[1, 0]]


@pytest.mark.parametrize("options", [{"scope": "request"}, {"scope": "batch"}],
                         ids=["request", "batch"])
def test_bandit_with_a_cost_model_is_exact(options):
    model = CostModel.from_coefficients(c_fixed=1e-2, c_tok=1e-4, drafters=[{"steps": 2e-3}, {"fixed": 1e-4}])
    prompts, eos = prompts_and_eos(4, seed=9)
    _, recording = run(BanditPolicy(num_draft_tokens=4, cost_model=model, **options), two_drafters(), prompts, eos)
    assert {int(d) for r in recording.records for d in r.drafter_index[r.rows]} == {0, 1}


def speculation_cost_model():
    """Plain step 1 s + 0.02 s per token; a drafted token costs 0.07 s in all. With 5 rows the
    first draft token pays when alpha is above about 0.32 (goodput 5 / 1.1 per second plain)."""
    return CostModel.from_coefficients(c_fixed=1.0, c_tok=0.02, drafters=[{"tokens": 0.05}])


@pytest.mark.parametrize("search", ["exact", "finish"])
def test_goodput_is_exact_and_stops_drafting_when_it_does_not_pay(search, monkeypatch):
    """A drafter that rarely agrees with the target, an optimistic prior (0.9): rows draft at
    first, their acceptance estimates fall, and they switch to plain decoding mid-generation."""
    from specdec.policies import finish, goodput

    prompts, eos = prompts_and_eos(5, seed=4)
    # synthetic seconds: no calibration against this machine's wall time; no revisits, so a row
    # switched off stays off (revisiting is tested in test_profile_options.py)
    monkeypatch.setattr(goodput, "REVISIT", 0.0)
    monkeypatch.setattr(finish, "REVISIT", 0.0)
    policy = GoodputPolicy(speculation_cost_model(), max_draft_tokens=4, search=search, prior=0.9)
    _, recording = run(policy, [ModelDrafter(poor_drafter_model())], prompts, eos, withhold_times=True)
    switched_off = []
    for row in range(len(prompts)):
        lengths = [(int(p.num_draft_tokens[row]), int(rem[row])) for p, rem in zip(recording.plans, recording.remaining)
                   if rem[row] > 1]  # the row is active and its budget does not cap the draft
        drafting = [k > 0 for k, _ in lengths]
        if any(drafting) and not drafting[-1] and drafting.index(False) > 0:
            switched_off.append(row)
    assert len(switched_off) >= 3, [p.num_draft_tokens.tolist() for p in recording.plans]
    assert recording.plans[0].num_draft_tokens.max() == 4  # the prior made speculation pay at first
    assert recording.plans[-1].num_draft_tokens.max() == 0


@pytest.mark.parametrize("options", [
    {"search": "exact"},
    {"search": "exact", "decide_every": 3},
    {"search": "exact", "drafter_index": 1},
], ids=["every-step", "every-3", "prompt-lookup"])
def test_goodput_with_a_good_drafter_is_exact_and_drafts_per_row(options):
    """With a drafter that agrees often, rows draft; per-row searches give rows different
    lengths in some step."""
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.02, drafters=[{"tokens": 0.05}, {"tokens": 0.01}])
    prompts, eos = prompts_and_eos(6, seed=5)
    _, recording = run(GoodputPolicy(model, max_draft_tokens=5, **options), two_drafters(), prompts, eos,
                       withhold_times=True)
    drafted = np.array([r.num_drafted.sum() for r in recording.records])
    assert drafted.sum() > 0
    differing = [p.num_draft_tokens[r.rows] for p, r in zip(recording.plans, recording.records)]
    assert any(len(set(k.tolist())) > 1 for k in differing)


def test_batch_adaptive_is_exact_and_follows_the_active_rows():
    """Table: 5 active rows -> 0 tokens (plain decoding), 4 -> 1, 3 -> 2, 2 -> 3, 1 -> 4. Rows
    stop at EOS at different steps, so the length grows mid-generation."""
    prompts, eos = prompts_and_eos(5, seed=6)
    table = {1: 4, 2: 3, 3: 2, 4: 1, 5: 0}
    _, recording = run(BatchAdaptivePolicy(table), two_drafters(), prompts, eos)
    for plan, record in zip(recording.plans, recording.records):
        assert set(plan.num_draft_tokens.tolist()) == {table[len(record.rows)]}
    used = [int(p.num_draft_tokens[0]) for p in recording.plans]
    assert used[0] == 0 and max(used) > 0, used


def test_batch_adaptive_from_a_short_profile_is_exact():
    prompts, eos = prompts_and_eos(4, seed=7)
    drafter = ModelDrafter(good_drafter_model())
    measured = profile_expected_tokens(target(), drafter, prompts[:2], draft_lengths=[1, 2, 4], max_new_tokens=12)
    assert all(1.0 <= tau <= s + 1 for s, tau in measured.items())
    model = CostModel.from_coefficients(c_fixed=1e-2, c_tok=1e-4, drafters=[{"steps": 1e-3}])
    policy = BatchAdaptivePolicy.from_cost_model(model, expected_tokens=measured, batch_sizes=[1, 2, 4], context_len=32)
    assert set(policy.table.values()) <= {0, 1, 2, 4}
    _, recording = run(policy, [drafter], prompts, eos)
    assert any(r.num_drafted.sum() > 0 for r in recording.records) == (policy.max_draft_tokens > 0)
