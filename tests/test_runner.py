"""ModelRunner: packed ragged forwards equal each model's own full forward."""

import numpy as np
import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from specdec import UnsupportedModelError, generate
from specdec.runner import ModelRunner, PackedLayout
from tests.tiny import ARCHS, device_params, hf_greedy, make_model


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0]


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_chunks_equal_full_forward(arch, device, dtype):
    model = make_model(arch, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (9, 2, 14, 5)]
    expected = [full_logits(model, s) for s in sequences]
    runner = ModelRunner(model, max_rows=4, max_len=32)
    # three passes with different rows and chunk sizes each, in shuffled row order
    cuts = [[4, 1, 6, 0], [7, 2, 6, 3], [9, 2, 14, 5]]
    done = np.zeros(4, dtype=np.int64)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    with runner.attached():
        for pass_index, cut in enumerate(cuts):
            order = np.roll(np.arange(4), pass_index)
            rows = np.array([r for r in order if cut[r] > done[r]])
            counts = np.array([cut[r] - done[r] for r in rows])
            tokens = [t for r in rows for t in sequences[r][done[r] : cut[r]]]
            logits = runner.forward(torch.tensor(tokens, device=device), PackedLayout(rows, done[rows].copy(), counts))
            offset = 0
            for r, c in zip(rows, counts):
                torch.testing.assert_close(logits[offset : offset + c], expected[r][done[r] : cut[r]], atol=tolerance, rtol=0)
                offset += c
            done[rows] += counts


def test_rolled_back_positions_are_overwritten():
    """Tokens written past a row's committed length (rejected drafts) never leak."""
    model = make_model("llama")
    runner = ModelRunner(model, max_rows=1, max_len=32)
    prefix, rejected, accepted = [5, 6, 7], [40, 41, 42], [50, 51]
    with runner.attached():
        runner.forward(torch.tensor(prefix + rejected), PackedLayout(np.array([0]), np.array([0]), np.array([6])))
        runner.cache.lengths[0] = 6
        runner.cache.rollback(np.array([0]), np.array([3]))
        logits = runner.forward(torch.tensor(accepted), PackedLayout(np.array([0]), np.array([3]), np.array([2])))
    torch.testing.assert_close(logits, full_logits(model, prefix + accepted)[3:], atol=1e-10, rtol=0)


def test_model_attention_is_restored_for_hugging_face():
    model = make_model("qwen2")
    before = hf_greedy(model, [3, 4, 5], 8)
    generate(model, [[3, 4, 5]], max_new_tokens=8)
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert hf_greedy(model, [3, 4, 5], 8) == before


def test_training_mode_is_restored():
    model = make_model("llama").train()
    generate(model, [[1, 2]], max_new_tokens=3)
    assert model.training


def test_not_a_transformers_model():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        generate(torch.nn.Linear(3, 3), [[1, 2]])


def test_model_without_attention_interface():
    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(UnsupportedModelError, match="AttentionInterface|attention"):
        generate(mamba, [[1, 2]], max_new_tokens=2)


def test_model_whose_layer_skips_the_attention_interface():
    """A layer that keeps its own state (here: attention replaced by a plain function) is caught."""
    model = make_model("llama")

    def no_interface(hidden_states, **kwargs):
        return hidden_states, None

    model.model.layers[1].self_attn.forward = no_interface
    with pytest.raises(UnsupportedModelError, match="1 of its 2 layers"):
        generate(model, [[1, 2, 3]], max_new_tokens=2)


def test_runners_live_and_die_with_their_model():
    import gc
    import weakref

    model = make_model("llama")
    generate(model, [[1, 2, 3]], max_new_tokens=3)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_cast_model_gets_a_new_runner():
    from specdec.runner import runners_of

    model = make_model("llama")
    first = generate(model, [[1, 2, 3]], max_new_tokens=6).sequences
    runner = runners_of(model)["target"]
    model.float()
    again = generate(model, [[1, 2, 3]], max_new_tokens=6).sequences
    assert runners_of(model)["target"] is not runner and again == first


def test_rotary_scaling_that_depends_on_the_batch_is_refused():
    model = make_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="'dynamic' rotary scaling"):
        generate(model, [[1, 2]], max_new_tokens=2)


def test_two_drafters_on_one_model_keep_their_own_runners():
    """Otherwise a second drafter with other settings would release the first one's cache."""
    from specdec.drafters import ModelDrafter
    from specdec.runner import runners_of
    from tests.tiny import AlternatingPolicy

    target = make_model("llama")
    shared = make_model("llama", seed=3)
    pair = [ModelDrafter(shared), ModelDrafter(shared)]
    out = generate(target, [[1, 2, 3, 4], [5, 6]], drafter=pair, policy=AlternatingPolicy(3), max_new_tokens=10)
    assert out.sequences == [hf_greedy(target, p, 10) for p in ([1, 2, 3, 4], [5, 6])]
    drafter_runners = [r for role, r in runners_of(shared).items() if role.startswith("drafter")]
    assert len(drafter_runners) == 2 and drafter_runners[0] is not drafter_runners[1]


def test_attention_metadata_moves_to_a_layer_device_once():
    """A model split over devices (device_map) reads the pass's metadata in each layer's device:
    every tensor moves, host fields stay, and the copy is made once per device ('meta' stands
    in for a second device on this CPU machine)."""
    import numpy as np

    from specdec.attention import reference_attention
    from specdec.cache import KVCache
    from specdec.runner import PackedLayout, packed_metadata

    layout = PackedLayout(rows=np.array([0, 1]), starts=np.array([3, 5]), counts=np.array([2, 1]))
    meta = packed_metadata(layout, KVCache(2, 3, 16), torch.device("cpu"), reference_attention)
    moved = meta.on(torch.device("meta"))
    assert moved is meta.on(torch.device("meta"))
    assert moved.token_rows.device.type == "meta" and moved.group_query_positions.device.type == "meta"
    assert (moved.max_group_tokens, moved.max_kv_len, moved.cache, moved.backend) == (
        meta.max_group_tokens, meta.max_kv_len, meta.cache, meta.backend)
    assert meta.token_rows.device.type == "cpu"


class _Hook:
    def __init__(self, execution_device):
        self.execution_device = execution_device


class _Sequential:  # accelerate's SequentialHook: several hooks on one module
    def __init__(self, *hooks):
        self.hooks = list(hooks)


@pytest.mark.parametrize("hook,expected", [
    (None, "cpu"),  # no accelerate hook: the parameters' device
    (_Hook(None), "cpu"),
    (_Hook(1), "cuda:1"),  # accelerate names GPUs by index
    (_Hook("cuda:1"), "cuda:1"),
    (_Hook(torch.device("cpu")), "cpu"),
    (_Sequential(_Hook(None), _Hook(0)), "cuda:0"),
])
def test_execution_device_reads_accelerate_hooks(hook, expected):
    from specdec.runner import execution_device

    module = torch.nn.Linear(2, 2)
    if hook is not None:
        module._hf_hook = hook
    assert execution_device(module) == torch.device(expected)
