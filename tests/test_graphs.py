"""CUDA graphs: output identical to Hugging Face greedy decoding, no capture after the warm-up,
and at most one host synchronisation per decoding step."""

import itertools
import warnings

import numpy as np
import pytest
import torch

from specdec import SamplingParams, generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy, Policy
from specdec.runner import runners_of
from specdec.types import Plan
from specdec.verifiers import DecomposedVerifier, PaddedVerifier, PaddingFreeVerifier, TreeVerifier
from tests.tiny import ARCHS, hf_greedy, make_model, perturbed_copy, random_prompts

pytestmark = pytest.mark.cuda
GRAPHS = dict(attention="fast", cuda_graphs=True)


def drafter_of(kind, target):
    if kind == "model":
        return ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True)
    return PromptLookupDrafter()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_kind", ["model", "lookup"])
@pytest.mark.parametrize("verifier_class", [PaddedVerifier, PaddingFreeVerifier, DecomposedVerifier])
def test_graphs_give_the_target_greedy_output(arch, drafter_kind, verifier_class):
    target = make_model(arch, dtype=torch.float32, device="cuda")
    prompts = random_prompts(8, target.config.vocab_size, seed=4)
    out = generate(target, prompts, drafter=drafter_of(drafter_kind, target), verifier=verifier_class(),
                   policy=FixedPolicy(3), max_new_tokens=24, **GRAPHS)
    assert out.sequences == [hf_greedy(target, p, 24) for p in prompts]


def test_no_capture_after_the_warm_up():
    target = make_model("llama", dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True)
    prompts = random_prompts(8, target.config.vocab_size, seed=6)
    first = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=20, **GRAPHS)
    drafter_role = drafter.runner_role
    target_runner, drafter_runner = runners_of(target)["target"], runners_of(drafter.model)[drafter_role]
    captured = (target_runner.graphs.captures, drafter_runner.graphs.captures)
    # the drafter's: a pass and a greedy feed a bucket (drafters/model.py)
    assert captured == (len(target_runner.graphs.buckets), 2 * len(drafter_runner.graphs.buckets))
    again = generate(target, prompts[::-1], drafter=drafter, policy=FixedPolicy(3), max_new_tokens=20, **GRAPHS)
    assert runners_of(target)["target"] is target_runner and runners_of(drafter.model)[drafter_role] is drafter_runner
    assert (target_runner.graphs.captures, drafter_runner.graphs.captures) == captured
    assert target_runner.prefill_graph.captures == 1  # the prompts' graph, once (prefill.py)
    assert again.sequences == first.sequences[::-1]  # packed the other way round, the prompts' passes too


@pytest.mark.parametrize("drafter_kind", ["model", "lookup", "model tree", "sampled model tree"])
def test_one_synchronisation_per_step(drafter_kind):
    target = make_model("qwen2", dtype=torch.float32, device="cuda")
    sampling = SamplingParams(temperature=0.8) if drafter_kind.startswith("sampled") else SamplingParams()
    if drafter_kind.endswith("tree"):  # a token tree's expansion, verification, walk and compaction
        drafter = ModelDrafter(perturbed_copy(target, 0.1), tree=TreeSpec(depth=3, branching=3), **GRAPHS)
        kwargs = dict(drafter=drafter, verifier=TreeVerifier(), policy=FixedPolicy(8), sampling=sampling)
    else:
        kwargs = dict(drafter=drafter_of(drafter_kind, target), policy=FixedPolicy(3))
    prompts = random_prompts(8, target.config.vocab_size, seed=7, min_len=2, max_len=2)  # graph-sized prefills
    kwargs.update(max_new_tokens=20, **GRAPHS)
    generate(target, prompts, **kwargs)  # warm-up: captures, kernel compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(target, prompts, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    # one a step, and one after the prefill (so that prefill_time_s holds its device work)
    assert len(syncs) <= out.stats.steps + 1, [str(w.message)[:200] for w in syncs[:5]]


def test_the_prefills_device_work_ends_inside_prefill_time(monkeypatch):
    """Decode throughput is (wall - prefill) time: a prefill left running on the GPU would be
    charged to the first step instead, so generate() waits for it before its first plan."""
    from specdec.engine import Engine

    events, real_prefill, real_synchronize = [], Engine._prefill, torch.cuda.synchronize
    monkeypatch.setattr(Engine, "_prefill", lambda *a: (real_prefill(*a), events.append("prefill"))[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (events.append("synchronize"), real_synchronize(*a))[1])
    real_stream_synchronize = torch.cuda.Stream.synchronize  # the engine waits for its own stream only
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: (events.append("synchronize"), real_stream_synchronize(self))[1])

    class Recording(FixedPolicy):
        def plan(self, batch, num_drafters):
            events.append("plan")
            return super().plan(batch, num_drafters)

    target = make_model("llama", dtype=torch.float32, device="cuda")
    generate(target, random_prompts(4, target.config.vocab_size, seed=2), policy=Recording(0), max_new_tokens=3,
             **GRAPHS)
    after_prefill = events[events.index("prefill"):]
    assert after_prefill.index("synchronize") < after_prefill.index("plan"), events


class PausingPolicy(Policy):
    """Steps 0-5: every row drafts 3 tokens in even steps, alternate rows in odd ones; steps
    6-17: the whole batch drafts every third step only (so every row falls 3-4 tokens behind);
    then plain decoding."""

    max_draft_tokens = 3

    def __init__(self):
        self.step = 0

    def plan(self, batch, num_drafters):
        step, self.step = self.step, self.step + 1
        rows = np.arange(batch.num_rows)
        if step < 6:
            k = np.full(batch.num_rows, 3) if step % 2 == 0 else np.where(rows % 2 == (step // 2) % 2, 3, 0)
        else:
            k = np.full(batch.num_rows, 3 if step < 18 and step % 3 == 0 else 0)
        return Plan(drafter_index=np.zeros(batch.num_rows, dtype=np.int64), num_draft_tokens=k)


def test_rows_that_pause_drafting_stay_in_the_drafter_graphs():
    """Rows that skip drafting for a step, or a whole batch that skips two, are caught up in
    graphed passes: the drafter's only eager pass is the prompts' (none when they fit a graph)."""
    target = make_model("llama", dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True)
    prompts = random_prompts(8, target.config.vocab_size, seed=5)
    out = generate(target, prompts, drafter=drafter, policy=PausingPolicy(), max_new_tokens=40, **GRAPHS)
    assert out.sequences == [hf_greedy(target, p, 40) for p in prompts]
    runner = runners_of(drafter.model)[drafter.runner_role]
    assert runner.eager_passes <= 1 and runner.graph_passes > 10


def test_a_replaced_runner_is_released_at_once():
    """Growing a call replaces the model's runner; the old one drops its graphs and cache
    immediately, so no graph pool is freed later in the middle of another capture."""
    from specdec.runner import runner_for

    model = make_model("llama", dtype=torch.float32, device="cuda")
    small = runner_for(model, role="drafter", max_rows=1, max_len=64, attention="fast", graph_shape=(2, 2))
    assert small.graphs.captures > 0
    large = runner_for(model, role="drafter", max_rows=8, max_len=64, attention="fast", graph_shape=(2, 16))
    assert large is not small and small.graphs is None and small.cache.max_rows == 1
    assert runner_for(model, role="drafter", max_rows=4, max_len=32, attention="fast", graph_shape=(2, 8)) is large


def test_compiled_graphs_give_the_target_greedy_output_and_never_recompile():
    """torch.compile inside the graphs: the same greedy output as Hugging Face (float32), and a
    second call neither compiles nor captures anything."""
    from torch._dynamo.utils import counters

    target = make_model("llama", dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True, compile=True)
    prompts = random_prompts(8, target.config.vocab_size, seed=9)
    kwargs = dict(drafter=drafter, policy=FixedPolicy(3), max_new_tokens=24, compile=True, **GRAPHS)
    first = generate(target, prompts, **kwargs)
    assert first.sequences == [hf_greedy(target, p, 24) for p in prompts]
    target_runner = runners_of(target)["target"]
    assert target_runner.graphs.compiled
    compiled_graphs, captures = counters["stats"]["unique_graphs"], target_runner.graphs.captures
    assert compiled_graphs > 0
    again = generate(target, prompts[::-1], **kwargs)
    assert again.sequences == first.sequences[::-1]
    assert counters["stats"]["unique_graphs"] == compiled_graphs and target_runner.graphs.captures == captures


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("min_share", [512, 128], ids=["unsplit", "split"])
def test_a_pass_gives_bitwise_the_same_logits_in_every_bucket(compile, min_share, monkeypatch):
    """The invariant that keeps bf16 verification lossless: one pass replayed in each bucket that
    holds it gives bitwise the same logits, compiled too (on an H200 the largest bucket's own
    compiled variant changed 3.7% of them and broke near-ties: graphs.py's docstring), with the
    keys read whole or in split-KV shares (a larger bucket has filler tokens in no group)."""
    from specdec import triton_attention
    from specdec.runner import runner_for

    monkeypatch.setattr(triton_attention, "MIN_SHARE", min_share)  # 512 keys: unsplit at 512, split at 128
    model = make_model("llama", vocab_size=512, hidden=128, dtype=torch.bfloat16, device="cuda", seed=3,
                       max_positions=512)
    runner = runner_for(model, role="target", max_rows=16, max_len=512, attention="fast", graph_shape=(9, 300),
                        compile=compile)
    graphs = runner.graphs
    assert (graphs.buckets[0] == 2) == compile  # compiled: no size-1 bucket
    if torch.cuda.get_device_properties(0).multi_processor_count >= 64:  # 32 programs: at least 2 shares
        assert (runner.kv_splits > 1) == (min_share == 128)
    # rows of one key block (the other shares see no key) and of five (every share sees some)
    for start, rows, tokens_per_row in itertools.product((40, 300), (1, 16), (1, 7, 9)):
        counts = np.full(rows, tokens_per_row, dtype=np.int64)
        num_tokens = int(counts.sum())
        starts = np.full(rows, start, dtype=np.int64)
        generator = torch.Generator().manual_seed(rows * 10 + tokens_per_row)
        input_ids = torch.randint(0, 512, (num_tokens,), generator=generator).cuda()
        replayed = {}
        with runner.attached():
            for bucket in (b for b in graphs.buckets if b >= num_tokens):
                replayed[bucket] = graphs.run(input_ids, np.arange(rows), starts, counts, bucket=bucket).clone()  # [N, V]
        assert len(replayed) >= 2  # buckets up to 512
        first = next(iter(replayed.values()))
        differing = {bucket: float(logits.ne(first).float().mean()) for bucket, logits in replayed.items()}
        assert all(fraction == 0 for fraction in differing.values()), (rows, tokens_per_row, differing)


def test_compiled_capture_makes_one_variant_for_every_bucket():
    """Structural check of the same property: capturing every bucket of a compiled runner makes as
    many Dynamo graphs as capturing one bucket does (one compiled variant serves them all; traced
    largest first, Dynamo made a variant for the largest bucket alone). Passed on an H200 in runs
    25 and 26 (BENCHMARKS.md)."""
    from torch._dynamo.utils import counters

    from specdec.runner import ModelRunner

    model = make_model("llama", vocab_size=512, hidden=128, dtype=torch.bfloat16, device="cuda", seed=4)

    def graphs_made(max_tokens: int) -> tuple[int, list[int]]:
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        runner = ModelRunner(model, max_rows=16, max_len=64, attention="fast")
        runner.enable_graphs(9, max_tokens, compile=True)
        buckets = list(runner.graphs.buckets)
        runner.release()
        return counters["stats"]["unique_graphs"] - before, buckets

    every, buckets = graphs_made(300)
    one, single = graphs_made(2)
    assert single == [2] and buckets == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert one >= 1, "nothing was compiled: the recompile limit may have been reached (Dynamo then runs eagerly)"
    assert every == one, f"{every} Dynamo graphs for {len(buckets)} buckets, {one} for one bucket"


def test_requests_with_their_own_sampling_under_graphs():
    """Greedy, sampled and penalised requests in one graphed engine: each greedy request is the
    target's greedy output; every request is the same when the whole trace is served again (the
    per-row parameters are eager tensors beside the captured passes, never captured values)."""
    from specdec import Engine

    target = make_model("llama", dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast", cuda_graphs=True)
    prompts = random_prompts(8, target.config.vocab_size, seed=6)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.2, top_k=7),
              SamplingParams(repetition_penalty=1.3)]

    def serve():
        with Engine(target, drafter, policy=FixedPolicy(3), max_rows=3, max_len=64, eos_token_id=[],
                    **GRAPHS) as engine:
            ids = [engine.add_request(p, 20, params[i % 4], seed=i) for i, p in enumerate(prompts)]
            done = {}
            while engine.has_work():
                done.update((d.id, d.token_ids) for d in engine.step())
        return [done[i] for i in ids]

    first = serve()
    assert first == serve()
    for i, prompt in enumerate(prompts):
        if i % 4 == 0:
            assert first[i] == hf_greedy(target, prompt, 20)
    # the sampled requests did sample (a random tiny model's distributions are flat)
    assert any(first[i] != hf_greedy(target, prompts[i], 20) for i in (1, 2, 5, 6))


def test_a_prompts_cache_is_bitwise_the_same_whatever_is_admitted_beside_it():
    """bf16, a 12-layer target: after admission, each prompt's keys and values are the same bits
    whether it was admitted alone (one replay of the prefill graph) or packed with fifteen others
    (several replays, some prompts cut across two, at other offsets of a pass), into an engine of
    plain decoding or of k = 5, and a prompt admitted with long ones (many replays) too: a
    request's output can then not depend on what arrives beside it, near-ties included."""
    from specdec import Engine

    target = make_model("llama", vocab_size=8192, num_layers=12, hidden=512, dtype=torch.bfloat16, device="cuda",
                        max_positions=1024)
    prompts = random_prompts(16, 8192, seed=4, min_len=60, max_len=127)
    long_ones = random_prompts(15, 8192, seed=5, min_len=300, max_len=400)  # up to 600 tokens: even ones repeat half

    def caches(policy, drafter, admitted):
        """[request][layer] its cache after admission (request i holds row i)."""
        with Engine(target, drafter, policy=policy, max_rows=16, max_len=1024, max_new_tokens=64, **GRAPHS) as engine:
            for prompt in admitted:
                engine.add_request(prompt, max_new_tokens=8)
            eager = engine.runner.eager_passes
            engine.admit()
            assert engine.runner.eager_passes == eager  # replays only
            cache = engine.runner.cache
            return [[torch.cat([cache.keys[j][row, :, :len(p) - 1], cache.values[j][row, :, :len(p) - 1]]).clone()
                     for j in range(len(cache.keys))] for row, p in enumerate(admitted)]

    alone = [caches(FixedPolicy(0), None, [p])[0] for p in prompts]
    packed = {"plain": caches(FixedPolicy(0), None, prompts),
              "k = 5": caches(FixedPolicy(5), drafter_of("model", target), prompts)}
    differ = {f"{name}, prompt {i}": [j for j, (a, b) in enumerate(zip(alone[i], got[i])) if not torch.equal(a, b)]
              for name, got in packed.items() for i in range(len(prompts))}
    with_long = caches(FixedPolicy(0), None, prompts[:1] + long_ones)[0]
    differ["beside long prompts, prompt 0"] = [j for j, (a, b) in enumerate(zip(alone[0], with_long))
                                               if not torch.equal(a, b)]
    assert not any(differ.values()), f"layers whose cache differs from the prompt's alone: " \
        f"{ {k: v for k, v in differ.items() if v} }"


def test_decomposed_pieces_replay_from_the_graphs_and_stay_exact():
    """Ragged per-row lengths cut into pieces (more groups than rows) still fit the graphs the
    engine captured for a verifier that cuts rows: no eager pass after the warm-up."""
    from tests.verifiers.test_verifiers import RaggedLengths

    target = make_model("llama", dtype=torch.float32, device="cuda")
    prompts = random_prompts(6, target.config.vocab_size, seed=12)
    policy = type("Ragged", (RaggedLengths, Policy), {})
    kwargs = dict(drafter=drafter_of("model", target), verifier=DecomposedVerifier(0.0), max_new_tokens=20, **GRAPHS)
    generate(target, prompts, policy=policy(), **kwargs)  # warm-up: runners, graphs
    runner = runners_of(target)["target"]
    eager = runner.eager_passes
    out = generate(target, prompts, policy=policy(), **kwargs)
    assert out.sequences == [hf_greedy(target, p, 20) for p in prompts]
    assert out.stats.padding_fraction < 0.2 and runner.eager_passes == eager
