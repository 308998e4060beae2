"""The target's prefill of admitted prompts, as passes the runner replays from its CUDA graphs
when it can (DESIGN §9: admission under continuous batching).

An eager forward pass of a small target is bound by host time (on the `gpu` zoo's 12-layer
target, about 13 ms: BENCHMARKS §9), a replay of a captured one costs about a tenth of that, and
an Engine refilling rows one at a time pays a prefill per admission. So with the fast attention
backend each prompt is cut into groups of at most ``group_tokens`` tokens (the graphs' group
size) at fixed offsets 0, g, 2g, ... of the row, and the groups are packed, in order, into
passes that fit a graph bucket (tokens and groups); when that takes more than MAX_REPLAYS passes
(a static batch's whole prompt set), they run as one eager pass instead.

Invariant: a row's keys and values are the same bitwise whichever way its groups are packed
(replayed or eager, alone or beside other prompts): its groups are fixed by its own length, a
group's attention reads only its own row's keys (at positions up to its own; an earlier group's
are written before, in this pass or an earlier one) and runs the same kernel variant either way
(the block of query rows follows the group size, the same in both), and the graphs' passes give
the logits of an eager pass (graphs.py). With the reference backend (CPU) each prompt is one
group, in one pass.
"""

from __future__ import annotations

import numpy as np

from .runner import PackedLayout

MAX_REPLAYS = 8  # graph replays of one admission's prefill before one eager pass is cheaper


def prefill_passes(rows: np.ndarray, counts: np.ndarray, group_tokens: int | None, graphs) -> list[PackedLayout]:
    """Passes that fill rows ``rows`` [R] from position 0 with ``counts`` [R] tokens each, in the
    order the rows' tokens are packed (row by row): each pass's tokens follow the last one's.
    group_tokens: the most tokens a group holds (None: one group a row, one pass); graphs: the
    runner's GraphedForward (None: no graphs, one pass)."""
    whole = PackedLayout(rows=rows, starts=np.zeros(len(rows), dtype=np.int64), counts=counts)
    if group_tokens is None:
        return [whole]
    # [R] groups per row; every group is group_tokens long but each row's last
    per_row = -(-counts // group_tokens)
    group_rows = np.repeat(rows, per_row)  # [G]
    group_index = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # [G] within its row
    starts = group_index * group_tokens  # [G]
    group_counts = np.minimum(group_tokens, np.repeat(counts, per_row) - starts)  # [G]
    chunked = PackedLayout(rows=group_rows, starts=starts, counts=group_counts)
    if graphs is None or group_tokens > graphs.max_group_tokens:
        return [chunked]
    passes, first = [], 0
    while first < len(group_counts):
        last = first + 1  # groups [first, last) make this pass: as many as the bucket's tokens and groups allow
        while (last < len(group_counts) and last - first < graphs.max_groups - 1
               and group_counts[first : last + 1].sum() <= graphs.max_tokens):
            last += 1
        passes.append(PackedLayout(rows=group_rows[first:last], starts=starts[first:last],
                                   counts=group_counts[first:last]))
        first = last
        if len(passes) > MAX_REPLAYS:
            return [chunked]
    return passes
