"""Synthetic static batches for trying a length policy without a model: rows of known i.i.d.
acceptance rates, a known step time (a CostModel's prediction, say), the decoding loop's
contract for a policy and nothing else. A research sandbox and a test bed: with the rates known,
the best fixed length of a batch can be found by simulation and a policy's choices compared
with it (tests/policies/test_simulate.py); the static batch's tail, which lasts as long as its
slowest row, is reproduced exactly.

``replay_call`` replays recorded greedy decoding instead of i.i.d. rates: for each row, whether
the drafter's greedy token at each generated position (given the target's own tokens before it)
is the target's. With a greedy target and a greedy drafter that is exactly what a draft of k
tokens from that position gets accepted (the run of agreements from it), so a policy meets the
acceptance of real text, bursts and droughts included, without a model in the loop
(experiments/sim_trace_replay.py records it from the model zoo).

Invariant (what ``generate()`` does for a policy): plan before each step, observe its
StepRecord after; a row drafts at most its budget less one token and emits at most its budget;
a drafted token is accepted with its row's rate, i.i.d. (or as the recorded agreements say),
until the first rejection, after which the target's own token is emitted; the call ends when
every row has its ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..batch import BatchState
from ..stats import StepRecord
from ..types import VerifyCost, is_int_at_least
from .base import Policy


@dataclass
class SimulatedCall:
    steps: int
    seconds: float
    tokens: int
    max_lengths: list[int] = field(default_factory=list)  # the longest draft of each step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def simulate_call(policy: Policy, rates, max_new_tokens: int, step_time: Callable[[np.ndarray, np.ndarray], float],
                  rng: np.random.Generator, prompt_tokens: int = 64) -> SimulatedCall:
    """One static batch of len(rates) rows (row i accepts each draft token with rates[i]) under
    ``policy``; step_time(lengths [A], k [A]) -> seconds of a step whose active rows hold
    ``lengths`` committed tokens and draft ``k`` (e.g. ``lambda n, k: model.step_time(n, k)``)."""
    rates = np.asarray(rates, dtype=np.float64)  # [B]
    if rates.ndim != 1 or len(rates) == 0 or np.any((rates < 0) | (rates >= 1)):
        raise ValueError(f"rates must be a non-empty 1-D array of acceptance rates in [0, 1), got {rates!r}")

    def accepted_run(generated: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        return np.minimum(rng.geometric(1.0 - rates) - 1, drafted)  # [B]

    return _run_call(policy, len(rates), max_new_tokens, step_time, accepted_run, prompt_tokens)


def replay_call(policy: Policy, agreement, max_new_tokens: int, step_time: Callable[[np.ndarray, np.ndarray], float],
                prompt_tokens: int = 64) -> SimulatedCall:
    """One static batch replaying recorded decoding: ``agreement`` holds one sequence of bools
    per row, entry j saying whether the drafter's greedy token at generated position j (after
    the target's own first j tokens) is the target's; a draft of k tokens from position j is
    accepted for the run of agreements agreement[j:j+k]. Each sequence needs ``max_new_tokens``
    entries (the last is never drafted at); step_time as for simulate_call."""
    if isinstance(agreement, np.ndarray) and agreement.ndim == 2:
        agreement = list(agreement)
    given = [np.asarray(a) for a in agreement]
    if not given or any(a.ndim != 1 or not (a.dtype == bool or np.isin(a, (0, 1)).all()) for a in given):
        raise ValueError("agreement must be a non-empty list of 1-D sequences of bools (or 0/1), one per row: "
                         "whether the drafter's token at each position is the target's, not acceptance rates "
                         "(simulate_call takes rates)")
    if not is_int_at_least(max_new_tokens, 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    rows = [a.astype(bool) for a in given]
    short = [i for i, a in enumerate(rows) if len(a) < max_new_tokens]
    if short:
        raise ValueError(f"rows {short[:5]} record fewer than max_new_tokens={max_new_tokens} positions: "
                         "record longer decodings or ask for fewer new tokens")
    agrees = np.stack([a[:max_new_tokens] for a in rows])  # [B, max_new_tokens]
    # [B, max_new_tokens + 1]: the run of agreements starting at each position (0 past the end)
    runs = np.zeros((len(rows), max_new_tokens + 1), dtype=np.int64)
    for j in range(max_new_tokens - 1, -1, -1):
        runs[:, j] = (runs[:, j + 1] + 1) * agrees[:, j]

    def accepted_run(generated: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        at = np.minimum(generated, max_new_tokens)  # [B]
        return np.minimum(runs[np.arange(len(rows)), at], drafted)  # [B]

    return _run_call(policy, len(rows), max_new_tokens, step_time, accepted_run, prompt_tokens)


def _run_call(policy: Policy, num_rows: int, max_new_tokens: int, step_time: Callable[[np.ndarray, np.ndarray], float],
              accepted_run: Callable[[np.ndarray, np.ndarray], np.ndarray], prompt_tokens: int) -> SimulatedCall:
    """The decoding loop of one static batch: accepted_run(generated [B], drafted [B]) -> each
    row's accepted draft tokens this step."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    batch = BatchState([np.zeros(prompt_tokens, dtype=np.int64)] * num_rows, max_new_tokens, np.arange(num_rows),
                       np.zeros(0, dtype=np.int64))
    result = SimulatedCall(0, 0.0, 0)
    while not batch.finished.all():
        active = batch.active_rows()  # [A]
        plan = policy.plan(batch, 1)
        remaining = batch.remaining  # [B] 0 where finished
        drafted = np.where(batch.finished, 0, np.minimum(plan.num_draft_tokens, np.maximum(remaining - 1, 0)))  # [B]
        accepted = accepted_run(batch.num_generated, drafted)  # [B] the run of accepted tokens
        emitted = np.where(batch.finished, 0, np.minimum(accepted + 1, remaining))  # [B]
        seconds = float(step_time(batch.lengths[active], drafted[active]))
        record = StepRecord(result.steps, active, np.zeros(num_rows, dtype=np.int64), drafted, accepted, emitted,
                            0.0, 0.0, VerifyCost(0, 0), step_time_s=seconds)
        batch.lengths += emitted
        batch.finished |= batch.num_generated >= max_new_tokens
        policy.observe(record)
        result.steps += 1
        result.seconds += seconds
        result.tokens += int(emitted.sum())
        result.max_lengths.append(int(drafted.max()))
    return result
