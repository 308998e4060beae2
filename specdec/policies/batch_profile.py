"""Synergy's short profile before serving (Su, Giannoula, Pekhimenko 2023, arXiv 2310.18813):
measured tokens per step and round times per batch size and draft length, from real generate()
calls with FixedPolicy (BatchAdaptivePolicy.from_measurements). Profiling runs the decoding loop;
the policy does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..types import is_int_at_least


def profile_expected_tokens(target, drafter, prompts, draft_lengths: Sequence[int], max_new_tokens: int = 32,
                            batch_size: int | None = None, **generate_options) -> dict[int, float]:
    """A short profile: l(s) = measured tau of generate() with FixedPolicy(s), for each s, over
    every one of ``prompts`` (in calls of at most ``batch_size`` requests; None: one call),
    pooled: emitted tokens over row steps of all the calls."""
    from ..generate import generate  # the loop imports the policies package
    from .fixed import FixedPolicy

    prompts = list(prompts)
    if not prompts:
        raise ValueError("profile_expected_tokens needs at least one prompt")
    if batch_size is not None and not is_int_at_least(batch_size, 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    size = len(prompts) if batch_size is None else int(batch_size)
    measured = {}
    for s in draft_lengths:
        emitted = row_steps = 0
        for start in range(0, len(prompts), size):
            out = generate(target, prompts[start : start + size], drafter=drafter, policy=FixedPolicy(int(s)),
                           max_new_tokens=max_new_tokens, **generate_options)
            emitted, row_steps = emitted + out.stats.emitted, row_steps + out.stats.row_steps
        measured[int(s)] = emitted / row_steps if row_steps else float("nan")
    return measured


def measure_round_times(target, drafter, prompts, batch_sizes: Sequence[int], draft_lengths: Sequence[int],
                        max_new_tokens: int = 32, repeats: int = 1, requests_per_size: int | None = None,
                        **generate_options
                        ) -> tuple[dict[int, float], dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """A short measured profile, no model in between: for every batch size b and length s,
    generate() with FixedPolicy(s) on every one of ``prompts`` in calls of b (one call of b
    requests, ``prompts`` cycled, when b exceeds their number), warm runners assumed. A small
    batch size thus still measures many requests, not one request's luck. With ``repeats`` > 1
    every length is measured that many times, the lengths taken in turn within each round (a
    slow spell of the machine then falls on one round of every length, not on all of one
    length's), and a length's time is the median over its rounds. ``requests_per_size``: batch
    size b measures only the first max(b, requests_per_size) prompts (None: all of them), so a
    profile given as many distinct prompts as its largest batch does not time many calls at
    the small ones. A call of b rows should hold b distinct requests: its slowest row sets its
    length, and requests cycled over more rows repeat their stragglers, which can rank the
    lengths wrongly.

    -> (l(s): tau pooled over every call, {(b, s): measured seconds per decoding step, the
    median over rounds of each round's pooled calls}, {(b, s): measured tokens per second of
    the calls, emitted tokens over decoding time, the median over rounds}). The last is what a
    static batch delivers: a call lasts until its slowest row is done, so a longer draft that
    raises tau without shortening the slowest row's steps only makes the steps dearer, which
    tau / seconds per step does not see.
    """
    from ..generate import generate  # the loop imports the policies package
    from .fixed import FixedPolicy

    if not is_int_at_least(repeats, 1):
        raise ValueError(f"repeats must be an integer >= 1 (measured rounds per length), got {repeats!r}")
    if requests_per_size is not None and not is_int_at_least(requests_per_size, 1):
        raise ValueError(f"requests_per_size must be an integer >= 1 or None, got {requests_per_size!r}")
    all_prompts = list(prompts)
    emitted: dict[int, float] = {}
    row_steps: dict[int, float] = {}
    rounds: dict[tuple[int, int], list[float]] = {}
    throughput_rounds: dict[tuple[int, int], list[float]] = {}
    for b in batch_sizes:
        b = int(b)
        prompts = all_prompts if requests_per_size is None else all_prompts[: max(b, int(requests_per_size))]
        if b >= len(prompts):
            calls = [[prompts[i % len(prompts)] for i in range(b)]]
        else:
            calls = [prompts[i : i + b] for i in range(0, len(prompts) - b + 1, b)]  # whole calls of b only
        for _ in range(repeats):
            for s in draft_lengths:
                decoding_s = steps = call_tokens = 0.0
                for chosen in calls:
                    out = generate(target, chosen, drafter=drafter if s > 0 else None, policy=FixedPolicy(int(s)),
                                   max_new_tokens=max_new_tokens, **generate_options)
                    stats = out.stats
                    decoding_s += stats.wall_time_s - stats.prefill_time_s
                    steps += stats.steps
                    call_tokens += stats.emitted
                    emitted[int(s)] = emitted.get(int(s), 0.0) + stats.emitted
                    row_steps[int(s)] = row_steps.get(int(s), 0.0) + stats.row_steps
                if steps <= 0 or decoding_s <= 0:
                    raise ValueError(f"the profile at batch size {b}, length {s} measured {steps:g} steps in {decoding_s:g} s: "
                                     "give prompts with room for new tokens (max_new_tokens >= 1) and a working clock")
                rounds.setdefault((b, int(s)), []).append(decoding_s / steps)
                throughput_rounds.setdefault((b, int(s)), []).append(call_tokens / decoding_s)
    seconds = {key: float(np.median(times)) for key, times in rounds.items()}
    tokens_per_s = {key: float(np.median(values)) for key, values in throughput_rounds.items()}
    return {s: emitted[s] / row_steps[s] for s in emitted}, seconds, tokens_per_s
