"""Hidden states kept from a runner's passes (hidden_states.HiddenStateTap): each packed token's
state entering each chosen block equals the model's own full forward over its row, and
observers hear of dense passes only."""

import numpy as np
import pytest
import torch

from specdec.hidden_states import HiddenStateTap
from specdec.runner import ModelRunner, PackedLayout, SparseLayout, TreeLayout, runner_for
from tests.tiny import make_model, random_prompts


def hf_hidden(model, tokens):
    """[layers + 1] hidden states of one row: HF's index j < layers is block j's input; the last
    one HF returns normed."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_tokens_kept_state_is_its_rows_own(arch):
    model = make_model(arch, num_layers=3)
    prompts = random_prompts(3, 96, seed=4, min_len=3, max_len=9)
    runner = ModelRunner(model, max_rows=3, max_len=32, hidden_layers=(0, 2, 3))
    split = [len(p) - 2 for p in prompts]  # a prefill, then the rest of each row in a second pass
    passes = []
    with runner.attached():
        for first in (True, False):
            starts = np.zeros(3, dtype=np.int64) if first else np.array(split)
            ends = np.array(split) if first else np.array([len(p) for p in prompts])
            layout = PackedLayout(rows=np.arange(3), starts=starts, counts=ends - starts)
            ids = torch.tensor([t for p, s, e in zip(prompts, starts, ends) for t in p[s:e]])
            runner.forward(ids, layout)
            passes.append((starts, ends, {j: t.clone() for j, t in runner.tap.latest.items()}))
    for starts, ends, kept in passes:
        n = 0
        for prompt, start, end in zip(prompts, starts, ends):
            expected = hf_hidden(model, prompt[:end])
            for j in (0, 2):
                torch.testing.assert_close(kept[j][n:n + end - start], expected[j][0, start:end])
            torch.testing.assert_close(model.model.norm(kept[3][n:n + end - start]), expected[3][0, start:end])
            n += end - start


def test_observers_hear_dense_passes_only():
    model = make_model("llama", num_layers=2)
    runner = ModelRunner(model, max_rows=2, max_len=32, hidden_layers=(1,))
    heard = []
    runner.observers.append(lambda seen: heard.append((seen.layout.num_tokens, seen.hidden[1].shape)))
    layout = PackedLayout(rows=np.array([0, 1]), starts=np.array([0, 0]), counts=np.array([3, 2]))
    ids = torch.tensor([1, 2, 3, 4, 5])
    with runner.attached():
        runner.forward(ids, layout)
        runner.forward(ids, layout, sparse=SparseLayout(sink=1, window_starts=np.array([0, 0])))
        tree = TreeLayout(positions=torch.tensor([0, 1, 1, 0, 1]), masks=torch.tensor([1, 3, 5, 1, 3]),
                          tree_starts=np.array([0, 0]))
        runner.forward(ids, layout, tree=tree)
    assert heard == [(5, torch.Size([5, 32]))]


def test_bad_layer_indices_and_unsupported_decoders_are_refused():
    with pytest.raises(ValueError, match="indices run from 0 .* to 2"):
        HiddenStateTap(make_model("llama", num_layers=2), (3,))
    with pytest.raises(TypeError, match="no `layers` list"):
        HiddenStateTap(make_model("gpt_neox"), (0,))


def test_a_runner_keeping_states_serves_calls_that_ask_for_fewer_and_is_rebuilt_for_more():
    model = make_model("llama", num_layers=2)
    first = runner_for(model, role="target", max_rows=2, max_len=16, hidden_layers=(1,))
    assert runner_for(model, role="target", max_rows=2, max_len=16, hidden_layers=(1,)) is first
    assert runner_for(model, role="target", max_rows=2, max_len=16) is first
    wider = runner_for(model, role="target", max_rows=2, max_len=16, hidden_layers=(0, 1))
    assert wider is not first and wider.tap.layers == (0, 1)


@pytest.mark.cuda
def test_a_replayed_pass_keeps_the_same_states_as_an_eager_one():
    model = make_model("llama", num_layers=3, dtype=torch.float32, device="cuda")
    states = []
    for graphs in (False, True):
        runner = ModelRunner(model, max_rows=4, max_len=64, attention="fast", hidden_layers=(0, 3))
        if graphs:
            runner.enable_graphs(4, 16)
        layout = PackedLayout(rows=np.arange(4), starts=np.zeros(4, dtype=np.int64), counts=np.array([3, 1, 4, 2]))
        with runner.attached():
            runner.forward(torch.arange(1, 11, device="cuda"), layout)
        assert runner.graph_passes == int(graphs)
        states.append({j: t.clone() for j, t in runner.tap.latest.items()})
    for j in (0, 3):
        torch.testing.assert_close(states[1][j], states[0][j])
