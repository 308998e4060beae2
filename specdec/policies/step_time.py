"""The step time GoodputPolicy optimises against: the CostModel's prediction over the active rows,
written out as a function of the draft lengths (SmartSpec, Liu et al. 2024, arXiv 2406.14066:
T = c_fixed + c_tok * batched tokens + c_kv * KV tokens read + the drafter's time).

With the committed lengths L_i fixed, the step time is linear in the lengths k once their
maximum m (the drafter's sequential passes) is fixed:

    T(k) = T_0 + [any k_i > 0] (d_fixed + d_steps * m) + sum_i (f_i [k_i > 0] + c_i k_i),

f_i = d_rows + d_ctx L_i the cost of drafting for row i at all and c_i = c_tok + c_kv + d_tokens
+ d_kv L_i the cost of each of its draft tokens.

Invariant: ``LinearStepTime.from_cost_model(model, L)(k) == model.step_time(L, k)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_model import CostModel


def numpy_sum(values: list[float]) -> float:
    """sum(values) as numpy's float64 np.add.reduce takes it (pairwise: one accumulator below 8
    values, 8 interleaved ones up to 128, halves above), so a Python sum is numpy's to the bit."""
    n = len(values)
    if n < 8:
        total = 0.0
        for value in values:
            total += value
        return total
    if n > 128:
        half = n // 2 - n // 2 % 8
        return numpy_sum(values[:half]) + numpy_sum(values[half:])
    r0, r1, r2, r3, r4, r5, r6, r7 = values[:8]
    end = n - n % 8
    for i in range(8, end, 8):
        r0, r1, r2, r3 = r0 + values[i], r1 + values[i + 1], r2 + values[i + 2], r3 + values[i + 3]
        r4, r5, r6, r7 = r4 + values[i + 4], r5 + values[i + 5], r6 + values[i + 6], r7 + values[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for value in values[end:]:
        total += value
    return 0.0 + total  # numpy adds the blocks' sum to its identity (-0.0 becomes 0.0)


def row_values(values, num_rows: int) -> list[float]:
    """[A] Python floats of one number or an array [A] (a per-row cost)."""
    values = np.asarray(values, dtype=np.float64)
    return (values if values.shape == (num_rows,) else np.broadcast_to(values, (num_rows,))).tolist()


def row_bucket(num_rows: int) -> int:
    """The power of two >= num_rows: the calibration keeps one correction per bucket of active rows."""
    return 1 << max(int(num_rows) - 1, 0).bit_length()


@dataclass
class LinearStepTime:
    """T(k) over the active rows (module docstring)."""

    base: float
    token_cost: np.ndarray  # [A]
    row_cost: np.ndarray | float = 0.0  # [A] or one for all rows
    draft_fixed: float = 0.0
    depth_cost: float = 0.0
    row_base: np.ndarray | None = None  # [A] what each row adds to the plain step (base - sum: fixed); None: all fixed

    def __call__(self, k: np.ndarray) -> np.ndarray | float:
        """k: [..., A] -> [...] seconds (one choice k [A]: a float, from Python floats in the same
        operations, cheaper than numpy's fixed cost per call)."""
        k = np.asarray(k)
        if k.ndim == 1:
            lengths = k.tolist()
            costs = zip(row_values(self.row_cost, len(lengths)), row_values(self.token_cost, len(lengths)), lengths)
            per_row = numpy_sum([row_cost * (length > 0) + token_cost * length for row_cost, token_cost, length in costs])
            drafting = float(any(length > 0 for length in lengths))
            return self.base + per_row + drafting * (self.draft_fixed + self.depth_cost * max([0, *lengths]))
        on = k > 0  # [..., A]
        drafting = on.any(axis=-1)
        per_row = (self.row_cost * on + self.token_cost * k).sum(axis=-1)
        return self.base + per_row + drafting * (self.draft_fixed + self.depth_cost * k.max(axis=-1, initial=0))

    def extra(self, k: np.ndarray) -> np.ndarray:
        """What drafting k [..., A] adds to the plain step: T(k) - base."""
        return self(k) - self.base

    def calibrated(self, base_scale: float, extra_scale: float) -> LinearStepTime:
        """The plain step scaled by ``base_scale``, everything drafting adds by ``extra_scale``."""
        return LinearStepTime(base=self.base * base_scale, token_cost=self.token_cost * extra_scale,
                              row_cost=np.asarray(self.row_cost) * extra_scale, draft_fixed=self.draft_fixed * extra_scale,
                              depth_cost=self.depth_cost * extra_scale,
                              row_base=None if self.row_base is None else np.asarray(self.row_base) * base_scale)

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, lengths: np.ndarray, drafter_index: int = 0) -> LinearStepTime:
        """The CostModel's step time over active rows of committed ``lengths`` [A], all drafting
        with drafter ``drafter_index``."""
        lengths = np.asarray(lengths, dtype=np.float64)
        num_rows = len(lengths)
        if not drafter_index < cost_model.num_drafters:
            raise ValueError(f"the cost model times {cost_model.num_drafters} drafter(s), not drafter {drafter_index}")
        target = cost_model.target.terms()
        drafter = cost_model.drafters[drafter_index].terms()
        base = float(cost_model.target_time(num_rows, lengths.sum(), num_rows))
        token_cost = target["tokens"] + target["kv_tokens"] + drafter["tokens"] + drafter["kv_tokens"] * lengths
        row_cost = drafter["rows"] + drafter["context_tokens"] * lengths
        row_base = target["tokens"] + target["rows"] + target["kv_tokens"] * lengths  # [A] one token, one row, its keys
        return cls(base=base, token_cost=token_cost, row_cost=row_cost, draft_fixed=drafter["fixed"],
                   depth_cost=drafter["steps"], row_base=row_base)
