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

Measuring the runner to fit these is profiling.py's (it imports the loop; this module does not).
Fitted models are saved as JSON keyed by model identity (class, config hash, dtype, parameter
count) and device name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

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
        """The entry for ``identity`` (profiling.identity_of) on ``device_name``
        (profiling.device_name_of); with neither given, the file's only entry."""
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
