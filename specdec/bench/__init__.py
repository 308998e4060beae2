"""Benchmark harness: specdec against its peers in one run (``python -m specdec bench``)."""

from .harness import BenchSettings, run
from .report import write

__all__ = ["BenchSettings", "run", "write"]
