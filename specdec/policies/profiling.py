"""Profiling: fit a CostModel by timing the real runner (SmartSpec's fitted step-time model).

``profile()`` measures the real runner: the target's packed forward over synthetic layouts (batch
sizes x tokens per row x context lengths) and each drafter's propose step (batch sizes x draft
lengths x context lengths, a batch of exactly b rows each), the median of a few repeats,
synchronising the device around every timing. By default the target runs eagerly (no CUDA
graphs), as generate() does by default; ``profile(..., cuda_graphs=True, compile=...)`` times it
through the runner generate(..., cuda_graphs=True, compile=...) uses instead (the runner kept
with the model, ``runner_for(role="target")``: it is reused, not rebuilt, when an earlier call
made one that covers the grid, and generate() reuses the one profile() leaves). Drafters are
timed as they are configured: a ``ModelDrafter(model, cuda_graphs=True, compile=True)`` proposes
through its graphs. ``step_overhead=True`` also measures what a decoding step costs beyond the
target's forward (the loop's host work: planning, verifying, committing; measured with plain
decoding through generate() at the grid's smallest and largest batch) and adds it to the
target's fixed term, so predicted step times are whole steps. Cost: the default grid times a few
hundred forward passes of each model (seconds on a GPU for the zoo's models); ``ProfileGrid.tiny()``
takes a few seconds on a CPU.

This module imports the decoding loop (profiling runs it); the policies do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .cost_model import DRAFTER_FEATURES, TARGET_FEATURES, CostModel, LinearTimeModel


@dataclass(frozen=True)
class ProfileGrid:
    """What profile() measures: the target at every (batch size, tokens per row, context
    length), each drafter at every (batch size, draft length, context length)."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens_per_row: tuple[int, ...] = (1, 2, 4, 8)
    context_lengths: tuple[int, ...] = (128, 512, 2048)
    draft_lengths: tuple[int, ...] = (1, 2, 4, 8)
    repeats: int = 5  # timings per point (the median is kept)
    warmup: int = 2  # untimed runs before them
    holdout_fraction: float = 0.2
    seed: int = 0

    @classmethod
    def tiny(cls) -> ProfileGrid:
        """A few seconds on a CPU with a tiny model: for tests."""
        return cls(batch_sizes=(1, 2, 4), tokens_per_row=(1, 3), context_lengths=(8, 32), draft_lengths=(1, 3),
                   repeats=2, warmup=1)


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(run: Callable[..., object], args: tuple, device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of ``run(*args)``, the device synchronised before and after each run."""
    for _ in range(warmup):
        run(*args)
    times = []
    for _ in range(repeats):
        _synchronise(device)
        started = time.perf_counter()
        run(*args)
        _synchronise(device)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def _propose_and_roll_back(drafter, batch, asked: np.ndarray, lengths_before: np.ndarray, no_accept: np.ndarray) -> None:
    drafter.propose(batch, asked)
    drafter.commit(lengths_before, no_accept)


def _position_limit(model) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def profile(target, drafters: Sequence = (), device=None, grid: ProfileGrid | None = None,
            attention: str = "auto", cuda_graphs: bool | str = False, compile: bool = False,
            step_overhead: bool = False) -> CostModel:
    """Measure ``target``'s verify pass and each drafter's propose step on ``device`` (the
    target's by default) and fit a CostModel. Contexts longer than a model's position limit are
    skipped. Drafters are started, used and finished here, like generate() does.

    attention, cuda_graphs, compile: the target's runner configuration, as for generate(); with
    graphs the target is timed through the runner kept with the model (built here unless one
    covering the grid exists, and left for generate() to reuse). step_overhead: measure the
    decoding loop's per-step cost beyond the target's forward and fold it into the fixed term
    (module docstring)."""
    from ..runner import models_in_use

    reading = [d.describe() for d in drafters if d.reads_target]
    if reading:
        raise ValueError(f"profile() times each drafter on its own, but {reading[0]} drafts from the target's cache "
                         "and activations: time it inside generate() instead (out.stats.draft_time_s)")
    # calls sharing these models (generate(), another profile) wait their turn
    with models_in_use([target, *(model for d in drafters for model in d.models())]):
        return _profile(target, drafters, device, grid, attention, cuda_graphs, compile, step_overhead)


def _profile(target, drafters, device, grid, attention, cuda_graphs, compile, step_overhead) -> CostModel:
    from ..batch import BatchState
    from ..runner import (
        ModelRunner,
        PackedLayout,
        device_of,
        resolve_backend,
        runner_for,
    )
    from ..types import SamplingParams

    grid = ProfileGrid() if grid is None else grid
    device = device_of(target) if device is None else torch.device(device)
    if device_of(target) != device:
        raise ValueError(f"the target is on {device_of(target)}, not on {device}: move it first")
    generator = torch.Generator().manual_seed(grid.seed)
    vocab_size = target.get_output_embeddings().weight.shape[0]

    # The target: packed forwards of b rows x t tokens after c cached positions.
    limit = _position_limit(target)
    contexts = [c for c in grid.context_lengths if limit is None or c + max(grid.tokens_per_row) <= limit]
    if not contexts:
        raise ValueError(f"no context length of {grid.context_lengths} fits the target's {limit} positions")
    max_rows = max(grid.batch_sizes)
    backend, graphs, compiled = resolve_backend(target, attention, cuda_graphs, compile)
    max_t, max_len = max(grid.tokens_per_row), max(contexts) + max(grid.tokens_per_row) + 1
    if graphs:  # the runner generate() will use: kept with the model, not released here
        runner = runner_for(target, role="target", max_rows=max_rows, max_len=max_len, attention=backend,
                            graph_shape=(max_t, max_rows * max_t), compile=compiled)
    else:
        runner = ModelRunner(target, max_rows=max_rows, max_len=max_len, attention=backend)
    rows_matrix, times = [], []
    try:
        with runner.attached():
            for c in contexts:
                for b in grid.batch_sizes:
                    for t in grid.tokens_per_row:
                        layout = PackedLayout(rows=np.arange(b), starts=np.full(b, c), counts=np.full(b, t))
                        input_ids = torch.randint(0, vocab_size, (b * t,), generator=generator).to(device)
                        times.append(_median_time(runner.forward, (input_ids, layout), device, grid.repeats, grid.warmup))
                        rows_matrix.append([1.0, b * t, b * (c + t), b])
    finally:
        if not graphs:
            runner.release()
    target_model = LinearTimeModel.fit(TARGET_FEATURES, np.array(rows_matrix), np.array(times),
                                       grid.holdout_fraction, grid.seed)
    overhead = 0.0
    if step_overhead:
        room = (runner.cache.max_len if graphs else max_len) - min(contexts) - 1
        overhead = _step_overhead(target, target_model, min(contexts), max(1, min(16, room)),
                                  sorted({min(grid.batch_sizes), max_rows}), vocab_size, generator,
                                  {"attention": attention, "cuda_graphs": graphs, "compile": compiled})
        target_model.coefficients[TARGET_FEATURES.index("fixed")] += overhead

    # Each drafter, over a batch of b rows of c tokens: propose k tokens for every row, then roll
    # back to one token short of the committed lengths (so the next proposal catches up one
    # token, as in decoding). Largest batch first, so a model drafter's cache is allocated once
    # per context length.
    drafter_models = []
    max_k = max(grid.draft_lengths)
    for drafter in drafters:
        drafter_limit = drafter.max_positions()
        fitting = [c for c in contexts if drafter_limit is None or c + max_k + 1 <= drafter_limit]
        rows_matrix, times = [], []
        for c in fitting:
            for b in sorted(grid.batch_sizes, reverse=True):
                prompts = [torch.randint(0, vocab_size, (c,), generator=generator).numpy() for _ in range(b)]
                batch = BatchState(prompts, max_k + 2, np.arange(b, dtype=np.int64), np.zeros(0, dtype=np.int64))
                drafter.start(batch, SamplingParams(), device, max_k)
                try:
                    step_back, no_accept = batch.lengths - 1, np.zeros(b, dtype=np.int64)
                    drafter.propose(batch, np.ones(b, dtype=np.int64))  # catch up on the prompts
                    drafter.commit(step_back, no_accept)
                    for k in grid.draft_lengths:
                        times.append(_median_time(_propose_and_roll_back, (drafter, batch, np.full(b, k), step_back, no_accept),
                                                  device, grid.repeats, grid.warmup))
                        rows_matrix.append([1.0, b, k, b * k, b * k * c, b * c])
                finally:
                    drafter.finish()
        if not rows_matrix:
            raise ValueError(f"no context length of {contexts} fits {drafter.describe()}'s {drafter_limit} positions")
        drafter_models.append(LinearTimeModel.fit(DRAFTER_FEATURES, np.array(rows_matrix), np.array(times),
                                                  grid.holdout_fraction, grid.seed))
    return CostModel(target_model, drafter_models, identity=identity_of(target, drafters), device_name=device_name_of(device),
                     step_overhead_s=overhead)


def _step_overhead(target, target_model: LinearTimeModel, context: int, new_tokens: int, batch_sizes: Sequence[int],
                   vocab_size: int, generator: torch.Generator, options: dict) -> float:
    """Seconds a plain decoding step of generate() takes beyond the target's predicted forward:
    the mean over ``batch_sizes`` of (measured step - predicted forward), at least 0."""
    from ..generate import generate  # the loop imports the policies package
    from .fixed import FixedPolicy

    gaps = []
    for b in batch_sizes:
        prompts = [torch.randint(0, vocab_size, (context,), generator=generator).tolist() for _ in range(b)]
        # eos_token_id=[]: every row decodes all its tokens, whatever the model's generation_config says
        generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=2, eos_token_id=[], **options)  # warm-up
        stats = generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=new_tokens, eos_token_id=[],
                         **options).stats
        step = (stats.wall_time_s - stats.prefill_time_s) / max(stats.steps, 1)
        mean_kv = b * (context + (new_tokens + 1) / 2)
        gaps.append(step - float(target_model.predict({"tokens": b, "kv_tokens": mean_kv, "rows": b})))
    return max(0.0, float(np.mean(gaps)))


def model_identity(model) -> str:
    """Class, hash of the config, dtype and parameter count of a transformers model."""
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    num_params = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__}:{digest}:{str(model.dtype).removeprefix('torch.')}:{num_params}"


def identity_of(target, drafters: Sequence = ()) -> str:
    """Identity of a target and its drafters, as the cost model file keys it."""
    parts = [model_identity(target)]
    for drafter in drafters:
        model = getattr(drafter, "model", None)
        parts.append(model_identity(model) if model is not None else drafter.describe())
    return " + ".join(parts)


def device_name_of(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{os.cpu_count()} cores"
