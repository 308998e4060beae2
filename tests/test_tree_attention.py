"""Tree attention on the packed path: each node of a token tree, at position length + depth and
attending to the committed prefix and its own ancestors, gets exactly the logits the model's own
full forward gives its root-to-node sequence; after KVCache.compact the accepted path's entries
serve the next pass as if the path had been decoded token by token. Both backends (the fast
kernel under -m cuda), rows with trees and chains in one pass, ragged prompts."""

import numpy as np
import pytest
import torch

from specdec.runner import ModelRunner, PackedLayout, TreeLayout
from specdec.sampling import tree_reach
from specdec.verifiers.base import compact_accepted_path, tree_grid
from tests.tiny import ARCHS, device_params, make_model


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0]


def ancestry(parents, node):
    """Nodes from the root's child down to ``node``."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


# per row: (prompt length, tree tokens, parents); row 1 is a chain, row 2 a bushy tree
TREES = [
    (7, [11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 1, 3]),
    (3, [21, 22, 23, 24], [-1, 0, 1, 2]),
    (12, [31, 32, 33, 34, 35, 36, 37, 38], [-1, -1, -1, 0, 0, 2, 5, 5]),
]


def _tree_pass(model, device, attention):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n, _, _ in TREES]
    runner = ModelRunner(model, max_rows=len(TREES), max_len=64, attention=attention)
    width = max(len(tokens) for _, tokens, _ in TREES)
    tokens = torch.full((len(TREES), width), 0, dtype=torch.int64)
    parents = torch.full((len(TREES), width), -1, dtype=torch.int64)
    for row, (_, row_tokens, row_parents) in enumerate(TREES):
        tokens[row, : len(row_tokens)] = torch.tensor(row_tokens)
        parents[row, : len(row_parents)] = torch.tensor(row_parents)
    num_nodes = torch.tensor([len(t) for _, t, _ in TREES])
    lengths = torch.tensor([len(p) for p in prompts])  # committed; the root is the last prompt token
    rows = np.arange(len(TREES))
    with runner.attached():
        prefix_counts = lengths.numpy() - 1
        runner.forward(torch.tensor([t for p in prompts for t in p[:-1]], device=device),
                       PackedLayout(rows, np.zeros(len(rows), dtype=np.int64), prefix_counts))
        positions, masks = tree_grid(tree_reach(parents, num_nodes), lengths)  # [3, width + 1] each
        counts = num_nodes.numpy() + 1
        packed = [(r, j) for r in rows for j in range(counts[r])]
        grid_tokens = torch.cat([lengths.new_tensor([p[-1] for p in prompts])[:, None], tokens], dim=1)
        pick = lambda grid: torch.stack([grid[r, j] for r, j in packed]).to(device)  # noqa: E731
        layout = PackedLayout(rows, lengths.numpy() - 1, counts)
        tree = TreeLayout(positions=pick(positions), masks=pick(masks), tree_starts=lengths.numpy())
        logits = runner.forward(pick(grid_tokens), layout, tree=tree)
    return runner, prompts, tokens, parents, lengths, logits, packed


@pytest.mark.parametrize("device,dtype", device_params())
@pytest.mark.parametrize("arch", ARCHS)
def test_each_tree_node_gets_the_logits_of_its_own_path(arch, device, dtype):
    model = make_model(arch, dtype=dtype, device=device)
    attention = "fast" if device == "cuda" else "reference"
    _, prompts, _, _, _, logits, packed = _tree_pass(model, device, attention)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-4
    for index, (row, slot) in enumerate(packed):
        _, row_tokens, row_parents = TREES[row]
        path = [] if slot == 0 else ancestry(row_parents, slot - 1)
        sequence = prompts[row] + [row_tokens[node] for node in path]
        torch.testing.assert_close(logits[index], full_logits(model, sequence)[-1], atol=tolerance, rtol=0)


@pytest.mark.parametrize("device,dtype", device_params())
def test_the_compacted_path_serves_the_next_pass(device, dtype):
    """Keep one root-to-leaf path per row (not the first nodes: row 2's is nodes 2, 5, 7), compact,
    then feed one more token after it: its logits are those of the full sequence. Without the
    compaction the next token would read the wrong nodes' keys."""
    model = make_model("llama", dtype=dtype, device=device)
    attention = "fast" if device == "cuda" else "reference"
    runner, prompts, tokens, parents, lengths, _, _ = _tree_pass(model, device, attention)
    paths = [[1, 4], [0, 1, 2], [2, 5, 7]]
    path = torch.full(tokens.shape, -1, dtype=torch.int64)
    for row, nodes in enumerate(paths):
        path[row, : len(nodes)] = torch.tensor(nodes)
    rows_t = torch.arange(len(TREES), device=device)
    extra = [90, 91, 92]
    with runner.attached():
        compact_accepted_path(runner, rows_t, lengths.to(device), path.to(device))
        starts = lengths.numpy() + np.array([len(p) for p in paths])
        logits = runner.forward(torch.tensor(extra, device=device),
                                PackedLayout(np.arange(3), starts, np.ones(3, dtype=np.int64)))
    tolerance = 1e-10 if dtype == torch.float64 else 2e-4
    for row, nodes in enumerate(paths):
        sequence = prompts[row] + [TREES[row][1][n] for n in nodes] + [extra[row]]
        torch.testing.assert_close(logits[row], full_logits(model, sequence)[-1], atol=tolerance, rtol=0)


def test_a_tree_beyond_the_mask_width_is_refused():
    model = make_model("llama")
    runner = ModelRunner(model, max_rows=1, max_len=128)
    layout = PackedLayout(np.array([0]), np.array([4]), np.array([66]))  # root + 65 nodes
    tree = TreeLayout(positions=torch.arange(66), masks=torch.zeros(66, dtype=torch.int64), tree_starts=np.array([5]))
    with runner.attached(), pytest.raises(ValueError, match="tree of 65 nodes does not fit .* 64 bits"):
        runner.forward(torch.zeros(66, dtype=torch.int64), layout, tree=tree)
