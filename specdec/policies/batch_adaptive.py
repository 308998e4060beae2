"""BatchAdaptivePolicy: the draft length that suits the batch size, from a table built once
(Su, Giannoula, Pekhimenko 2023, "The Synergy of Speculative Decoding and Batching in Serving
Large Language Models", arXiv 2310.18813; ALGORITHMS.md §4).

At small batch the target's step is memory-bound, so verifying more tokens is nearly free and
long drafts win; at large batch verification becomes compute-bound and long drafts cost more
than they return. For each batch size b of a menu, with l(s) the expected tokens a row emits
per step when drafting s tokens (measured tau per length, or the i.i.d. formula from an
acceptance rate) and T(b, s) = s * T_draft(b) + T_target(b, s + 1) the round time,

    s*(b) = argmax_s b * l(s) / T(b, s)      (ties: the shorter draft).

``build_table`` computes this for every b. From a measured profile (``from_measurements``) the
table takes, by default, the length of highest measured tokens per second of whole calls at b
(``table_from_throughput``): ``generate()`` runs static batches, which last until their slowest
row is done, while the per-step formula above assumes a batch kept full and so can favour a
longer draft than pays per call. Each step the policy looks up the number of active
rows: the entry of the nearest tabulated batch size on a log scale. With a CostModel, T(b, s)
is the model's drafter time for b rows drafting s tokens plus its verify time for b rows of
s + 1 tokens at a stated context length (the paper's known gap: the table ignores how context
length moves the optimum).

Invariant: the policy changes only how many tokens are drafted; output is the target's own.
Cost: a dictionary lookup per step; the table costs |batch sizes| x |lengths| predictions.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..types import Plan, is_int_at_least
from .acceptance import expected_emitted
from .base import Policy
from .cost_model import CostModel

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def cost_model_round_time(cost_model: CostModel, context_len: int, drafter_index: int = 0) -> Callable[[int, int], float]:
    """T(b, s): drafter ``drafter_index`` drafting s tokens for b rows, then the target verifying
    s + 1 tokens per row, every row holding ``context_len`` committed tokens."""
    if not 0 <= drafter_index < cost_model.num_drafters:
        raise ValueError(f"the cost model times {cost_model.num_drafters} drafter(s), not drafter {drafter_index}")

    def round_time(batch_size: int, length: int) -> float:
        lengths = np.full(batch_size, context_len)
        return cost_model.step_time(lengths, np.full(batch_size, length), drafter_index)

    return round_time


def expected_tokens_from_rate(acceptance_rate: float, draft_lengths: Sequence[int]) -> dict[int, float]:
    """l(s) = (1 - a^(s+1)) / (1 - a) for every length of the menu."""
    return {int(s): float(expected_emitted(acceptance_rate, s)) for s in draft_lengths}


def build_table(batch_sizes: Sequence[int], expected_tokens: Mapping[int, float],
                round_time: Callable[[int, int], float]) -> dict[int, int]:
    """{b: s*(b)} over the lengths s of ``expected_tokens`` (l(s), with l(0) = 1 for plain
    decoding if not given) and round times ``round_time(b, s)`` in seconds."""
    tokens = {0: 1.0, **{int(s): float(v) for s, v in expected_tokens.items()}}
    lengths = np.array(sorted(tokens))
    per_row = np.array([tokens[s] for s in lengths])  # [S]
    if np.any(lengths < 0) or np.any(per_row <= 0):
        raise ValueError("draft lengths must be >= 0 and expected tokens > 0")
    table = {}
    for b in sorted({int(b) for b in batch_sizes}):
        if b < 1:
            raise ValueError(f"batch sizes must be >= 1, got {b}")
        seconds = np.array([round_time(b, int(s)) for s in lengths])  # [S]
        if np.any(seconds <= 0):
            raise ValueError(f"round times must be positive; got {seconds} at batch size {b}")
        throughput = b * per_row / seconds
        table[b] = int(lengths[np.argmax(throughput)])  # first maximum: the shorter draft
    return table


def _check_throughputs(tokens_per_s: Mapping[tuple[int, int], float]) -> None:
    """Measured {(b, s): tokens/s} must hold batch sizes >= 1, lengths >= 0 and positive values."""
    for (b, s), value in tokens_per_s.items():
        if int(b) < 1 or int(s) < 0 or not value > 0:
            raise ValueError(f"need batch sizes >= 1, lengths >= 0 and positive throughputs, got {(b, s)}: {value}")


def table_from_throughput(tokens_per_s: Mapping[tuple[int, int], float]) -> dict[int, int]:
    """{b: s*(b)}: for each batch size b, the length s of highest measured tokens per second
    ``tokens_per_s[(b, s)]`` (ties: the shorter draft)."""
    _check_throughputs(tokens_per_s)
    table: dict[int, tuple[float, int]] = {}
    for (b, s), value in sorted(tokens_per_s.items()):
        if int(b) not in table or value > table[int(b)][0]:
            table[int(b)] = (float(value), int(s))
    return {b: s for b, (_, s) in table.items()}


def monotone_table(tokens_per_s: Mapping[tuple[int, int], float]) -> dict[int, int]:
    """{b: s(b)} with lengths that never grow with the batch size (the synergy paper's finding:
    the larger the batch, the shorter the best draft), the choice of highest total over batch
    sizes of each one's measured throughput relative to its best, sum_b tps(b, s(b)) / max_s
    tps(b, s) (dynamic programming over the batch sizes, ascending; ties: the shortest draft at
    the largest batch size, then at each smaller one the shortest of the best allowed).
    Where the measured argmax already shortens as b grows it is the argmax; one odd measurement
    (plain decoding best at one batch size between sizes where drafting won) gives
    way where keeping it would cost its neighbours more than it gains. A pair (b, s) not
    measured is not chosen; measurements that leave no such table are an error."""
    if not tokens_per_s:
        raise ValueError("monotone_table needs measured throughputs {(batch size, length): tokens/s}, got none")
    _check_throughputs(tokens_per_s)
    best_of: dict[int, float] = {}
    for (b, s), value in tokens_per_s.items():
        best_of[int(b)] = max(best_of.get(int(b), 0.0), float(value))
    sizes = sorted(best_of)
    lengths = sorted({int(s) for _, s in tokens_per_s})
    score = np.full((len(sizes), len(lengths)), -np.inf)  # [N, S] relative throughput, -inf where not measured
    for (b, s), value in tokens_per_s.items():
        score[sizes.index(int(b)), lengths.index(int(s))] = float(value) / best_of[int(b)]
    # total[j, s]: the best sum over sizes 0..j with size j at length s and the earlier ones at lengths >= s
    total = score.copy()
    for j in range(1, len(sizes)):
        longer_or_equal = np.maximum.accumulate(total[j - 1][::-1])[::-1]  # [S] max over s' >= s
        total[j] = score[j] + longer_or_equal
    if np.isneginf(total[-1]).all():
        raise ValueError(f"no table of lengths that never grow with the batch size uses only measured pairs "
                         f"{sorted(tokens_per_s)}: measure plain decoding (length 0) at every batch size, or use "
                         "table_from_throughput")
    chosen = [int(np.argmax(total[-1]))]  # first maximum: the shorter draft
    for j in range(len(sizes) - 2, -1, -1):
        allowed = np.where(np.arange(len(lengths)) >= chosen[-1], total[j], -np.inf)
        chosen.append(int(np.argmax(allowed)))
    return {b: lengths[s] for b, s in zip(sizes, reversed(chosen))}


def switch_points(sizes: Sequence[int]) -> list[float]:
    """Between neighbouring tabulated batch sizes b < b' (sorted), the nearest on a log scale
    switches at their geometric mean."""
    return [math.sqrt(a * b) for a, b in zip(sizes, sizes[1:])]


def nearest_size(sizes: Sequence[int], switch: Sequence[float], num_rows: int) -> int:
    """The size of ``sizes`` (sorted, with their ``switch_points``) nearest to num_rows on a log
    scale (ties: the larger size; fewer than one row: the smallest)."""
    return sizes[bisect.bisect_right(switch, max(int(num_rows), 1))]


def lookup(table: Mapping[int, int], num_rows: int) -> int:
    """The entry of the tabulated batch size nearest to num_rows on a log scale (ties: the larger
    batch size; fewer than one row: the smallest batch size's), so 60 active rows of a batch of
    64 use the entry measured at 64, not the one at 16."""
    sizes = sorted(table)
    return int(table[nearest_size(sizes, switch_points(sizes), num_rows)])


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


class BatchAdaptivePolicy(Policy):
    def __init__(self, table: Mapping[int, int], drafter_index: int = 0):
        """table: batch size -> draft length (``build_table`` or ``from_cost_model``);
        drafter_index: the drafter every row uses."""
        if not table:
            raise ValueError("BatchAdaptivePolicy needs a non-empty table batch size -> draft length")
        for b, s in table.items():
            if int(b) < 1 or int(s) < 0:
                raise ValueError(f"table entries must map batch sizes >= 1 to lengths >= 0, got {b!r}: {s!r}")
        if drafter_index < 0:
            raise ValueError(f"drafter_index must be >= 0, got {drafter_index!r}")
        self.table = {int(b): int(s) for b, s in table.items()}
        self.drafter_index = int(drafter_index)
        self._sizes = sorted(self.table)
        self._switch = switch_points(self._sizes)  # lookup(), precomputed
        self.profile: dict | None = None  # what from_measurements measured

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, expected_tokens: Mapping[int, float] | None = None,
                        acceptance_rate: float | None = None, draft_lengths: Sequence[int] = tuple(range(9)),
                        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, context_len: int = 512,
                        drafter_index: int = 0) -> BatchAdaptivePolicy:
        """The table from a cost model and either measured l(s) (``expected_tokens``, e.g. from
        ``profile_expected_tokens``) or an ``acceptance_rate`` for the lengths ``draft_lengths``."""
        if (expected_tokens is None) == (acceptance_rate is None):
            raise ValueError("give either expected_tokens (measured tau per draft length) or acceptance_rate")
        if expected_tokens is None:
            expected_tokens = expected_tokens_from_rate(acceptance_rate, draft_lengths)
        round_time = cost_model_round_time(cost_model, context_len, drafter_index)
        return cls(build_table(batch_sizes, expected_tokens, round_time), drafter_index=drafter_index)

    @classmethod
    def from_measurements(cls, target, drafter, prompts, batch_sizes: Sequence[int] = (1, 4, 16, 64),
                          draft_lengths: Sequence[int] = (0, 1, 2, 3, 4, 6, 8), max_new_tokens: int = 32,
                          drafter_index: int = 0, repeats: int = 1, objective: str = "calls",
                          monotone: bool = True, requests_per_size: int | None = None,
                          **generate_options) -> BatchAdaptivePolicy:
        """The table from a measured profile (``measure_round_times``, ``repeats`` rounds per
        length) rather than a fitted cost model: what the paper's short profile before serving
        does. By default (``objective="calls"``) each batch size gets the length of highest
        measured tokens per second of whole calls (table_from_throughput), which counts a static
        batch's slowest rows; ``objective="steps"`` takes b * l(s) / T(b, s) from the measured tau
        and seconds per step instead (build_table: the per-step throughput of a batch kept full,
        as under continuous batching). ``monotone`` (calls only): lengths that never grow with the
        batch size, the best such choice by relative throughput (monotone_table), so one odd
        measurement at a batch size does not stand against its neighbours'. Lookups between the measured batch sizes take the nearest
        one on a log scale, as always (so the tail of a 64-row call, once fewer rows are active,
        uses entries measured on whole calls of fewer rows). requests_per_size: as for
        ``measure_round_times``."""
        if objective not in ("calls", "steps"):
            raise ValueError(f"objective must be 'calls' or 'steps', got {objective!r}")
        expected, seconds, tokens_per_s = measure_round_times(target, drafter, prompts, batch_sizes, draft_lengths,
                                                              max_new_tokens, repeats=repeats,
                                                              requests_per_size=requests_per_size, **generate_options)
        if objective == "calls":
            table = monotone_table(tokens_per_s) if monotone else table_from_throughput(tokens_per_s)
        else:
            table = build_table(batch_sizes, expected, lambda b, s: seconds[(int(b), int(s))])
        policy = cls(table, drafter_index)
        policy.profile = {"objective": objective, "monotone": monotone and objective == "calls", "expected_tokens": expected,
                          "seconds_per_step": {f"{b},{s}": t for (b, s), t in seconds.items()},
                          "tokens_per_s": {f"{b},{s}": v for (b, s), v in tokens_per_s.items()}}
        return policy

    @property
    def max_draft_tokens(self) -> int:
        return max(self.table.values())

    def plan(self, batch, num_drafters):
        active = batch.num_rows - int(np.count_nonzero(batch.finished))
        length = self.table[nearest_size(self._sizes, self._switch, active)]
        if length > 0 and self.drafter_index >= num_drafters:
            raise ValueError(f"{self!r} drafts with drafter {self.drafter_index} but generate() was given {num_drafters}")
        return Plan(drafter_index=np.full(batch.num_rows, self.drafter_index, dtype=np.int64),
                    num_draft_tokens=np.full(batch.num_rows, length, dtype=np.int64))

    def __repr__(self) -> str:
        return f"BatchAdaptivePolicy(table={self.table}, drafter_index={self.drafter_index})"
