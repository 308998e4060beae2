"""GoodputPolicy "finish" when its history's calibration is stale (BENCHMARKS.md, run 21: at copy b64 the
history left drafting at 64 rows priced 4.02x the model, the call itself measured 0.47x, and the policy decoded
plainly for 68 steps from its first decision).

The true step time is run 21's b64 cost model (drafter-4L-narrow) with drafting 0.7x what it predicts, times a
slowdown of the plain step and of what drafting adds, during the history and during the measured call; a
drafting step after 3 or more steps without drafting also pays a catch-up (the drafter reads the tokens it
missed: 2x a plain step at 64 rows). Rows accept at about 0.8 ("plain best": about 0.35). 12 seeds, the same
measured batches for every policy. Printed: fixed k against plain decoding, then each variant as a fraction of
the best fixed k:
- "current": the library before session 17 (a bucket's scale is the median of its last 8 samples, whatever
  call they came from);
- "local": once the current call holds MIN_SAMPLES samples of a bucket, its scale is their median alone;
- "local+stale": and a bucket whose drafting scale rests on earlier calls alone is forgotten after
  STALE_STEPS steps without drafting (not reprobe_after), so the call measures drafting for itself;
- "whole-step": one scale per bucket for the whole step, the median of measured / predicted over its last 8
  steps of either kind, so the cost model's split between the plain step and drafting is kept and only the
  host's speed is learnt (a residual (measured - base) / extra turns a 20% slower step into a 40% dearer
  drafting term where the two are alike).
About 5 minutes on 2 CPU cores. Results (session 17) in BENCHMARKS.md, run 21: whole-step 0.994-1.009 in every
spell case but 0.67-0.84 where drafting is 2-3x the model throughout; current 0.82-1.00 and 0.92-0.95 there.
"""
import json
import statistics
import sys
from collections import deque

import numpy as np

from specdec.policies import CostModel, FixedPolicy, GoodputPolicy
from specdec.policies.goodput import LinearStepTime, StepTimeCalibration, row_bucket
from specdec.policies.simulate import simulate_call

r = json.load(open("benchmarks/results/policies_h100_run21.json"))
cm = CostModel.from_dict(r["parts"][0]["cost_model"]).subset([1])
STALE_STEPS = 4


class Local(StepTimeCalibration):
    def __init__(self, stale_reprobe=False):
        super().__init__()
        self.call, self.stale_reprobe = 0, stale_reprobe

    def new_call(self):
        self.call += 1

    def _add(self, samples, scales, bucket, sample):
        held = samples.setdefault(bucket, deque(maxlen=self.WINDOW))
        held.append((self.call, sample))
        own = [v for c, v in held if c == self.call]
        if len(own) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(own)
        elif len(held) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(v for _, v in held)

    def idle(self, num_rows, forget_after, steps=1):
        bucket = row_bucket(num_rows)
        held = self._extra_samples.get(bucket)
        if self.stale_reprobe and held is not None and sum(c == self.call for c, _ in held) < self.MIN_SAMPLES:
            forget_after = min(forget_after, STALE_STEPS)
        super().idle(num_rows, forget_after, steps)


class WholeStep(StepTimeCalibration):
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

    def idle(self, num_rows, forget_after, steps=1):
        pass  # plain steps measure the same scale: nothing to forget


class Policy(GoodputPolicy):
    def plan(self, batch, num_drafters):
        if batch is not self._batch and hasattr(self.calibration, "new_call"):
            self.calibration.new_call()
        return super().plan(batch, num_drafters)


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


def mean_tps(make, history, measured, n, seeds, mean_rate, calls=4):
    values = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        policy = make()
        rates = lambda g: np.clip(g.beta(mean_rate * 30, (1 - mean_rate) * 30, n), 0, 0.98)
        for _ in range(calls if isinstance(policy, GoodputPolicy) else 0):
            simulate_call(policy, rates(rng), 128, true_time(*history), rng)
        m = simulate_call(policy, rates(np.random.default_rng(2000 + seed)), 128, true_time(*measured),
                          np.random.default_rng(1000 + seed))
        values.append(m.tokens_per_s)
    return float(np.mean(values))


seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 16, 4]
CASES = {  # name: (history (base, extra) slowdown, measured call's, mean acceptance)
    "none": ((1.0, 1.0), (1.0, 1.0), 0.8),
    "history x1.5": ((1.5, 1.5), (1.0, 1.0), 0.8),
    "history drafting x3": ((1.5, 3.0), (1.0, 1.0), 0.8),
    "call x1.5": ((1.0, 1.0), (1.5, 1.5), 0.8),
    "plain best": ((1.0, 1.0), (1.0, 1.0), 0.35),
    "drafting x2 throughout": ((1.0, 2.0), (1.0, 2.0), 0.8),
}
variants = {
    "current": lambda: GoodputPolicy(cm, max_draft_tokens=8, search="finish", decide_every=16, prior=0.8),
    "local": lambda: _with(Local()),
    "local+stale": lambda: _with(Local(stale_reprobe=True)),
    "whole-step": lambda: _with(WholeStep()),
}


def _with(calibration):
    policy = Policy(cm, max_draft_tokens=8, search="finish", decide_every=16, prior=0.8)
    policy.calibration = calibration
    return policy


for n in sizes:
    for name, (history, measured, rate) in CASES.items():
        fixed = {k: mean_tps(lambda k=k: FixedPolicy(k), history, measured, n, seeds, rate) for k in (0, 2, 4, 6)}
        best = max(fixed.values())
        got = {v: mean_tps(make, history, measured, n, seeds, rate) / best for v, make in variants.items()}
        print(f"b{n} {name}: fixed " + " ".join(f"{k}:{v / fixed[0]:.2f}" for k, v in fixed.items()) + " | "
              + " ".join(f"{v} {x:.3f}" for v, x in got.items()), flush=True)
