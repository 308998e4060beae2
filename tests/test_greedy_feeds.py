"""A greedy chain's single-token passes replayed from the drafter runner's captured greedy feeds
(graphs.GraphedForward.capture_greedy_feeds): the same draft tokens, step by step, as the passes
one by one with an argmax between them, in float32 and in compiled bf16; and where they cannot
run (rows asking different lengths), the passes one by one."""

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.drafters import ModelDrafter
import specdec.drafters.model as model_drafter
from specdec.graphs import GraphedForward
from specdec.policies import FixedPolicy, Policy
from specdec.types import Plan
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts

pytestmark = pytest.mark.cuda
GRAPHS = dict(attention="fast", cuda_graphs=True)


class UnevenPolicy(Policy):
    """Rows ask 4 or 2 tokens, by parity of row and step: no greedy feed can serve the step."""

    max_draft_tokens = 4

    def plan(self, batch, num_drafters):
        k = np.where((np.arange(batch.num_rows) + self.steps) % 2 == 0, 4, 2)
        self.steps += 1
        return Plan(drafter_index=np.zeros(batch.num_rows, dtype=np.int64), num_draft_tokens=k)

    steps = 0


def drafts_of(target, drafter_model, prompts, policy, dtype, compile, feeds, monkeypatch):
    """-> (outputs, every step's draft tokens on the host, greedy feed replays)."""
    monkeypatch.setattr(model_drafter, "GREEDY_FEEDS", feeds)
    replays = []
    original = GraphedForward.run_greedy_feeds

    def counted(self, first_ids, rows, starts, num_passes):
        replays.append(num_passes)
        return original(self, first_ids, rows, starts, num_passes)

    monkeypatch.setattr(GraphedForward, "run_greedy_feeds", counted)
    drafter = ModelDrafter(drafter_model, compile=compile, **GRAPHS)
    drafts = []
    propose = drafter.propose

    def recorded(batch, num_tokens, **kwargs):
        draft = propose(batch, num_tokens, **kwargs)
        drafts.append(draft.token_ids.cpu().numpy().copy())
        return draft

    drafter.propose = recorded
    out = generate(target, prompts, drafter=drafter, policy=policy, max_new_tokens=24, compile=compile, **GRAPHS)
    return out.sequences, drafts, replays


@pytest.mark.parametrize("dtype, compile", [(torch.float32, False), (torch.bfloat16, True)], ids=["float32", "bf16-compiled"])
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_feeds_draft_what_the_passes_one_by_one_draft(dtype, compile, batch, monkeypatch):
    target = make_model("llama", dtype=dtype, device="cuda")
    drafter_model = perturbed_copy(target, 0.1)
    prompts = random_prompts(batch, target.config.vocab_size, seed=11)
    outputs, drafts, replays = drafts_of(target, drafter_model, prompts, FixedPolicy(4), dtype, compile, True,
                                         monkeypatch)
    loop_outputs, loop_drafts, loop_replays = drafts_of(target, drafter_model, prompts, FixedPolicy(4), dtype, compile,
                                                        False, monkeypatch)
    assert replays and not loop_replays  # the feeds ran in the first, not in the second
    assert len(drafts) == len(loop_drafts)
    for step, (got, want) in enumerate(zip(drafts, loop_drafts)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
    assert outputs == loop_outputs
    if dtype == torch.float32:
        assert outputs == [hf_greedy(target, p, 24) for p in prompts]


def test_rows_asking_different_lengths_draft_pass_by_pass(monkeypatch):
    target = make_model("qwen2", dtype=torch.float32, device="cuda")
    prompts = random_prompts(4, target.config.vocab_size, seed=12)
    outputs, drafts, replays = drafts_of(target, perturbed_copy(target, 0.1), prompts, UnevenPolicy(), torch.float32,
                                         False, True, monkeypatch)
    assert len(replays) < len(drafts) // 2  # only where the rows still running happen to ask one length
    assert outputs == [hf_greedy(target, p, 24) for p in prompts]
