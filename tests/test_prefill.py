"""Prefill passes of admitted prompts (specdec/prefill.py): every prompt position is filled once,
within the prefill graph's tokens and groups, prompts cut at pass boundaries going on in the next
pass; an Engine whose prefill runs in several passes gives every request the target's greedy
output. CPU, float64 (no graphs: the passes run eagerly, as packed)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec import Engine
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.prefill import prefill_passes
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

VOCAB = 96


def graph_like(max_tokens: int, max_groups: int):
    """What prefill_passes reads of a GraphedForward; it fits nothing, so passes run eagerly."""
    return SimpleNamespace(max_tokens=max_tokens, max_groups=max_groups, fits=lambda counts: False)


def covered(passes) -> list[tuple[int, int]]:
    """(row, position) of every token the passes fill, in pass order."""
    return [(int(row), int(start) + j) for layout in passes for row, start, count
            in zip(layout.rows, layout.starts, layout.counts) for j in range(int(count))]


@pytest.mark.parametrize("counts", [[1], [7], [6, 1, 13], [30, 30], [5, 2, 17, 9]])
def test_passes_fill_each_position_once_within_the_graph(counts):
    rows = np.array([4, 0, 2, 3][: len(counts)], dtype=np.int64)
    counts = np.array(counts, dtype=np.int64)
    passes = prefill_passes(rows, counts, graph_like(max_tokens=8, max_groups=3))
    assert covered(passes) == [(int(r), p) for r, c in zip(rows, counts) for p in range(int(c))]
    for layout in passes:  # a graph's pass: its tokens, at most max_groups - 1 groups, one a row
        assert layout.num_tokens <= 8 and len(layout.counts) <= 2 and len(set(layout.rows.tolist())) == len(layout.rows)
    assert all(layout.num_tokens == 8 for layout in passes[:-1] if len(layout.counts) < 2)  # full unless out of groups


def test_without_a_graph_one_eager_pass_of_whole_prompts():
    whole = prefill_passes(np.array([3, 1]), np.array([9, 4]), None)
    assert len(whole) == 1 and whole[0].rows.tolist() == [3, 1] and whole[0].counts.tolist() == [9, 4]
    many = prefill_passes(np.array([0, 1]), np.array([100, 1]), graph_like(max_tokens=8, max_groups=3))
    assert len(many) == 13 and sum(layout.num_tokens for layout in many) == 101  # replays, however many


@pytest.mark.parametrize("graph", [graph_like(8, 3), graph_like(5, 4), graph_like(16, 2)])
def test_an_engine_prefilling_in_several_passes_gives_the_targets_greedy_output(graph):
    """A prompt cut at a pass boundary reads its earlier part from the cache."""
    target = make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float64)
    prompts = random_prompts(5, VOCAB, seed=21, max_len=15)
    with Engine(target, ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(3), max_rows=3, max_len=40,
                eos_token_id=[]) as engine:
        engine.runner.prefill_graph = graph
        ids = [engine.add_request(p, max_new_tokens=9) for p in prompts]
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
        engine.runner.prefill_graph = None
    for prompt, request_id in zip(prompts, ids):
        assert finished[request_id].token_ids == hf_greedy(target, prompt, 9)
