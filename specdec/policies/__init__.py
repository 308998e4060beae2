"""Policies: which drafter each row uses and how many tokens it drafts, step by step."""

from .base import Policy
from .fixed import FixedPolicy

__all__ = ["Policy", "FixedPolicy"]
