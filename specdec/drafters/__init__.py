"""Drafters: who proposes the tokens the target verifies."""

from .base import Drafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter

__all__ = ["Drafter", "ModelDrafter", "PromptLookupDrafter"]
