"""ModelDrafter keeps its cache consistent through arbitrary accept/reject sequences: every
proposal equals the drafter model's own greedy continuation of the committed tokens."""

import numpy as np
import pytest
import torch

from specdec import SamplingParams
from specdec.batch import BatchState
from specdec.drafters import ModelDrafter
from specdec.types import HostVerdict
from tests.tiny import ARCHS, hf_greedy, make_model, random_prompts


@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_follow_the_drafter_after_rollbacks(arch):
    model = make_model(arch, seed=7)
    reference = make_model(arch, seed=7)  # an identical copy, decoded by Hugging Face
    prompts = random_prompts(4, 96, seed=2)
    batch = BatchState([np.array(p) for p in prompts], 40, np.arange(4), np.zeros(0, dtype=np.int64))
    drafter = ModelDrafter(model)
    generator = np.random.default_rng(0)
    drafter.start(batch, SamplingParams(), torch.device("cpu"), max_draft_tokens=5)
    try:
        for _ in range(6):
            wanted = generator.integers(0, 6, size=4)  # some rows draft nothing this step
            draft = drafter.propose(batch, wanted)
            for r in range(4):
                k = int(wanted[r])
                committed = batch.token_ids[r, : batch.lengths[r]].tolist()
                expected = hf_greedy(reference, committed, k) if k else []
                assert draft.token_ids[r, :k].tolist() == expected
            # accept a random prefix of each draft, then append a token the drafter did not propose
            accepted = np.array([generator.integers(0, k + 1) for k in wanted])
            emitted = np.full((4, 7), -1)
            for r in range(4):
                emitted[r, : accepted[r]] = draft.token_ids[r, : accepted[r]].numpy()
                emitted[r, accepted[r]] = generator.integers(0, 96)
            lengths_before = batch.lengths.copy()
            batch.commit(HostVerdict(token_ids=emitted, num_emitted=accepted + 1, num_accepted=accepted))
            drafter.commit(lengths_before, accepted)
    finally:
        drafter.finish()
