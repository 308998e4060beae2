"""Online correction of GoodputPolicy's step-time model by measured step wall times, always on:
a model profiled once mis-predicts a host whose speed drifts, or a shape it was not fitted on,
and a length chosen on a wrong step time is a wrong length (the measurement: BENCHMARKS.md §3).
Cost: a few medians over short windows per decision.

Invariant: scales are positive; with no measurement the calibrated model is the model.
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from .step_time import LinearStepTime, row_bucket


class StepTimeCalibration:
    """Online correction of a LinearStepTime by measured step wall times, per bucket of active
    rows (row_bucket), since what a model mis-predicts differs between 64 rows and 3. Two factors:

    - the host's **speed** (``base_scale``): the median of measured / predicted over the bucket's
      last WINDOW steps of either kind (MIN_SAMPLES at least; 1 before), the prediction with the
      current shape. It scales the whole step, so it moves no decision: a slow spell of the
      host, or a history served on a slower one, is not read as dear drafting;
    - the **shape** (``extra_scale``): what drafting adds against the model's prediction,
      relative to the speed, learnt only from drafting and plain steps measured close together
      (within PAIR_STEPS steps of the same call): a drafting step of m seconds, predicted plain
      part P0 and drafting part E, beside plain steps that ran p times their prediction, gives
      a sample (m / p - P0) / E (clipped to EXTRA_CLIP); the shape is the median of the bucket's
      last WINDOW samples once it holds MIN_SAMPLES, 1 (the model as profiled) before.

    Pairing matters: a drafting sample (m - plain scale x P0) / E that read the plain scale
    from whenever it was last measured would take a slow spell of the host for dear drafting
    (a step 20% slower reads as drafting 40% dearer where P0 and E are alike), and at a call's
    start every sample would be the history's.

    A bucket whose drafting is measured with no plain step beside it cannot tell a slow host
    from dear drafting. When its recent unpaired drafting steps (MIN_SAMPLES of them, median)
    ran more than PROBE_TOLERANCE off what the current shape predicts at the recent plain speed
    (the bucket's plain steps, else any bucket's, else 1), ``wants_plain_probe`` asks the policy
    for PROBE_STEPS plain steps, which pair with them; at most once per PROBE_EVERY of the
    bucket's steps. The test is on the whole step's time, which is what a decision weighs, not
    on the shape, which a small error of the speed moves a lot where drafting is cheap. So
    drafting that costs up to about PROBE_TOLERANCE more of the whole step than modelled, with
    no plain step beside it, goes uncorrected (the speed takes it up). A bucket's shape is
    forgotten after REPROBE_AFTER steps in a row that did not draft, so
    drafting is measured again now and then (and pairs with the plain steps just taken) rather
    than ruled out for good. Steps whose time includes catch-up work (a model drafter reading
    the tokens it missed while its row did not draft: the whole prompt the first time), and
    steps that switch between drafting and plain decoding, are not fed in (``unmeasured``;
    GoodputPolicy._calibrate says why).

    Invariant: scales are positive; with no measurement the calibrated model is the model, and
    the shape moves only on drafting and plain steps measured within PAIR_STEPS of each other."""

    WINDOW = 8
    MIN_SAMPLES = 3
    EXTRA_CLIP = (0.05, 50.0)
    PAIR_STEPS = 16  # a drafting and a plain step this many steps apart or fewer are measured "together"
    PROBE_TOLERANCE = 0.25  # drafting steps this far off their prediction ask for a plain probe
    PROBE_EVERY = 64  # the bucket's steps between two plain probes, at the least
    PROBE_STEPS = 2  # plain steps of a probe
    REPROBE_AFTER = 64  # a bucket's shape is forgotten after this many steps in a row without drafting

    def __init__(self):
        self.base_scale: dict[int, float] = {}  # bucket -> the host's speed (median of MIN_SAMPLES or more)
        self.extra_scale: dict[int, float] = {}  # bucket -> the shape (median of its pair samples)
        self._base_samples: dict[int, deque[float]] = {}  # bucket -> its last WINDOW speed samples
        self._extra_samples: dict[int, deque[float]] = {}  # bucket -> its last WINDOW shape samples
        # bucket -> (clock, measured / predicted) of its last plain steps: as many as PAIR_STEPS ahead of a drafting step
        self._plain: dict[int, deque] = {}
        self._drafting: dict[int, deque] = {}  # bucket -> [clock, seconds, P0, E, paired] of its last WINDOW drafting steps
        self._bucket_steps: dict[int, int] = {}  # bucket -> its steps measured
        self._last_probe: dict[int, int] = {}  # bucket -> its step count at its last plain probe
        self._idle: dict[int, int] = {}  # steps without drafting since the bucket's last drafting step
        self._clock = 0  # steps measured, with a gap between calls (no pairs across calls)

    @property
    def steps_measured(self) -> int:
        """Steps fed in so far, calibrated on or not (``unmeasured``), over every bucket."""
        return sum(self._bucket_steps.values())

    def new_call(self) -> None:
        """A new generate() call: its steps pair with none of the last call's."""
        self._clock += 2 * self.PAIR_STEPS + 1

    def apply(self, step_time: LinearStepTime, num_rows: int) -> LinearStepTime:
        bucket = row_bucket(num_rows)
        speed = self.base_scale.get(bucket, 1.0)
        return step_time.calibrated(speed, speed * self.extra_scale.get(bucket, 1.0))

    def _add(self, samples: dict, scales: dict, bucket: int, new_samples: list[float]) -> None:
        """Append ``new_samples`` to the bucket's last WINDOW samples; its scale becomes their median
        once it holds MIN_SAMPLES (as adding them one by one would leave it: nothing reads the scale
        in between). None: nothing changes (no window is made for the bucket)."""
        if not new_samples:
            return
        held = samples.setdefault(bucket, deque(maxlen=self.WINDOW))
        held.extend(new_samples)
        if len(held) >= self.MIN_SAMPLES:
            scales[bucket] = statistics.median(held)

    def idle(self, num_rows: int, steps: int = 1) -> None:
        """Count ``steps`` steps that did not draft; after REPROBE_AFTER of them in a row,
        forget this bucket's shape and drafting steps, so the next decision uses the model again
        and, if it drafts, measures afresh beside the plain steps just taken: measurements cannot
        rule speculation out for good."""
        bucket = row_bucket(num_rows)
        if bucket not in self._extra_samples and bucket not in self._drafting:
            return
        self._idle[bucket] = self._idle.get(bucket, 0) + steps
        if self._idle[bucket] >= self.REPROBE_AFTER:
            self._extra_samples.pop(bucket, None)
            self._drafting.pop(bucket, None)
            self.extra_scale.pop(bucket, None)
            self._idle[bucket] = 0

    def _tick(self, bucket: int) -> None:
        """One more step on the clock and in the bucket's count."""
        self._clock += 1
        self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1

    def unmeasured(self, num_rows: int, drafting: bool) -> None:
        """A step not calibrated on (a catch-up, or a switch between drafting and plain
        decoding): the clock runs on, and a drafting one ends the bucket's run of idle steps."""
        bucket = row_bucket(num_rows)
        self._tick(bucket)
        if drafting:
            self._idle[bucket] = 0

    def measured(self, num_rows: int) -> bool:
        """Whether the bucket of ``num_rows`` active rows has drafting measurements (a shape, or
        MIN_SAMPLES drafting steps) since it was last forgotten."""
        bucket = row_bucket(num_rows)
        return bucket in self.extra_scale or len(self._drafting.get(bucket, ())) >= self.MIN_SAMPLES

    def observe(self, step_time: LinearStepTime, k: np.ndarray, measured_s: list[float]) -> None:
        """Steps of the same lengths k [A], one sample each; step_time: the uncalibrated model over
        their A active rows (the prediction computed once)."""
        bucket = row_bucket(len(k))
        base = step_time.base
        if base <= 0:
            return
        drafting = bool(k.any())
        extra = float(step_time.extra(k)) if drafting else 0.0
        predicted = base + self.extra_scale.get(bucket, 1.0) * extra
        speeds = []  # measured / predicted of each step
        for seconds in measured_s:
            self._tick(bucket)
            if seconds <= 0:
                continue
            speeds.append(seconds / predicted)
            if extra > 0:
                self._drafting.setdefault(bucket, deque(maxlen=self.WINDOW)).append([self._clock, seconds, base, extra, False])
            elif not drafting:
                self._plain.setdefault(bucket, deque(maxlen=self.PAIR_STEPS + 1)).append((self._clock, seconds / base))
        self._add(self._base_samples, self.base_scale, bucket, speeds)
        if drafting:
            self._idle[bucket] = 0
        self._pair(bucket)

    def _pair(self, bucket: int) -> None:
        """Shape samples from the bucket's drafting steps that have plain steps within PAIR_STEPS."""
        plain = self._plain.get(bucket, ())
        low, high = self.EXTRA_CLIP
        shapes = []
        for sample in self._drafting.get(bucket, ()):
            clock, seconds, base, extra, paired = sample
            if paired:
                continue
            near = [ratio for at, ratio in plain if abs(at - clock) <= self.PAIR_STEPS]
            if near:
                shape = (seconds / statistics.median(near) - base) / extra
                shapes.append(min(max(shape, low), high))
                sample[4] = True
        self._add(self._extra_samples, self.extra_scale, bucket, shapes)

    def _plain_speed(self, bucket: int) -> float:
        """The recent plain steps' measured / predicted: the bucket's (its last MIN_SAMPLES), else
        the latest of any bucket's, else 1."""
        own = self._plain.get(bucket)
        if own:
            return statistics.median(ratio for _, ratio in list(own)[-self.MIN_SAMPLES:])
        latest = max((held[-1] for held in self._plain.values() if held), default=None)
        return latest[1] if latest is not None else 1.0

    def wants_plain_probe(self, num_rows: int) -> bool:
        """Whether the bucket's recent unpaired drafting steps (MIN_SAMPLES or more, within
        PAIR_STEPS) ran more than PROBE_TOLERANCE off what the current shape predicts at the
        recent plain speed, and its last probe is PROBE_EVERY of its steps ago or more: a few
        plain steps then tell a slow host from dear drafting."""
        bucket = row_bucket(num_rows)
        steps = self._bucket_steps.get(bucket, 0)
        if bucket in self._last_probe and steps - self._last_probe[bucket] < self.PROBE_EVERY:
            return False
        recent = [s for s in self._drafting.get(bucket, ()) if not s[4] and self._clock - s[0] <= self.PAIR_STEPS]
        if len(recent) < self.MIN_SAMPLES:
            return False
        speed, shape = self._plain_speed(bucket), self.extra_scale.get(bucket, 1.0)
        off = statistics.median(seconds / (speed * (base + shape * extra)) for _, seconds, base, extra, _ in recent)
        return abs(off - 1.0) > self.PROBE_TOLERANCE

    def probed(self, num_rows: int) -> None:
        """The policy takes a plain probe in this bucket now."""
        bucket = row_bucket(num_rows)
        self._last_probe[bucket] = self._bucket_steps.get(bucket, 0)
