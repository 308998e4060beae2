"""Committing emitted tokens (EOS and budget cuts) and the statistics built from it."""

import numpy as np
import pytest

from specdec import generate
from specdec.batch import BatchState
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.types import PAD_ID, HostVerdict
from tests.tiny import make_model, random_prompts

# emitted, budget left (max_new_tokens - generated), eos ids -> appended tokens, finished
COMMIT_CASES = [
    ([4, 5, 6], 10, [], [4, 5, 6], False),
    ([4, 5, 6], 2, [], [4, 5], True),  # budget reached inside the emitted tokens
    ([4, 9, 6], 10, [9], [4, 9], True),  # EOS inside: cut after it
    ([9, 5, 6], 10, [9], [9], True),
    ([4, 5, 9], 2, [9], [4, 5], True),  # budget first: the EOS is never emitted
    ([4, 5, 6], 10, [6, 5], [4, 5], True),  # several EOS ids: the first occurrence cuts
]


@pytest.mark.parametrize("emitted,budget,eos,appended,finished", COMMIT_CASES)
def test_commit_table(emitted, budget, eos, appended, finished):
    batch = BatchState([np.array([1, 2])], max_new_tokens=10, seeds=np.zeros(1), eos_token_ids=np.array(eos, dtype=np.int64))
    batch.lengths[0] += 10 - budget  # pretend earlier steps generated tokens
    width = 5
    verdict = HostVerdict(
        token_ids=np.array([emitted + [PAD_ID] * (width - len(emitted))]),
        num_emitted=np.array([len(emitted)]),
        num_accepted=np.array([len(emitted) - 1]),
    )
    count = batch.commit(verdict)
    assert count.tolist() == [len(appended)]
    start = 2 + 10 - budget
    assert batch.token_ids[0, start : start + len(appended)].tolist() == appended
    assert batch.finished[0] == finished


def test_statistics_agree_with_the_outputs():
    target = make_model("llama")
    prompts = random_prompts(5, 96, seed=9)
    out = generate(target, prompts, drafter=ModelDrafter(target), policy=FixedPolicy(3), max_new_tokens=13)
    stats = out.stats
    for request, sequence in zip(stats.requests, out.sequences):
        assert request.emitted == len(sequence) == 13
        assert request.steps == 4  # drafting itself: 4 + 4 + 4 + 1 tokens
        assert request.drafted == 3 + 3 + 3 + 0  # the last step's draft is capped by the budget
        assert request.accepted == 9 and request.tau == 13 / 4
        assert request.acceptance_by_position == [1.0, 1.0, 1.0]
        assert 0 < request.wall_time_s <= stats.wall_time_s
    assert stats.steps == 4 and stats.emitted == 65 and stats.tau == 13 / 4
    assert stats.target_tokens == 5 * (4 + 4 + 4 + 1) and stats.padding_fraction == 0
    assert stats.tokens_per_s == pytest.approx(65 / stats.wall_time_s)
    assert set(stats.as_dict()) == {"overall", "requests"}


def test_finished_rows_stop_taking_part():
    target = make_model("llama")
    out = generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=6)
    eos = out.sequences[0][1]
    out = generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=6, eos_token_id=eos)
    first, second = out.stats.requests
    assert len(out.sequences[0]) == 2 and len(out.sequences[1]) > 2  # row 0 stops early at its EOS
    # plain decoding: one target token per row per step, and none once a row is finished
    assert (first.steps, second.steps) == (2, len(out.sequences[1]))
    assert out.stats.target_tokens == 2 + len(out.sequences[1])


def test_zero_new_tokens_returns_empty_outputs():
    out = generate(make_model("llama"), [[1, 2], [3]], max_new_tokens=0)
    assert out.sequences == [[], []] and out.stats.steps == 0
