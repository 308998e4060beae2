"""Drafters: who proposes the tokens the target verifies."""

from .base import Drafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .self_speculative import SelfSpeculativeDrafter
from .spire import SPIReDrafter
from .spire_model import SpireDraft

__all__ = ["Drafter", "ModelDrafter", "PromptLookupDrafter", "SelfSpeculativeDrafter", "SPIReDrafter", "SpireDraft"]
