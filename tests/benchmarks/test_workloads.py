"""Workloads for the policy experiments (benchmarks/policies/workloads.py), on the tiny zoo's held-out files
and tokenizer: the mixture holds its proportions (overall and in every block, so the first few
requests are mixed like the whole), a workload is a function of its seed, a copy-heavy request
really is its file's beginning followed by that beginning again, and on copy-heavy requests
prompt lookup proposes what the file says next far more often than on continuation requests.

The last check replays PromptLookupDrafter's matching against each file's own continuation (a
target that reproduced the file): the tiny zoo's 2-layer target is too weak to copy anything
(it decodes whitespace whatever the prompt), so its own generations cannot tell the two kinds
apart; the gpu zoo's run reports prompt lookup's measured tau on each workload."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.policies.workloads import (
    BLOCK,
    STANDARD,
    WorkloadGenerator,
    copy_pattern,
    mean_oracle_lookup_tau,
)


@pytest.fixture(scope="module")
def tiny(tiny_zoo_root):
    from specdec.zoo import load

    return load("tiny", out=tiny_zoo_root / "tiny")


@pytest.fixture(scope="module")
def generator(tiny):
    return WorkloadGenerator(tiny.heldout_texts(), tiny.tokenizer, prompt_tokens=96, seed=0)


def test_proportions_hold_overall_and_in_every_block(generator):
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        workload = generator.workload(fraction, 40)
        kinds = np.array(workload.kinds()) == "copy"
        assert kinds.sum() == np.floor(40 * fraction + 0.5)
        for start in range(0, 40, BLOCK):  # every block of 8 holds its share
            assert kinds[start : start + BLOCK].sum() == round(BLOCK * fraction)
    workloads = generator.standard(16)
    assert list(workloads) == list(STANDARD)
    assert workloads["mixed"].kinds(8).count("copy") == 4
    assert set(workloads["copy"].kinds()) == {"copy"} and set(workloads["continuation"].kinds()) == {"continuation"}
    # the three workloads draw on the same files, in the same order
    assert [r.id for r in workloads["mixed"].requests] == [r.id for r in workloads["copy"].requests] \
        == [r.id for r in workloads["continuation"].requests]


def test_the_pattern_is_a_seeded_shuffle_of_an_even_spread():
    a = copy_pattern(0.5, 64, np.random.default_rng(1))
    b = copy_pattern(0.5, 64, np.random.default_rng(1))
    c = copy_pattern(0.5, 64, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c) and a.sum() == c.sum() == 32


def test_workloads_are_deterministic_given_the_seed(tiny):
    def make(seed):
        generator = WorkloadGenerator(tiny.heldout_texts(), tiny.tokenizer, prompt_tokens=96, seed=seed)
        return generator.standard(24)

    first, again, other = make(0), make(0), make(1)
    for name in STANDARD:
        assert first[name].requests == again[name].requests
    assert [r.id for r in first["mixed"].requests] != [r.id for r in other["mixed"].requests]
    # asking for more requests, or asking in another order, extends without changing the first ones
    generator = WorkloadGenerator(tiny.heldout_texts(), tiny.tokenizer, prompt_tokens=96, seed=0)
    later = generator.workload(1.0, 8, offset=24)
    assert generator.standard(24)["copy"].requests == first["copy"].requests
    assert not {r.id for r in later.requests} & {r.id for r in first["copy"].requests}


def test_a_copy_request_is_its_file_beginning_then_that_beginning_again(tiny, generator):
    texts = dict(tiny.heldout_texts())
    for copy, continuation in generator.pairs(20):
        assert copy.id == continuation.id and copy.kind == "copy" and continuation.kind == "continuation"
        text = texts[copy.id]
        assert text.startswith(continuation.prompt.rstrip("\n"))
        assert copy.prompt.startswith(continuation.prompt)
        repeated = copy.prompt[len(continuation.prompt):]
        assert repeated.strip() and text.startswith(repeated)  # the file's own first lines
        assert len(repeated) < len(continuation.prompt)
        assert copy.reference == text[len(repeated):]  # what the file says after its beginning
        assert list(copy.token_ids) == tiny.tokenizer(copy.prompt, add_special_tokens=False)["input_ids"]
        assert len(continuation.token_ids) <= 96


def test_prompt_lookup_finds_far_more_to_copy_in_copy_heavy_requests(tiny, generator):
    workload = generator.workload(0.5, 32)
    tau = mean_oracle_lookup_tau(workload, tiny.tokenizer, num_draft_tokens=4, max_new_tokens=64)
    assert tau["copy"] > 1.5 * tau["continuation"] and tau["copy"] > 2.5


def test_bad_settings_are_refused(tiny, generator):
    with pytest.raises(ValueError, match="copy_fraction"):
        generator.workload(1.5, 4)
    with pytest.raises(ValueError, match="unknown workloads"):
        generator.standard(4, names=("mixed", "chat"))
    with pytest.raises(ValueError, match="none of the"):
        WorkloadGenerator([("empty.py", "")], tiny.tokenizer).pairs(1)


def test_available_counts_the_files_that_make_requests_and_cycled_repeats_a_workload(tiny):
    """available(limit): the distinct files that make requests, up to limit (a file too short
    for a request does not count); cycled(n): the workload's own requests repeated in order."""
    texts = tiny.heldout_texts()[:12] + [("empty.py", "")]
    generator = WorkloadGenerator(texts, tiny.tokenizer, prompt_tokens=96, seed=0)
    total = generator.available(1000)
    # the files pairs() reads when asked for more requests than there are files (it wraps around)
    making = {r.id for r in WorkloadGenerator(texts, tiny.tokenizer, prompt_tokens=96, seed=0).workload(0.5, 100).requests}
    assert "empty.py" not in making and total == len(making) >= 2 and generator.available(2) == 2
    assert len({r.id for r in generator.workload(0.5, total).requests}) == total  # every one distinct
    workload = generator.standard(3)["mixed"]
    longer = workload.cycled(8)
    assert [r.id for r in longer.requests] == [r.id for r in workload.requests] * 2 + [r.id for r in workload.requests[:2]]
    assert longer.kinds(3) == workload.kinds() and longer.name == workload.name
    assert workload.cycled(2).requests == workload.requests[:2]
