"""Every metric specdec reports, defined once.

Per request, counted over the decoding steps the request took part in:
- ``steps``: verification steps (one target forward each); a plain-decoding step counts too.
- ``drafted``: draft tokens proposed for the request (a token tree's: its nodes, slots
  included).
- ``accepted``: draft tokens the acceptance rule kept that reached the output (a tree's: its
  accepted path).
- ``emitted``: tokens appended to the output (accepted + one recovered or bonus token per step,
  fewer only in the step that hits EOS or ``max_new_tokens``). Equals the output length.
- ``tau`` (mean accepted length): emitted / steps; plain decoding has tau = 1.
- ``acceptance_rate``: accepted / drafted.
- ``acceptance_by_position[i]`` (i = 0 for the first draft token): among steps that drafted at
  least i + 1 tokens, the fraction that accepted at least i + 1 of them. For token trees,
  position is depth: among steps whose tree was built i + 1 levels deep or more, the fraction
  whose accepted path reached depth i + 1.
- ``wall_time_s``: from the start of generate() to the end of the step that finished the
  request; ``tokens_per_s`` = emitted / wall_time_s. ``prefill_time_s`` (overall only): from the
  start to the end of the prompts' forward pass, its device work included (on a GPU, generate()
  waits for it once), so wall_time_s - prefill_time_s is the decoding's time.
Overall: sums of the per-request counts; ``tau`` = emitted / request-steps; ``steps`` counts
loop iterations; ``tokens_per_s`` = emitted / total wall time; ``padding_fraction`` = pad slots
/ all token slots the target computed while verifying; ``draft_time_s`` and
``verify_time_s`` are summed device times of the two phases (CUDA events on GPU); a step's
``drafter_time_s[d]`` is the part of its draft time spent in drafter d's ``propose``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .types import VerifyCost


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator else float("nan")


@dataclass
class StepRecord:
    """What one decoding step did, per row (host arrays of size B)."""

    step: int
    rows: np.ndarray  # [A] rows that took part
    drafter_index: np.ndarray  # [B]
    num_drafted: np.ndarray  # [B]
    num_accepted: np.ndarray  # [B] accepted tokens that reached the output
    num_emitted: np.ndarray  # [B] tokens appended to the output
    draft_time_s: float
    verify_time_s: float
    cost: VerifyCost
    drafter_time_s: np.ndarray | None = None  # [D] draft time of each drafter given to generate()
    step_time_s: float | None = None  # host wall time of the whole step, from the policy's plan to the commit
    drafter_wall_s: np.ndarray | None = None  # [D] host-clock time of each drafter's propose (its share of step_time_s)
    plan_time_s: float = 0.0  # host wall time of the policy's plan (its share of step_time_s)
    draft_depths: np.ndarray | None = None  # [B] how deep each row's token tree reached; None: chains (num_drafted)


@dataclass
class RequestStats:
    steps: int
    drafted: int
    accepted: int
    emitted: int
    drafted_by_position: list[int]
    accepted_by_position: list[int]
    wall_time_s: float

    @property
    def tau(self) -> float:
        return _ratio(self.emitted, self.steps)

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted, self.drafted)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [_ratio(a, d) for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.emitted, self.wall_time_s)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class GenerationStats:
    requests: list[RequestStats]
    steps: int
    wall_time_s: float
    prefill_time_s: float
    draft_time_s: float
    verify_time_s: float
    target_tokens: int
    padding_tokens: int
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.requests)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.requests)

    @property
    def emitted(self) -> int:
        return sum(r.emitted for r in self.requests)

    @property
    def row_steps(self) -> int:
        """Steps summed over the requests (a request's steps end when it does)."""
        return sum(r.steps for r in self.requests)

    @property
    def tau(self) -> float:
        return _ratio(self.emitted, self.row_steps)

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted, self.drafted)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [_ratio(a, d) for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.emitted, self.wall_time_s)

    @property
    def padding_fraction(self) -> float:
        return _ratio(self.padding_tokens, self.target_tokens)

    def as_dict(self) -> dict:
        summary = {k: v for k, v in asdict(self).items() if k != "requests"}
        summary.update(
            drafted=self.drafted,
            accepted=self.accepted,
            emitted=self.emitted,
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_s=self.tokens_per_s,
            padding_fraction=self.padding_fraction,
        )
        return {"overall": summary, "requests": [r.as_dict() for r in self.requests]}

    def summary(self) -> str:
        by_position = ", ".join(f"{rate:.2f}" for rate in self.acceptance_by_position) or "-"
        return (
            f"{len(self.requests)} requests, {self.emitted} tokens in {self.steps} steps, "
            f"{self.wall_time_s:.3f} s ({self.tokens_per_s:.1f} tok/s); tau {self.tau:.2f}; "
            f"accepted {self.accepted}/{self.drafted} drafted (by position: {by_position}); "
            f"padding {self.padding_fraction:.1%} of {self.target_tokens} verified token slots"
        )


class StatsRecorder:
    """Accumulates StepRecords into per-request and overall statistics."""

    def __init__(self, num_rows: int, max_draft_tokens: int):
        self.steps = np.zeros(num_rows, dtype=np.int64)
        self.drafted = np.zeros(num_rows, dtype=np.int64)
        self.accepted = np.zeros(num_rows, dtype=np.int64)
        self.emitted = np.zeros(num_rows, dtype=np.int64)
        self.drafted_at = np.zeros((num_rows, max_draft_tokens), dtype=np.int64)  # [B, K]
        self.accepted_at = np.zeros((num_rows, max_draft_tokens), dtype=np.int64)  # [B, K]
        self.finish_time_s = np.zeros(num_rows)
        self.num_steps = 0
        self.draft_time_s = self.verify_time_s = 0.0
        self.target_tokens = self.padding_tokens = 0
        # since the recorder began, whatever rows held: what a serving run's steps cost (Engine.load_stats)
        self.row_steps = self.drafted_tokens = self.emitted_tokens = 0
        self.step_time_s = self.plan_time_s = 0.0

    def record(self, record: StepRecord, elapsed_s: float, finished: np.ndarray) -> None:
        self.num_steps += 1
        self.steps[record.rows] += 1
        self.drafted += record.num_drafted
        self.accepted += record.num_accepted
        self.emitted += record.num_emitted
        position = np.arange(self.drafted_at.shape[1])  # a tree's depth (a chain's position) less one
        reach = record.num_drafted if record.draft_depths is None else record.draft_depths
        self.drafted_at += position < reach[:, None]
        self.accepted_at += position < record.num_accepted[:, None]
        newly_finished = np.zeros_like(finished)
        newly_finished[record.rows] = finished[record.rows]
        self.finish_time_s = np.where(newly_finished, elapsed_s, self.finish_time_s)
        self.draft_time_s += record.draft_time_s
        self.verify_time_s += record.verify_time_s
        self.target_tokens += record.cost.target_tokens
        self.padding_tokens += record.cost.padding_tokens
        self.row_steps += len(record.rows)
        self.drafted_tokens += int(record.num_drafted.sum())
        self.emitted_tokens += int(record.num_emitted.sum())
        self.step_time_s += record.step_time_s or 0.0
        self.plan_time_s += record.plan_time_s

    def start_rows(self, rows: np.ndarray) -> None:
        """Rows ``rows`` begin new requests: their counts start again from zero."""
        for counts in (self.steps, self.drafted, self.accepted, self.emitted, self.drafted_at, self.accepted_at,
                       self.finish_time_s):
            counts[rows] = 0

    def request_stats(self, row: int) -> RequestStats:
        """The statistics of the request row ``row`` holds (or held last)."""
        return RequestStats(
            steps=int(self.steps[row]),
            drafted=int(self.drafted[row]),
            accepted=int(self.accepted[row]),
            emitted=int(self.emitted[row]),
            drafted_by_position=self.drafted_at[row].tolist(),
            accepted_by_position=self.accepted_at[row].tolist(),
            wall_time_s=float(self.finish_time_s[row]),
        )

    def finish(self, wall_time_s: float, prefill_time_s: float) -> GenerationStats:
        """Every row's request as one call's statistics (generate(): request i held row i)."""
        return GenerationStats(
            requests=[self.request_stats(r) for r in range(len(self.steps))],
            steps=self.num_steps,
            wall_time_s=wall_time_s,
            prefill_time_s=prefill_time_s,
            draft_time_s=self.draft_time_s,
            verify_time_s=self.verify_time_s,
            target_tokens=self.target_tokens,
            padding_tokens=self.padding_tokens,
            drafted_by_position=self.drafted_at.sum(axis=0).tolist(),
            accepted_by_position=self.accepted_at.sum(axis=0).tolist(),
        )
