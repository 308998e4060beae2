"""Request arrivals and serving latency, for measuring an engine under load (SmartSpec, arXiv
2406.14066: mean request latency against request rate, from light load to saturation).

- Arrival traces: ``poisson_arrivals`` (exponential gaps at a given rate, seeded) or
  ``arrivals_from_file`` (timestamps in seconds, one per line or a JSON list).
- Per request (``RequestTiming``): time to first token (TTFT), time per output token after the
  first (TPOT) and end-to-end latency, from its arrival, first-token and finish times.
- Per run (``summarize``): token and request throughput over the run's span (first arrival to
  last finish), and the mean, p50, p90 and p99 of each latency.

Invariant: pure functions of their inputs (a trace depends only on rate, count and seed). Cost:
O(requests).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> np.ndarray:
    """[count] arrival times in seconds of a Poisson process at ``rate_per_s`` requests per
    second, starting from 0 (the first request arrives after one gap)."""
    if not (isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s must be a positive number of requests per second, got {rate_per_s!r}")
    if int(count) != count or count < 1:
        raise ValueError(f"count must be a whole number >= 1, got {count!r}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=int(count))
    return np.cumsum(gaps)


def arrivals_from_file(path: str | Path) -> np.ndarray:
    """Arrival times in seconds from a file: a JSON list of numbers, or one number per line
    (blank lines and lines starting with # skipped). They must be finite, >= 0 and in order."""
    text = Path(path).read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [
            float(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    except ValueError as error:
        raise ValueError(f"{path}: expected a JSON list of seconds or one number per line ({error})") from None
    times = np.asarray(values, dtype=np.float64)
    if times.ndim != 1 or len(times) == 0:
        raise ValueError(f"{path}: no arrival times found; write one time in seconds per line")
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ValueError(f"{path}: arrival times must be finite and >= 0 seconds")
    if np.any(np.diff(times) < 0):
        first = int(np.flatnonzero(np.diff(times) < 0)[0]) + 1
        raise ValueError(f"{path}: arrival {first} ({times[first]} s) comes before the one above it; sort the trace")
    return times


@dataclass(frozen=True)
class RequestTiming:
    arrival_s: float
    first_token_s: float  # when its first output token was committed
    finish_s: float  # when its last output token was committed
    output_tokens: int

    def __post_init__(self):
        if not self.arrival_s <= self.first_token_s <= self.finish_s:
            raise ValueError(f"a request's times must run arrival <= first token <= finish, got {self.arrival_s}, "
                             f"{self.first_token_s}, {self.finish_s}")
        if self.output_tokens < 1:
            raise ValueError(f"a finished request has at least one output token, got {self.output_tokens}")

    @property
    def time_to_first_token_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        """End to end: arrival to the last token."""
        return self.finish_s - self.arrival_s

    @property
    def time_per_output_token_s(self) -> float:
        """Mean time between output tokens after the first (NaN for a one-token request)."""
        if self.output_tokens == 1:
            return float("nan")
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


def _stats(values: list[float]) -> dict:
    values = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if len(values) == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(timings: list[RequestTiming]) -> dict:
    """A run's throughput (over first arrival to last finish) and latency statistics (seconds)."""
    if not timings:
        raise ValueError("summarize needs at least one finished request")
    span = max(t.finish_s for t in timings) - min(t.arrival_s for t in timings)
    tokens = sum(t.output_tokens for t in timings)
    return {
        "requests": len(timings),
        "output_tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span > 0 else float("nan"),
        "requests_per_s": len(timings) / span if span > 0 else float("nan"),
        "latency_s": _stats([t.latency_s for t in timings]),
        "time_to_first_token_s": _stats([t.time_to_first_token_s for t in timings]),
        "time_per_output_token_s": _stats([t.time_per_output_token_s for t in timings]),
    }
