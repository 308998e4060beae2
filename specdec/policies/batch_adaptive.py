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
table takes, by default (``objective="calls"``, the one static-batch option), the length of
highest measured tokens per second of whole calls at b (``table_from_throughput``):
``generate()`` runs static batches, which last until their slowest row is done, while the
per-step formula assumes a batch kept full and so can favour a longer draft than pays per call
(BENCHMARKS.md §3). Each step the policy looks up the number of active
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

from ..types import Plan
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
                          objective: str = "calls", drafter_index: int = 0, **profile_options) -> BatchAdaptivePolicy:
        """The table from a short measured profile before serving, as the paper does
        (batch_profile.measure_round_times; ``profile_options``: its ``repeats``,
        ``requests_per_size`` and generate() options). ``objective="steps"`` is the paper's
        rule, b * l(s) / T(b, s) from the measured tau and seconds per step (build_table: a batch
        kept full, as under continuous batching); ``objective="calls"`` (the default, the one
        static-batch option) takes the length of highest measured tokens per second of whole
        generate() calls (table_from_throughput), which counts a static batch's slowest rows (the
        module docstring cites the measurement). drafter_index: where ``drafter`` sits in the
        drafters given to generate(). The measurements are kept in ``profile``."""
        from .batch_profile import measure_round_times  # profiling runs the loop; the policy does not

        if objective not in ("calls", "steps"):
            raise ValueError(f"objective must be 'calls' or 'steps', got {objective!r}")
        expected, seconds, tokens_per_s = measure_round_times(target, drafter, prompts, batch_sizes, draft_lengths,
                                                              max_new_tokens, **profile_options)
        if objective == "calls":
            table = table_from_throughput(tokens_per_s)
        else:
            table = build_table(batch_sizes, expected, lambda b, s: seconds[(int(b), int(s))])
        policy = cls(table, drafter_index=drafter_index)
        policy.profile = {"objective": objective, "expected_tokens": expected,
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
