"""PaddingFreeVerifier: rows' chains packed back to back, so the target's forward pass
computes no pad token at all (the ragged layout BASS and SmartSpec argue for).

Invariant: the packed pass holds exactly sum(1 + k_r) tokens; its logits are scattered back to
the [A, K+1] grid the acceptance rule reads. Verdicts equal the padded verifier's.
"""

from __future__ import annotations

import numpy as np

from ..transfer import to_device

from ..types import VerifyCost
from .base import Verifier, chain_layout


class PaddingFreeVerifier(Verifier):
    def score(self, runner, batch, rows, chains, num_draft):
        num_rows, width = chains.shape
        chain_lengths = num_draft + 1  # [A]
        layout = chain_layout(batch, rows, chain_lengths)
        cost = VerifyCost(target_tokens=layout.num_tokens, padding_tokens=0)
        if np.all(chain_lengths == width):  # every chain full: the packed order is the grid's
            return runner.forward(chains.reshape(-1), layout).view(num_rows, width, -1), cost
        slot = np.arange(width)
        grid_rows, grid_cols = np.nonzero(slot[None, :] < chain_lengths[:, None])  # packed order: row by row
        flat_index = to_device(grid_rows * width + grid_cols, runner.device)  # [N]
        packed_logits = runner.forward(chains.reshape(-1)[flat_index], layout)  # [N, V]
        logits = packed_logits.new_zeros(num_rows * width, packed_logits.shape[-1])
        logits[flat_index] = packed_logits
        return logits.view(num_rows, width, -1), cost
