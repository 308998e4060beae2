"""Verifiers: how drafts (chains or token trees) are laid out for the target's forward pass."""

from .base import Verifier
from .padded import PaddedVerifier
from .padding_free import PaddingFreeVerifier, TreeVerifier

__all__ = ["Verifier", "PaddedVerifier", "PaddingFreeVerifier", "TreeVerifier"]
