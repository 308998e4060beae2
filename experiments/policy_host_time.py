"""Host time of GoodputPolicy.plan() per decoding step, and a fingerprint of its decisions.

Two settings. Simulated static batches (specdec.policies.simulate_call) at batch sizes 1, 4, 16 and 64, with
GoodputPolicy(search=..., decide_every=16, max_draft_tokens=8, prior=0.84) for the searches
"finish" and "exact". The step time the simulation reports is the cost model's
prediction, with drafting DRAFT_SCALE times dearer than modelled and seeded log-normal noise, so
the policy's calibration (_calibrate: speed, shape, plain probes) has something to correct; each
policy serves CALLS calls in a row, so its state across calls (the calibration) is exercised
too. Step records carry the drafter's host time (drafter_wall_s) as
generate()'s do, and no plan time (it would make the decisions depend on the timing).

And "serve", the Engine's setting: GoodputPolicy(model, max_draft_tokens=5) as serve-bench builds
it (decide_every=1, search "exact", prior 0.5), at batch sizes 1, 2, 4 and 16, over a batch that
is refilled as the Engine refills it: each free row takes a new request (a prompt of 16-511
tokens, a budget of 16-255, its own acceptance rate) with probability ARRIVAL a step, announced
by start_rows() (timed with plan()), so the active rows and their calibration bucket vary and
rows start mid-batch; SERVE_STEPS loop steps a seed, the same noisy step times.

Printed per (search, batch size): ms of plan() per step (summed over the seeds' calls, divided by
their steps) and two fingerprints over every seed and call: ``plans``, a hash of every plan's
num_draft_tokens in order, and ``state``, a hash of each decision's predicted goodputs (float
bits) and the calibration's scales at the end of each call. Two versions of the policy that
decide the same must print the same ``plans`` fingerprints; ``state`` shows whether the floats
they weigh are bit for bit the same too.

    python experiments/policy_host_time.py [--cost-model PATH] [--seeds 3] [--repeats 1] [--settings finish,exact,serve]

--cost-model: a cost model file (CostModel.load), by default the one embedded in
benchmarks/results/policies_h200_run26.json; the policy times its drafter drafter-4L-narrow.
--repeats: time each case this many times (the same decisions) and keep the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from specdec.batch import BatchState
from specdec.policies import CostModel, GoodputPolicy, simulate_call
from specdec.stats import StepRecord
from specdec.types import VerifyCost

DEFAULT_RESULT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "policies_h200_run26.json"
POLICY_DRAFTER = "drafter-4L-narrow"
BATCH_SIZES = (1, 4, 16, 64)
SEARCHES = ("finish", "exact")
SERVE_BATCH_SIZES = (1, 2, 4, 16)
SERVE_STEPS = 400  # loop steps of the refilled batch per seed
ARRIVAL = 0.3  # the chance a step that a free row takes a new request
CALLS = 3  # calls served by each policy, one after the other
MAX_NEW_TOKENS = 128
DRAFT_SCALE = 1.3  # what drafting really costs against the model's prediction
NOISE_SD = 0.05  # log-normal noise of every step's time


def load_cost_model(path: str | None) -> CostModel:
    """The policy drafter's cost model: from ``path`` (a cost model file), else run 23's embedded one."""
    if path is not None:
        model = CostModel.load(path)
        names = None
    else:
        data = json.loads(DEFAULT_RESULT.read_text())["cost_model"]
        model, names = CostModel.from_dict(data), data.get("drafter_names")
    index = names.index(POLICY_DRAFTER) if names and POLICY_DRAFTER in names else min(1, model.num_drafters - 1)
    return model.subset([index])


def row_rates(batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """[B] acceptance rates about 0.8, one row in ten a straggler about 0.3."""
    rates = rng.normal(0.8, 0.06, batch_size)
    stragglers = rng.random(batch_size) < 0.1
    rates[stragglers] = rng.normal(0.3, 0.1, int(stragglers.sum()))
    return np.clip(rates, 0.02, 0.97)


def noisy_step_time(model: CostModel, rng: np.random.Generator):
    """step_time(lengths [A], k [A]) -> seconds: the model's prediction with drafting DRAFT_SCALE
    times dearer and log-normal noise."""
    def step_time(lengths: np.ndarray, k: np.ndarray) -> float:
        plain = model.step_time(lengths, np.zeros_like(k), 0)
        drafting = model.step_time(lengths, k, 0) - plain
        return (plain + DRAFT_SCALE * drafting) * float(np.exp(rng.normal(0.0, NOISE_SD)))
    return step_time


class TimedPolicy:
    """Wraps a policy: times its plan() and hashes what it returns and predicts."""

    def __init__(self, policy: GoodputPolicy, plans, state):
        self.policy, self.plans, self.state = policy, plans, state
        self.seconds = 0.0

    def start_rows(self, batch, rows) -> None:
        started = time.perf_counter()
        self.policy.start_rows(batch, rows)
        self.seconds += time.perf_counter() - started

    def plan(self, batch, num_drafters):
        started = time.perf_counter()
        plan = self.policy.plan(batch, num_drafters)
        self.seconds += time.perf_counter() - started
        self.plans.update(np.ascontiguousarray(plan.num_draft_tokens, dtype=np.int64).tobytes())
        self.state.update(np.array([self.policy.predicted_goodput, self.policy.predicted_plain_goodput]).tobytes())
        return plan

    def observe(self, record) -> None:
        """As generate() records it: the drafter's host time where it ran (_calibrate reads it)."""
        ran = float(np.any(record.num_drafted))
        self.policy.observe(dataclasses.replace(record, drafter_wall_s=np.array([1e-4 * ran])))


def calibration_bytes(policy: GoodputPolicy) -> bytes:
    """The calibration's scales, in a fixed order."""
    calibration = policy.calibration
    values = []
    for scales in (calibration.base_scale, calibration.extra_scale):
        values += [x for bucket in sorted(scales) for x in (bucket, scales[bucket])]
    return np.array(values, dtype=np.float64).tobytes()


def run_case(model: CostModel, search: str, batch_size: int, seeds: int) -> tuple[float, int, str, str]:
    """Seconds of plan(), steps, and the plans' and state's fingerprints over ``seeds`` policies."""
    plans, state = hashlib.sha256(), hashlib.sha256()
    seconds, steps = 0.0, 0
    for seed in range(seeds):
        rng = np.random.default_rng([seed, batch_size])
        policy = TimedPolicy(GoodputPolicy(model, max_draft_tokens=8, search=search, decide_every=16, prior=0.84),
                             plans, state)
        step_time = noisy_step_time(model, np.random.default_rng([seed, batch_size, 1]))
        for _ in range(CALLS):
            call = simulate_call(policy, row_rates(batch_size, rng), MAX_NEW_TOKENS, step_time, rng)
            steps += call.steps
            state.update(calibration_bytes(policy.policy))
        seconds += policy.seconds
    return seconds, steps, plans.hexdigest()[:16], state.hexdigest()[:16]


def run_serve_case(model: CostModel, batch_size: int, seeds: int) -> tuple[float, int, str, str]:
    """As run_case, for a batch refilled as the Engine refills it (module docstring)."""
    plans, state = hashlib.sha256(), hashlib.sha256()
    seconds, steps = 0.0, 0
    for seed in range(seeds):
        rng = np.random.default_rng([seed, batch_size, 2])
        policy = TimedPolicy(GoodputPolicy(model, max_draft_tokens=5), plans, state)
        step_time = noisy_step_time(model, np.random.default_rng([seed, batch_size, 3]))
        batch = BatchState.empty(batch_size, 768, np.zeros(0, dtype=np.int64))
        rates = np.full(batch_size, 0.5)  # [B] each row's request's acceptance rate
        for _ in range(SERVE_STEPS):
            free = np.flatnonzero(batch.finished)
            new = free[rng.random(len(free)) < ARRIVAL]  # [N]
            for row in new:
                batch.admit(int(row), np.zeros(int(rng.integers(16, 512)), dtype=np.int64), int(rng.integers(16, 256)), 0)
            rates[new] = row_rates(len(new), rng)
            if len(new):
                policy.start_rows(batch, new)
            if batch.finished.all():
                continue
            active = batch.active_rows()  # [A]
            plan = policy.plan(batch, 1)
            remaining = batch.remaining  # [B] 0 where finished
            drafted = np.where(batch.finished, 0, np.minimum(plan.num_draft_tokens, np.maximum(remaining - 1, 0)))  # [B]
            accepted = np.minimum(rng.geometric(1.0 - rates) - 1, drafted)  # [B]
            emitted = np.where(batch.finished, 0, np.minimum(accepted + 1, remaining))  # [B]
            record = StepRecord(steps, active, np.zeros(batch_size, dtype=np.int64), drafted, accepted, emitted,
                                0.0, 0.0, VerifyCost(0, 0), step_time_s=float(step_time(batch.lengths[active], drafted[active])))
            batch.lengths += emitted
            batch.finished |= batch.num_generated >= batch.max_new_tokens
            policy.observe(record)
            steps += 1
        policy.policy.learn_now()
        state.update(calibration_bytes(policy.policy))
        seconds += policy.seconds
    return seconds, steps, plans.hexdigest()[:16], state.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-model", default=None, help="a cost model file (default: run 26's embedded model)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--settings", default="finish,exact,serve", help="which of finish, exact, serve to run")
    args = parser.parse_args()
    model = load_cost_model(args.cost_model)
    print(f"{'search':8} {'batch':>5} {'steps':>6} {'ms/step':>8}  plans            state")
    settings = args.settings.split(",")
    cases = [(search, batch_size) for search in SEARCHES if search in settings for batch_size in BATCH_SIZES]
    cases += [("serve", batch_size) for batch_size in SERVE_BATCH_SIZES if "serve" in settings]
    for search, batch_size in cases:
        if search == "serve":
            runs = [run_serve_case(model, batch_size, args.seeds) for _ in range(args.repeats)]
        else:
            runs = [run_case(model, search, batch_size, args.seeds) for _ in range(args.repeats)]
        if len({run[1:] for run in runs}) != 1:
            raise RuntimeError(f"{search} b{batch_size}: repeats decided differently")
        seconds, steps, plans, state = min(runs)
        print(f"{search:8} {batch_size:5d} {steps:6d} {1e3 * seconds / steps:8.4f}  {plans} {state}", flush=True)

if __name__ == "__main__":
    main()
