"""SPIReDrafter: the SPIRe draft model (drafters/spire_model.py) proposing chains through the
runner (arXiv 2504.06419; ALGORITHMS.md section 8).

Its own cache holds, per draft block, keys and values at the text's positions:
- at committed positions, projected from the target's hidden states entering the block's source
  block. They are written as the target runs: an observer of the target's runner projects every
  dense pass (the prefill, each chain verification) into the draft's cache at the pass's slots.
  Entries for rejected tokens lie beyond the committed length, where the draft overwrites them;
- at the positions the draft feeds itself (the last committed token, then its drafts), its own
  memory: at the end of each pass a hook on the draft LM (SpireDraft.install_memory_writer)
  mixes the block inputs and the last block's output into memory vectors, whose projections
  overwrite the entries the pass wrote; as GPU work inside the pass, graphs capture it.
Each draft pass attends to the sink, the last ``window`` committed positions, and the tokens fed
this step (runner.SparseLayout), so it reads a constant number of keys whatever the context.

Invariant: the draft's computation equals ``SpireDraft.unrolled_logits`` with the block starting
at the last committed token; the output is the target's, as for any drafter. Chains only: a tree
verification's slots are not positions, so its passes are not projected.

Cost per step of k tokens: k passes of len(source_layers) blocks, one token a row, each ending
with one projection of the memory into every block's keys and values; after each verification,
one projection of the verified tokens' target states (eager, outside the target's graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from ..batch import BatchState
from ..runner import ObservedPass, PackedLayout, SparseLayout
from ..transfer import to_device
from .model import ModelDrafter
from .spire_model import SPIRE_ROLE, SpireDraft


class SPIReDrafter(ModelDrafter):
    role_prefix = SPIRE_ROLE  # runners of its own: their passes end with the memory writes
    reads_target = True

    def __init__(self, draft: SpireDraft, attention: str = "auto", cuda_graphs: bool | str = False):
        """draft: a SpireDraft built from the target it drafts for (SpireDraft.from_target, or the
        zoo's); attention and cuda_graphs as for generate()."""
        if not isinstance(draft, SpireDraft):
            raise TypeError(f"draft must be a SpireDraft (SpireDraft.from_target(target) or the zoo's), got "
                            f"{type(draft).__name__}")
        super().__init__(draft.model, attention=attention, cuda_graphs=cuda_graphs)
        self.draft = draft
        draft.install_memory_writer()  # before any graph of the draft is captured
        self._target = None

    def describe(self) -> str:
        memory = "feedback memory" if self.draft.feedback else "no feedback memory"
        return (f"SPIReDrafter({self.draft.num_blocks} blocks from {list(self.draft.source_layers)}, sink "
                f"{self.draft.sink}, window {self.draft.window}, {memory})")

    def target_hidden_layers(self) -> tuple[int, ...]:
        return self.draft.source_layers

    def check_target(self, target) -> None:
        config = target.config.get_text_config()
        if (config.hidden_size != self.draft.model.config.hidden_size
                or max(self.draft.source_layers) >= config.num_hidden_layers):
            raise ValueError(f"{self.describe()} reads target blocks {list(self.draft.source_layers)} of width "
                             f"{self.draft.model.config.hidden_size}, but the target has {config.num_hidden_layers} "
                             f"blocks of width {config.hidden_size}: build the draft from this target "
                             "(SpireDraft.from_target)")

    def bind_target(self, runner) -> None:
        self._target = runner

    def _graph_group(self) -> int:
        return 1  # one token a row in every pass

    def _start(self, batch: BatchState, max_draft_tokens: int) -> None:
        if self._target is None:
            raise RuntimeError("SPIReDrafter reads the target's activations: pass it to generate(), which hands it "
                               "the target's runner before it starts")
        super()._start(batch, max_draft_tokens)
        self._target.observers.append(self._project_target)

    def finish(self) -> None:
        if self._target is not None and self._project_target in self._target.observers:
            self._target.observers.remove(self._project_target)
        self._target = None
        super().finish()

    @torch.inference_mode()
    def _project_target(self, seen: ObservedPass) -> None:
        """A dense target pass: its tokens' keys and values, from the target's states, into the
        draft's cache at the same slots."""
        device = self._runner.device
        rows, slots = seen.token_rows.to(device), seen.token_slots.to(device)  # [N] each
        for block, source in enumerate(self.draft.source_layers):
            states = seen.hidden[source].to(device=device, dtype=self.draft.model.dtype)  # [N, hidden]
            keys, values = self.draft.keys_values(block, states, slots)  # [N, Hkv, D] each
            self._runner.cache.write(block, rows, slots, keys.transpose(0, 1), values.transpose(0, 1))

    def _pass(self, batch: BatchState, tokens: torch.Tensor, rows: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        layout = PackedLayout(rows=rows, starts=slots, counts=np.ones(len(rows), dtype=np.int64))
        # the sink and the last ``window`` positions with target memory (all but the last committed token)
        view = SparseLayout(sink=self.draft.sink, window_starts=np.maximum(batch.lengths[rows] - 1 - self.draft.window, 0))
        return self._runner.forward(tokens, layout, sparse=view)  # the memory writer hook ends the pass

    def _catch_up(self, batch: BatchState, asked: np.ndarray) -> torch.Tensor:
        """The last committed token of each asked row (the target has not run it yet, so the draft
        feeds it itself) -> logits [R, V]."""
        return self._pass(batch, to_device(batch.last_token_ids(asked), self._runner.device), asked,
                          batch.lengths[asked] - 1)

    def _feed(self, batch: BatchState, tokens: torch.Tensor, rows: np.ndarray, depth: int) -> torch.Tensor:
        return self._pass(batch, tokens, rows, batch.lengths[rows] + depth)

    def commit(self, lengths_before: np.ndarray, num_accepted: np.ndarray) -> None:
        """Nothing: the verification's target states were projected as it ran."""
