"""CostModel: the least-squares fit recovers known coefficients from noisy synthetic timings (and
reports R^2 and error on held-out points), coefficients are never negative, predictions follow
the documented formulas, save/load round-trips keyed by identity and device, and a real tiny
profile on the CPU yields a fitted model (no timing assertions: only that it is well formed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies.cost_model import (
    DRAFTER_FEATURES,
    TARGET_FEATURES,
    CostModel,
    LinearTimeModel,
)
from specdec.policies.profiling import ProfileGrid, identity_of, profile
from tests.tiny import make_model, perturbed_copy

TRUE_TARGET = np.array([6.94e-3, 1.84e-5, 4.86e-8, 2.0e-5])  # SmartSpec's H100 fit (s), plus a row term


def synthetic_target_points(noise: float, seed: int = 0):
    """A profile-like grid (batch x tokens per row x context) with multiplicative noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for t in (1, 2, 4, 8):
            for c in (128, 512, 2048):
                rows.append([1.0, b * t, b * (c + t), b])
    matrix = np.array(rows)
    times = matrix @ TRUE_TARGET * (1 + noise * rng.standard_normal(len(matrix)))
    return matrix, times


def test_fit_recovers_known_coefficients_from_noisy_timings():
    """1% multiplicative noise on 84 points: every coefficient within 10% of the truth, held-out
    R^2 > 0.99 and mean absolute error < 2%."""
    matrix, times = synthetic_target_points(noise=0.01)
    model = LinearTimeModel.fit(TARGET_FEATURES, matrix, times)
    print(model.describe())
    assert model.held_out and model.num_points == len(times)
    relative = np.abs(model.coefficients - TRUE_TARGET) / TRUE_TARGET
    assert np.all(relative < 0.10), relative
    assert model.r2 > 0.99 and model.mape < 0.02


def test_fit_is_exact_without_noise():
    matrix, times = synthetic_target_points(noise=0.0)
    model = LinearTimeModel.fit(TARGET_FEATURES, matrix, times)
    assert np.allclose(model.coefficients, TRUE_TARGET, rtol=1e-6)
    assert model.r2 == pytest.approx(1.0) and model.mape < 1e-6


def test_negative_coefficients_are_dropped():
    """Times that fall with the token count would fit a negative coefficient: it is set to 0
    and the others refitted."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 100, size=40).astype(float)
    matrix = np.stack([np.ones(40), tokens], axis=1)
    times = 0.01 - 1e-5 * tokens
    model = LinearTimeModel.fit(("fixed", "tokens"), matrix, times)
    assert model.coefficient("tokens") == 0.0
    assert model.coefficient("fixed") == pytest.approx(times.mean())


def test_predictions_follow_the_formulas():
    model = CostModel.from_coefficients(c_fixed=1.0, c_tok=0.1, c_kv=0.001, c_row=0.01,
                                        drafters=[{"fixed": 0.5, "rows": 0.02, "steps": 0.2, "tokens": 0.03, "kv_tokens": 1e-4,
                                                   "context_tokens": 1e-3}])
    lengths = np.array([10, 20, 30])
    k = np.array([0, 2, 3])
    target = 1.0 + 0.1 * (k + 1).sum() + 0.001 * (lengths + k).sum() + 0.01 * 3
    drafter = 0.5 + 0.02 * 2 + 0.2 * 3 + 0.03 * 5 + 1e-4 * (2 * 20 + 3 * 30) + 1e-3 * (20 + 30)
    assert model.step_time(lengths, k) == pytest.approx(target + drafter)
    assert model.step_time(lengths, np.zeros(3)) == pytest.approx(1.0 + 0.1 * 3 + 0.001 * 60 + 0.03)
    assert model.drafter_time(0, 0, 0, 0, 0) == 0.0
    with pytest.raises(ValueError, match="drafter 1"):
        model.drafter_time(1, 2, 2, 4, 40)


def test_save_and_load_round_trip_keyed_by_identity_and_device(tmp_path):
    path = tmp_path / "costs.json"
    first = CostModel.from_coefficients(1e-3, 2e-5, 3e-8, drafters=[{"steps": 4e-4, "tokens": 1e-6}],
                                        identity="Llama:abc", device_name="NVIDIA H200")
    first.target.r2, first.target.mape, first.target.num_points, first.target.held_out = 0.98, 0.03, 84, True
    second = CostModel.from_coefficients(5e-3, 1e-5, identity="Llama:abc", device_name="cpu")
    first.save(path)
    assert CostModel.load(path).as_dict() == first.as_dict()  # the only entry
    second.save(path)
    loaded = CostModel.load(path, identity="Llama:abc", device_name="NVIDIA H200")
    assert loaded.as_dict() == first.as_dict()
    assert np.array_equal(loaded.drafters[0].coefficients, first.drafters[0].coefficients)
    assert loaded.target.r2 == 0.98 and loaded.target.held_out
    assert CostModel.load(path, device_name="cpu").as_dict() == second.as_dict()
    assert sorted(json.loads(path.read_text())["entries"]) == ["Llama:abc@NVIDIA H200", "Llama:abc@cpu"]
    with pytest.raises(KeyError):
        CostModel.load(path)  # two entries: which one?
    with pytest.raises(KeyError):
        CostModel.load(path, identity="Qwen2:def")


def test_identity_changes_with_the_model():
    llama = make_model("llama")
    assert identity_of(llama) == identity_of(make_model("llama", seed=3))  # same config and size
    assert identity_of(llama) != identity_of(make_model("llama", num_layers=3))
    assert identity_of(llama) != identity_of(make_model("qwen2"))
    assert identity_of(llama, [PromptLookupDrafter()]).endswith("PromptLookupDrafter(n=1..3)")


def test_real_tiny_profile_on_cpu(tmp_path):
    target = make_model("llama", dtype=torch.float32)
    drafters = [ModelDrafter(perturbed_copy(target, 0.1)), PromptLookupDrafter()]
    model = profile(target, drafters, device="cpu", grid=ProfileGrid.tiny())
    print(model.describe())
    grid = ProfileGrid.tiny()
    expected_points = len(grid.batch_sizes) * len(grid.context_lengths)
    assert model.target.num_points == expected_points * len(grid.tokens_per_row)
    assert [d.num_points for d in model.drafters] == [expected_points * len(grid.draft_lengths)] * 2
    assert model.target.features == TARGET_FEATURES and model.drafters[0].features == DRAFTER_FEATURES
    for fitted in [model.target, *model.drafters]:
        assert np.all(np.isfinite(fitted.coefficients)) and np.all(fitted.coefficients >= 0)
        assert fitted.coefficients.sum() > 0 and np.isfinite(fitted.mape)
    assert model.step_time(np.array([20, 30]), np.array([3, 1])) > 0
    assert model.identity == identity_of(target, drafters) and model.device_name.startswith("cpu")
    model.save(tmp_path / "tiny.json")
    assert CostModel.load(tmp_path / "tiny.json", identity=model.identity).as_dict() == model.as_dict()
    # the drafters are usable afterwards (profile started and finished them)
    assert drafters[0]._runner is None


def test_bad_cost_model_inputs():
    with pytest.raises(ValueError, match="unknown drafter features"):
        CostModel.from_coefficients(1.0, 0.1, drafters=[{"per_pass": 1.0}])
    with pytest.raises(ValueError, match="no timings"):
        LinearTimeModel.fit(TARGET_FEATURES, np.zeros((0, 4)), np.zeros(0))
