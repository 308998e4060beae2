"""The padding-free verifier returns the padded verifier's verdict; padding is reported."""

import numpy as np
import pytest
import torch

from specdec import SamplingParams
from specdec.batch import BatchState
from specdec.runner import ModelRunner, PackedLayout
from specdec.types import PAD_ID, Draft
from specdec.verifiers import PaddedVerifier, PaddingFreeVerifier
from tests.tiny import make_model, random_prompts


def verdict_of(verifier, target, prompts, draft_tokens, num_tokens, sampling, finished=()):
    batch = BatchState([np.array(p) for p in prompts], 16, np.arange(len(prompts)), np.zeros(0, dtype=np.int64))
    batch.finished[list(finished)] = True
    runner = ModelRunner(target, max_rows=len(prompts), max_len=64)
    draft = Draft(token_ids=torch.tensor(draft_tokens), num_tokens=np.array(num_tokens))
    with runner.attached():
        # fill the cache with everything but each prompt's last token, as generate() does
        for row, prompt in enumerate(prompts):
            if len(prompt) > 1:
                runner.forward(torch.tensor(prompt[:-1]), PackedLayout(np.array([row]), np.array([0]), np.array([len(prompt) - 1])))
        return verifier.verify(runner, batch, draft, sampling)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_padding_free_equals_padded_on_ragged_drafts(sampling):
    target = make_model("llama")
    prompts = random_prompts(4, 96, seed=3)
    draft_tokens = [[5, 6, 7, 8], [9, PAD_ID, PAD_ID, PAD_ID], [PAD_ID] * 4, [1, 2, PAD_ID, PAD_ID]]
    num_tokens = [4, 1, 0, 2]
    padded, padded_cost = verdict_of(PaddedVerifier(), target, prompts, draft_tokens, num_tokens, sampling)
    packed, packed_cost = verdict_of(PaddingFreeVerifier(), target, prompts, draft_tokens, num_tokens, sampling)
    assert torch.equal(padded.token_ids, packed.token_ids)
    assert torch.equal(padded.num_accepted, packed.num_accepted)
    # padded: 4 rows x 5 slots, of which 5 + 2 + 1 + 3 = 11 real
    assert (padded_cost.target_tokens, padded_cost.padding_tokens) == (20, 9)
    assert (packed_cost.target_tokens, packed_cost.padding_tokens) == (11, 0)


def test_finished_rows_cost_nothing():
    target = make_model("llama")
    prompts = random_prompts(3, 96, seed=4)
    draft_tokens = [[5, 6], [7, 8], [1, PAD_ID]]
    verdict, cost = verdict_of(PaddingFreeVerifier(), target, prompts, draft_tokens, [2, 2, 1], SamplingParams(), finished=[1])
    assert cost.target_tokens == 3 + 2
    assert verdict.num_emitted.tolist()[1] == 0 and (verdict.token_ids[1] == PAD_ID).all()
