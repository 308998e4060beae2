"""The Triton attention kernel on the CPU, under Triton's interpreter, against the reference
backend: causal, sliding window, static sparse (sink + window), tree masks and split-KV shares,
on random ragged passes (float32). For developing the kernel on a machine without a GPU:

    pip install triton==3.6.0 && TRITON_INTERPRET=1 python experiments/kernel_on_cpu.py

The interpreter computes tl.dot with numpy, so it checks values, not bitwise properties (those
are checked on the GPU: tests/test_sparse_attention.py). (Triton 3.6's interpreter turns loop bounds into ints with int() of a 1-element array, which
numpy 2 refuses; where it does, change `int(self.handle.data)` to
`int(self.handle.data.reshape(-1)[0])` in triton/runtime/interpreter.py.)
"""

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from specdec.attention import reference_attention  # noqa: E402
from specdec.runner import SparseLayout, TreeLayout, packed_metadata  # noqa: E402
from specdec.triton_attention import packed_attention  # noqa: E402
from tests.test_sparse_attention import fresh_cache, random_pass, run_backend  # noqa: E402


def error(counts, sparse_args, splits, window, tree, seed=0, heads=4, kv_heads=2, head_dim=16):
    rng, layout, history, qkv = random_pass(seed, counts, dtype=torch.float32, heads=heads, kv_heads=kv_heads,
                                            head_dim=head_dim, max_start=300)
    rows, length = len(counts) + 2, history[0].shape[2]
    sparse = SparseLayout.trailing(layout, *sparse_args) if sparse_args else None
    masks = None
    if tree:  # each group a chain whose last node also sees a sibling branch: bits 0..count-1, skipping one
        masks = torch.cat([torch.tensor([(1 << (i + 1)) - 1 - (2 if i >= 2 else 0) for i in range(c)]) for c in counts])
    tree_layout = TreeLayout(positions=None, masks=masks, tree_starts=layout.starts.copy()) if tree else None
    reference_cache = fresh_cache(history, rows, length)
    meta = packed_metadata(layout, reference_cache, torch.device("cpu"), reference_attention, tree=tree_layout,
                           sparse=sparse)
    import types
    expected = reference_attention(types.SimpleNamespace(layer_idx=0), *qkv, meta, head_dim ** -0.5, window)
    cache = fresh_cache(history, rows, length)
    meta = packed_metadata(layout, cache, torch.device("cpu"), None, tree=tree_layout, sparse=sparse)
    cache.write(0, meta.token_rows, meta.token_positions, qkv[1][0], qkv[2][0])
    actual = packed_attention(qkv[0][0].transpose(0, 1), cache.keys[0], cache.values[0], meta.token_positions,
                              meta.group_rows, meta.group_first_token, meta.group_counts, meta.max_group_tokens,
                              head_dim ** -0.5, window, meta.token_tree_mask, meta.group_tree_start,
                              meta.group_sink_end, meta.group_window_start, kv_splits=splits)
    return float((actual[None] - expected).abs().max())


def main() -> int:
    worst = 0.0
    cases = itertools.product(([1] * 6, [3, 1, 5], [40, 2]), (None, (1, 20), (4, 100)), (1, 2, 8), (None, 30),
                              (False, True))
    for counts, sparse, splits, window, tree in cases:
        if tree and window is not None:
            continue  # refused by design (a window counts positions, tree slots are not positions)
        worst = max(worst, error(counts, sparse, splits, window, tree))
    print(f"largest difference from the reference: {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
