"""Arrival traces and serving latency metrics (specdec/load.py), on hand-computed cases."""

import math

import numpy as np
import pytest

from specdec.load import RequestTiming, arrivals_from_file, poisson_arrivals, summarize


def test_poisson_gaps_have_the_rates_mean_and_the_seed_fixes_the_trace():
    times = poisson_arrivals(rate_per_s=4.0, count=20_000, seed=3)
    gaps = np.diff(np.concatenate([[0.0], times]))
    # exponential gaps of mean 0.25 s: the sample mean's standard error is 0.25 / sqrt(20,000) = 0.0018
    assert abs(gaps.mean() - 0.25) < 4 * 0.25 / math.sqrt(20_000)
    assert abs(gaps.std() - 0.25) < 0.01  # an exponential's standard deviation equals its mean
    assert np.all(gaps > 0)
    assert np.array_equal(times, poisson_arrivals(4.0, 20_000, seed=3))
    assert not np.array_equal(times, poisson_arrivals(4.0, 20_000, seed=4))


@pytest.mark.parametrize("rate,count,message", [(0, 5, "rate_per_s must be a positive"),
                                                (float("inf"), 5, "rate_per_s must be a positive"),
                                                (2.0, 0, "count must be a whole number >= 1")])
def test_bad_traces_are_refused(rate, count, message):
    with pytest.raises(ValueError, match=message):
        poisson_arrivals(rate, count)


def test_traces_from_files(tmp_path):
    lines = tmp_path / "trace.txt"
    lines.write_text("# seconds\n0.0\n0.5\n\n2.25\n")
    assert arrivals_from_file(lines).tolist() == [0.0, 0.5, 2.25]
    listed = tmp_path / "trace.json"
    listed.write_text("[0, 1.5, 1.5]")
    assert arrivals_from_file(listed).tolist() == [0.0, 1.5, 1.5]
    for text, message in (("1.0\n0.5\n", "comes before the one above it"), ("-1\n", "finite and >= 0"),
                          ("soon\n", "one number per line"), ("# nothing\n", "no arrival times")):
        lines.write_text(text)
        with pytest.raises(ValueError, match=message):
            arrivals_from_file(lines)


def test_request_and_run_metrics():
    timings = [RequestTiming(arrival_s=0.0, first_token_s=0.5, finish_s=2.5, output_tokens=5),
               RequestTiming(arrival_s=1.0, first_token_s=1.25, finish_s=1.25, output_tokens=1),
               RequestTiming(arrival_s=2.0, first_token_s=3.0, finish_s=4.0, output_tokens=3)]
    first = timings[0]
    assert (first.time_to_first_token_s, first.latency_s, first.time_per_output_token_s) == (0.5, 2.5, 0.5)
    assert math.isnan(timings[1].time_per_output_token_s)
    run = summarize(timings)
    assert run["span_s"] == 4.0 and run["output_tokens"] == 9
    assert run["tokens_per_s"] == 9 / 4.0 and run["requests_per_s"] == 3 / 4.0
    assert run["latency_s"]["mean"] == pytest.approx((2.5 + 0.25 + 2.0) / 3)
    assert run["latency_s"]["p50"] == 2.0
    assert run["time_per_output_token_s"]["mean"] == pytest.approx((0.5 + 0.5) / 2)  # the one-token request has none
    with pytest.raises(ValueError, match="arrival <= first token <= finish"):
        RequestTiming(arrival_s=1.0, first_token_s=0.5, finish_s=2.0, output_tokens=2)
    with pytest.raises(ValueError, match="at least one finished request"):
        summarize([])
