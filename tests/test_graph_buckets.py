"""The buckets of GraphedForward (specdec/graphs.py), checked without a GPU: powers of two up to
the first >= the largest pass; compiled runners have no size-1 bucket (Dynamo gives size 1 a
compiled variant of its own, whose bf16 rounding differs from the other buckets')."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.graphs import GraphedForward


def buckets_of(max_tokens: int, compile: bool) -> list[int]:
    runner = SimpleNamespace(model=torch.nn.Linear(2, 2), device=torch.device("cpu"),
                             cache=SimpleNamespace(max_rows=5))
    return GraphedForward(runner, max_group_tokens=4, max_tokens=max_tokens, compile=compile).buckets


@pytest.mark.parametrize("max_tokens, eager, compiled", [
    (1, [1], [2]),
    (2, [1, 2], [2]),
    (3, [1, 2, 4], [2, 4]),
    (9, [1, 2, 4, 8, 16], [2, 4, 8, 16]),
    (16, [1, 2, 4, 8, 16], [2, 4, 8, 16]),
    (576, [1 << i for i in range(11)], [1 << i for i in range(1, 11)]),
])
def test_buckets_are_powers_of_two_and_compiled_ones_start_at_two(max_tokens, eager, compiled):
    assert buckets_of(max_tokens, compile=False) == eager
    assert buckets_of(max_tokens, compile=True) == compiled


def test_a_replay_in_a_chosen_bucket_needs_one_that_was_captured_and_holds_the_pass():
    runner = SimpleNamespace(model=torch.nn.Linear(2, 2), device=torch.device("cpu"), cache=SimpleNamespace(max_rows=5))
    graphs = GraphedForward(runner, max_group_tokens=4, max_tokens=8)  # nothing captured (no GPU here)
    counts = np.array([3, 3])
    with pytest.raises(ValueError, match="does not hold a pass of 6 tokens"):
        graphs.run(torch.zeros(6, dtype=torch.int64), np.arange(2), np.zeros(2, dtype=np.int64), counts, bucket=8)
