"""SPIReDrafter and its draft model: the wiring oracle (all target blocks, a full window and the
target's states as memory give the target's own next-token distribution), the runner's drafting
equal to the training forward, greedy identity, saving and loading, and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import SamplingParams, UnsupportedModelError, generate
from specdec.drafters import SPIReDrafter, SpireDraft
from specdec.policies import FixedPolicy
from specdec.verifiers import PaddedVerifier, PaddingFreeVerifier
from tests.test_generate_exact import MAX_NEW_TOKENS, eos_for, reference
from tests.tiny import cached_model, device_params, make_model, random_prompts


class RecordingSPIRe(SPIReDrafter):
    """Keeps every draft pass: the committed tokens of each row, the fed tokens and the logits."""

    def __init__(self, draft, cuda_graphs=False):
        super().__init__(draft, cuda_graphs=cuda_graphs)
        self.passes = []

    def _pass(self, batch, tokens, rows, slots):
        logits = super()._pass(batch, tokens, rows, slots)
        for i, row in enumerate(rows):
            committed = batch.token_ids[row, : batch.lengths[row]].tolist()
            self.passes.append((committed, int(slots[i]), int(tokens[i]), logits[i].clone()))
        return logits


def target_states(target, tokens):
    with torch.no_grad():
        out = target(torch.tensor([tokens], device=target.device), output_hidden_states=True)
    return out.logits[0], {j: h for j, h in enumerate(out.hidden_states[:-1])}


def randomised(draft, seed=0):
    """The memory weights away from their start, so that feedback memory differs from block inputs."""
    with torch.no_grad():
        draft.memory_mix.copy_(torch.randn(draft.memory_mix.shape, generator=torch.Generator().manual_seed(seed)))
    return draft


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_with_every_block_a_full_window_and_target_memory_the_first_draft_is_the_targets(arch):
    target = make_model(arch, num_layers=3)
    draft = randomised(SpireDraft.from_target(target, num_blocks=3, window=1000))
    drafter = RecordingSPIRe(draft)
    prompts = random_prompts(4, 96, seed=2, min_len=5, max_len=30)
    generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=12,
             sampling=SamplingParams(temperature=1.0))
    first_passes = [p for p in drafter.passes if p[1] == len(p[0]) - 1]  # the last committed token fed
    assert len(first_passes) >= 4
    for committed, slot, token, logits in first_passes:
        expected, _ = target_states(target, committed)
        torch.testing.assert_close(logits, expected[-1], rtol=1e-9, atol=1e-9)
    # the training forward agrees: step 0 of any block is the target's own prediction
    tokens = prompts[0] + [5, 9, 11]
    logits, hidden = target_states(target, tokens)
    starts = torch.tensor([0, 2, len(tokens) - 3])
    unrolled = draft.unrolled_logits(torch.tensor([tokens]), hidden, starts, 3)
    torch.testing.assert_close(unrolled[0, :, 0], logits[starts], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sink,window,feedback,verifier_class,temperature", [
    (1, 3, True, PaddingFreeVerifier, 0.0), (1, 3, False, PaddingFreeVerifier, 0.0),
    (4, 2, True, PaddedVerifier, 1.0),  # the sink reaching past the window's start
    (0, 3, True, PaddingFreeVerifier, 1.0), (3, 1, False, PaddedVerifier, 0.0)])
def test_the_runners_drafting_is_the_training_forward(sink, window, feedback, verifier_class, temperature):
    """Every draft pass of a call (first steps and later ones, whose context the target's
    verification projected) equals SpireDraft.unrolled_logits on the same tokens."""
    target = make_model("llama", num_layers=3)
    draft = randomised(SpireDraft.from_target(target, sink=sink, window=window, feedback=feedback), seed=3)
    drafter = RecordingSPIRe(draft)
    prompts = random_prompts(3, 96, seed=7, min_len=6, max_len=20)
    generate(target, prompts, drafter=drafter, verifier=verifier_class(), policy=FixedPolicy(3), max_new_tokens=10,
             sampling=SamplingParams(temperature=temperature))
    blocks: dict = {}  # (row's committed tokens) -> fed tokens and logits, in order
    for committed, slot, token, logits in drafter.passes:
        blocks.setdefault(tuple(committed), []).append((token, logits))
    assert len(blocks) >= 6
    for committed, fed in blocks.items():
        tokens = list(committed) + [token for token, _ in fed[1:]]
        _, hidden = target_states(target, tokens)
        start = len(committed) - 1
        unrolled = draft.unrolled_logits(torch.tensor([tokens]), hidden, torch.tensor([start]), len(fed))
        torch.testing.assert_close(unrolled[0, 0], torch.stack([logits for _, logits in fed]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size,num_draft_tokens,verifier_class", [
    (1, 4, PaddingFreeVerifier), (8, 1, PaddedVerifier), (8, 4, PaddingFreeVerifier), (8, 3, PaddedVerifier)])
def test_greedy_output_equals_target_greedy(verifier_class, num_draft_tokens, batch_size, arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(batch_size, target.config.vocab_size, seed=batch_size + 40, min_len=6, max_len=30)
    eos = eos_for(arch, device, dtype, prompts)
    draft = SpireDraft.from_target(target, sink=1, window=4)
    out = generate(target, prompts, drafter=SPIReDrafter(draft), verifier=verifier_class(),
                   policy=FixedPolicy(num_draft_tokens), max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert out.sequences == [reference(arch, device, dtype, tuple(p), eos) for p in prompts]
    assert out.stats.accepted > 0


def test_a_saved_draft_loads_back_to_the_same_outputs(tmp_path):
    target = make_model("llama", num_layers=4)
    draft = randomised(SpireDraft.from_target(target, sink=2, window=5), seed=4)
    draft.save(tmp_path)
    loaded = SpireDraft.load(tmp_path, dtype=torch.float64)
    assert (loaded.source_layers, loaded.sink, loaded.window, loaded.feedback) == ((3,), 2, 5, True)
    tokens = random_prompts(1, 96, seed=5, min_len=20, max_len=21)[0]
    _, hidden = target_states(target, tokens)
    starts = torch.tensor([0, 7, 15])
    torch.testing.assert_close(loaded.unrolled_logits(torch.tensor([tokens]), hidden, starts, 4),
                               draft.unrolled_logits(torch.tensor([tokens]), hidden, starts, 4))
    prompts = random_prompts(3, 96, seed=6, min_len=6, max_len=20)
    outputs = [generate(target, prompts, drafter=SPIReDrafter(d), policy=FixedPolicy(3), max_new_tokens=10,
                        sampling=SamplingParams(temperature=1.0), seed=1).sequences for d in (draft, loaded)]
    assert outputs[0] == outputs[1]


def test_the_ablations_change_the_draft():
    target = make_model("llama", num_layers=4)
    tokens = random_prompts(1, 96, seed=8, min_len=20, max_len=21)[0]
    _, hidden = target_states(target, tokens)
    starts = torch.tensor([4, 12])
    full = randomised(SpireDraft.from_target(target, window=6))
    results = {name: d.unrolled_logits(torch.tensor([tokens]), hidden, starts, 3) for name, d in {
        "full": full,
        "no feedback": SpireDraft.from_target(target, window=6, feedback=False),
        "random init": SpireDraft.from_target(target, window=6, random_init=True),
    }.items()}
    torch.testing.assert_close(results["full"][:, :, 0], results["no feedback"][:, :, 0])  # step 0 sees no memory of its own
    assert not torch.allclose(results["full"][:, :, 1:], results["no feedback"][:, :, 1:])
    assert not torch.allclose(results["full"], results["random init"])


def test_a_text_shorter_than_the_sink_trains():
    target = make_model("llama", num_layers=4)
    tokens = [3, 9, 4]
    _, hidden = target_states(target, tokens)
    logits = SpireDraft.from_target(target, sink=4, window=2).unrolled_logits(torch.tensor([tokens]), hidden,
                                                                              torch.tensor([0]), 3)
    assert logits.shape == (1, 1, 3, 96) and torch.isfinite(logits).all()


def test_the_memory_writes_stay_out_of_other_drafters_passes_over_the_same_model():
    """A ModelDrafter over the SPIRe draft's LM (a vanilla baseline) drafts the same before and
    after a SPIReDrafter has used it: the memory writes belong to SPIRe's own runners."""
    from specdec.drafters import ModelDrafter

    target = make_model("llama", num_layers=4)
    draft = randomised(SpireDraft.from_target(target, window=4), seed=5)
    prompts = random_prompts(4, 96, seed=9, min_len=6, max_len=20)
    vanilla = lambda: generate(target, prompts, drafter=ModelDrafter(draft.model), policy=FixedPolicy(3),  # noqa: E731
                               max_new_tokens=12).stats.accepted_by_position
    before = vanilla()
    generate(target, prompts, drafter=SPIReDrafter(draft), policy=FixedPolicy(3), max_new_tokens=12)
    assert vanilla() == before


def test_a_target_reading_drafter_beside_a_tree_drafter_is_refused():
    from specdec.drafters import ModelDrafter
    from specdec.drafters.tree import TreeSpec
    from specdec.verifiers import TreeVerifier
    from tests.tiny import perturbed_copy

    target = make_model("llama", num_layers=4)
    trees = ModelDrafter(perturbed_copy(target, 0.1), tree=TreeSpec(depth=3, branching=2))
    with pytest.raises(ValueError, match="reads the target's activations from chain verifications"):
        generate(target, [[1, 2, 3]], drafter=[SPIReDrafter(SpireDraft.from_target(target)), trees],
                 verifier=TreeVerifier(), max_new_tokens=4)


def test_profile_says_it_cannot_time_drafters_that_read_the_target():
    from specdec.drafters import SelfSpeculativeDrafter
    from specdec.policies import profile

    target = make_model("llama", num_layers=4)
    for drafter in (SPIReDrafter(SpireDraft.from_target(target)), SelfSpeculativeDrafter()):
        with pytest.raises(ValueError, match="time it inside generate"):
            profile(target, [drafter])


def test_bad_drafts_and_targets_are_refused():
    with pytest.raises(UnsupportedModelError, match="not Llama-like"):
        SpireDraft.from_target(make_model("gpt_neox"))
    with pytest.raises(TypeError, match="must be a SpireDraft"):
        SPIReDrafter(make_model("llama"))
    with pytest.raises(ValueError, match="num_blocks must be between 1 and"):
        SpireDraft.from_target(make_model("llama", num_layers=2), num_blocks=3)
    other = SpireDraft.from_target(make_model("llama", hidden=64, num_layers=4))
    with pytest.raises(ValueError, match="build the draft from this target"):
        generate(make_model("llama", num_layers=2), [[1, 2, 3]], drafter=SPIReDrafter(other), max_new_tokens=4)


@pytest.mark.cuda
def test_graphed_drafting_is_the_training_forward_and_the_output_the_targets():
    from tests.tiny import hf_greedy

    target = make_model("llama", num_layers=4, dtype=torch.float32, device="cuda")
    prompts = random_prompts(6, 96, seed=9, min_len=8, max_len=40)
    drafter = RecordingSPIRe(randomised(SpireDraft.from_target(target, window=5)), cuda_graphs=True)
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=20, cuda_graphs=True)
    assert out.sequences == [hf_greedy(target, p, 20) for p in prompts]
    assert 0 < out.stats.accepted < out.stats.drafted
    assert drafter._runner is None and drafter.runner_role.startswith("spire")
    blocks: dict = {}
    for committed, slot, token, logits in drafter.passes:
        blocks.setdefault(tuple(committed), []).append((token, logits))
    for committed, fed in list(blocks.items())[:8]:
        tokens = list(committed) + [token for token, _ in fed[1:]]
        _, hidden = target_states(target, tokens)
        unrolled = drafter.draft.unrolled_logits(torch.tensor([tokens], device="cuda"), hidden,
                                                 torch.tensor([len(committed) - 1], device="cuda"), len(fed))
        torch.testing.assert_close(unrolled[0, 0], torch.stack([logits for _, logits in fed]), rtol=1e-3, atol=1e-3)
