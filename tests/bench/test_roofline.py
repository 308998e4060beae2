"""SPIRe's performance model (bench/roofline.py) on hand-computed cases."""

import pytest
import torch

from specdec.bench.roofline import Hardware, PassCost, modelled_speedup, multiplier
from tests.tiny import make_model

HW = Hardware(flops=1e15, bandwidth=1e12)


def test_a_pass_costs_its_bytes_or_its_flops_whichever_is_slower():
    cost = PassCost(weight_bytes=1e9, flops_per_token=1e9, kv_bytes_per_position=1e5, attention_flops_per_position=1e3)
    # 4 rows x 1 token x 1,000 positions: reads 1e9 + 4e8 bytes (1.4 ms), computes 4.004e9 FLOPs (4 us)
    assert cost.seconds(4, 1, 1000, HW) == pytest.approx(1.4e-3)
    # 1e6 tokens, no cache: 1e15 FLOPs take 1 s, the weights 1 ms
    assert cost.seconds(1000, 1000, 0, HW) == pytest.approx(1.0)


def test_the_multiplier_is_tau_over_the_steps_cost_in_target_passes():
    assert multiplier(tau=3.0, k=4, draft_seconds=0.0, verify_seconds=1.0, target_seconds=1.0) == 3.0
    assert multiplier(tau=3.0, k=4, draft_seconds=0.25, verify_seconds=1.0, target_seconds=1.0) == 1.5


def test_a_free_sparse_draft_at_long_context_gives_about_tau():
    """KV-bound: verification reads the same cache as a plain step, a sink + window draft almost nothing."""
    target = PassCost(weight_bytes=1e8, flops_per_token=1e8, kv_bytes_per_position=2.5e4, attention_flops_per_position=2e4)
    sparse = PassCost(weight_bytes=2.5e7, flops_per_token=2.5e7, kv_bytes_per_position=6e3, attention_flops_per_position=5e3)
    speedup = modelled_speedup(target, sparse, draft_positions=65 + 4, batch=64, context=16384, k=4, tau=3.0,
                               hardware=HW)
    assert 2.7 < speedup < 3.0
    assert modelled_speedup(target, None, 0, 64, 16384, 4, 3.0, HW) == 1.0


def test_costs_of_a_transformers_model():
    model = make_model("llama", vocab_size=96, num_layers=2, hidden=32, dtype=torch.float32)
    cost = PassCost.of_model(model)
    params = sum(p.numel() for p in model.parameters()) - 96 * 32  # the embedding is gathered
    assert cost.weight_bytes == 4 * params and cost.flops_per_token == 2 * params
    assert cost.kv_bytes_per_position == 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 KV heads of 8, float32
