"""FixedPolicy: every row drafts the same number of tokens with the same drafter, every step
(the classic speculative decoding setting; num_draft_tokens=0 is plain decoding).
"""

from __future__ import annotations

import numpy as np

from ..types import Plan, is_int_at_least
from .base import Policy


class FixedPolicy(Policy):
    def __init__(self, num_draft_tokens: int = 4, drafter_index: int = 0, trees: bool | None = None):
        """trees: ask a tree-growing drafter for trees of num_draft_tokens nodes (True) or for
        chains (False) in every row; None leaves it to the drafter's spec."""
        for name, value in (("num_draft_tokens", num_draft_tokens), ("drafter_index", drafter_index)):
            if not is_int_at_least(value, 0):
                raise ValueError(f"FixedPolicy's {name} must be an integer >= 0, got {value!r}")
        if trees is not None and not isinstance(trees, bool):
            raise TypeError(f"FixedPolicy's trees must be True, False or None, got {trees!r}")
        self.num_draft_tokens = int(num_draft_tokens)
        self.drafter_index = int(drafter_index)
        self.trees = trees

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens

    def plan(self, batch, num_drafters):
        if self.num_draft_tokens > 0 and self.drafter_index >= num_drafters:
            raise ValueError(
                f"FixedPolicy uses drafter {self.drafter_index} but generate() was given {num_drafters} drafter(s)"
            )
        return Plan(
            drafter_index=np.full(batch.num_rows, self.drafter_index, dtype=np.int64),
            num_draft_tokens=np.full(batch.num_rows, self.num_draft_tokens, dtype=np.int64),
            trees=None if self.trees is None else np.full(batch.num_rows, self.trees),
        )

    def __repr__(self) -> str:
        trees = "" if self.trees is None else f", trees={self.trees}"
        return f"FixedPolicy(num_draft_tokens={self.num_draft_tokens}, drafter_index={self.drafter_index}{trees})"
