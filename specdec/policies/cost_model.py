"""CostModel: how long a decoding step takes, as fitted linear models of what the step computes
(SmartSpec, Liu et al. 2024, arXiv 2406.14066: T = c_fixed + c_tok * batched tokens + c_kv * KV
tokens read; Synergy, Su et al. 2023, arXiv 2310.18813: drafter time per batch size and length).

Target verify pass over active rows with committed lengths L_r drafting k_r tokens each (the
pass feeds each row's last committed token plus its draft, and reads its keys up to there):

    T_target = c_fixed + c_tok * sum(k_r + 1) + c_kv * sum(L_r + k_r) + c_row * rows

Each drafter d, over the rows it drafts for (zero when it drafts for none):

    T_draft_d = d_fixed + d_rows * rows + d_steps * max(k_r) + d_tokens * sum(k_r)
                + d_kv * sum(k_r * L_r) + d_ctx * sum(L_r)

(``steps`` is the number of sequential passes a model drafter makes, ``kv_tokens`` the keys those
passes read, ``context_tokens`` the committed tokens of the rows it drafts for, which a prompt
lookup scans). A step's time is T_target plus the T_draft of every drafter used.

Invariant: coefficients are fitted by least squares (numpy.linalg.lstsq on columns scaled to
unit size) and are never negative: a feature whose coefficient comes out negative is dropped and
the fit redone, so predicted times never fall when a step does more work. Each fit reports R^2
and the mean absolute percentage error on held-out points (a random 20%), its coefficients then
come from all points.

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
takes a few seconds on a CPU. Fitted models are saved as JSON keyed by
model identity (class, config hash, dtype, parameter count) and device name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

TARGET_FEATURES = ("fixed", "tokens", "kv_tokens", "rows")
DRAFTER_FEATURES = ("fixed", "rows", "steps", "tokens", "kv_tokens", "context_tokens")
FORMAT = "specdec.cost_model/1"


@dataclass
class LinearTimeModel:
    """time_s = coefficients . features, with fit quality measured on held-out points."""

    features: tuple[str, ...]
    coefficients: np.ndarray  # [F] seconds per unit of each feature
    r2: float = float("nan")  # on held-out points (in-sample if there were too few points)
    mape: float = float("nan")  # mean |predicted - measured| / measured, same points
    num_points: int = 0
    held_out: bool = False  # whether r2 and mape come from held-out points

    def __post_init__(self) -> None:
        self.features = tuple(self.features)
        self.coefficients = np.asarray(self.coefficients, dtype=np.float64)
        if self.coefficients.shape != (len(self.features),):
            raise ValueError(f"{len(self.features)} features but coefficients of shape {self.coefficients.shape}")

    def coefficient(self, name: str) -> float:
        return float(self.coefficients[self.features.index(name)])

    def terms(self) -> dict[str, float]:
        """Feature name -> its coefficient (seconds per unit, as Python floats)."""
        return dict(zip(self.features, self.coefficients.tolist()))

    def predict(self, values: Mapping[str, object]):
        """Time for feature values (scalars or arrays that broadcast; "fixed" is implied). A
        Python number is used as it is (the same float64 arithmetic as a 0-d array)."""
        total = 0.0
        for name, coefficient in zip(self.features, self.coefficients.tolist()):
            if coefficient == 0.0:
                continue
            value = 1.0 if name == "fixed" else values[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                value = np.asarray(value, dtype=np.float64)
            total = total + coefficient * value
        return np.float64(total) if isinstance(total, float) else total

    @classmethod
    def fit(cls, features: Sequence[str], matrix: np.ndarray, times_s: np.ndarray,
            holdout_fraction: float = 0.2, seed: int = 0) -> LinearTimeModel:
        """Least squares on ``matrix`` [N, F] (column order of ``features``) -> ``times_s`` [N]."""
        matrix = np.asarray(matrix, dtype=np.float64)
        times_s = np.asarray(times_s, dtype=np.float64)
        num_points, num_features = matrix.shape
        if num_points == 0:
            raise ValueError("no timings to fit")
        num_held = math.ceil(holdout_fraction * num_points) if holdout_fraction > 0 else 0
        held_out = num_held >= 2 and num_points - num_held >= num_features + 1
        if held_out:
            order = np.random.default_rng(seed).permutation(num_points)
            test, train = order[:num_held], order[num_held:]
            trial = _nonnegative_lstsq(matrix[train], times_s[train])
            r2, mape = _quality(matrix[test] @ trial, times_s[test])
        coefficients = _nonnegative_lstsq(matrix, times_s)
        if not held_out:
            r2, mape = _quality(matrix @ coefficients, times_s)
        return cls(tuple(features), coefficients, r2=r2, mape=mape, num_points=num_points, held_out=held_out)

    def as_dict(self) -> dict:
        """JSON-ready (an unknown R^2 or error is None)."""
        finite = lambda value: None if math.isnan(value) else float(value)
        return {"features": list(self.features), "coefficients": self.coefficients.tolist(), "r2": finite(self.r2),
                "mape": finite(self.mape), "num_points": self.num_points, "held_out": self.held_out}

    @classmethod
    def from_dict(cls, data: Mapping) -> LinearTimeModel:
        number = lambda value: float("nan") if value is None else float(value)
        return cls(tuple(data["features"]), np.asarray(data["coefficients"]), r2=number(data["r2"]),
                   mape=number(data["mape"]), num_points=int(data["num_points"]), held_out=bool(data["held_out"]))

    def describe(self) -> str:
        terms = ", ".join(f"{n} {c * 1e3:.4g} ms" for n, c in zip(self.features, self.coefficients))
        where = "held-out" if self.held_out else "in-sample"
        return f"{terms} (R^2 {self.r2:.3f}, error {self.mape:.1%} {where}, {self.num_points} points)"


def _nonnegative_lstsq(matrix: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """lstsq on unit-scaled columns; drop the most negative coefficient and refit until none is."""
    scale = np.abs(matrix).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = matrix / scale
    active = list(range(matrix.shape[1]))
    while True:
        solution = np.zeros(matrix.shape[1])
        if active:
            solution[active] = np.linalg.lstsq(scaled[:, active], times_s, rcond=None)[0]
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            return solution / scale
        active.remove(worst)


def _quality(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    residual = float(((measured - predicted) ** 2).sum())
    spread = float(((measured - measured.mean()) ** 2).sum())
    r2 = 1.0 - residual / spread if spread > 0 else float("nan")
    mape = float(np.mean(np.abs(predicted - measured) / np.maximum(np.abs(measured), 1e-12)))
    return r2, mape


class CostModel:
    """Predicted step times: one LinearTimeModel for the target's verify pass, one per drafter
    (in the order the drafters are given to generate())."""

    def __init__(self, target: LinearTimeModel, drafters: Sequence[LinearTimeModel] = (),
                 identity: str = "synthetic", device_name: str = "synthetic", step_overhead_s: float = 0.0):
        if tuple(target.features) != TARGET_FEATURES:
            raise ValueError(f"the target model needs features {TARGET_FEATURES}, got {target.features}")
        for model in drafters:
            if tuple(model.features) != DRAFTER_FEATURES:
                raise ValueError(f"drafter models need features {DRAFTER_FEATURES}, got {model.features}")
        self.target = target
        self.drafters = list(drafters)
        self.identity = identity
        self.device_name = device_name
        self.step_overhead_s = float(step_overhead_s)  # already included in the target's fixed term

    @classmethod
    def from_coefficients(cls, c_fixed: float, c_tok: float, c_kv: float = 0.0, c_row: float = 0.0,
                          drafters: Sequence[Mapping[str, float]] = (), identity: str = "synthetic",
                          device_name: str = "synthetic") -> CostModel:
        """A synthetic model: target coefficients in seconds, and per drafter a mapping from
        DRAFTER_FEATURES names ("fixed", "rows", "steps", "tokens", "kv_tokens", "context_tokens") to seconds
        (missing names are 0)."""
        target = LinearTimeModel(TARGET_FEATURES, np.array([c_fixed, c_tok, c_kv, c_row], dtype=np.float64))
        models = []
        for coefficients in drafters:
            unknown = set(coefficients) - set(DRAFTER_FEATURES)
            if unknown:
                raise ValueError(f"unknown drafter features {sorted(unknown)}; use {DRAFTER_FEATURES}")
            models.append(LinearTimeModel(DRAFTER_FEATURES, np.array([float(coefficients.get(n, 0.0)) for n in DRAFTER_FEATURES])))
        return cls(target, models, identity=identity, device_name=device_name)

    @property
    def num_drafters(self) -> int:
        return len(self.drafters)

    # --- predictions -------------------------------------------------------------------------
    def target_time(self, num_tokens, kv_tokens, num_rows):
        """Verify pass over ``num_rows`` rows, ``num_tokens`` packed tokens, ``kv_tokens`` keys read."""
        return self.target.predict({"tokens": num_tokens, "kv_tokens": kv_tokens, "rows": num_rows})

    def drafter_time(self, drafter_index: int, num_rows, steps, num_tokens, kv_tokens, context_tokens=0):
        """Drafter ``drafter_index`` proposing for ``num_rows`` rows (0 -> no time)."""
        if not 0 <= drafter_index < len(self.drafters):
            raise ValueError(
                f"this cost model times {len(self.drafters)} drafter(s), not drafter {drafter_index}: "
                "profile every drafter given to generate(), or build it with from_coefficients(drafters=[...])"
            )
        time_s = self.drafters[drafter_index].predict(
            {"rows": num_rows, "steps": steps, "tokens": num_tokens, "kv_tokens": kv_tokens,
             "context_tokens": context_tokens})
        return np.where(np.asarray(num_rows) > 0, time_s, 0.0)

    def step_time(self, lengths: np.ndarray, num_draft_tokens: np.ndarray, drafter_index=0) -> float:
        """Predicted draft + verify time of one step over the active rows: ``lengths`` [A]
        committed tokens, ``num_draft_tokens`` [A], ``drafter_index`` one or [A]."""
        lengths = np.asarray(lengths, dtype=np.int64)
        k = np.asarray(num_draft_tokens, dtype=np.int64)
        total = float(self.target_time((k + 1).sum(), (lengths + k).sum(), len(lengths)))
        owners = np.broadcast_to(np.asarray(drafter_index, dtype=np.int64), k.shape)
        for d in np.unique(owners[k > 0]):
            mine = (owners == d) & (k > 0)
            total += float(self.drafter_time(int(d), mine.sum(), k[mine].max(), k[mine].sum(), (k * lengths)[mine].sum(),
                                             lengths[mine].sum()))
        return total

    # --- persistence -------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.identity}@{self.device_name}"

    def as_dict(self) -> dict:
        return {"identity": self.identity, "device_name": self.device_name, "target": self.target.as_dict(),
                "drafters": [d.as_dict() for d in self.drafters], "step_overhead_s": self.step_overhead_s}

    @classmethod
    def from_dict(cls, data: Mapping) -> CostModel:
        return cls(LinearTimeModel.from_dict(data["target"]), [LinearTimeModel.from_dict(d) for d in data["drafters"]],
                   identity=data["identity"], device_name=data["device_name"],
                   step_overhead_s=float(data.get("step_overhead_s", 0.0)))

    def save(self, path) -> None:
        """Write (or replace) this model's entry in the JSON file at ``path``, keyed by
        identity and device name; other entries in the file are kept."""
        entries = {}
        if os.path.exists(path):
            with open(path) as handle:
                entries = _entries(json.load(handle), path)
        entries[self.key] = self.as_dict()
        with open(path, "w") as handle:
            json.dump({"format": FORMAT, "entries": entries}, handle, indent=1, sort_keys=True, allow_nan=False)

    @classmethod
    def load(cls, path, identity: str | None = None, device_name: str | None = None) -> CostModel:
        """The entry for ``identity`` (see ``identity_of``) on ``device_name`` (see
        ``device_name_of``); with neither given, the file's only entry."""
        with open(path) as handle:
            entries = _entries(json.load(handle), path)
        if identity is None and device_name is None:
            if len(entries) != 1:
                raise KeyError(f"{path} holds {len(entries)} cost models ({sorted(entries)}): name identity and device_name")
            return cls.from_dict(next(iter(entries.values())))
        matches = [e for e in entries.values()
                   if (identity is None or e["identity"] == identity) and (device_name is None or e["device_name"] == device_name)]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} cost models in {path} match identity={identity!r}, device_name={device_name!r}; "
                           f"it holds {sorted(entries)}")
        return cls.from_dict(matches[0])

    def subset(self, drafter_indices: Sequence[int]) -> CostModel:
        """The same model timing only the drafters ``drafter_indices`` (in that order): for a
        generate() call given a subset of the profiled drafters."""
        return CostModel(self.target, [self.drafters[i] for i in drafter_indices], identity=self.identity,
                         device_name=self.device_name, step_overhead_s=self.step_overhead_s)

    def describe(self) -> str:
        lines = [f"CostModel {self.key}", f"  target:  {self.target.describe()}"]
        if self.step_overhead_s:
            lines[-1] += f" (fixed term includes {self.step_overhead_s * 1e3:.3g} ms of per-step loop overhead)"
        lines += [f"  drafter {i}: {d.describe()}" for i, d in enumerate(self.drafters)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CostModel({self.key!r}, {len(self.drafters)} drafter(s))"


def _entries(data, path) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a specdec cost model file (format {FORMAT})")
    return data["entries"]


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


# --- profiling ------------------------------------------------------------------------------
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
