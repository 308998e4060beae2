"""The target's prefill of admitted prompts, as passes the runner replays from its CUDA graphs
when it can (DESIGN §9: admission under continuous batching).

An eager forward pass of a small target is bound by host time (on the `gpu` zoo's 12-layer
target, about 13 ms: BENCHMARKS §9), a replay of a captured one costs about a tenth of that, and
an Engine refilling rows one at a time pays a prefill per admission. So with the fast attention
backend each prompt of up to MAX_CUT_TOKENS tokens is cut into groups of at most
``group_tokens`` tokens (the graphs' group size) at fixed offsets 0, g, 2g, ... of its row, and
the groups are packed into passes that fit a graph bucket (tokens and groups); when that takes
more than MAX_REPLAYS passes (a static batch's whole prompt set), they run as one eager pass
instead. Longer prompts stay whole, in an eager pass of their own: cut into small groups, a long
prompt's attention would read its keys once per group.

Invariant: a row's keys and values are the same bitwise however the rows admitted beside it are
packed: whether it is cut, and where, depends on its own length alone; a group's attention reads
only its own row's keys (at positions up to its own; an earlier group's are written before, in
this pass or an earlier one); a pass of cut prompts holds no whole one, so the kernel's block of
query rows (which follows the pass's largest group) is the same for them in every pass; and a
replay gives the logits of an eager pass (graphs.py). With the reference backend (CPU) each
prompt is one group, in one pass.
"""

from __future__ import annotations

import numpy as np

from .runner import PackedLayout

MAX_REPLAYS = 8  # graph replays of one admission's cut prompts before one eager pass is cheaper
MAX_CUT_TOKENS = 512  # longer prompts stay whole (module docstring)


def prefill_passes(rows: np.ndarray, counts: np.ndarray, group_tokens: int | None, graphs) -> list[PackedLayout]:
    """Passes that fill each rows[i] from position 0 with counts[i] tokens (each pass's tokens:
    BatchState.packed_tokens of its groups). group_tokens: the most tokens a group of a cut
    prompt holds (None: every prompt whole, in one pass); graphs: the runner's GraphedForward
    (None: no graphs, one pass of cut prompts)."""
    if group_tokens is None:
        return [PackedLayout(rows=rows, starts=np.zeros(len(rows), dtype=np.int64), counts=counts)]
    long = counts > MAX_CUT_TOKENS  # [R]
    passes = [PackedLayout(rows=rows[long], starts=np.zeros(int(long.sum()), dtype=np.int64), counts=counts[long])]
    passes = passes if long.any() else []
    rows, counts = rows[~long], counts[~long]
    if not len(rows):
        return passes
    per_row = -(-counts // group_tokens)  # [R] groups of each row: all group_tokens long but its last
    group_rows = np.repeat(rows, per_row)  # [G]
    group_index = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # [G] within its row
    starts = group_index * group_tokens  # [G]
    group_counts = np.minimum(group_tokens, np.repeat(counts, per_row) - starts)  # [G]
    cut = PackedLayout(rows=group_rows, starts=starts, counts=group_counts)
    if graphs is None or group_tokens > graphs.max_group_tokens:
        return passes + [cut]
    replays, first = [], 0
    while first < len(group_counts):
        last = first + 1  # groups [first, last) make this pass: as many as the bucket's tokens and groups allow
        while (last < len(group_counts) and last - first < graphs.max_groups - 1
               and group_counts[first : last + 1].sum() <= graphs.max_tokens):
            last += 1
        replays.append(PackedLayout(rows=group_rows[first:last], starts=starts[first:last],
                                    counts=group_counts[first:last]))
        first = last
        if len(replays) > MAX_REPLAYS:
            return passes + [cut]
    return passes + replays
