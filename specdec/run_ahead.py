"""Run-ahead: plain decoding steps launched before the step before them commits (issue 36: host
work off the critical path).

In plain decoding (a policy that never drafts) every running row commits exactly one token a
step, so the next step's pass is known before its predecessor's verdict reaches the host, but for
which rows end at an EOS or stop sequence: its rows are the running ones less those whose budget
the step exhausts, each one position further, and its input tokens are the verdict's, still on
the device. The engine therefore launches step t + 1 before it waits for step t's verdict; the
host then commits step t (records it, streams it, releases finished rows, admits new requests)
while the device computes step t + 1, and the device waits for the host only when the host's
work per step exceeds the device's.

Invariant (lossless): a step launched ahead runs, for every row still running when it commits,
exactly the pass that row would get after its predecessor's commit (same token, position, seed
and parameters; the seeded noise of a draw is a function of seed and position alone). A row that
ended meanwhile (EOS, stop sequence, ``cancel``), or whose cache row went to a new request, is
dropped from the verdict before the commit: it emits nothing, and what the pass wrote to its
cache lies beyond its committed length, stale as a rejected draft's entries are. A step launched
before rows were admitted is launched again over every running row in their admitting step, so
every ``step()`` commits what it commits without run-ahead (a request's tokens at a ``cancel``
do not depend on it). The policy (one that never drafts) still plans every step, over the batch
as predicted.

Not run ahead: speculative steps (the next draft follows the verdict), repetition penalties (they
read the committed tokens), tensor-parallel targets (every rank must take the same steps) and
pipelined engines. Cost: a row that ends at an EOS or stop sequence costs one pass it does not
use, and a step that admits requests one pass more (the one launched before them); both count
in the target's tokens. On the CPU nothing overlaps (``RUN_AHEAD = "cuda"`` keeps it to GPUs;
True runs it everywhere, as the CPU tests do).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from .batch import BatchState
from .timing import PhaseTimer
from .transfer import to_device_many
from .types import HostCopy, Plan, Verdict, VerifyCost

RUN_AHEAD: bool | str = "cuda"  # "cuda": on GPUs; True: on every device; False: never (read per engine)


def enabled(device: torch.device) -> bool:
    return RUN_AHEAD is True or (RUN_AHEAD == "cuda" and device.type == "cuda")


@dataclass
class Launched:
    """A plain decoding step launched and not yet committed."""

    rows: np.ndarray  # [A] the rows of its pass
    admissions: np.ndarray  # [A] each row's admission count at launch (a new request: another count)
    verdict: Verdict  # over every row, on the device
    copy: HostCopy  # the verdict on its way to the host
    cost: VerifyCost
    timer: PhaseTimer  # its verify phase
    started: float  # time.perf_counter() at its launch
    plan: Plan  # the policy's (no drafts), made over the batch it launched from
    plan_time_s: float

    def still_running(self, admissions: np.ndarray, batch: BatchState) -> np.ndarray:
        """[A] whether each row still runs the request it held at launch (``admissions`` [B]: the
        engine's admission count per row)."""
        return (admissions[self.rows] == self.admissions) & ~batch.finished[self.rows]

    def next_tokens(self, rows: np.ndarray, carried: np.ndarray, batch: BatchState) -> torch.Tensor:
        """[R] on the device: the last token of each of ``rows`` once this step commits: the
        token it emits where ``carried`` [R], the committed last token elsewhere (rows admitted
        since its launch)."""
        emitted = self.verdict.token_ids[:, 0]  # [B] a plain step emits one token a row
        if carried.all() and len(rows) == batch.num_rows:
            return emitted
        committed = np.where(carried, 0, batch.last_token_ids(rows))  # [R]
        rows_t, carried_t, committed_t = to_device_many([rows, carried, committed], emitted.device)
        return torch.where(carried_t.bool(), emitted[rows_t], committed_t)


def predicted_batch(batch: BatchState, carried: np.ndarray) -> BatchState:
    """The batch as it will be once each of the ``carried`` rows [R] commits one token: a shallow
    copy with lengths one further on those rows, and those the token brings to their budget
    finished. Its token_ids lack the carried tokens (they are on the device: next_tokens)."""
    ahead = copy.copy(batch)
    ahead.lengths = batch.lengths.copy()
    ahead.lengths[carried] += 1
    ahead.finished = batch.finished.copy()
    ahead.finished[carried] |= ahead.num_generated[carried] >= batch.max_new_tokens[carried]
    return ahead
