"""Verifiers: how draft chains are laid out for the target's forward pass."""

from .base import Verifier
from .padded import PaddedVerifier
from .padding_free import PaddingFreeVerifier

__all__ = ["Verifier", "PaddedVerifier", "PaddingFreeVerifier"]
