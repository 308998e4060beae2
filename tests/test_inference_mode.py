"""Engine.step and Engine.admit run in inference mode (specdec/inference.py), but what they hand
to the caller's code is the caller's: a stream callback runs outside it, so the tensors it makes
are ordinary ones (modifiable in place and usable by autograd once the step has returned), and
models that generate() ran can be trained afterwards."""

import torch

from specdec import Engine, generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from tests.tiny import make_model, perturbed_copy, random_prompts


def test_a_stream_callback_runs_outside_inference_mode():
    target = make_model("llama", dtype=torch.float32)
    kept, modes = [], []

    def stream(request, tokens):
        modes.append(torch.is_inference_mode_enabled())
        kept.append(torch.tensor(tokens, dtype=torch.float32))  # e.g. gathered for a later update

    generate(target, random_prompts(2, 96, seed=1), drafter=ModelDrafter(perturbed_copy(target, 0.1)),
             policy=FixedPolicy(3), max_new_tokens=6, stream=stream)
    assert modes and not any(modes)
    total = torch.cat(kept)
    total += 1  # in place, outside inference mode
    for tensor in kept:
        tensor.mul_(2)


def test_engine_steps_leave_inference_mode_as_they_found_it():
    target = make_model("llama", dtype=torch.float32)
    with Engine(target, max_rows=2, max_len=32) as engine:
        engine.add_request([1, 2, 3], max_new_tokens=4)
        while engine.has_work():
            engine.step()
            assert not torch.is_inference_mode_enabled()
        with torch.inference_mode():
            engine.add_request([4, 5], max_new_tokens=3)
            while engine.has_work():
                engine.step()
                assert torch.is_inference_mode_enabled()


def test_models_generate_ran_can_be_trained_afterwards():
    target = make_model("llama", dtype=torch.float32)
    small = perturbed_copy(target, 0.1)
    generate(target, random_prompts(3, 96, seed=2), drafter=ModelDrafter(small), policy=FixedPolicy(3),
             max_new_tokens=8)
    inputs = torch.arange(1, 9)[None]
    for model in (target, small):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        assert all(not p.is_inference() for p in model.parameters())
        assert all(not b.is_inference() for b in model.buffers())
