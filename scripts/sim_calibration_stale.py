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
import statistics
import sys
from collections import deque

import numpy as np

from specdec.policies import CostModel, FixedPolicy, GoodputPolicy
from specdec.policies.goodput import LinearStepTime, row_bucket
from specdec.policies.simulate import simulate_call

r = json.load(open("benchmarks/results/policies_h100_run21.json"))
cm = CostModel.from_dict(r["parts"][0]["cost_model"]).subset([1])


class Residual:
    """Online correction of a LinearStepTime by measured step wall times, per bucket of active
    rows (row_bucket), since what a model mis-predicts differs between 64 rows and 3.

    A plain step measured at m seconds against a predicted base P0 gives a sample
    m / P0 of base_scale; a speculative step against predicted base P0 and extra E = T(k) - P0
    gives a sample (m - base_scale * P0) / E of extra_scale (clipped to [0.05, 50]). Each scale
    is the median of the bucket's last WINDOW samples once it holds MIN_SAMPLES, and 1 (the
    model as profiled) before: a step slowed down by something else (a garbage collection, the
    host scheduler) moves neither, where a moving average would let one such step switch
    speculation off. A bucket's drafting samples are forgotten after ``reprobe_after`` steps in
    a row that did not draft (GoodputPolicy), so speculation is measured again now and then (a
    few steps in that many when it does not pay) rather than ruled out for good.
    Steps whose time includes catch-up work (a model drafter reading the tokens it missed while
    its row did not draft: the whole prompt the first time) are not fed in.

    Invariant: scales are positive; with fewer than MIN_SAMPLES measurements the calibrated model
    is the model."""

    WINDOW = 8
    MIN_SAMPLES = 3
    EXTRA_CLIP = (0.05, 50.0)

    def __init__(self):
        self.base_scale: dict[int, float] = {}  # bucket -> median of its samples (MIN_SAMPLES or more)
        self.extra_scale: dict[int, float] = {}
        self._base_samples: dict[int, deque[float]] = {}  # bucket -> its last WINDOW samples
        self._extra_samples: dict[int, deque[float]] = {}
        self._idle: dict[int, int] = {}  # steps without drafting since the bucket's last drafting step
        self._catch_up_samples: deque[float] = deque(maxlen=self.WINDOW)  # seconds a catch-up step cost beyond its prediction

    @property
    def catch_up_s(self) -> float:
        """What a catch-up step costs beyond an ordinary drafting step (the median of the last
        WINDOW measured ones; 0 before the first): the price of switching a row back on."""
        return statistics.median(self._catch_up_samples) if self._catch_up_samples else 0.0

    def observe_catch_up(self, excess_s: float) -> None:
        """One catch-up step's measured time minus the calibrated prediction of its drafting step."""
        self._catch_up_samples.append(max(float(excess_s), 0.0))

    def apply(self, step_time: LinearStepTime, num_rows: int) -> LinearStepTime:
        bucket = row_bucket(num_rows)
        return step_time.calibrated(self.base_scale.get(bucket, 1.0), self.extra_scale.get(bucket, 1.0))

    def _add(self, samples: dict, scales: dict, bucket: int, sample: float) -> None:
        held = samples.setdefault(bucket, deque(maxlen=self.WINDOW))
        held.append(sample)
        if len(held) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(held)

    def idle(self, num_rows: int, forget_after: int, steps: int = 1) -> None:
        """Count ``steps`` steps that did not draft; after ``forget_after`` of them in a row,
        forget this bucket's drafting samples, so the next decision uses the model again and, if
        it drafts, measures afresh: measurements cannot rule speculation out for good."""
        bucket = row_bucket(num_rows)
        if bucket not in self._extra_samples:
            return
        self._idle[bucket] = self._idle.get(bucket, 0) + steps
        if self._idle[bucket] >= forget_after:
            del self._extra_samples[bucket]
            self.extra_scale.pop(bucket, None)
            self._catch_up_samples.clear()  # and what switching back on costs: one slow catch-up cannot rule it out for good
            self._idle[bucket] = 0

    def measured(self, num_rows: int) -> bool:
        """Whether the bucket of ``num_rows`` active rows has a drafting correction (MIN_SAMPLES
        measurements or more since it was last forgotten)."""
        return row_bucket(num_rows) in self.extra_scale

    def observe(self, step_time: LinearStepTime, k: np.ndarray, measured_s: list[float]) -> None:
        """Steps of the same lengths k [A], one sample each; step_time: the uncalibrated model over
        their A active rows (the prediction computed once)."""
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
        for seconds in measured_s:
            if seconds > 0:
                low, high = self.EXTRA_CLIP
                self._add(self._extra_samples, self.extra_scale, bucket, min(max((seconds - base) / extra, low), high))

    def new_call(self):
        pass

    def wants_plain_probe(self, num_rows):
        return False

    def probed(self, num_rows):
        pass



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

    def idle(self, num_rows, forget_after, steps=1):
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
