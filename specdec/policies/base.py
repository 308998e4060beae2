"""The Policy protocol: before each step decide, per row, which drafter proposes and how many
tokens it drafts (0 = plain decoding for that row); after the step, learn from what happened.

Invariant: a policy sees only host-side statistics (``StepRecord``) and the batch; it never
touches drafters, verifiers or tensors on the device.

Under a PipelinedEngine (pipeline.py) a plan's active rows are one micro-batch's (the others
read as finished), and the next micro-batch is planned before the last one's step is observed
(plan A, plan B, observe A, plan A, observe B, ...): what a policy keeps from a plan to reward
its step must be kept per row, from the last plan in which the row was active (BanditPolicy
does). A policy whose state follows one sequence of steps (GoodputPolicy: one decision, interval
and step-time model for the batch) sets ``one_per_micro_batch``, and the engine gives each
micro-batch its own copy: the object passed in serves the first micro-batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..batch import BatchState
from ..stats import StepRecord
from ..types import Plan


class Policy(ABC):
    #: under a PipelinedEngine, give each micro-batch a copy of its own (state for one step sequence)
    one_per_micro_batch = False

    @property
    @abstractmethod
    def max_draft_tokens(self) -> int:
        """The most tokens any row may draft in one step (sizes caches and buffers)."""

    @abstractmethod
    def plan(self, batch: BatchState, num_drafters: int) -> Plan:
        """Per-row drafter index and draft length for the next step."""

    def start_rows(self, batch: BatchState, rows) -> None:
        """Rows ``rows`` ([R] host indices) now hold new requests (an Engine admitted them, or a
        generate() call began); a policy that keeps per-row state resets theirs. The default
        keeps nothing."""

    def observe(self, record: StepRecord) -> None:
        """What the last step did (counts per row, times); the default ignores it."""
