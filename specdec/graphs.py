"""CUDA graphs for a runner's forward passes over bucketed shapes (DESIGN §5).

Invariant: a replay runs exactly the kernels an eager forward would (uncompiled), over static
buffers, and gives the same logits for the real tokens. A pass of N packed tokens in groups of
at most ``max_group_tokens`` runs the graph of the smallest bucket of N_b >= N tokens (powers of
two); the N_b - N filler tokens form one extra group on a scratch cache row at position 0, so
they never touch a real row. Graphs are captured once, in ``capture()``; afterwards nothing is
captured or compiled again (``captures`` counts them) and a pass that fits no bucket (a long
prefill) runs eagerly.

With ``compile=True`` the passes are first compiled with ``torch.compile`` (dynamic token count;
attention stays our Triton kernel, an opaque custom op), which fuses the dozens of small kernels
per layer (normalisation, rotary embedding, activations, residual adds) that otherwise dominate a
small-batch step; the graphs then replay the compiled kernels. Compilation also happens only in
``capture()``.

A property the CUDA tests and ``experiments/bf16_shape_probe.py`` check, compiled or not: a pass's
logits are bitwise the same whichever bucket replays it (bf16 included), so the padding a pass
gets does not decide a near-tie. (It also rests on cuBLAS giving a row the same product whatever
the number of rows, which the probe checks for the zoo's shapes.) Compiled, it needs
one compiled variant for every bucket, and Dynamo does not give that by itself:
- it compiles a variant of its own for size 1 (it specialises sizes 0 and 1);
- when the first size it traces is the largest bucket, it compiles one for that bucket alone (the
  token view then spans the whole buffer, and Dynamo guards on that stride);
- duck sizing ties sizes that happen to be equal at the first trace (bucket 2 against another
  input dimension of size 2), and recompiles when they part.
Variants differ in their kernels, hence in bf16 rounding, enough to break near-ties and make
verification diverge from plain decoding. So compiled buckets start at 2 tokens (a 1-token pass
runs with one filler token), and ``capture()`` traces them smallest first, with duck sizing off,
before capturing them largest first, so that one variant serves every bucket.

Per replay the host gathers all of the pass's integers into one array and copies it into the
static buffers in one non-blocking transfer (``transfer.to_device``): no synchronisation.

A drafter's runner also captures a greedy feed per bucket (``capture_greedy_feeds``): the
bucket's pass, preceded by moving every token one position on and followed by writing each
token's argmax back as its next input. A greedy chain's single-token passes are then that
graph's replays, one host fill for all of them; they run the bucket's own kernels, so they give
bitwise the tokens that the passes one by one with an argmax between them give.
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from .attention import METADATA_KWARG, AttentionMetadata


RECOMPILE_LIMIT = 64  # compiled variants per model class (target and drafters share a forward's code)


def _no_duck_shapes():
    """Dynamo's symbolic sizes without duck sizing (equal sizes at trace time get one symbol and
    an equality guard); a no-op where this torch has no such setting."""
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "use_duck_shape"):
        return contextlib.nullcontext()
    return config.patch(use_duck_shape=False)


class GraphedForward:
    def __init__(self, runner, max_group_tokens: int, max_tokens: int, compile: bool = False, one_bucket: bool = False,
                 max_groups: int | None = None, logits: bool = True):
        """one_bucket: capture the bucket of ``max_tokens`` tokens alone (every pass replays it);
        max_groups: the most groups a pass holds (None: one a cache row); logits: False computes
        the head for the bucket's last slot only (a pass whose logits nobody reads: a prefill)."""
        self.runner = runner
        self.logits_to_keep = 0 if logits else 1
        self.compiled = compile
        self._model = torch.compile(runner.model, dynamic=True) if compile else runner.model
        self.max_group_tokens = max_group_tokens
        first = 1 if compile else 0  # exponent of the smallest bucket: compiled, no size-1 bucket (module docstring)
        # powers of two from 2^first up to the first >= max_tokens
        self.buckets = [1 << i for i in range(first, max(first, (max_tokens - 1).bit_length()) + 1)]
        self.buckets = self.buckets[-1:] if one_bucket else self.buckets
        self.max_tokens = self.buckets[-1]
        groups = runner.cache.max_rows - 1 if max_groups is None else max_groups
        self.max_groups = min(self.max_tokens, groups) + 1  # + the filler group
        device = runner.device
        # one int64 buffer: ids, cache slots, rows, RoPE positions, tree masks [T each]; group rows,
        # first tokens, counts, tree starts, sink ends, window starts [G each]. Every pass runs the
        # tree and sparse kernel: a causal one as groups whose tree starts at the cache's end (no
        # key in a tree) and whose window starts at 0 (the whole row), so one graph serves all three
        self._sizes = [self.max_tokens] * 5 + [self.max_groups] * 6
        self._offsets = np.cumsum([0] + self._sizes)
        self._device = torch.zeros(sum(self._sizes), dtype=torch.int64, device=device)
        views = torch.split(self._device, self._sizes)
        (self.input_ids, self.positions, self.token_rows, self.rope_positions, self.tree_masks,
         self.group_rows, self.group_first, self.group_counts, self.group_tree_start, self.group_sink_end,
         self.group_window_start) = views
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.hidden: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> the kept hidden states its replay writes
        self.greedy_feeds: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its greedy feed (capture_greedy_feeds)
        self.captures = 0
        self._pool = None

    def _metadata(self, num_tokens: int, num_groups: int) -> AttentionMetadata:
        runner = self.runner
        return AttentionMetadata(
            cache=runner.cache,
            token_rows=self.token_rows[:num_tokens],
            token_positions=self.positions[:num_tokens],
            token_group=None,  # only the reference backend reads these, and it does not run in graphs
            token_slot=None,
            group_rows=self.group_rows[:num_groups],
            group_first_token=self.group_first[:num_groups],
            group_counts=self.group_counts[:num_groups],
            group_query_positions=None,
            max_group_tokens=self.max_group_tokens,
            max_kv_len=runner.cache.max_len,
            backend=runner.backend,
            token_tree_mask=self.tree_masks[:num_tokens],
            group_tree_start=self.group_tree_start[:num_groups],
            group_sink_end=self.group_sink_end[:num_groups],
            group_window_start=self.group_window_start[:num_groups],
            kv_splits=runner.kv_splits,
            role=runner.role,
        )

    def _groups_for(self, bucket: int) -> int:
        return min(bucket, self.max_groups - 1) + 1

    def _fill(self, input_ids: torch.Tensor | None, rows, starts, counts, bucket: int, tree=None,
              sparse=None) -> None:
        """Write one pass (real groups, then the filler group) into the static buffers; a tree
        pass's positions and masks (runner.TreeLayout) are copied device to device, a sparse
        pass's sink and window starts (runner.SparseLayout) come with the other integers."""
        num_tokens = int(counts.sum())
        num_groups = self._groups_for(bucket)
        scratch = self.runner.cache.max_rows - 1
        real_groups = len(counts)
        group_rows = np.full(num_groups, scratch, dtype=np.int64)
        group_first = np.full(num_groups, num_tokens, dtype=np.int64)
        group_counts = np.zeros(num_groups, dtype=np.int64)
        group_rows[:real_groups], group_counts[:real_groups] = rows, counts
        group_first[:real_groups] = np.cumsum(counts) - counts
        group_counts[-1] = min(bucket - num_tokens, self.max_group_tokens)  # the filler group
        token_group = np.repeat(np.arange(real_groups), counts)
        positions = np.zeros(bucket, dtype=np.int64)
        positions[:num_tokens] = starts[token_group] + np.arange(num_tokens) - group_first[token_group]
        token_rows = np.full(bucket, scratch, dtype=np.int64)
        token_rows[:num_tokens] = rows[token_group]
        tree_starts = np.full(num_groups, self.runner.cache.max_len, dtype=np.int64)
        if tree is not None:
            tree_starts[:real_groups] = tree.tree_starts
        pinned = torch.zeros(sum(self._sizes), dtype=torch.int64, pin_memory=self.runner.device.type == "cuda")
        host = pinned.numpy()  # filled in place: the transfer's pinned buffer (from the caching host allocator)
        offsets = self._offsets
        host[offsets[1] : offsets[1] + bucket] = positions
        host[offsets[2] : offsets[2] + bucket] = token_rows
        host[offsets[3] : offsets[3] + bucket] = positions  # RoPE positions: the slots, but in a tree
        host[offsets[5] : offsets[5] + num_groups] = group_rows
        host[offsets[6] : offsets[6] + num_groups] = group_first
        host[offsets[7] : offsets[7] + num_groups] = group_counts
        host[offsets[8] : offsets[8] + num_groups] = tree_starts
        if sparse is not None:  # dense groups keep sink end 0 and window start 0: every key
            host[offsets[9] : offsets[9] + real_groups] = sparse.sink_ends
            host[offsets[10] : offsets[10] + real_groups] = sparse.window_starts
        self._device.copy_(pinned, non_blocking=True)
        if input_ids is not None:
            self.input_ids[:num_tokens].copy_(input_ids)
        if tree is not None:
            self.rope_positions[:num_tokens].copy_(tree.positions)
            self.tree_masks[:num_tokens].copy_(tree.masks)

    def _run_model(self, bucket: int) -> torch.Tensor:
        runner = self.runner
        position_ids = self.rope_positions[:bucket]
        if runner.max_position_id is not None:
            position_ids = position_ids.clamp(max=runner.max_position_id - 1)
        meta = self._metadata(bucket, self._groups_for(bucket))
        output = self._model(input_ids=self.input_ids[None, :bucket], position_ids=position_ids[None],
                             use_cache=False, logits_to_keep=self.logits_to_keep, **{METADATA_KWARG: meta})
        return output.logits[0]

    def release(self) -> None:
        self.graphs.clear()
        self.hidden.clear()
        self.greedy_feeds.clear()
        self._pool = None
        self._model = None
        self.runner = None  # break the runner <-> graphs cycle

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket (explicit warm-up; call once, before decoding).

        The garbage collector is off meanwhile: collecting an old graph during a capture would
        free its memory pool, which invalidates the capture in progress."""
        with self._capturing():
            if self.compiled:
                self._allocate_cache()
            self._capture_all()

    @contextlib.contextmanager
    def _capturing(self):
        """The garbage collector off, and compiled, Dynamo's limits raised and duck sizing off
        (sizes equal at the first trace would be tied: module docstring)."""
        gc.collect()
        gc.disable()
        try:
            if self.compiled:
                name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
                limit = max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT)  # the name before torch 2.7
                with torch._dynamo.config.patch(**{name: limit}), _no_duck_shapes():
                    yield
            else:
                yield
        finally:
            gc.enable()

    @torch.inference_mode()
    def capture_greedy_feeds(self) -> None:
        """Capture, per bucket, a greedy feed: move every token one position on, run the pass
        (the bucket's own kernels), and write each token's argmax back as its next input. A
        greedy chain's k - 1 single-token passes are then k - 1 replays with no host work between
        them (``run_greedy_feeds``). Call once (a drafter's warm-up); needs the runner attached."""
        if self.greedy_feeds or self.runner.tap is not None:
            return  # captured already; or a tap, whose hidden states these graphs do not keep
        with self._capturing():
            captured = self._capture_buckets(self._greedy_feed)
        self.greedy_feeds = {bucket: graph for bucket, (graph, _) in captured.items()}

    def _greedy_feed(self, bucket: int) -> None:
        self.positions[:bucket] += 1
        self.rope_positions[:bucket] += 1
        self.input_ids[:bucket] = self._run_model(bucket).argmax(dim=-1)  # [bucket]

    def run_greedy_feeds(self, first_ids: torch.Tensor, rows: np.ndarray, starts: np.ndarray,
                         num_passes: int) -> torch.Tensor:
        """Continue greedy chains by ``num_passes`` single-token passes: row rows[r] is fed
        first_ids[r] ([R] on the device) at position starts[r], then each pass's argmax at the
        next position -> the argmax tokens [R, num_passes] (the chains' next tokens). Bitwise the
        tokens that as many ``run`` calls with an argmax between them give: the same kernels."""
        num_rows = len(rows)
        bucket = next(b for b in self.buckets if b >= num_rows)
        # positions one short: every replay first moves them on (filler: the scratch row's 1, 2, ...)
        self._fill(first_ids, rows, starts - 1, np.ones(num_rows, dtype=np.int64), bucket)
        graph = self.greedy_feeds[bucket]
        chosen = torch.empty(num_rows, num_passes, dtype=torch.int64, device=self.input_ids.device)
        for index in range(num_passes):
            graph.replay()
            chosen[:, index] = self.input_ids[:num_rows]
        return chosen

    def _allocate_cache(self) -> None:
        """One eager pass on the scratch row, so the cache exists before compilation traces it."""
        empty = np.zeros(0, dtype=np.int64)
        self._fill(None, empty, empty, empty, 1)
        model, self._model = self._model, self.runner.model
        try:
            self._run_model(1)
        finally:
            self._model = model

    def _capture_all(self) -> None:
        def run(bucket: int):
            logits = self._run_model(bucket)
            tap = self.runner.tap  # held here, the tensors the capture kept are never reused in the pool
            return logits, {} if tap is None else dict(tap.latest)

        for bucket, (graph, (logits, hidden)) in self._capture_buckets(run, trace_first=self.compiled).items():
            self.graphs[bucket] = (graph, logits)
            self.hidden[bucket] = hidden
        self.runner._check_every_layer_ran()  # capturing wrote to the scratch row only

    def _capture_buckets(self, run, trace_first: bool = False) -> dict[int, tuple[torch.cuda.CUDAGraph, object]]:
        """Capture ``run(bucket)`` for every bucket on a side stream, over filler-only buffers (the
        scratch row) -> {bucket: (graph, what the captured run returned)}, kept only once all are
        captured. Largest first: smaller graphs reuse its memory pool; two runs before each capture
        compile kernels and create library handles outside it. trace_first: one run of every bucket,
        smallest first, before any (compiled: one variant serves them all, module docstring)."""
        captured = {}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        empty = np.zeros(0, dtype=np.int64)
        with torch.cuda.stream(stream):
            for bucket in self.buckets if trace_first else []:
                self._fill(None, empty, empty, empty, bucket)
                run(bucket)
            for bucket in reversed(self.buckets):
                self._fill(None, empty, empty, empty, bucket)
                for _ in range(2):
                    run(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    output = run(bucket)
                self._pool = graph.pool() if self._pool is None else self._pool
                captured[bucket] = (graph, output)
                self.captures += 1
        torch.cuda.current_stream().wait_stream(stream)
        return captured

    def fits(self, counts: np.ndarray) -> bool:
        return (len(self.graphs) > 0 and int(counts.max()) <= self.max_group_tokens and int(counts.sum()) <= self.max_tokens
                and len(counts) < self.max_groups)

    def run(self, input_ids: torch.Tensor, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
            bucket: int | None = None, tree=None, sparse=None) -> torch.Tensor:
        """Replay the graph of the smallest bucket that holds this pass (or of ``bucket``, one that
        holds it) -> logits [N, V] (a view: copy before the next replay; [1, V] for a graph without
        logits)."""
        num_tokens = int(counts.sum())
        if bucket is None:
            bucket = next(b for b in self.buckets if b >= num_tokens)
        elif bucket not in self.graphs or bucket < num_tokens:
            raise ValueError(f"bucket {bucket} does not hold a pass of {num_tokens} tokens; buckets: {sorted(self.graphs)}")
        self._fill(input_ids, rows, starts, counts, bucket, tree, sparse)
        graph, logits = self.graphs[bucket]
        graph.replay()
        if self.runner.tap is not None:
            self.runner.tap.latest = {j: hidden[:num_tokens] for j, hidden in self.hidden[bucket].items()}
        return logits[:num_tokens]
