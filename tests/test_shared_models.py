"""Models shared between calls: threads that use one model take turns (and leave it as they
found it), a new ModelDrafter per call reuses its model's runner instead of adding one, and
caches are sized by what a call can draft (issue 31)."""

from __future__ import annotations

import sys
import threading

import pytest

from specdec import generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.runner import CPU_LENGTH_QUANTUM, runners_of
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts


@pytest.fixture
def fast_switching():
    """Switch threads every microsecond so that unserialised calls would interleave mid-step."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _run_threads(jobs, timeout=120.0):
    """Run each job (a function of no arguments) in a thread of its own, started together; ->
    their results, or the exception one raised."""
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def work(index):
        barrier.wait()
        try:
            results[index] = jobs[index]()
        except Exception as error:  # noqa: BLE001 - reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "threads still running: a deadlock"
    if errors:
        raise errors[0]
    return results


def test_threads_sharing_a_target_and_a_drafter_get_exact_output_and_leave_the_models_working(fast_switching):
    target = make_model("llama", num_layers=2)
    small = perturbed_copy(target, 0.05)
    prompt_sets = [random_prompts(3, 96, seed=s, min_len=3) for s in (1, 2)]
    expected = [[hf_greedy(target, p, 12) for p in prompts] for prompts in prompt_sets]

    def rounds(prompts):
        return [generate(target, prompts, drafter=ModelDrafter(small), policy=FixedPolicy(3), max_new_tokens=12).sequences
                for _ in range(4)]

    results = _run_threads([lambda: rounds(prompt_sets[0]), lambda: rounds(prompt_sets[1])])
    for got, want in zip(results, expected):
        assert got == [want] * 4
    # both models are back on their own attention: transformers' generate works on them again
    assert target.config._attn_implementation != "specdec" and small.config._attn_implementation != "specdec"
    assert hf_greedy(target, prompt_sets[0][0], 5) == expected[0][0][:5]


def test_two_calls_using_two_models_in_opposite_roles_do_not_deadlock(fast_switching):
    first = make_model("llama", num_layers=1, seed=0)
    second = make_model("llama", num_layers=1, seed=1)
    prompts = random_prompts(2, 96, seed=3, min_len=3)

    def rounds(target, drafter_model):
        return [generate(target, prompts, drafter=ModelDrafter(drafter_model), policy=FixedPolicy(2),
                         max_new_tokens=8).sequences for _ in range(3)]

    results = _run_threads([lambda: rounds(first, second), lambda: rounds(second, first)])
    assert results[0] == [[hf_greedy(first, p, 8) for p in prompts]] * 3
    assert results[1] == [[hf_greedy(second, p, 8) for p in prompts]] * 3


def test_a_new_model_drafter_per_call_reuses_the_models_runner():
    target = make_model("llama", num_layers=1)
    small = perturbed_copy(target, 0.05)
    prompts = random_prompts(2, 96, seed=4, min_len=3)
    for _ in range(12):
        generate(target, prompts, drafter=ModelDrafter(small), policy=FixedPolicy(2), max_new_tokens=6)
    assert list(runners_of(small)) == ["drafter-0"]  # one runner, not one per wrapper ever made
    assert not runners_of(small)["drafter-0"].in_use


def test_caches_are_sized_by_what_the_call_can_draft():
    """A policy's largest length (here 100,000) beyond max_new_tokens allocates nothing for it."""
    target = make_model("llama", num_layers=1)
    small = perturbed_copy(target, 0.05)
    prompts = random_prompts(4, 96, seed=5, min_len=3)
    out = generate(target, prompts, drafter=ModelDrafter(small), policy=FixedPolicy(100_000), max_new_tokens=8)
    assert out.sequences == [hf_greedy(target, p, 8) for p in prompts]
    assert runners_of(target)["target"].cache.max_len == CPU_LENGTH_QUANTUM  # 12 + 8 + 8 positions, rounded up
    assert runners_of(small)["drafter-0"].cache.max_len == CPU_LENGTH_QUANTUM


def test_generate_called_from_a_stream_callback_is_refused_and_the_outer_call_stays_exact():
    target = make_model("llama", num_layers=1)
    prompts = random_prompts(2, 96, seed=6, min_len=3)
    refused = []

    def nested(index, tokens):
        with pytest.raises(RuntimeError, match="inside another generate.. call on the same thread"):
            generate(target, prompts, max_new_tokens=2)
        refused.append(index)

    out = generate(target, prompts, max_new_tokens=6, stream=nested)
    assert refused and out.sequences == [hf_greedy(target, p, 6) for p in prompts]
    assert generate(target, prompts, max_new_tokens=6).sequences == out.sequences  # usable again afterwards


def test_one_drafter_object_twice_in_a_call_is_refused():
    target = make_model("llama", num_layers=1)
    drafter = ModelDrafter(perturbed_copy(target, 0.05))
    with pytest.raises(ValueError, match="drafter 1 is the same object as drafter 0"):
        generate(target, [[1, 2, 3]], drafter=[drafter, drafter], max_new_tokens=4)


def test_a_model_used_by_generate_still_copies_and_pickles_without_its_runners():
    """The runners (cache, captured graphs) stay with the model, not with its copies: a copy or a
    pickle taken after a call carries none, and the copy decodes exactly on its own."""
    import copy
    import pickle

    target = make_model("llama")
    prompts = random_prompts(2, 96, seed=3)
    generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1)), policy=FixedPolicy(3),
             max_new_tokens=4)
    assert runners_of(target)
    copied, unpickled = copy.deepcopy(target), pickle.loads(pickle.dumps(target))
    assert not runners_of(copied) and not runners_of(unpickled) and runners_of(target)
    for model in (copied, unpickled):
        out = generate(model, prompts, max_new_tokens=6)
        assert out.sequences == [hf_greedy(target, p, 6) for p in prompts]
