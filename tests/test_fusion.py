"""Merged projections (fusion.py): a runner of a model whose q/k/v and gate/up projections are
merged gives the same logits and the same greedy tokens as the unmerged model (float32 on the
CPU: tokens exact, logits to float32 rounding), leaves the model computing as before outside
the runner, follows in-place weight updates, and computes a projection called alone or on
another input by itself."""

import numpy as np
import pytest
import torch

from specdec import fusion, generate
from specdec.fusion import MergedProjections
from specdec.policies import FixedPolicy
from specdec.runner import ModelRunner, PackedLayout, release_runners, runners_of
from tests.tiny import make_model, perturbed_copy


@pytest.fixture
def merge_everywhere(monkeypatch):
    monkeypatch.setattr(fusion, "MERGE", True)


def hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def packed_logits(model, merge, monkeypatch):
    monkeypatch.setattr(fusion, "MERGE", merge)
    runner = ModelRunner(model, max_rows=3, max_len=32)
    layout = PackedLayout(rows=np.array([0, 2]), starts=np.array([0, 0]), counts=np.array([5, 3]))
    ids = torch.tensor([3, 9, 4, 1, 7, 11, 2, 5])
    with runner.attached():
        logits = runner.forward(ids, layout)  # [8, V]
    return runner, logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_merged_runner_gives_the_unmerged_logits(arch, monkeypatch):
    model = make_model(arch, dtype=torch.float32)
    _, unmerged = packed_logits(model, False, monkeypatch)
    runner, merged = packed_logits(model, True, monkeypatch)
    assert len(runner.merged) == 2 * model.config.num_hidden_layers  # q/k/v and gate/up of every layer
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged.argmax(-1), unmerged.argmax(-1))


def test_parameters_become_views_of_one_tensor_per_group():
    model = make_model("llama", dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = MergedProjections(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    attention = model.model.layers[0].self_attn
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    group = merged.groups[0]
    assert group.weight.shape == (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    # a second merge (a later runner) finds them laid out and reuses the storage
    again = MergedProjections(model)
    assert again.groups[0].weight.data_ptr() == group.weight.data_ptr()
    assert attention.q_proj.weight.data_ptr() == q.data_ptr()


def test_greedy_output_is_the_models_own_and_the_model_is_untouched_outside(merge_everywhere):
    model = make_model("llama", dtype=torch.float32)
    prompts = [[5, 17, 3, 22, 9], [40, 2]]
    expected = [hf_greedy(model, p, 12) for p in prompts]
    with torch.no_grad():
        before = model(torch.tensor([prompts[0]])).logits
    out = generate(model, prompts, max_new_tokens=12, eos_token_id=[])
    assert out.sequences == expected
    assert runners_of(model)["target"].merged  # the runner did merge
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear  # the model's own modules are back
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompts[0]])).logits, before)
    assert [hf_greedy(model, p, 12) for p in prompts] == expected


def test_speculative_output_with_merged_target_and_drafter(merge_everywhere):
    from specdec.drafters import ModelDrafter

    model = make_model("qwen2", dtype=torch.float32)
    drafter = perturbed_copy(model, 0.02)
    prompts = [[5, 17, 3, 22, 9], [40, 2], [7]]
    expected = [hf_greedy(model, p, 16) for p in prompts]
    out = generate(model, prompts, drafter=ModelDrafter(drafter), policy=FixedPolicy(3), max_new_tokens=16,
                   eos_token_id=[])
    assert out.sequences == expected
    assert out.stats.acceptance_rate > 0  # the drafts were used, not just the target's own tokens


def test_in_place_weight_updates_reach_the_merged_product(merge_everywhere):
    model = make_model("llama", dtype=torch.float32)
    other = make_model("llama", dtype=torch.float32, seed=5)
    prompt = [5, 17, 3, 22, 9]
    generate(model, [prompt], max_new_tokens=4, eos_token_id=[])  # runner built, weights merged
    model.load_state_dict(other.state_dict())  # copies into the (now merged) parameters
    out = generate(model, [prompt], max_new_tokens=12, eos_token_id=[])
    assert out.sequences[0] == hf_greedy(other, prompt, 12)


class TwoInputs(torch.nn.Module):
    """q/k/v called on different inputs (as a cross-attention would)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, y):
        return self.q_proj(x) + self.k_proj(y) + self.v_proj(y)


def test_parts_called_alone_or_on_other_inputs_compute_their_own_product():
    module = TwoInputs()
    merged = MergedProjections(module)
    assert len(merged) == 1
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    expected = module(x, y)
    with merged.installed():
        torch.testing.assert_close(module(x, y), expected)  # k and v on y: not q's product
        assert type(module.k_proj).__name__ == "Part"
        torch.testing.assert_close(module.v_proj(y), expected - module.q_proj(x) - module.k_proj(y))
        alone = module.k_proj(x)  # k alone (as a drafter that projects the target's keys), after q on x
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, merged.groups[0].linears[1].weight,
                                                                     merged.groups[0].linears[1].bias))
    assert torch.equal(module(x, y), expected)  # restored, and its parameters still work unmerged


def test_unmergeable_groups_are_left_alone():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, bias=False)

    module = Mixed()
    pointers = [p.data_ptr() for p in module.parameters()]
    assert len(MergedProjections(module)) == 0  # input sizes differ; biases differ
    assert [p.data_ptr() for p in module.parameters()] == pointers


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_merged_graphs_give_the_unmerged_tokens_on_a_gpu(compile, monkeypatch):
    model = make_model("llama", dtype=torch.float32, device="cuda", hidden=64)
    prompts = [[5, 17, 3, 22, 9], [40, 2], [7, 8, 9]]
    options = dict(max_new_tokens=16, eos_token_id=[], cuda_graphs=True, compile=compile)
    monkeypatch.setattr(fusion, "MERGE", False)
    plain = generate(model, prompts, **options).sequences
    release_runners(model)
    monkeypatch.setattr(fusion, "MERGE", "fast")
    out = generate(model, prompts, **options)
    assert runners_of(model)["target"].merged
    assert out.sequences == plain
    assert out.sequences == [hf_greedy(model, p, 16) for p in prompts]


def test_a_merged_model_saves_and_loads_as_before(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model("qwen2", dtype=torch.float32)
    expected = {name: p.detach().clone() for name, p in model.state_dict().items()}
    MergedProjections(model)
    model.save_pretrained(tmp_path)  # parameters that are views of one tensor: still saved one by one
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], value) for name, value in expected.items())


def test_spire_drafting_from_a_merged_target(merge_everywhere):
    """SPIRe's draft projects keys and values with the target's own k and v projections, alone:
    they compute their own products, and the output stays the target's."""
    from specdec.drafters import SPIReDrafter, SpireDraft

    target = make_model("llama", dtype=torch.float32, num_layers=3)
    prompts = [[5, 17, 3, 22, 9, 1, 4, 8, 30, 2], [40, 2, 11, 9, 6, 5, 3]]
    expected = [hf_greedy(target, p, 12) for p in prompts]
    draft = SpireDraft.from_target(target, sink=1, window=4)
    out = generate(target, prompts, drafter=SPIReDrafter(draft), policy=FixedPolicy(3), max_new_tokens=12,
                   eos_token_id=[])
    assert runners_of(target)["target"].merged
    assert out.sequences == expected
    assert out.stats.accepted > 0


def test_the_model_keeps_its_parameters_and_state_while_a_runner_is_attached(merge_everywhere):
    """An open Engine holds its runner attached for its whole life: meanwhile the model's
    parameters(), state_dict() and weights fingerprint are those it has outside."""
    from specdec.engine import Engine
    from specdec.runner import weights_fingerprint

    model = make_model("llama", dtype=torch.float32)
    keys = list(model.state_dict())
    engine = Engine(model, max_rows=2, max_len=64)
    try:
        assert runners_of(model)["target"].merged
        assert list(model.state_dict()) == keys
        assert weights_fingerprint(model) == runners_of(model)["target"].weights_fingerprint  # taken outside
    finally:
        engine.close()


def test_a_model_drafting_for_itself_keeps_its_drafter_runner_across_calls(merge_everywhere):
    """The drafter's runner is built while the target's is attached: its fingerprint must still
    match the model's outside, or it is rebuilt (graphs recaptured) whenever the model is used
    alone as a drafter in between."""
    from specdec.drafters import ModelDrafter

    model, other = make_model("llama", dtype=torch.float32), make_model("llama", dtype=torch.float32, seed=3)
    options = dict(policy=FixedPolicy(2), max_new_tokens=6, eos_token_id=[])
    generate(model, [[5, 17, 3]], drafter=ModelDrafter(model), **options)
    first = runners_of(model)["drafter-0"]
    generate(other, [[5, 17, 3]], drafter=ModelDrafter(model), **options)
    generate(model, [[5, 17, 3]], drafter=ModelDrafter(model), **options)
    assert runners_of(model)["drafter-0"] is first


def test_tied_projection_weights_are_not_merged(merge_everywhere):
    """A parameter two projections share (layers tying their q) stays one tensor: merged, an
    in-place update would reach one group's product only."""
    model = make_model("llama", dtype=torch.float32)
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight
    merged = MergedProjections(model)
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    with torch.no_grad():
        layers[0].self_attn.q_proj.weight.mul_(3.0)  # an in-place update (load_state_dict, an optimiser step)
        expected = model(ids).logits
        with merged.installed():
            assert torch.equal(model(ids).logits, expected)


def test_a_runner_built_during_a_call_leaves_the_weights_of_the_runner_in_use(monkeypatch):
    """A target runner built unmerged (fusion.MERGE off), then a drafter runner of the same model
    built with merging on in a call: merging would give the parameters new storage under the
    target runner in use (on a GPU its captured graphs would replay over freed memory)."""
    from specdec.drafters import ModelDrafter
    from specdec.runner import weights_fingerprint

    model = make_model("llama", dtype=torch.float32)
    prompts = [[5, 17, 3, 22, 9]]
    expected = [hf_greedy(model, p, 8) for p in prompts]
    monkeypatch.setattr(fusion, "MERGE", False)
    generate(model, prompts, max_new_tokens=8, eos_token_id=[])
    target = runners_of(model)["target"]
    monkeypatch.setattr(fusion, "MERGE", True)
    out = generate(model, prompts, drafter=ModelDrafter(model), policy=FixedPolicy(2), max_new_tokens=8,
                   eos_token_id=[])
    assert runners_of(model)["target"] is target  # the same runner served the call
    assert target.weights_fingerprint == weights_fingerprint(model)  # and its weights never moved
    assert out.sequences == expected
