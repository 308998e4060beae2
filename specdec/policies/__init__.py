"""Policies: which drafter each row uses and how many tokens it drafts, step by step."""

from .acceptance import (
    AcceptanceEstimator,
    expected_emitted,
    expected_emitted_table,
    rate_from_expected_tokens,
)
from .bandit import BanditPolicy, BanditState
from .base import Policy
from .batch_adaptive import (
    BatchAdaptivePolicy,
    build_table,
    measure_round_times,
    profile_expected_tokens,
    monotone_table,
    table_from_throughput,
)
from .cost_model import CostModel, LinearTimeModel, ProfileGrid, profile
from .fixed import FixedPolicy
from .goodput import GoodputPolicy
from .simulate import SimulatedCall, replay_call, simulate_call

__all__ = [
    "AcceptanceEstimator",
    "BanditPolicy",
    "BanditState",
    "BatchAdaptivePolicy",
    "CostModel",
    "FixedPolicy",
    "GoodputPolicy",
    "LinearTimeModel",
    "Policy",
    "ProfileGrid",
    "SimulatedCall",
    "build_table",
    "expected_emitted",
    "expected_emitted_table",
    "profile",
    "profile_expected_tokens",
    "measure_round_times",
    "monotone_table",
    "rate_from_expected_tokens",
    "replay_call",
    "simulate_call",
    "table_from_throughput",
]
