"""PaddedVerifier: the reference layout, every row padded to the longest draft of the step
(the layout of batched speculative decoding without ragged support, e.g. BASS's padded mode).

Invariant: pad slots sit after a row's real tokens, so no real query ever attends to them; they
are written into the cache beyond the row's committed length, where they are stale. The
verdict equals the padding-free one; the cost reports the wasted slots.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runner import PackedLayout
from ..types import VerifyCost
from .base import Verifier, chain_layout

PAD_TOKEN_FOR_MODEL = 0  # any valid id: pad slots' outputs are never read


class PaddedVerifier(Verifier):
    def score(self, runner, batch, rows, chains, num_draft, tree=None):
        num_rows, grid_width = chains.shape
        width = int(num_draft.max(initial=0)) + 1  # the longest chain of the step
        layout: PackedLayout = chain_layout(batch, rows, np.full(num_rows, width, dtype=np.int64))
        input_ids = chains[:, :width].clamp(min=PAD_TOKEN_FOR_MODEL).reshape(-1)  # [A * width]
        logits = runner.forward(input_ids, layout).view(num_rows, width, -1)  # [A, width, V]
        if width < grid_width:  # slots no row uses: never read by the acceptance rule
            logits = torch.nn.functional.pad(logits, (0, 0, 0, grid_width - width))
        computed = num_rows * width
        return logits, VerifyCost(target_tokens=computed, padding_tokens=computed - int((num_draft + 1).sum()))
