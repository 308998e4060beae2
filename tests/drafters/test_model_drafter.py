"""ModelDrafter keeps its cache consistent through arbitrary accept/reject sequences: every
proposal equals the drafter model's own greedy continuation of the committed tokens, and rows
that do not draft in a step are caught up all the same."""

import numpy as np
import pytest
import torch

from specdec import SamplingParams
from specdec.batch import BatchState
from specdec.drafters import ModelDrafter
from specdec.drafters.model import MAX_CATCH_UP_PASSES
from specdec.types import HostVerdict
from specdec import generate
from specdec.policies import FixedPolicy
from tests.tiny import ARCHS, hf_greedy, make_model, perturbed_copy, random_prompts


class ChunkingGraphs:
    """Stands in for captured graphs of groups of at most 2 tokens, so the drafter feeds a longer
    catch-up in chunks; every pass still runs eagerly (``fits`` is False), on CPU."""

    max_group_tokens = 2
    greedy_feeds = {}  # none captured: chains feed pass by pass

    def __init__(self):
        self.passes = []

    def fits(self, counts):
        self.passes.append(int(counts.max()))
        return False


@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_follow_the_drafter_after_rollbacks(arch, chunked):
    model = make_model(arch, seed=7)
    reference = make_model(arch, seed=7)  # an identical copy, decoded by Hugging Face
    prompts = random_prompts(4, 96, seed=2)
    batch = BatchState([np.array(p) for p in prompts], 40, np.arange(4), np.zeros(0, dtype=np.int64))
    drafter = ModelDrafter(model)
    generator = np.random.default_rng(0)
    drafter.start(batch, SamplingParams(), torch.device("cpu"), max_draft_tokens=5)
    graphs = drafter._runner.graphs = ChunkingGraphs() if chunked else None
    chunked_catch_ups = 0
    try:
        for step in range(8):
            wanted = generator.integers(0, 6, size=4)  # some rows draft nothing this step
            if step in (2, 5):
                wanted[:] = 0  # nor does any row: each falls further behind
            lag = int((batch.lengths - drafter._runner.cache.lengths[:4]).max())
            passes_before = len(graphs.passes) if chunked else 0
            draft = drafter.propose(batch, wanted)
            if chunked and wanted.any() and 2 < lag <= 2 * MAX_CATCH_UP_PASSES:
                chunked_catch_ups += 1  # fed in passes of at most 2 tokens per row
                assert max(graphs.passes[passes_before : passes_before - (-lag // 2)]) <= 2
            # whenever any row drafts, every row has been fed all its committed tokens
            assert np.all(drafter._runner.cache.lengths[:4] >= batch.lengths) or not wanted.any()
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
        assert chunked_catch_ups > 0 or not chunked
    finally:
        drafter._runner.graphs = None
        drafter.finish()


def test_a_drafter_whose_start_fails_part_way_leaves_its_model_restored():
    """A drafter that attached its runner (switching its model's attention to specdec's) and then
    failed in start(): generate() still finishes it, so the model works with transformers again."""
    target = make_model("llama", num_layers=1)
    small = perturbed_copy(target, 0.05)
    before = small.config._attn_implementation

    class FailingDrafter(ModelDrafter):
        def _start(self, *args):
            super()._start(*args)
            raise RuntimeError("failed after attaching")

    drafter = FailingDrafter(small)  # held, so no garbage collection closes its attachment instead
    with pytest.raises(RuntimeError, match="failed after attaching"):
        generate(target, [[1, 2, 3]], drafter=drafter, policy=FixedPolicy(2), max_new_tokens=4)
    assert small.config._attn_implementation == before != "specdec"
