"""Replay an arrival trace against an Engine in real time (SmartSpec's measurement, arXiv
2406.14066: mean request latency under a request rate).

Request i joins the engine at the first step boundary after its arrival time (seconds from the
start of the replay); while nothing is in flight the replay sleeps until the next arrival. Its
latency counts from its scheduled arrival, so time spent waiting for a step to end or for a free
row is charged to it, as a real server would.

Invariant: every request's output is the engine's (the target's own, see engine.py); only the
times depend on the load. Cost: the engine's steps, plus the sleeps of an idle engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .engine import Engine, FinishedRequest
from .load import RequestTiming


@dataclass(frozen=True)
class ReplayedRequest:
    result: FinishedRequest
    timing: RequestTiming  # seconds from the start of the replay


def replay(engine: Engine, prompts: list, arrivals, max_new_tokens: int = 128, seeds=None,
           sampling=None) -> list[ReplayedRequest]:
    """Add ``prompts[i]`` at ``arrivals[i]`` seconds (in order, >= 0) and step the engine until all
    are done -> one ReplayedRequest per prompt, in order. seeds: one per prompt (default: i).
    sampling: one SamplingParams (or None: the engine's) per prompt (default: the engine's)."""
    arrivals = np.asarray(arrivals, dtype=np.float64)
    if arrivals.shape != (len(prompts),):
        raise ValueError(f"give one arrival time per prompt: {len(prompts)} prompts, arrivals of shape {arrivals.shape}")
    if len(prompts) and (not np.all(np.isfinite(arrivals)) or arrivals.min() < 0 or np.any(np.diff(arrivals) < 0)):
        raise ValueError("arrival times must be finite, >= 0 and in order (sort the trace with its prompts)")
    if max_new_tokens < 1:
        raise ValueError(f"a replayed request must ask for at least one token, got max_new_tokens={max_new_tokens}")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    sampling = [None] * len(prompts) if sampling is None else list(sampling)
    if len(seeds) != len(prompts) or len(sampling) != len(prompts):
        raise ValueError(f"give one seed and one sampling (or None) per prompt: {len(prompts)} prompts, "
                         f"{len(seeds)} seeds, {len(sampling)} samplings")
    if engine.has_work():
        raise ValueError("the engine already has requests: replay a trace on an idle engine")
    if engine.tensor_parallel:
        raise ValueError("replay admits requests by each process's own clock, which would part a tensor-parallel "
                         "target's ranks: replay on a target of one process")
    start = engine.now()
    ids, finished, next_request = [], {}, 0
    try:
        while next_request < len(prompts) or engine.has_work():
            elapsed = engine.now() - start
            while next_request < len(prompts) and arrivals[next_request] <= elapsed:
                ids.append(engine.add_request(prompts[next_request], max_new_tokens=max_new_tokens,
                                              sampling=sampling[next_request], seed=seeds[next_request]))
                next_request += 1
            if not engine.has_work():  # idle until the next arrival
                time.sleep(max(0.0, arrivals[next_request] - (engine.now() - start)))
                continue
            finished.update((done.id, done) for done in engine.step())
    except BaseException:  # (a bad prompt, say) the engine is left idle, as it was given
        for request_id in ids:
            engine.cancel(request_id)
        while engine.has_work():
            engine.step()
        raise
    out = []
    for request_id, arrival in zip(ids, arrivals):
        done = finished[request_id]
        out.append(ReplayedRequest(done, RequestTiming(arrival_s=float(arrival), first_token_s=done.first_token_s - start,
                                                       finish_s=done.finish_s - start,
                                                       output_tokens=len(done.token_ids))))
    return out
