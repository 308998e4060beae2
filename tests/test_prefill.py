"""Prefill passes of admitted prompts (specdec/prefill.py): every prompt position is filled once,
within the graphs' limits, with groups fixed by the row alone and long prompts whole in a pass of
their own; an Engine that prefills in groups and in several passes gives every request the
target's greedy output. CPU, float64 (the reference backend, which the engine prefills whole
unless told otherwise)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec import Engine
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.prefill import MAX_CUT_TOKENS, MAX_REPLAYS, prefill_passes
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

VOCAB = 96


def graphs_like(max_group_tokens: int, max_tokens: int, max_groups: int):
    """What prefill_passes reads of a GraphedForward."""
    return SimpleNamespace(max_group_tokens=max_group_tokens, max_tokens=max_tokens, max_groups=max_groups)


def covered(passes) -> list[tuple[int, int]]:
    """(row, position) of every token the passes fill, sorted."""
    return [(int(row), int(start) + j) for layout in passes for row, start, count
            in zip(layout.rows, layout.starts, layout.counts) for j in range(int(count))]


@pytest.mark.parametrize("counts", [[1], [7], [6, 1, 13], [30, 30], [5, 2, 17, 9]])
def test_passes_fill_each_position_once_within_the_buckets(counts):
    rows = np.array([4, 0, 2, 3][: len(counts)], dtype=np.int64)
    counts = np.array(counts, dtype=np.int64)
    graphs = graphs_like(max_group_tokens=3, max_tokens=8, max_groups=4)
    passes = prefill_passes(rows, counts, 3, graphs)
    assert sorted(covered(passes)) == sorted((int(r), p) for r, c in zip(rows, counts) for p in range(int(c)))
    if len(passes) > 1 or passes[0].num_tokens <= 8:  # replayed: each pass fits a bucket
        for layout in passes:
            assert layout.num_tokens <= 8 and len(layout.counts) <= 3 and layout.counts.max() <= 3


def test_a_rows_groups_do_not_depend_on_the_rows_beside_it():
    """Groups start at multiples of the group size of the row, whoever else is admitted."""
    graphs = graphs_like(max_group_tokens=4, max_tokens=16, max_groups=5)

    def groups_of(row, passes):
        return [(int(s), int(c)) for layout in passes for r, s, c in zip(layout.rows, layout.starts, layout.counts)
                if r == row]

    alone = groups_of(1, prefill_passes(np.array([1]), np.array([11]), 4, graphs))
    beside = groups_of(1, prefill_passes(np.array([0, 1, 2]), np.array([5, 11, 3]), 4, graphs))
    eager = groups_of(1, prefill_passes(np.array([0, 1]), np.array([200, 11]), 4, graphs))  # too many replays
    long = groups_of(1, prefill_passes(np.array([0, 1]), np.array([MAX_CUT_TOKENS + 1, 11]), 4, graphs))
    assert alone == beside == eager == long == [(0, 4), (4, 4), (8, 3)]


def test_long_prompts_stay_whole_in_a_pass_without_cut_ones():
    graphs = graphs_like(max_group_tokens=4, max_tokens=16, max_groups=5)
    passes = prefill_passes(np.array([0, 1, 2]), np.array([MAX_CUT_TOKENS + 1, 9, MAX_CUT_TOKENS + 40]), 4, graphs)
    whole = [layout for layout in passes if layout.counts.max() > 4]
    assert len(whole) == 1 and whole[0].rows.tolist() == [0, 2]
    assert whole[0].counts.tolist() == [MAX_CUT_TOKENS + 1, MAX_CUT_TOKENS + 40]
    assert [(int(r), int(s), int(c)) for layout in passes if layout is not whole[0]
            for r, s, c in zip(layout.rows, layout.starts, layout.counts)] == [(1, 0, 4), (1, 4, 4), (1, 8, 1)]


def test_too_many_replays_make_one_eager_pass_and_no_group_size_one_pass_a_row():
    graphs = graphs_like(max_group_tokens=2, max_tokens=4, max_groups=3)
    many = prefill_passes(np.array([0]), np.array([4 * (MAX_REPLAYS + 1)]), 2, graphs)
    assert len(many) == 1 and many[0].counts.tolist() == [2] * (2 * (MAX_REPLAYS + 1))
    whole = prefill_passes(np.array([3, 1]), np.array([9, 4]), None, graphs)
    assert len(whole) == 1 and whole[0].rows.tolist() == [3, 1] and whole[0].counts.tolist() == [9, 4]
    wide = prefill_passes(np.array([0]), np.array([9]), 3, graphs)  # groups wider than the graphs': eager
    assert len(wide) == 1 and wide[0].counts.tolist() == [3, 3, 3]


@pytest.mark.parametrize("group,graphs,cut_limit", [(3, None, MAX_CUT_TOKENS), (2, graphs_like(2, 8, 5), MAX_CUT_TOKENS),
                                                    (4, graphs_like(4, 12, 4), MAX_CUT_TOKENS),
                                                    (2, graphs_like(2, 8, 5), 12)])  # some prompts whole
def test_an_engine_prefilling_in_groups_and_passes_gives_the_targets_greedy_output(group, graphs, cut_limit,
                                                                                     monkeypatch):
    """The reference attention reads a row's earlier groups, of this pass or an earlier one."""
    monkeypatch.setattr("specdec.prefill.MAX_CUT_TOKENS", cut_limit)
    target = make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float64)
    prompts = random_prompts(5, VOCAB, seed=21, max_len=15)
    with Engine(target, ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(3), max_rows=3, max_len=40,
                eos_token_id=[]) as engine:
        engine._prefill_group = group
        if graphs is not None:  # the runner has none on CPU: each pass runs eagerly, as packed
            engine.runner.graphs = graphs
            graphs.fits = lambda counts: False
        ids = [engine.add_request(p, max_new_tokens=9) for p in prompts]
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
    for prompt, request_id in zip(prompts, ids):
        assert finished[request_id].token_ids == hf_greedy(target, prompt, 9)
