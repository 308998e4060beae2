"""SelfSpeculativeDrafter: the target drafts for itself over a static sparse view of its own KV
cache (MagicDec, Chen et al. 2024, arXiv 2408.11049; ALGORITHMS.md section 8).

Each draft pass runs the target's own weights, through the target's own runner, on one token a
row, attending only to the row's first ``sink`` keys, its last ``window`` committed keys and the
tokens drafted this step, all at their original positions (runner.SparseLayout). It reads the
target's cache by index: no second cache, no second prefill, nothing copied. The draft's keys
and values go to the slots just past the committed ones, which the verify pass overwrites with
the target's own; so the committed entries are never touched and ``commit`` has nothing to do.

Invariant: with a window at least as long as every row, each draft pass is the target's own
pass (dense attention over the same keys), so under greedy decoding every drafted token is
accepted. Output is the target's, as for any drafter.

Cost per step of k tokens: k passes of the full target on one token a row, each reading sink +
window + up to k keys a row, whatever the row's length; the verify pass reads the whole row. So
the draft's share of a step falls as batch and context grow, where reading the KV cache bounds
decoding (MagicDec's regime).
"""

from __future__ import annotations

import numpy as np
import torch

from ..batch import BatchState
from ..runner import PackedLayout, SparseLayout, vocab_size_of
from ..transfer import to_device
from ..types import SamplingParams
from .model import ModelDrafter


class SelfSpeculativeDrafter(ModelDrafter):
    def __init__(self, sink: int = 16, window: int = 512):
        """sink: the first positions every draft query sees (MagicDec: 16); window: the last
        committed positions it sees (MagicDec: about 512). The model is the target given to
        generate(); the draft runs with the target's attention backend and CUDA graphs."""
        for name, value, least in (("sink", sink, 0), ("window", window, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r} (MagicDec used sink=16, window=512; "
                                 "the window holds at least the last committed token)")
        self.sink, self.window = int(sink), int(window)
        self.tree = None
        self.model = None
        self.vocab_size = None
        self._runner = None
        self._attached = None
        self.runner_role = "target"
        self.attention = self.cuda_graphs = self.compile = None  # the target runner's, once bound

    reads_target = True

    def bind_target(self, runner) -> None:
        self._runner = runner
        self.model = runner.model
        self.vocab_size = vocab_size_of(runner.model)
        self.attention, self.cuda_graphs = runner.attention, runner.graphs is not None

    def models(self) -> list[torch.nn.Module]:
        return []  # the target, whose runner generate() already holds

    def device(self) -> torch.device | None:
        return None if self._runner is None else self._runner.device

    def max_positions(self) -> int | None:
        return None  # the target's own limit, which generate() checks

    def describe(self) -> str:
        return f"SelfSpeculativeDrafter(sink={self.sink}, window={self.window})"

    def start(self, batch: BatchState, sampling: SamplingParams, device: torch.device, max_draft_tokens: int) -> None:
        if self._runner is None:
            raise RuntimeError("SelfSpeculativeDrafter drafts with the target: pass it to generate(), which "
                               "hands it the target's runner before it starts")
        self._seeds = to_device(batch.seeds, self._runner.device)

    def start_rows(self, batch: BatchState, rows: np.ndarray) -> None:
        """Only the seeds: the draft reads the target's cache, which the engine refills."""
        self._seeds[to_device(rows, self._seeds.device)] = to_device(batch.seeds[rows], self._seeds.device)

    def finish(self) -> None:
        self._runner = None  # the target's runner is generate()'s to release

    def commit(self, lengths_before: np.ndarray, num_accepted: np.ndarray) -> None:
        """Nothing: the verifier keeps the target's cache, and the draft's entries lay beyond it."""

    def _view(self, batch: BatchState, layout: PackedLayout) -> SparseLayout:
        """The sink and the last ``window`` committed positions of each row of ``layout``."""
        committed = batch.lengths[layout.rows]  # [G]
        return SparseLayout(sink=self.sink, window_starts=np.maximum(committed - self.window, 0))

    def _catch_up(self, batch: BatchState, asked: np.ndarray) -> torch.Tensor:
        """Feed each asked row its last committed token (the target's cache holds the ones
        before it) -> next-token logits [R, V] over the sparse view."""
        layout = PackedLayout(rows=asked, starts=batch.lengths[asked] - 1, counts=np.ones(len(asked), dtype=np.int64))
        return self._runner.forward(to_device(batch.last_token_ids(asked), self._runner.device), layout,
                                    sparse=self._view(batch, layout))

    def _feed(self, batch: BatchState, tokens: torch.Tensor, rows: np.ndarray, depth: int) -> torch.Tensor:
        layout = PackedLayout(rows=rows, starts=batch.lengths[rows] + depth, counts=np.ones(len(rows), dtype=np.int64))
        return self._runner.forward(tokens, layout, sparse=self._view(batch, layout))
