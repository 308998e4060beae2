"""The target's prefill of admitted prompts under CUDA graphs (DESIGN §9: admission under
continuous batching).

An eager forward pass of a small target is bound by host time (the `gpu` zoo's 12-layer target:
12-20 ms, BENCHMARKS §9), and an Engine refilling rows one at a time pays a prefill per
admission. With graphs, the runner keeps one more graph, of PREFILL_TOKENS tokens
(ModelRunner.enable_prefill_graph), and the admitted prompts are packed, in order, into passes of
at most that many tokens (a prompt that does not fit the rest of a pass goes on in the next),
each replayed padded to the graph's size, however many passes it takes: an eager pass of another
size would give other bits (its products' shapes, its split-KV shares).

Invariant: a prompt's keys and values are the same bits however the prompts admitted beside it
are packed: every pass has one shape (so cuBLAS picks the same products for it, which it may not
across pass sizes) and one kernel configuration, and a query's attention reads its row's keys by
position, in key blocks and split-KV shares aligned to the row, whichever group or pass it is in
(an earlier pass's keys are in the cache, this pass's are written before the attention reads
them). A CUDA test compares every prompt's cache admitted alone and packed with fifteen others.
Without graphs each admission is one eager pass, one group a prompt.
"""

from __future__ import annotations

import numpy as np

from .runner import PackedLayout

PREFILL_TOKENS = 256  # tokens of the prefill graph's one pass


def prefill_passes(rows: np.ndarray, counts: np.ndarray, graph) -> list[PackedLayout]:
    """Passes that fill each rows[i] from position 0 with counts[i] tokens: graph: the runner's
    prefill graph (GraphedForward; None: one eager pass). Each pass holds at most the graph's
    tokens and one group a row (a row cut at a pass boundary goes on in the next pass)."""
    if graph is None:
        return [PackedLayout(rows=rows, starts=np.zeros(len(rows), dtype=np.int64), counts=counts)]
    passes, pass_rows, pass_starts, pass_counts, room = [], [], [], [], graph.max_tokens
    for row, count in zip(rows.tolist(), counts.tolist()):
        start = 0
        while start < count:
            if room == 0 or len(pass_rows) == graph.max_groups - 1:  # this pass is full: the next one
                passes.append(PackedLayout(rows=np.array(pass_rows), starts=np.array(pass_starts),
                                           counts=np.array(pass_counts)))
                pass_rows, pass_starts, pass_counts, room = [], [], [], graph.max_tokens
            take = min(count - start, room)
            pass_rows.append(row)
            pass_starts.append(start)
            pass_counts.append(take)
            start, room = start + take, room - take
    if pass_rows:
        passes.append(PackedLayout(rows=np.array(pass_rows), starts=np.array(pass_starts), counts=np.array(pass_counts)))
    return passes
