"""GoodputPolicy "finish" when the machine was slower during its history than during the measured call
(BENCHMARKS.md, run 20: at continuation b16 the history left drafting priced at 1.97x the model).

The true step time is run 20's b16 cost model (drafter-4L-narrow) with drafting 0.7x what it predicts (run 20's
calibrations read 0.5-1.0), times a slowdown: the history's 4 calls at x1.5 and the measured call at x1.0, the
reverse, or neither. Rows accept at about 0.8; 12 seeds, the same measured batches for every policy. Printed:
fixed k against plain decoding, then "finish" as the library has it ("current") and with a probe not in the
library ("call-local": a bucket's calibration from the current call's own samples once it holds MIN_SAMPLES,
the window's before), each as a fraction of the best fixed k. About 5 minutes on 2 CPU cores.
BENCHMARKS run 20's figures are for the calibration of residuals the library had then; since session 17 the
library's StepTimeCalibration learns the host's speed and drafting's shape apart (scripts/sim_calibration_stale.py
compares the two), and "current" here is that one.
"""
import json, statistics, sys
from collections import deque
import numpy as np
from specdec.policies import CostModel, GoodputPolicy, FixedPolicy
from specdec.policies.goodput import StepTimeCalibration, LinearStepTime
from specdec.policies.simulate import simulate_call

r = json.load(open('benchmarks/results/policies_h200_run20.json'))
cm = CostModel.from_dict(r['parts'][1]['cost_model'] if 'cost_model' in r['parts'][1] else r['cost_model']).subset([1])

class CallLocal(StepTimeCalibration):
    """Samples tagged with their call; a bucket's scale is the median of the current call's samples once it holds MIN_SAMPLES, else of the window."""
    def __init__(self):
        super().__init__(); self._call = 0
    def new_call(self):
        self._call += 1
    def _add(self, samples, scales, bucket, sample):
        held = samples.setdefault(bucket, deque(maxlen=self.WINDOW))
        held.append((self._call, sample))
        own = [v for c, v in held if c == self._call]
        if len(own) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(own)
        elif len(held) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(v for _, v in held)

class Policy(GoodputPolicy):
    def plan(self, batch, num_drafters):
        if batch is not self._batch and hasattr(self.calibration, 'new_call'):
            self.calibration.new_call()
        return super().plan(batch, num_drafters)

def true_time(slow, extra_factor=0.7):
    def f(lengths, k):
        st = LinearStepTime.from_cost_model(cm, lengths, 0)
        return slow * (st.base + extra_factor * float(st.extra(k)))
    return f

def mean_tps(make, history_slow, measured_slow, n, seeds, history=4, local=False):
    vals = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        policy = make()
        if local and isinstance(policy, GoodputPolicy):
            policy.calibration = CallLocal()
        rates = lambda g: np.clip(g.beta(0.8 * 30, 0.2 * 30, n), 0, 0.98)
        for _ in range(history):
            simulate_call(policy, rates(rng), 128, true_time(history_slow), rng)
        m = simulate_call(policy, rates(np.random.default_rng(2000 + seed)), 128, true_time(measured_slow), np.random.default_rng(1000 + seed))
        vals.append(m.tokens_per_s)
    return float(np.mean(vals))

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
for n in (16, 4, 64):
    for hs, ms in ((1.0, 1.0), (1.5, 1.0), (1.0, 1.5)):
        fixed = {k: mean_tps(lambda k=k: FixedPolicy(k), hs, ms, n, seeds, history=0) for k in (0, 2, 4, 6)}
        best = max(fixed.values())
        make = lambda: Policy(cm, max_draft_tokens=8, search='finish', decide_every=16, prior=0.8)
        cur = mean_tps(make, hs, ms, n, seeds)
        loc = mean_tps(make, hs, ms, n, seeds, local=True)
        print(f"b{n} history x{hs} measured x{ms}: fixed " + " ".join(f"{k}:{v/fixed[0]:.2f}" for k, v in fixed.items()) + f" | current {cur/best:.3f} | call-local {loc/best:.3f}", flush=True)
