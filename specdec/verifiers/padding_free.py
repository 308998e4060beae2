"""PaddingFreeVerifier: rows' chains packed back to back, so the target's forward pass
computes no pad token at all (the ragged layout BASS and SmartSpec argue for).

Invariant: the packed pass holds exactly sum(1 + k_r) tokens; its logits are scattered back to
the [A, K+1] grid the acceptance rule reads. Verdicts equal the padded verifier's.
"""

from __future__ import annotations

import numpy as np

from ..transfer import to_device

from ..runner import TreeLayout
from ..types import VerifyCost
from .base import Verifier, chain_layout


class PaddingFreeVerifier(Verifier):
    def score(self, runner, batch, rows, chains, num_draft, tree=None):
        num_rows, width = chains.shape
        chain_lengths = num_draft + 1  # [A]
        layout = chain_layout(batch, rows, chain_lengths)
        cost = VerifyCost(target_tokens=layout.num_tokens, padding_tokens=0)
        tree_layout = None
        if np.all(chain_lengths == width):  # every chain full: the packed order is the grid's
            if tree is not None:
                tree_layout = TreeLayout(positions=tree[0].reshape(-1), masks=tree[1].reshape(-1),
                                         tree_starts=layout.starts + 1)
            return runner.forward(chains.reshape(-1), layout, tree=tree_layout).view(num_rows, width, -1), cost
        slot = np.arange(width)
        grid_rows, grid_cols = np.nonzero(slot[None, :] < chain_lengths[:, None])  # packed order: row by row
        flat_index = to_device(grid_rows * width + grid_cols, runner.device)  # [N]
        if tree is not None:  # the tree starts after the root, at the row's committed length
            tree_layout = TreeLayout(positions=tree[0].reshape(-1)[flat_index], masks=tree[1].reshape(-1)[flat_index],
                                     tree_starts=layout.starts + 1)
        packed_logits = runner.forward(chains.reshape(-1)[flat_index], layout, tree=tree_layout)  # [N, V]
        logits = packed_logits.new_zeros(num_rows * width, packed_logits.shape[-1])
        logits[flat_index] = packed_logits
        return logits.view(num_rows, width, -1), cost


class TreeVerifier(PaddingFreeVerifier):
    """Token trees (SpecInfer, Miao et al. 2023; Sequoia; EAGLE-2), packed without padding: each
    row's root and nodes are one group of the pass, node i at position length + depth attending
    to the committed prefix and its own ancestors (an ancestor bitmask per node, up to 64 nodes a
    row); the tree rule (sampling.tree_verdict) picks the accepted path, whose cache entries move
    into place (KVCache.compact). Chains pass as they do through PaddingFreeVerifier, and rows
    with chains and rows with trees share a pass. Cost over a chain of as many nodes: the
    acceptance walk (one tensor round per node tried when sampling) and the compaction copy."""

    verifies_trees = True
