"""The padding-free and decomposed verifiers return the padded verifier's verdict; padding is reported."""

import numpy as np
import pytest
import torch

from specdec import SamplingParams
from specdec.batch import BatchState
from specdec.runner import ModelRunner, PackedLayout
from specdec.types import PAD_ID, Draft
from specdec.verifiers import DecomposedVerifier, PaddedVerifier, PaddingFreeVerifier
from specdec.verifiers.decomposed import piece_width
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


@pytest.mark.parametrize("piece_cost", [0.0, 0.5, 1.0, 100.0])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_decomposed_equals_padded_whatever_the_pieces(sampling, piece_cost):
    """Pieces of a row attend to the cache entries its earlier pieces write in the same pass."""
    target = make_model("llama")
    prompts = random_prompts(5, 96, seed=6)
    draft_tokens = [[5, 6, 7, 8, 9], [9, PAD_ID, PAD_ID, PAD_ID, PAD_ID], [PAD_ID] * 5, [1, 2, 3, PAD_ID, PAD_ID],
                    [4, 4, 4, 4, 4]]
    num_tokens = [5, 1, 0, 3, 5]
    padded, _ = verdict_of(PaddedVerifier(), target, prompts, draft_tokens, num_tokens, sampling)
    pieces, cost = verdict_of(DecomposedVerifier(piece_cost), target, prompts, draft_tokens, num_tokens, sampling)
    assert torch.equal(padded.token_ids, pieces.token_ids)
    assert torch.equal(padded.num_accepted, pieces.num_accepted)
    width = piece_width(np.array(num_tokens) + 1, piece_cost)
    chains = np.array(num_tokens) + 1  # 6, 2, 1, 4, 6: 19 real slots
    assert cost.target_tokens == int((-(-chains // width) * width).sum())
    assert cost.padding_tokens == cost.target_tokens - 19


def test_piece_width_trades_padding_against_pieces():
    chains = np.array([1, 6, 6, 6, 3])  # 22 tokens; padded to 6 wastes 8 of 30 slots
    assert piece_width(chains, 0.0) == 1  # no padding at all
    assert piece_width(chains, 1.0) == 3  # 24 slots in 8 pieces: 32, against 36 for w = 2 and 35 for w = 6
    assert piece_width(chains, 100.0) == 6  # one piece a row: the padded layout
    assert piece_width(np.array([4, 4, 4]), 0.0) == 4  # equal chains: the widest of the free widths
    with pytest.raises(ValueError, match="piece_cost must be a number >= 0"):
        DecomposedVerifier(-1)


class RaggedLengths:
    """Each row drafts a length that changes from step to step and row to row (0 to 5)."""

    max_draft_tokens = 5

    def __init__(self):
        self.step = 0

    def plan(self, batch, num_drafters):
        from specdec.types import Plan

        self.step += 1
        lengths = (np.arange(batch.num_rows) * 2 + self.step) % 6
        return Plan(drafter_index=np.zeros(batch.num_rows, dtype=np.int64), num_draft_tokens=lengths)

    def observe(self, record):
        pass

    def start_rows(self, batch, rows):
        pass


@pytest.mark.parametrize("piece_cost", [0.0, 1.0])
def test_decomposed_generation_is_the_targets_greedy_output_under_ragged_lengths(piece_cost):
    from specdec import generate
    from specdec.drafters import ModelDrafter
    from specdec.policies.base import Policy
    from tests.tiny import hf_greedy, perturbed_copy

    target = make_model("llama", dtype=torch.float64)
    prompts = random_prompts(5, 96, seed=9)
    policy = type("Ragged", (RaggedLengths, Policy), {})()
    out = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)),
                   verifier=DecomposedVerifier(piece_cost), policy=policy, max_new_tokens=14, eos_token_id=[])
    assert out.sequences == [hf_greedy(target, p, 14) for p in prompts]
    assert out.stats.accepted > 0


@pytest.mark.parametrize("piece_cost", [0.0, 0.3, 1.0, 5.0])
def test_decomposed_scores_every_real_slot_as_padding_free_does(piece_cost):
    """The logits of every real slot (not only the ones an early rejection reads), with a draft
    grid wider than the longest chain (as prompt lookup hands over) and rows of no draft."""
    target = make_model("llama", dtype=torch.float64)
    prompts = random_prompts(5, 96, seed=7)
    num_draft = np.array([5, 0, 2, 3, 1])  # chains of 6, 1, 3, 4, 2 in a grid of 9 slots
    generator = torch.Generator().manual_seed(3)
    chains = torch.randint(1, 96, (5, 9), generator=generator)
    batch = BatchState([np.array(p) for p in prompts], 16, np.arange(5), np.zeros(0, dtype=np.int64))
    rows = np.arange(5)
    logits = {}
    for name, verifier in (("packed", PaddingFreeVerifier()), ("pieces", DecomposedVerifier(piece_cost))):
        runner = ModelRunner(target, max_rows=5, max_len=64)
        with runner.attached():
            for row, prompt in enumerate(prompts):
                if len(prompt) > 1:
                    runner.forward(torch.tensor(prompt[:-1]), PackedLayout(np.array([row]), np.array([0]),
                                                                           np.array([len(prompt) - 1])))
            logits[name], _ = verifier.score(runner, batch, rows, chains, num_draft)
    for row, k in enumerate(num_draft):
        torch.testing.assert_close(logits["pieces"][row, : k + 1], logits["packed"][row, : k + 1], rtol=0, atol=1e-12)
