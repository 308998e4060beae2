"""DecomposedVerifier: SPIN's request decomposition for batch verification (Chen et al. 2025,
ALGORITHMS.md §2). Rows draft chains of different lengths; padding every chain to the longest
wastes the difference. Here each row's chain (its last committed token and its draft, 1 + k_r
tokens) is cut into pieces of one width w, the last piece of a row padded to w, and the pieces
form a rectangular [P, w] pass; a piece attends to the cache entries the earlier pieces of its
row write in the same pass (the attention reads a row's keys by position).

The width is chosen per step: the w in 1..max(1 + k_r) that minimises the pass's slots,
sum_r ceil((1 + k_r) / w) * w, plus ``piece_cost`` slots for each piece (what one more group
of the pass costs against one more token), the wider on ties. With piece_cost 0 that is the
widest width that leaves no padding (1 at worst: a piece per token); with a large one, one piece
a row, the padded layout.

Invariant: the verdict equals the padded and padding-free verifiers' (the same slots are
scored; pad slots sit after a row's chain, where no real query attends, and their cache
entries lie beyond the row's committed length, stale). Cost: P * w target tokens, of which
P * w - sum_r (1 + k_r) padding (VerifyCost). Under CUDA graphs the Engine captures its graphs
for as many groups as tokens (Verifier.cuts_rows), so a pass of pieces is replayed too.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runner import PackedLayout
from ..transfer import to_device
from ..types import VerifyCost
from .base import Verifier
from .padded import PAD_TOKEN_FOR_MODEL


def piece_width(chain_lengths: np.ndarray, piece_cost: float) -> int:
    """The piece width for chains of ``chain_lengths`` [A] tokens (module docstring)."""
    lengths = np.asarray(chain_lengths, dtype=np.int64)
    widths = np.arange(1, int(lengths.max(initial=1)) + 1)  # [W]
    pieces = -(-lengths[None, :] // widths[:, None])  # [W, A]
    cost = (pieces * widths[:, None]).sum(axis=1) + piece_cost * pieces.sum(axis=1)  # [W]
    return int(widths[np.flatnonzero(cost == cost.min())[-1]])  # the widest of the cheapest


class DecomposedVerifier(Verifier):
    cuts_rows = True

    def __init__(self, piece_cost: float = 1.0):
        """piece_cost: what one more piece (a group of the pass) costs, in target tokens."""
        if isinstance(piece_cost, bool) or not isinstance(piece_cost, (int, float)) or not piece_cost >= 0:
            raise ValueError(f"piece_cost must be a number >= 0 (target tokens a piece is worth), got {piece_cost!r}")
        self.piece_cost = float(piece_cost)

    def score(self, runner, batch, rows, chains, num_draft, tree=None):
        num_rows, grid_width = chains.shape
        chain_lengths = num_draft + 1  # [A]
        width = piece_width(chain_lengths, self.piece_cost)
        pieces = -(-chain_lengths // width)  # [A] pieces of each row
        first_piece = np.cumsum(pieces) - pieces  # [A] the pass's index of each row's first piece
        index_in_row = np.arange(pieces.sum()) - np.repeat(first_piece, pieces)  # [P]
        layout = PackedLayout(rows=np.repeat(rows, pieces), counts=np.full(int(pieces.sum()), width, dtype=np.int64),
                              starts=np.repeat(batch.lengths[rows] - 1, pieces) + index_in_row * width)
        # [P, w] the pieces' tokens: row r's chain slots j*w .. j*w + w - 1, pad slots past its chain
        padded_width = int(pieces.max(initial=1)) * width
        grid = chains.clamp(min=PAD_TOKEN_FOR_MODEL)  # [A, K+1]; PAD_ID slots become a valid id
        if padded_width > grid_width:
            grid = torch.nn.functional.pad(grid, (0, padded_width - grid_width), value=PAD_TOKEN_FOR_MODEL)
        columns = index_in_row[:, None] * width + np.arange(width)  # [P, w]
        flat = np.repeat(np.arange(num_rows), pieces)[:, None] * grid.shape[1] + columns  # [P, w] into grid
        packed_logits = runner.forward(grid.reshape(-1)[to_device(flat.reshape(-1), grid.device)], layout)  # [P*w, V]
        # row r's slot c sits at (first_piece[r] * w + c) of the pass (its pieces are consecutive)
        slots = np.minimum(first_piece[:, None] * width + np.arange(grid_width), len(packed_logits) - 1)  # [A, K+1]
        logits = packed_logits[to_device(slots.reshape(-1), packed_logits.device)].view(num_rows, grid_width, -1)
        computed = int(pieces.sum()) * width
        return logits, VerifyCost(target_tokens=computed, padding_tokens=computed - int(chain_lengths.sum()))

    def __repr__(self) -> str:
        return f"DecomposedVerifier(piece_cost={self.piece_cost})"
