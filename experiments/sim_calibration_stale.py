"""GoodputPolicy "finish" when its calibration meets a slow host (BENCHMARKS.md, run 21: at copy b64 the history
left drafting at 64 rows priced 4.02x the model, the call itself measured 0.47x, and the policy decoded plainly
for 68 steps from its first decision).

The true step time is run 21's b64 cost model (drafter-4L-narrow) with drafting 0.7x what it predicts, times a
slowdown of the plain step and of what drafting adds, during the history (4 calls) and during the measured call;
a drafting step after 3 or more steps without drafting also pays a catch-up (the drafter reads the tokens it
missed: 2x a plain step). Rows accept at about 0.8 ("plain best": about 0.35). 12 seeds, the same measured
batches for every policy. Printed: fixed k against plain decoding, then each calibration as a fraction of the
best fixed k:
- "speed+shape": the library since session 17 (StepTimeCalibration: the host's speed from every step, the
  shape of drafting against the model only from drafting and plain steps measured together, a plain probe of
  PROBE_STEPS steps when drafting alone reads far off);
- "residual": the library before (4d9268b): a plain scale from plain steps, a drafting scale from the residual
  (measured - plain scale x predicted plain) / predicted drafting, each the median of its bucket's last 8;
- "whole-step": one scale for the whole step (the model's split kept), the median of measured / predicted.
Session 17's results are in BENCHMARKS.md, run 21. About 8 minutes on 2 CPU cores; arguments: seeds, batch sizes
(64,16,4 by default; 1 for the batch-1 case), cases (comma-separated names of CASES; all by default).
"""
import json
import sys

import numpy as np

from specdec.policies import CostModel, FixedPolicy, GoodputPolicy
from specdec.policies.calibration import StepTimeCalibration
from specdec.policies.step_time import LinearStepTime, row_bucket
from specdec.policies.simulate import simulate_call

r = json.load(open("benchmarks/results/policies_h100_run21.json"))
cm = CostModel.from_dict(r["parts"][0]["cost_model"]).subset([1])


class Residual(StepTimeCalibration):
    """The calibration of residuals as the library had it before session 17 (4d9268b): base_scale from plain
    steps, extra_scale from (measured - base_scale x P0) / E of drafting steps, each the median of its bucket's
    last WINDOW; the catch-up, forgetting and windows as the library's (no drafting step is kept for pairing, so
    no plain probe is ever asked for)."""

    def apply(self, step_time, num_rows):
        bucket = row_bucket(num_rows)
        return step_time.calibrated(self.base_scale.get(bucket, 1.0), self.extra_scale.get(bucket, 1.0))

    def observe(self, step_time, k, measured_s):
        bucket = row_bucket(len(k))
        if step_time.base <= 0:
            return
        if not np.any(k):
            for seconds in measured_s:
                if seconds > 0:
                    self._add(self._base_samples, self.base_scale, bucket, seconds / step_time.base)
            return
        self._idle[bucket] = 0
        extra = float(step_time.extra(k))
        if extra <= 0:
            return
        base = self.base_scale.get(bucket, 1.0) * step_time.base  # drafting samples leave base_scale as it is
        low, high = self.EXTRA_CLIP
        for seconds in measured_s:
            if seconds > 0:
                self._add(self._extra_samples, self.extra_scale, bucket, min(max((seconds - base) / extra, low), high))


class WholeStep(Residual):
    def observe(self, step_time, k, measured_s):
        bucket = row_bucket(len(k))
        predicted = float(step_time(k))
        if predicted <= 0:
            return
        if np.any(k):
            self._idle[bucket] = 0
        for seconds in measured_s:
            if seconds > 0:
                self._add(self._base_samples, self.base_scale, bucket, seconds / predicted)
                if bucket in self.base_scale:
                    self.extra_scale[bucket] = self.base_scale[bucket]

    def idle(self, num_rows, steps=1):
        pass  # plain steps measure the same scale: nothing to forget


def true_time(base_slow, extra_slow, catch_up_plain_steps=2.0, extra_factor=0.7):
    idle = [3]

    def f(lengths, k):
        st = LinearStepTime.from_cost_model(cm, lengths, 0)
        seconds = base_slow * st.base + extra_slow * extra_factor * float(st.extra(k))
        if np.any(k):
            if idle[0] >= 3:
                seconds += catch_up_plain_steps * base_slow * st.base
            idle[0] = 0
        else:
            idle[0] += 1
        return seconds
    return f


def mean_tps(make, history, measured, n, seeds, mean_rate, extra_factor=0.7, calls=4, measured_calls=1):
    """history: one (plain, drafting) slowdown for every history call, or a list cycled over them;
    measured_calls: calls timed after the history (batch 1: one request each), the last of the
    history's slowdowns list continued for them when ``measured`` is None."""
    values = []
    speeds = history if isinstance(history, list) else [history]
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        policy = make()
        rates = lambda g: np.clip(g.beta(mean_rate * 30, (1 - mean_rate) * 30, n), 0, 0.98)
        for call in range(calls if isinstance(policy, GoodputPolicy) else 0):
            simulate_call(policy, rates(rng), 128, true_time(*speeds[call % len(speeds)], extra_factor=extra_factor), rng)
        seconds = tokens = 0.0
        for call in range(measured_calls):
            speed = measured if measured is not None else speeds[(calls + call) % len(speeds)]
            m = simulate_call(policy, rates(np.random.default_rng(2000 + 100 * seed + call)), 128,
                              true_time(*speed, extra_factor=extra_factor), np.random.default_rng(1000 + 100 * seed + call))
            seconds, tokens = seconds + m.seconds, tokens + m.tokens
        values.append(tokens / seconds)
    return float(np.mean(values))


def finish(calibration=None):
    policy = GoodputPolicy(cm, max_draft_tokens=8, search="finish", decide_every=16, prior=0.8)
    if calibration is not None:
        policy.calibration = calibration
    return policy


CASES = {  # name: (history (plain, drafting) slowdown, measured call's, mean acceptance[, options of mean_tps])
    "none": ((1.0, 1.0), (1.0, 1.0), 0.8),
    "history x1.5": ((1.5, 1.5), (1.0, 1.0), 0.8),
    "history drafting x3": ((1.5, 3.0), (1.0, 1.0), 0.8),
    "call x1.5": ((1.0, 1.0), (1.5, 1.5), 0.8),
    "plain best": ((1.0, 1.0), (1.0, 1.0), 0.35),
    "drafting x2 throughout": ((1.0, 2.0), (1.0, 2.0), 0.8),
    "drafting x4 throughout": ((1.0, 4.0), (1.0, 4.0), 0.8),
    # a drafter costing 0.2x the model's drafting, on a host 1.2x slower than the model throughout
    "cheap drafting, host x1.2": ((1.2, 1.2), (1.2, 1.2), 0.8, {"extra_factor": 0.2}),
    # 8 history calls and 8 measured ones, the host's speed alternating 1.0 / 1.15 from call to call
    "speed 1.0/1.15 by call": ([(1.0, 1.0), (1.15, 1.15)], None, 0.8, {"calls": 8, "measured_calls": 8}),
}
VARIANTS = {"speed+shape": finish, "residual": lambda: finish(Residual()), "whole-step": lambda: finish(WholeStep())}

if __name__ == "__main__":
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 16, 4]
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    for n in sizes:
        for name in only:
            history, measured, rate, *options = CASES[name]
            options = options[0] if options else {}
            fixed = {k: mean_tps(lambda k=k: FixedPolicy(k), history, measured, n, seeds, rate, **options)
                     for k in (0, 2, 4, 6)}
            best = max(fixed.values())
            got = {v: mean_tps(make, history, measured, n, seeds, rate, **options) / best for v, make in VARIANTS.items()}
            print(f"b{n} {name}: fixed " + " ".join(f"{k}:{v / fixed[0]:.2f}" for k, v in fixed.items()) + " | "
                  + " ".join(f"{v} {x:.3f}" for v, x in got.items()), flush=True)
