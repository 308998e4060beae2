"""The greedy feeds' host logic on the CPU (graphs.GraphedForward.run_greedy_feeds, ModelRunner.
greedy_chains, ModelDrafter._greedy_chains): a GraphedForward whose "graphs" replay their pass
eagerly, reading the pass back from the static buffers (rows, positions, RoPE positions, input
ids, groups), so every buffer the feed moves on between replays is what the next pass runs. A
drafter over them proposes, step after step of random acceptances, exactly what it proposes pass
by pass (GREEDY_FEEDS off) over the same buffers, and keeps the same cache lengths; what the
CUDA graphs add (capture, kernels) is left to tests/test_greedy_feeds.py."""

import numpy as np
import pytest
import torch

import specdec.drafters.model as model_drafter
from specdec import SamplingParams
from specdec.attention_metadata import METADATA_KWARG
from specdec.batch import BatchState
from specdec.drafters import ModelDrafter
from specdec.graphs import GraphedForward
from specdec.runner import PackedLayout, packed_metadata
from specdec.types import HostVerdict
from tests.tiny import hf_greedy, make_model, random_prompts


class _Replay:
    def __init__(self, run):
        self.replay = run


class EagerGraphs(GraphedForward):
    """Graphs of a CPU runner: a replay runs the bucket's pass eagerly (reference attention) as
    the static buffers describe it, into the bucket's static logits (the filler tokens' rows are
    left zero)."""

    def capture(self) -> None:
        vocab = self.runner.vocab_size
        for bucket in self.buckets:
            logits = torch.zeros(bucket, vocab, dtype=self.runner.model.dtype)
            self.graphs[bucket] = (_Replay(lambda b=bucket, out=logits: out.copy_(self._run_model(b))), logits)
            self.hidden[bucket] = {}
            self.captures += 1

    def capture_greedy_feeds(self) -> None:
        if self.greedy_feeds:
            return
        for bucket in self.buckets:
            self.greedy_feeds[bucket] = _Replay(lambda b=bucket: self._greedy_feed(b))
            self.captures += 1

    def _run_model(self, bucket: int) -> torch.Tensor:
        runner = self.runner
        groups = self._groups_for(bucket)
        rows = self.group_rows[:groups].numpy()
        first = self.group_first[:groups].numpy()
        counts = self.group_counts[:groups].numpy()
        positions = self.positions[:bucket].numpy()
        token_rows = self.token_rows[:bucket].numpy()
        used = (counts > 0) & (rows != runner.cache.max_rows - 1)  # real groups (the filler's touch its scratch row only)
        rows, first, counts = rows[used], first[used], counts[used]
        num_tokens = int(counts.sum())
        assert np.array_equal(first, np.cumsum(counts) - counts), "groups are packed in order"
        starts = positions[first]
        for row, start, begin, count in zip(rows, starts, first, counts):
            assert np.array_equal(positions[begin : begin + count], start + np.arange(count)), "consecutive positions"
            assert (token_rows[begin : begin + count] == row).all(), "a group's tokens sit in its row"
        assert (starts + counts <= runner.cache.max_len).all(), "every position fits the cache"
        layout = PackedLayout(rows=rows, starts=starts, counts=counts)
        meta = packed_metadata(layout, runner.cache, runner.device, runner.backend, kv_splits=runner.kv_splits,
                               role=runner.role)
        position_ids = self.rope_positions[:num_tokens]  # what RoPE sees: moved on by the feed too
        if runner.max_position_id is not None:
            position_ids = position_ids.clamp(max=runner.max_position_id - 1)
        output = runner.model(input_ids=self.input_ids[None, :num_tokens], position_ids=position_ids[None],
                              use_cache=False, logits_to_keep=0, **{METADATA_KWARG: meta})
        logits = torch.zeros(bucket, runner.vocab_size, dtype=output.logits.dtype)
        logits[:num_tokens] = output.logits[0]
        return logits


def _drafter_over_eager_graphs(model, batch, max_draft_tokens):
    drafter = ModelDrafter(model)
    drafter.start(batch, SamplingParams(), torch.device("cpu"), max_draft_tokens)
    runner = drafter._runner
    runner.graphs = EagerGraphs(runner, max_group_tokens=2, max_tokens=2 * batch.num_rows)
    runner.graphs.capture()
    runner.graphs.capture_greedy_feeds()
    return drafter


def _run(model, reference, prompts, plans, accept_seed, feeds, monkeypatch, max_new_tokens=40):
    """Drafts of every step (host arrays), the drafter cache's lengths after each, feed replays."""
    monkeypatch.setattr(model_drafter, "GREEDY_FEEDS", feeds)
    rows = len(prompts)
    batch = BatchState([np.array(p) for p in prompts], max_new_tokens, np.arange(rows), np.zeros(0, dtype=np.int64))
    drafter = _drafter_over_eager_graphs(model, batch, max_draft_tokens=int(max(p.max() for p in plans)))
    generator = np.random.default_rng(accept_seed)
    feeds_run = []
    original = drafter._runner.graphs.run_greedy_feeds

    def counted(*args):
        feeds_run.append(args[-1])
        return original(*args)

    drafter._runner.graphs.run_greedy_feeds = counted
    drafts, lengths = [], []
    try:
        for wanted in plans:
            wanted = np.minimum(wanted, np.maximum(batch.remaining - 1, 0))
            draft = drafter.propose(batch, wanted)
            drafts.append(draft.token_ids.numpy().copy())
            lengths.append(drafter._runner.cache.lengths[:rows].copy())
            for r in range(rows):  # each row's chain is the drafter's own greedy continuation
                k = int(wanted[r])
                committed = batch.token_ids[r, : batch.lengths[r]].tolist()
                assert draft.token_ids[r, :k].tolist() == (hf_greedy(reference, committed, k) if k else [])
            accepted = np.array([generator.integers(0, k + 1) for k in wanted])
            emitted = np.full((rows, drafts[-1].shape[1] + 1), -1)
            for r in range(rows):
                emitted[r, : accepted[r]] = draft.token_ids[r, : accepted[r]].numpy()
                emitted[r, accepted[r]] = generator.integers(0, model.config.vocab_size)
            lengths_before = batch.lengths.copy()
            batch.commit(HostVerdict(token_ids=emitted, num_emitted=accepted + 1, num_accepted=accepted))
            drafter.commit(lengths_before, accepted)
    finally:
        drafter._runner.graphs = None
        drafter.finish()
    return drafts, lengths, feeds_run


def _plans(rows: int, steps: int, seed: int, uneven: bool) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    plans = []
    for step in range(steps):
        if uneven and step % 3 == 2:
            plans.append(generator.integers(0, 5, size=rows))  # lengths differ: pass by pass
        elif step % 3 == 1:
            plans.append(np.where(generator.random(rows) < 0.5, 4, 0))  # a subset asks, the rest fall behind
        else:
            plans.append(np.full(rows, int(generator.integers(2, 6))))
    return plans


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_greedy_feeds_propose_what_the_passes_one_by_one_propose(arch, rows, monkeypatch):
    model, reference = make_model(arch, seed=3), make_model(arch, seed=3)  # the drafter's, and a copy for HF
    prompts = random_prompts(rows, 96, seed=4)
    plans = _plans(rows, 9, seed=5, uneven=rows > 1)
    drafts, lengths, feeds = _run(model, reference, prompts, plans, 6, True, monkeypatch)
    loop_drafts, loop_lengths, loop_feeds = _run(model, reference, prompts, plans, 6, False, monkeypatch)
    assert feeds and not loop_feeds
    for step, (got, want) in enumerate(zip(drafts, loop_drafts)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
    for step, (got, want) in enumerate(zip(lengths, loop_lengths)):
        np.testing.assert_array_equal(got, want, err_msg=f"cache lengths after step {step}")


def test_chains_up_to_the_cache_end(monkeypatch):
    """A chain that ends in the drafter cache's last slot is fed, and drafts what the passes one by
    one draft; one token longer, no feed runs and the passes one by one raise as they did."""
    model, reference = make_model("llama", seed=3), make_model("llama", seed=3)
    batch = BatchState([np.array([5, 6, 7])], 4, np.arange(1), np.zeros(0, dtype=np.int64))
    drafter = _drafter_over_eager_graphs(model, batch, max_draft_tokens=1)
    try:
        runner = drafter._runner
        longest = runner.cache.max_len - len(batch.token_ids[0, : batch.lengths[0]]) + 1  # the last pass at max_len - 1
        feeds = []
        original = runner.graphs.run_greedy_feeds
        runner.graphs.run_greedy_feeds = lambda *args: feeds.append(args[-1]) or original(*args)
        draft = drafter.propose(batch, np.array([longest]))
        assert feeds == [longest - 1]
        assert draft.token_ids[0].tolist() == hf_greedy(reference, [5, 6, 7], longest)
        assert runner.cache.lengths[0] == runner.cache.max_len
        drafter.commit(batch.lengths.copy(), np.array([0]))  # nothing accepted: back to the prompt
        with pytest.raises(ValueError, match="does not fit the cache"):
            drafter.propose(batch, np.array([longest + 1]))
        assert feeds == [longest - 1]
    finally:
        drafter._runner.graphs = None
        drafter.finish()
