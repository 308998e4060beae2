"""Policies: which drafter each row uses and how many tokens it drafts, step by step."""

from .acceptance import AcceptanceEstimator, expected_emitted, expected_emitted_table, rate_from_expected_tokens
from .bandit import BanditPolicy
from .bandit_state import BanditState
from .base import Policy
from .batch_adaptive import BatchAdaptivePolicy, build_table, table_from_throughput
from .batch_profile import measure_round_times, profile_expected_tokens
from .cost_model import CostModel, LinearTimeModel
from .fixed import FixedPolicy
from .goodput import GoodputPolicy
from .profiling import ProfileGrid, profile
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
    "measure_round_times",
    "profile",
    "profile_expected_tokens",
    "rate_from_expected_tokens",
    "replay_call",
    "simulate_call",
    "table_from_throughput",
]
