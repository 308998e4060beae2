"""Benchmark harness: specdec against its peers in one run (``python -m specdec bench``)."""

from .common import BenchSettings
from .harness import run
from .report import write

__all__ = ["BenchSettings", "run", "write"]
