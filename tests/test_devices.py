"""Targets and drafters on more than one device (issue 6): a drafter on another device than the
target, and a target whose layers are split over devices with accelerate's ``device_map``
(each layer's KV cache on that layer's device). The runs need a GPU besides the CPU, or two GPUs,
so they are ``cuda`` tests; float64 over a GPU and the CPU, float32 over two GPUs (reference
attention in both runs), so the split and unsplit runs must agree token for token."""

from __future__ import annotations

import pytest
import torch

from specdec import generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.runner import runners_of
from specdec.types import Draft
from tests.tiny import make_model, perturbed_copy, random_prompts


def test_a_draft_on_the_target_device_is_not_copied():
    draft = Draft(token_ids=torch.zeros(2, 3, dtype=torch.int64), num_tokens=torch.zeros(2).numpy())
    assert draft.to(torch.device("cpu")) is draft


def _plain(target, prompts, max_new_tokens):
    return generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=max_new_tokens).sequences


@pytest.mark.cuda
@pytest.mark.parametrize("target_device,drafter_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_drafter_on_another_device_than_the_target(target_device, drafter_device):
    target = make_model("llama", num_layers=3)
    drafter_model = perturbed_copy(target, 0.02).to(drafter_device)
    target = target.to(target_device)
    prompts = random_prompts(5, 96, seed=1, min_len=3)
    expected = _plain(target, prompts, 24)
    out = generate(target, prompts, drafter=[ModelDrafter(drafter_model), PromptLookupDrafter()],
                   policy=FixedPolicy(3), max_new_tokens=24)
    assert out.sequences == expected
    assert out.stats.tau > 1.0  # the drafter's proposals were used, not just moved


def _split_over_cuda_and_cpu(model, offload: bool = False):
    """The embedding, the first half of the layers and the head on cuda:0; the rest on the CPU.
    offload=False: those layers run on the CPU (accelerate's main device set to the CPU, the
    one-GPU stand-in for a split over two GPUs); offload=True: accelerate's CPU offload (the
    default for "cpu" in a device_map), whose layers keep weights on the CPU and run on the GPU."""
    dispatch_model = pytest.importorskip("accelerate", reason="device_map needs accelerate").dispatch_model
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": "cpu", "lm_head": 0}
    device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else "cpu" for i in range(layers)})
    return dispatch_model(model, device_map=device_map, **({} if offload else {"main_device": "cpu"}))


@pytest.mark.cuda
@pytest.mark.parametrize("offload,cache_devices", [(False, ["cuda", "cuda", "cpu", "cpu"]), (True, ["cuda"] * 4)],
                         ids=["split", "cpu-offload"])
def test_a_layer_sharded_target_decodes_as_the_whole_model(offload, cache_devices):
    whole = make_model("llama", num_layers=4)
    prompts = random_prompts(4, 96, seed=2, min_len=3)
    expected = _plain(whole, prompts, 20)
    split = _split_over_cuda_and_cpu(make_model("llama", num_layers=4), offload)  # the same weights (same seed)
    assert _plain(split, prompts, 20) == expected
    drafter = ModelDrafter(perturbed_copy(whole, 0.02).to("cuda"))
    out = generate(split, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=20)
    assert out.sequences == expected and out.stats.tau > 1.0
    keys = runners_of(split)["target"].cache.keys
    assert [k.device.type for k in keys] == cache_devices  # each layer's cache where that layer computes


@pytest.mark.cuda
def test_fast_attention_and_graphs_refuse_a_split_target():
    split = _split_over_cuda_and_cpu(make_model("llama", num_layers=2, dtype=torch.float32))
    with pytest.raises(ValueError, match="split over several devices"):
        generate(split, [[1, 2, 3]], max_new_tokens=2, attention="fast")
    with pytest.raises(ValueError, match="CUDA graphs need the whole model on one device"):
        generate(split, [[1, 2, 3]], max_new_tokens=2, attention="reference", cuda_graphs=True)


def _two_gpus():
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs (run `pytest -m cuda` on a machine with two)")


# "balanced": accelerate spreads the layers over both GPUs with the head on the second, the layout
# device_map="auto" gives a target too big for one GPU; "norm-apart": the final norm on the second
# GPU and the head back on the first, so the head's device is neither the embeddings' nor the
# decoder output's.
TWO_GPU_MAPS = {
    "balanced": "balanced",
    "norm-apart": {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                   "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 0},
}


@pytest.mark.cuda
@_two_gpus()
@pytest.mark.parametrize("device_map", sorted(TWO_GPU_MAPS))
@pytest.mark.parametrize("drafting", ["plain", "prompt-lookup", "model-drafter-on-cuda1"])
def test_a_target_split_over_two_gpus_decodes_as_the_whole_model(tmp_path, device_map, drafting):
    """A zoo-like target loaded with from_pretrained(device_map=...) over cuda:0 and cuda:1 decodes
    exactly as the unsplit model on cuda:0 (float32, reference attention on both), with each
    drafter; its layers' caches sit on both GPUs."""
    pytest.importorskip("accelerate", reason="device_map needs accelerate")
    from transformers import AutoModelForCausalLM

    whole = make_model("llama", num_layers=4, dtype=torch.float32)
    whole.save_pretrained(tmp_path)
    whole = whole.to("cuda:0")
    prompts = random_prompts(4, 96, seed=3, min_len=3)
    expected = generate(whole, prompts, policy=FixedPolicy(0), max_new_tokens=20, attention="reference").sequences
    split = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=TWO_GPU_MAPS[device_map], dtype=torch.float32)
    assert {p.device for p in split.parameters()} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    if drafting == "plain":
        out = generate(split, prompts, policy=FixedPolicy(0), max_new_tokens=20)
    else:
        drafter = (PromptLookupDrafter() if drafting == "prompt-lookup"
                   else ModelDrafter(perturbed_copy(whole, 0.02).to("cuda:1")))
        out = generate(split, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=20)
    assert out.sequences == expected
    if drafting == "model-drafter-on-cuda1":
        assert out.stats.tau > 1.0
    keys = runners_of(split)["target"].cache.keys
    assert {k.device for k in keys} == {torch.device("cuda", 0), torch.device("cuda", 1)}
