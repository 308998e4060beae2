"""The host's critical path in a plain decoding step (issue 36: host time per step at most 0.3 ms
at batch 1): the time from a step's synchronisation (the verdict's copy to the host) to the next
step's graph replay, during which the device has nothing to run, and the functions that fill it.

Wraps a few functions with wall-clock timers (about a microsecond each, unlike cProfile's
per-call cost over every function), runs plain decoding of a random-weight Llama shape through
generate() under CUDA graphs, and prints the mean gap per step and each wrapped function's time
inside the gaps (nested functions overlap: the rows do not add up). Run-ahead (run_ahead.py) is
turned off here: with it the next step is queued before the synchronisation, so the gap would not
be idle device time; the bandwidth bench's host milliseconds measure what it leaves.

    PYTHONPATH=. python experiments/host_critical_path.py --shape llama-8B --batch 1 [--compile]   # GPU
    PYTHONPATH=. python experiments/host_critical_path.py --device cpu --tiny                      # a smoke run
"""

from __future__ import annotations

import functools
import json
import time

import torch

from specdec import batch, engine, generate, graphs, run_ahead, stats, types
from specdec.bench.bandwidth import SHAPES
from specdec.bench.pipeline import random_model
from specdec.policies import FixedPolicy
from specdec.verifiers import base

from experiments.host_step_profile import TINY, probe_arguments
SYNC, LAUNCH = "HostCopy.wait (the synchronisation)", "graph replay launch"
WRAPPED = [  # (owner, attribute, label)
    (types.HostCopy, "wait", SYNC),
    (torch.cuda.CUDAGraph, "replay", LAUNCH),
    (engine.Engine, "admit", "Engine.admit"),
    (engine.Engine, "_plan", "Engine._plan (policy)"),
    (engine.Engine, "_draft", "Engine._draft"),
    (engine.Engine, "_verify", "Engine._verify (to the replay, then the verdict's kernels)"),
    (engine.Engine, "_finish", "Engine._finish (from the synchronisation on)"),
    (batch.BatchState, "commit", "BatchState.commit"),
    (stats.StatsRecorder, "record", "StatsRecorder.record"),
    (base, "to_device_many", "verify's to_device_many"),
    (graphs.GraphedForward, "_fill", "GraphedForward._fill (layout + transfer)"),
    (base, "chain_verdict", "chain_verdict (launches)"),
]


def instrument(events: list) -> list:
    """Wrap every WRAPPED function to append (label, start, end) to ``events`` -> the originals."""
    originals = []
    for owner, name, label in WRAPPED:
        original = getattr(owner, name)
        originals.append((owner, name, original))

        @functools.wraps(original)
        def timed(*args, __original=original, __label=label, **kwargs):
            started = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                events.append((__label, started, time.perf_counter()))

        setattr(owner, name, timed)
    return originals


def critical_path(events: list) -> tuple[float, int, dict[str, float]]:
    """-> (mean gap from a synchronisation's end to the next replay's start, gaps, each label's
    mean seconds inside the gaps)."""
    syncs = sorted(end for label, _, end in events if label == SYNC)
    launches = sorted(start for label, start, _ in events if label == LAUNCH)
    gaps = []
    for sync in syncs:
        following = [launch for launch in launches if launch > sync]
        if following:
            gaps.append((sync, following[0]))
    inside = {}
    for label, start, end in events:
        overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in gaps)
        inside[label] = inside.get(label, 0.0) + overlap
    count = max(1, len(gaps))
    return sum(b - a for a, b in gaps) / count, len(gaps), {k: v / count for k, v in inside.items()}


def main(argv: list[str] | None = None) -> int:
    parser = probe_arguments(__doc__)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shape = TINY if args.tiny else SHAPES[args.shape]
    model = random_model(shape, args.device, seed=0, dtype=torch.bfloat16 if cuda else torch.float32)
    options = dict(attention="fast", cuda_graphs=True, compile=args.compile) if cuda else {}
    context = min(args.context, 64) if args.tiny else args.context
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(context)] for i in range(args.batch)]
    call = functools.partial(generate, model, prompts, policy=FixedPolicy(0), max_new_tokens=args.new_tokens,
                             eos_token_id=[], **options)
    run_ahead.RUN_AHEAD = False  # (module docstring)
    call(), call()  # the first sizes the cache and captures the graphs
    events: list = []
    originals = instrument(events)
    try:
        out = call()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    steps = out.stats.steps
    step_ms = 1e3 * (out.stats.wall_time_s - out.stats.prefill_time_s) / steps
    gap, count, inside = critical_path(events)
    print(f"{steps} steps, {step_ms:.3f} ms a step; the device waits for the host {1e3 * gap:.3f} ms a step "
          f"(from each synchronisation to the next replay, {count} gaps)")
    print(f"{'ms in the gap':>13}  function (per step, nested ones overlap)")
    for label, seconds in sorted(inside.items(), key=lambda item: -item[1]):
        print(f"{1e3 * seconds:13.3f}  {label}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(shape="tiny" if args.tiny else args.shape, device=args.device, batch=args.batch,
                           compile=args.compile, steps=steps, step_ms=step_ms, gap_ms=1e3 * gap,
                           inside_ms={k: 1e3 * v for k, v in inside.items()}), handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
