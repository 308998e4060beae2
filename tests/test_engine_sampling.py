"""Per-request sampling parameters in the Engine (issue 34, point 1): requests with different
SamplingParams (greedy, temperatures, top-k, top-p, repetition penalty) share each step's draft
and verify passes, and each request's output is the one it gets alone.

- Exactness (CPU, float32): under staggered arrivals, every request's tokens, and the draft
  tokens accepted for it, are bit-identical to generate() on that request alone with its own
  params and seed (for greedy params: the target's own greedy output), for the model drafter,
  prompt lookup, no drafter, token trees with sampled and with deterministic children and a
  prompt-lookup trie (TreeVerifier), the self-speculative drafter and SPIRe. A spy on RowSampling.of checks that the mixed path really ran.
- Distribution: rows at temperature 0.7 and at top-k 3 (temperature 1.2), decoded in one batch
  beside greedy rows and rows at temperature 1.5 with a repetition penalty, follow the target's
  processed joint of the first two tokens under their own params (chi-square, threshold stated
  in that test's docstring); greedy rows all give the greedy output.
- Per-row rules against their uniform versions: process_logits, chain_verdict (with log-
  probabilities) and the repetition penalty on a RowSampling give each row bit-for-bit what its
  own SamplingParams gives.
- Bad input: clear errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import Engine, SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter, SelfSpeculativeDrafter, SpireDraft, SPIReDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy
from specdec.sampling import chain_verdict, process_logits
from specdec.types import RowSampling
from specdec.verifiers import TreeVerifier
from tests.test_engine import run_schedule
from tests.test_generate_sampling import joint_pvalue
from tests.tiny import hf_greedy, make_model, perturbed_copy, random_prompts, shifted

VOCAB = 96
GREEDY = SamplingParams()
ENGINE_DEFAULT = SamplingParams(temperature=0.8)
PARAMS = [  # request i takes PARAMS[i % len(PARAMS)]; None: the engine's
    GREEDY,
    SamplingParams(temperature=0.9, top_p=0.9),
    None,
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(repetition_penalty=1.3),  # greedy with a penalty
    SamplingParams(temperature=0.7, top_k=12, top_p=0.8, repetition_penalty=1.2),
]


@pytest.fixture(scope="module")
def model():
    return make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float32)


def drafter_of(kind, model):
    return {"model": lambda: ModelDrafter(perturbed_copy(model, 0.3)), "lookup": PromptLookupDrafter,
            "tree": lambda: ModelDrafter(perturbed_copy(model, 0.3), tree=TreeSpec(depth=3, branching=2, sampled=False)),
            "sampled tree": lambda: ModelDrafter(perturbed_copy(model, 0.3), tree=TreeSpec(depth=3, branching=2)),
            "trie": lambda: PromptLookupDrafter(tree=TreeSpec(depth=3, branching=2)),
            "self": lambda: SelfSpeculativeDrafter(sink=1, window=3),
            "spire": lambda: SPIReDrafter(SpireDraft.from_target(model, window=3)),
            "none": lambda: None}[kind]()


@pytest.fixture
def mixed_steps(monkeypatch):
    """How many RowSamplings were built: the mixed path ran when > 0."""
    built = []
    original = RowSampling.of.__func__

    def spy(cls, rows, device):
        built.append(len(rows))
        return original(cls, rows, device)

    monkeypatch.setattr(RowSampling, "of", classmethod(spy))
    return built


@pytest.mark.parametrize("kind,schedule_seed", [("model", 0), ("model", 1), ("lookup", 2), ("none", 3), ("tree", 4),
                                                ("sampled tree", 8),
                                                ("trie", 5), ("self", 6), ("spire", 7)])
def test_each_request_gets_what_it_gets_alone_whatever_params_run_beside_it(model, mixed_steps, kind, schedule_seed):
    rng = np.random.default_rng(schedule_seed)
    prompts = random_prompts(9, VOCAB, seed=30 + schedule_seed, min_len=2, max_len=14)
    # long enough for the target's own output to repeat itself, which prompt lookup then proposes
    budgets = rng.integers(4, 13, size=len(prompts)) + (12 if kind in ("lookup", "trie") else 0)
    budgets = budgets.tolist()
    seeds = rng.integers(0, 2**31, size=len(prompts)).tolist()
    arrivals = np.sort(rng.integers(0, 8, size=len(prompts))).tolist()
    params = [PARAMS[(i + schedule_seed) % len(PARAMS)] for i in range(len(prompts))]
    policy = FixedPolicy(0 if kind == "none" else 4 if kind in ("tree", "sampled tree", "trie") else 3)
    verifier = TreeVerifier() if kind in ("tree", "sampled tree", "trie") else None
    with Engine(model, drafter_of(kind, model), verifier, policy=policy, max_rows=3, max_len=64,
                sampling=ENGINE_DEFAULT, eos_token_id=[]) as engine:
        finished, ids = run_schedule(engine, list(zip(prompts, budgets, seeds, params)), arrivals)
    assert mixed_steps, "no step had rows with different sampling parameters: the test checks nothing"
    accepted = 0
    for prompt, budget, seed, own, request_id in zip(prompts, budgets, seeds, params, ids):
        done = finished[request_id]
        own = ENGINE_DEFAULT if own is None else own
        alone = generate(model, [prompt], drafter=drafter_of(kind, model), verifier=verifier, policy=policy,
                         max_new_tokens=budget, sampling=own, seed=[seed], eos_token_id=[])
        assert done.token_ids == alone.sequences[0], own
        assert done.stats.accepted == alone.stats.requests[0].accepted, own  # the same drafts as alone
        if own == GREEDY:
            assert done.token_ids == hf_greedy(model, prompt, budget)
        accepted += done.stats.accepted
    if kind != "none":
        assert accepted > 0  # drafts were kept, so the acceptance rule's per-row branches mattered


def test_sampled_output_does_not_depend_on_the_neighbours_params(model):
    """The same requests (seeds and params) beside greedy rows and beside other sampled rows:
    bit-identical outputs; a different temperature for the request itself changes them."""
    prompts = random_prompts(4, VOCAB, seed=50, min_len=3)
    mine = SamplingParams(temperature=1.1, top_k=20)

    def run(neighbour, own=mine):
        with Engine(model, ModelDrafter(perturbed_copy(model, 0.3)), policy=FixedPolicy(3), max_rows=4,
                    max_len=40, eos_token_id=[]) as engine:
            ids = [engine.add_request(p, 12, own if i % 2 == 0 else neighbour, seed=100 + i)
                   for i, p in enumerate(prompts)]
            finished = {}
            while engine.has_work():
                finished.update((done.id, done) for done in engine.step())
        return [finished[ids[i]].token_ids for i in (0, 2)]

    beside_greedy = run(GREEDY)
    assert beside_greedy == run(SamplingParams(temperature=0.5, top_p=0.7, repetition_penalty=1.4))
    assert beside_greedy != run(GREEDY, own=SamplingParams(temperature=1.6, top_k=20))


# --- the distribution -------------------------------------------------------------------------
SMALL_VOCAB = 8
PROMPT = [1, 2, 5, 1, 2]
N = 6_000
ALPHA = 1e-3
TEMPERATURE = SamplingParams(temperature=0.7)
TOP_K = SamplingParams(temperature=1.2, top_k=3)
HOT_PENALISED = SamplingParams(temperature=1.5, repetition_penalty=1.5)


def joint_first_two(model, params: SamplingParams) -> np.ndarray:
    """[V, V] exact probabilities of the first two tokens under ``params`` (no penalty)."""
    with torch.no_grad():
        first = process_logits(model(torch.tensor([PROMPT])).logits[0, -1], params)  # [V]
        second = process_logits(model(torch.tensor([PROMPT + [t] for t in range(SMALL_VOCAB)])).logits[:, -1], params)
    return (first[:, None] * second).double().numpy()


def test_rows_of_each_params_follow_their_own_processed_distribution():
    """With a model drafter (draft probabilities of each row's own params; prompt lookup's point
    masses are covered by the exactness test against the uniform rule, whose own distribution
    tests are in test_generate_sampling.py), N = 6,000 requests at temperature 0.7 and N at
    top-k 3 (temperature 1.2) share one batch
    with N / 4 greedy rows and N / 4 rows at temperature 1.5 with a repetition penalty of 1.5
    (requests interleaved; the engine's default is greedy). V = 8, so the exact joint of the
    first two tokens is enumerated from the model. Chi-square over the 64 cells (expected counts
    below 5 pooled) for each group against its own joint: p > 1e-3. Negative controls: each
    group's counts must be rejected (p < 1e-3) against the other group's joint, the
    joint at plain temperature 1.0 (no cut), and its own joint with 0.05 moved between its
    two likeliest cells."""
    target = make_model("llama", vocab_size=SMALL_VOCAB, seed=4, dtype=torch.float32)
    drafter = ModelDrafter(perturbed_copy(target, scale=0.6, seed=2))
    groups = [TEMPERATURE, TOP_K] * 4 + [GREEDY, HOT_PENALISED]  # N each of the first two, N / 4 of the others
    plan = [groups[i % len(groups)] for i in range(len(groups) * N // 4)]
    with Engine(target, drafter, policy=FixedPolicy(2), max_rows=len(plan), max_len=len(PROMPT) + 4,
                max_new_tokens=4, eos_token_id=[]) as engine:
        ids = [engine.add_request(PROMPT, 4, params, seed=i) for i, params in enumerate(plan)]
        finished = {}
        while engine.has_work():
            finished.update((done.id, done) for done in engine.step())
        acceptance = engine.recorder.finish(wall_time_s=1.0, prefill_time_s=0.0).acceptance_rate
    assert 0.0 < acceptance < 1.0  # both branches of the rule ran
    outputs = {params: [finished[i].token_ids for i, p in zip(ids, plan) if p == params] for params in groups}
    assert len(outputs[TEMPERATURE]) == len(outputs[TOP_K]) == N
    greedy_output = hf_greedy(target, PROMPT, 4)
    assert all(s == greedy_output for s in outputs[GREEDY])
    joints = {TEMPERATURE: joint_first_two(target, TEMPERATURE), TOP_K: joint_first_two(target, TOP_K)}
    for params, other in ((TEMPERATURE, TOP_K), (TOP_K, TEMPERATURE)):
        first_two = [s[:2] for s in outputs[params]]
        assert joint_pvalue(first_two, joints[params]) > ALPHA, params
        assert joint_pvalue(first_two, joints[other]) < ALPHA, params
        assert joint_pvalue(first_two, joint_first_two(target, SamplingParams(temperature=1.0))) < ALPHA, params
        assert joint_pvalue(first_two, shifted(joints[params])) < ALPHA, params


# --- the per-row rules against their uniform versions -------------------------------------------
ROW_PARAMS = [GREEDY, SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
              SamplingParams(temperature=0.9, top_p=0.6), SamplingParams(temperature=1.0, top_k=7, top_p=0.8),
              SamplingParams(temperature=0.5, top_k=1000, top_p=1.0)]


def row_sampling(params: list[SamplingParams]) -> RowSampling:
    return RowSampling.of(np.array([RowSampling.host_rows(p) for p in params]), "cpu")


def test_process_logits_per_row_is_each_rows_own_bit_for_bit():
    logits = torch.randn(len(ROW_PARAMS), 3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    mixed = process_logits(logits, row_sampling(ROW_PARAMS))  # [R, 3, V]
    for row, params in enumerate(ROW_PARAMS):
        if params.greedy:  # the point mass on the argmax of the logits themselves
            expected = torch.nn.functional.one_hot(logits[row].argmax(dim=-1), 50).float()
        else:
            expected = process_logits(logits[row], params)
        assert torch.equal(mixed[row], expected), params


def test_chain_verdict_per_row_is_each_rows_own_bit_for_bit():
    """A greedy row gets the greedy rule's verdict through the sampled rule; sampled rows the
    uniform rule's, with and without draft probabilities, log-probabilities included."""
    generator = torch.Generator().manual_seed(1)
    num_rows, width, vocab = len(ROW_PARAMS), 4, 12
    target_logits = torch.randn(num_rows, width + 1, vocab, generator=generator) * 3
    draft_probs = torch.randn(num_rows, width, vocab, generator=generator).softmax(dim=-1)
    # drafts that often match the target's argmax, so that acceptances and rejections both occur
    argmax = target_logits[:, :width].argmax(dim=-1)
    random_ids = torch.randint(0, vocab, (num_rows, width), generator=generator)
    draft_ids = torch.where(torch.rand(num_rows, width, generator=generator) < 0.6, argmax, random_ids)
    num_draft = torch.tensor([4, 3, 4, 2, 4, 1])
    seeds, positions = torch.arange(num_rows) * 7 + 3, torch.arange(num_rows) + 10
    accepted = 0
    for probs in (None, draft_probs):
        mixed = chain_verdict(draft_ids, num_draft, target_logits, probs, row_sampling(ROW_PARAMS), seeds, positions,
                              logprobs=True)
        for row, params in enumerate(ROW_PARAMS):
            pick = slice(row, row + 1)
            alone = chain_verdict(draft_ids[pick], num_draft[pick], target_logits[pick],
                                  None if probs is None else probs[pick], params, seeds[pick], positions[pick],
                                  logprobs=True)
            assert torch.equal(mixed.token_ids[row], alone.token_ids[0]), params
            assert torch.equal(mixed.num_accepted[row], alone.num_accepted[0]), params
            assert torch.equal(mixed.logprobs[row], alone.logprobs[0]), params
            accepted += int(alone.num_accepted[0])
    assert accepted > 0


def test_repetition_penalty_per_row_is_each_rows_own_bit_for_bit():
    from specdec.batch import BatchState
    from specdec.token_rules import apply_token_rules

    penalties = [None, 1.3, 0.8, 1.0]
    prompts = [np.array([1, 2, 3]), np.array([4, 4, 5]), np.array([0, 6]), np.array([7, 1])]
    batch = BatchState(prompts, 4, np.arange(4), np.zeros(0, dtype=np.int64))
    params = [SamplingParams(temperature=1.0, repetition_penalty=p) for p in penalties]
    logits = torch.randn(4, 2, 10, generator=torch.Generator().manual_seed(2))
    extra = torch.tensor([[8, 9], [8, 1], [2, 2], [3, 4]])
    rows = np.arange(4)
    mixed = apply_token_rules(logits, batch, rows, extra, 0, row_sampling(params))
    for row, own in enumerate(params):
        alone = apply_token_rules(logits[row : row + 1], batch, rows[row : row + 1], extra[row : row + 1], 0, own)
        assert torch.equal(mixed[row], alone[0]), own
    assert not torch.equal(mixed[1], logits[1])  # the penalty did something


# --- bad input --------------------------------------------------------------------------------
def test_bad_sampling_gets_a_clear_error(model):
    with Engine(model, max_rows=1, max_len=20, policy=FixedPolicy(0)) as engine:
        with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
            engine.add_request([1, 2], 4, {"temperature": 0.5})
        with pytest.raises(TypeError, match="seed is its own argument"):
            engine.add_request([1, 2], 4, 7)  # the seed where the sampling now goes
        with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
            engine.add_request([1, 2], 4, np.array([0.5, 1.0]))  # not compared with the engine's first
        assert engine.num_waiting == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_per_row_division_rounds_as_one_python_float_does_on_the_device(device):
    """The uniform path divides by a Python float (temperature, repetition penalty); on CUDA ATen
    computes that as x * (1 / b) with a float32 reciprocal, which differs from x / b in the last
    bit for about a quarter of inputs. RowSampling.divide must give each row exactly that."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    values = [1.3, 0.7, 1.5, 0.9, 2.0 / 3.0]
    params = [SamplingParams(temperature=t, repetition_penalty=1 / t) for t in values]
    rows = RowSampling.of(np.array([RowSampling.host_rows(p) for p in params]), device)
    x = torch.randn(len(values), 4096, generator=torch.Generator().manual_seed(0)).to(device) * 8  # [R, V]
    by_temperature = rows.divide(x, rows.temperature, rows.inv_temperature)
    by_penalty = rows.divide(x, rows.penalty, rows.inv_penalty)
    for i, p in enumerate(params):
        assert torch.equal(by_temperature[i], x[i] / p.temperature)
        assert torch.equal(by_penalty[i], x[i] / p.repetition_penalty)
    if device == "cuda":  # the check has teeth: true division differs somewhere
        assert not torch.equal(x / rows.per_row(rows.temperature, x), by_temperature)


def test_a_top_k_beyond_int64_cuts_nothing_beside_rows_that_cut(model):
    prompts = random_prompts(2, VOCAB, seed=41, min_len=3, max_len=6)
    huge, small = SamplingParams(temperature=0.9, top_k=2**64), SamplingParams(temperature=0.9, top_k=3)
    with Engine(model, policy=FixedPolicy(0), max_rows=2, max_len=32, eos_token_id=[]) as engine:
        ids = [engine.add_request(p, 6, s, seed=i) for i, (p, s) in enumerate(zip(prompts, (huge, small)))]
        done = {}
        while engine.has_work():
            done.update((d.id, d.token_ids) for d in engine.step())
    for i, (p, s) in enumerate(zip(prompts, (huge, small))):
        assert done[ids[i]] == generate(model, [p], max_new_tokens=6, sampling=s, seed=[i], eos_token_id=[]).sequences[0]
