"""Token trees under greedy decoding: output token-identical to the target's own greedy decoding
on the exactness grid (architectures, batch 1/3/8, ragged prompts, rows stopping at EOS and at
max_new_tokens mid-tree); a step's accepted length never falls when nodes are added to its tree;
malformed trees and impossible settings get clear errors."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy
from specdec.types import PAD_ID, Draft
from specdec.verifiers import PaddingFreeVerifier, TreeVerifier
from tests.tiny import (ARCHS, AlternatingPolicy, cached_model, device_params, hf_greedy, make_model, perturbed_copy,
                        random_prompts)

MAX_NEW_TOKENS = 21


@functools.lru_cache(maxsize=None)
def drafter_model(arch, device, dtype):
    # agrees with the target often, not always: accepted paths run through second and third siblings
    return perturbed_copy(cached_model(arch, device, dtype), scale=0.4)


@functools.lru_cache(maxsize=None)
def reference(arch, device, dtype, prompt: tuple, eos_token_id):
    return hf_greedy(cached_model(arch, device, dtype), list(prompt), MAX_NEW_TOKENS, eos_token_id)


def make_drafter(kind, arch, device, dtype):
    if kind == "model tree":
        return ModelDrafter(drafter_model(arch, device, dtype), tree=TreeSpec(depth=4, branching=3))
    if kind == "lookup trie":
        return PromptLookupDrafter(tree=TreeSpec(depth=5, branching=3))
    return [ModelDrafter(drafter_model(arch, device, dtype), tree=TreeSpec(depth=3, branching=2)),
            PromptLookupDrafter()]  # trees and chains in one pass


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("budget", [2, 9])
@pytest.mark.parametrize("kind", ["model tree", "lookup trie", "tree and chain rows"])
def test_greedy_tree_output_equals_target_greedy(kind, budget, batch_size, arch, device, dtype):
    target = cached_model(arch, device, dtype)
    prompts = random_prompts(batch_size, target.config.vocab_size, seed=batch_size)
    eos = reference(arch, device, dtype, tuple(prompts[0]), None)[7]  # the first row stops early
    expected = [reference(arch, device, dtype, tuple(p), eos) for p in prompts]
    policy = AlternatingPolicy(budget) if kind == "tree and chain rows" else FixedPolicy(budget)
    out = generate(target, prompts, drafter=make_drafter(kind, arch, device, dtype), verifier=TreeVerifier(),
                   policy=policy, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert out.sequences == expected
    assert [r.emitted for r in out.stats.requests] == [len(s) for s in expected]
    assert out.stats.drafted > 0


def test_chains_through_the_tree_verifier_equal_the_padding_free_verifier():
    target = cached_model("llama", "cpu", torch.float64)
    prompts = random_prompts(5, 96, seed=2)
    drafter = ModelDrafter(drafter_model("llama", "cpu", torch.float64))
    runs = [generate(target, prompts, drafter=drafter, verifier=v, policy=FixedPolicy(4), max_new_tokens=16)
            for v in (TreeVerifier(), PaddingFreeVerifier())]
    assert runs[0].sequences == runs[1].sequences
    assert runs[0].stats.accepted_by_position == runs[1].stats.accepted_by_position


class RecordingPolicy(FixedPolicy):
    def __init__(self, k):
        super().__init__(k)
        self.records = []

    def observe(self, record):
        self.records.append(record)


def test_adding_nodes_never_lowers_a_steps_accepted_length():
    """At temperature 0 a budget of b + 1 nodes keeps the b nodes of the budget-b tree (the best
    by cumulative log-probability) and adds one, so every row's first step accepts at least as
    many tokens, over 24 contexts of the target's own output. A node that sees keys it should not
    (later nodes, siblings: the class of bug in which extra nodes disturb the others) breaks it;
    a wrong compaction shows in the identity grid above instead."""
    target = cached_model("qwen2", "cpu", torch.float64)
    drafter = ModelDrafter(drafter_model("qwen2", "cpu", torch.float64), tree=TreeSpec(depth=4, branching=3))
    prompts = random_prompts(4, 96, seed=5)
    contexts = [p + reference("qwen2", "cpu", torch.float64, tuple(p), None)[:cut] for p in prompts for cut in range(0, 18, 3)]
    accepted = []
    for budget in range(1, 13):
        policy = RecordingPolicy(budget)
        generate(target, contexts, drafter=drafter, verifier=TreeVerifier(), policy=policy, max_new_tokens=5)
        accepted.append(policy.records[0].num_accepted)
    accepted = np.array(accepted)  # [budget, context]
    assert np.all(np.diff(accepted, axis=0) >= 0)
    assert accepted[-1].mean() > accepted[0].mean()  # the extra nodes were accepted somewhere


class HandMadeTreeDrafter(Drafter):
    """Proposes one fixed tree for every row."""

    def __init__(self, tokens, parents, probs=None):
        self.tokens, self.parents, self.probs = tokens, parents, probs
        self.tree = TreeSpec(depth=len(tokens), branching=1)

    def propose(self, batch, num_tokens):
        rows = batch.num_rows
        count = len(self.tokens)
        return Draft(token_ids=torch.tensor([self.tokens] * rows), num_tokens=np.full(rows, count),
                     parents=torch.tensor([self.parents] * rows), depths=np.full(rows, count),
                     probs=None if self.probs is None else self.probs.expand(rows, -1, -1))


@pytest.mark.parametrize("tokens,parents,message", [
    ([5, 5, 6], [-1, -1, 0], "two siblings carry the same token"),
    ([5, 6, 7], [-1, 2, 0], "a node's parent is neither -1 .the root., an earlier node nor -2"),
    ([5, 6, 7], [-1, -2, 1], "a node hangs under an empty slot"),
])
def test_a_malformed_tree_from_a_drafter_is_a_clear_error(tokens, parents, message):
    target = cached_model("llama", "cpu", torch.float64)
    with pytest.raises(ValueError, match=f"row 0: the token tree from HandMadeTreeDrafter is malformed: {message}"):
        generate(target, [[1, 2, 3], [4, 5]], drafter=HandMadeTreeDrafter(tokens, parents), verifier=TreeVerifier(),
                 policy=FixedPolicy(3), max_new_tokens=8)


def test_siblings_drawn_with_replacement_may_repeat_a_token():
    from specdec import SamplingParams

    target = cached_model("llama", "cpu", torch.float64)
    probs = torch.full((1, 3, 96), 1 / 96, dtype=torch.float32)
    out = generate(target, [[1, 2, 3]], drafter=HandMadeTreeDrafter([5, 5, 6], [-1, -1, 0], probs),
                   verifier=TreeVerifier(), policy=FixedPolicy(3), max_new_tokens=8,
                   sampling=SamplingParams(temperature=1.0))
    assert len(out.sequences[0]) == 8


def test_impossible_tree_settings_are_refused_up_front():
    target = cached_model("llama", "cpu", torch.float64)
    drafter = ModelDrafter(drafter_model("llama", "cpu", torch.float64), tree=TreeSpec(depth=3, branching=2))
    with pytest.raises(ValueError, match="proposes token trees, which PaddingFreeVerifier cannot verify: pass "
                                         "verifier=TreeVerifier"):
        generate(target, [[1, 2]], drafter=drafter, policy=FixedPolicy(4), max_new_tokens=4)
    with pytest.raises(ValueError, match="grows trees of up to the policy's 65 draft tokens, over the 64 nodes"):
        generate(target, [[1, 2]], drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(65), max_new_tokens=4)
    with pytest.raises(ValueError, match="feeds 66 nodes a row, over the attention's 64-bit ancestor masks"):
        TreeSpec(depth=12, branching=6)
    with pytest.raises(ValueError, match="depth >= 1 and branching >= 1"):
        TreeSpec(depth=0, branching=2)
    with pytest.raises(TypeError, match="tree must be a TreeSpec"):
        ModelDrafter(target, tree=(3, 2))
    with pytest.raises(TypeError, match="tree must be a TreeSpec"):
        PromptLookupDrafter(tree={"depth": 3})


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_trees_inside_cuda_graphs_equal_target_greedy(compile):
    """Tree verification and the drafter's tree expansion replay captured graphs (a static node
    budget), with the fast kernel, and the output is still the target's own greedy decoding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    target = make_model("llama", device="cuda", dtype=torch.float32)  # the cached model's weights, fresh runners
    prompts = random_prompts(6, 96, seed=4)
    expected = [reference("llama", "cuda", torch.float32, tuple(p), None) for p in prompts]
    drafter = ModelDrafter(drafter_model("llama", "cuda", torch.float32), tree=TreeSpec(depth=4, branching=3),
                           cuda_graphs=True, compile=compile)
    out = generate(target, prompts, drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(12),
                   max_new_tokens=MAX_NEW_TOKENS, cuda_graphs=True, compile=compile)
    assert out.sequences == expected
    runner = target.__dict__["_specdec_runners"]["target"]
    assert runner.eager_passes <= 1 and runner.graph_passes >= out.stats.steps  # the prefill at most ran eagerly


def test_a_tree_near_the_end_of_the_drafters_cache_fits():
    """The drafter feeds (depth - 1) * branching nodes past a row (20 here), more than the 8-node
    budget: its cache is sized for them (a prompt 8 short of 256 positions used to overflow it)."""
    target = cached_model("llama", "cpu", torch.float64)
    prompt = [torch.randint(0, 96, (227,), generator=torch.Generator().manual_seed(3)).tolist()]
    drafter = ModelDrafter(drafter_model("llama", "cpu", torch.float64), tree=TreeSpec(depth=6, branching=4))
    out = generate(target, prompt, drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(8), max_new_tokens=20)
    assert out.sequences == [hf_greedy(target, prompt[0], 20)]


class RecordingTreeDrafter(ModelDrafter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parents = []

    def propose(self, batch, num_tokens):
        draft = super().propose(batch, num_tokens)
        full = (num_tokens == num_tokens.max()) & (batch.remaining - 1 >= self.tree.depth)  # not cut by the end
        self.parents.append(draft.parents[torch.from_numpy(full)].cpu())
        return draft


def test_a_sampled_trees_shape_does_not_depend_on_the_draws():
    """Under top-p 0.3 the drafter's q often has fewer tokens than branching, so some children cannot be
    drawn: their slots stay empty instead of going to other candidates, and every kept slot has
    the same parent in every row and step whose depth the end of the output does not cut (the
    shape is static)."""
    from specdec import SamplingParams
    from specdec.sampling import DETACHED

    target = cached_model("llama", "cpu", torch.float64)
    drafter = RecordingTreeDrafter(drafter_model("llama", "cpu", torch.float64), tree=TreeSpec(depth=4, branching=3))
    generate(target, random_prompts(8, 96, seed=6), drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(12),
             max_new_tokens=12, sampling=SamplingParams(temperature=1.0, top_p=0.3))
    parents = torch.cat(drafter.parents)  # [rows over steps, 12]
    detached = parents == DETACHED
    assert detached.any() and not detached.all(dim=0).any()  # some slots emptied, none always
    for slot in range(parents.shape[1]):
        kept = parents[~detached[:, slot], slot]
        assert (kept == kept[0]).all(), f"slot {slot} has parents {kept.unique().tolist()}"


@pytest.mark.parametrize("device,dtype", device_params())
def test_a_sliding_window_model_decodes_chains_and_refuses_trees_past_its_window(device, dtype):
    """Chains through a sliding-window model equal its own greedy decoding (with graphs on CUDA,
    whose captured passes always carry tree masks); a tree on a row longer than the window is a
    clear error (a window counts positions, which a tree's slots do not follow)."""
    window = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, layer_types=None)
    target = make_model("qwen2", device=device, dtype=dtype, **window)
    prompts = random_prompts(3, 96, seed=8, min_len=8, max_len=12)
    graphs = dict(cuda_graphs=True) if device == "cuda" else {}
    out = generate(target, prompts, drafter=ModelDrafter(perturbed_copy(target, 0.1), **graphs), policy=FixedPolicy(3),
                   max_new_tokens=10, **graphs)
    assert out.sequences == [hf_greedy(target, p, 10) for p in prompts]
    tree = ModelDrafter(perturbed_copy(target, 0.1), tree=TreeSpec(depth=3, branching=2), **graphs)
    with pytest.raises(ValueError, match="reaches past this model's sliding window of 6"):
        generate(target, prompts, drafter=tree, verifier=TreeVerifier(), policy=FixedPolicy(4), max_new_tokens=10,
                 **graphs)


class EvenRowsGetTrees(FixedPolicy):
    """Trees for even rows, chains for odd ones, from one tree-growing drafter."""

    def plan(self, batch, num_drafters):
        plan = super().plan(batch, num_drafters)
        plan.trees = np.arange(batch.num_rows) % 2 == 0
        return plan


@pytest.mark.parametrize("kind", ["model tree", "lookup trie"])
def test_a_policy_chooses_a_tree_or_a_chain_per_row(kind):
    target = cached_model("gpt_neox", "cpu", torch.float64)
    prompts = random_prompts(6, 96, seed=9)
    expected = [reference("gpt_neox", "cpu", torch.float64, tuple(p), None) for p in prompts]
    drafter = make_drafter(kind, "gpt_neox", "cpu", torch.float64)
    mixed = generate(target, prompts, drafter=drafter, verifier=TreeVerifier(), policy=EvenRowsGetTrees(6),
                     max_new_tokens=MAX_NEW_TOKENS)
    assert mixed.sequences == expected
    # asked for chains everywhere, a tree-growing drafter drafts exactly what its chain form drafts
    chains = generate(target, prompts, drafter=make_drafter(kind, "gpt_neox", "cpu", torch.float64),
                      verifier=TreeVerifier(), policy=FixedPolicy(6, trees=False), max_new_tokens=MAX_NEW_TOKENS)
    plain_drafter = (ModelDrafter(drafter_model("gpt_neox", "cpu", torch.float64)) if kind == "model tree"
                     else PromptLookupDrafter())
    reference_chains = generate(target, prompts, drafter=plain_drafter, policy=FixedPolicy(6),
                                max_new_tokens=MAX_NEW_TOKENS)
    assert chains.sequences == expected
    assert [r.accepted_by_position for r in chains.stats.requests] == \
        [r.accepted_by_position for r in reference_chains.stats.requests]
    # in the mixed call the odd rows drafted exactly as in the all-chains call; the even rows got
    # trees, never deeper than their spec, where the chains reached depth 6
    tree_rows, chain_rows = mixed.stats.requests[0::2], mixed.stats.requests[1::2]
    assert [r.drafted_by_position for r in chain_rows] == [r.drafted_by_position for r in chains.stats.requests[1::2]]
    depth = drafter.tree.depth
    assert all(sum(r.drafted_by_position[depth:]) == 0 for r in tree_rows)
    assert sum(sum(r.drafted_by_position[depth:]) for r in chains.stats.requests[0::2]) > 0


def test_a_tree_asked_of_a_chain_drafter_is_a_clear_error():
    target = cached_model("llama", "cpu", torch.float64)
    with pytest.raises(ValueError, match="asked for a token tree from a drafter without a TreeSpec"):
        generate(target, [[1, 2, 3]], drafter=ModelDrafter(drafter_model("llama", "cpu", torch.float64)),
                 verifier=TreeVerifier(), policy=FixedPolicy(4, trees=True), max_new_tokens=6)
    with pytest.raises(TypeError, match="FixedPolicy's trees must be True, False or None"):
        FixedPolicy(4, trees="yes")
