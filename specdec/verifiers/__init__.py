"""Verifiers: how drafts (chains or token trees) are laid out for the target's forward pass."""

from .base import Verifier
from .decomposed import DecomposedVerifier
from .padded import PaddedVerifier
from .padding_free import PaddingFreeVerifier, TreeVerifier

__all__ = ["Verifier", "DecomposedVerifier", "PaddedVerifier", "PaddingFreeVerifier", "TreeVerifier"]
