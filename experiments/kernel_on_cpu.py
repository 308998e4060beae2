"""The Triton kernels on the CPU, under Triton's interpreter: the attention kernel against the
reference backend (causal, sliding window, static sparse (sink + window), tree masks and split-KV
shares with their combine, on random ragged passes, float32), the split kernel against the
unsplit one, tokens in no group (graph filler) getting zeros, the combine skipping shares that saw
no key without reading their outputs, and the fused cache write (triton_cache) against the torch
one. For developing the kernels on a machine without a GPU:

    pip install triton==3.6.0 && TRITON_INTERPRET=1 python experiments/kernel_on_cpu.py

The interpreter computes tl.dot with numpy, so it checks values, not bitwise properties (those
are checked on the GPU: tests/test_sparse_attention.py). (Triton 3.6's interpreter turns loop
bounds into ints with int() of a 1-element array, which numpy 2 refuses; where it does, change
`int(self.handle.data)` to `int(self.handle.data.reshape(-1)[0])` in triton/runtime/interpreter.py.)
"""

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from specdec.attention import reference_attention  # noqa: E402
from specdec.runner import SparseLayout, TreeLayout, packed_metadata  # noqa: E402
from specdec import cache as cache_module  # noqa: E402
from specdec.triton_attention import combine_shares, packed_attention  # noqa: E402
from specdec.triton_cache import store_kv  # noqa: E402
from tests.test_sparse_attention import fresh_cache, random_pass, run_backend  # noqa: E402


def error(counts, sparse_args, splits, window, tree, seed=0, heads=4, kv_heads=2, head_dim=16):
    """-> (largest difference from the reference, the kernel's output [1, N, H, D])."""
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
    return float((actual[None] - expected).abs().max()), actual[None]


def filler_error(splits: int, seed: int = 1, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 fillers: int = 3) -> tuple[float, float]:
    """A pass whose last ``fillers`` tokens are in no group (as a graph bucket's filler beyond the
    filler group): -> (largest magnitude of their outputs, largest difference of the real tokens'
    outputs from the same pass without them)."""
    counts = [3, 1, 2]
    rng, layout, history, qkv = random_pass(seed, counts, dtype=torch.float32, heads=heads, kv_heads=kv_heads,
                                            head_dim=head_dim, max_start=300)
    cache = fresh_cache(history, len(counts) + 2, history[0].shape[2])
    meta = packed_metadata(layout, cache, torch.device("cpu"), None)
    cache.write(0, meta.token_rows, meta.token_positions, qkv[1][0], qkv[2][0])
    query = qkv[0][0].transpose(0, 1)  # [N, H, D]
    n = query.shape[0]
    padded = torch.cat([query, torch.randn(fillers, heads, head_dim)])  # [N + F, H, D]
    positions = torch.cat([meta.token_positions, torch.zeros(fillers, dtype=torch.int64)])
    outputs = [packed_attention(q, cache.keys[0], cache.values[0], p, meta.group_rows, meta.group_first_token,
                                meta.group_counts, meta.max_group_tokens, head_dim ** -0.5, kv_splits=splits)
               for q, p in ((query, meta.token_positions), (padded, positions))]
    assert torch.isfinite(outputs[1]).all()
    return float(outputs[1][n:].abs().max()), float((outputs[1][:n] - outputs[0]).abs().max())


def combine_error(splits: int = 4, tokens: int = 5, heads: int = 3, head_dim: int = 20, block_d: int = 32) -> float:
    """The combine kernel against the formula in torch, with shares that saw no key (sum 0) whose
    outputs hold NaN (never written): the kernel must not read them. A token with every share
    empty gets zeros."""
    part_out = torch.randn(splits, tokens, heads, block_d)  # [S, N, H, Dp]
    maxima, sums = torch.randn(splits, tokens, heads) * 3, torch.rand(splits, tokens, heads) + 0.5  # [S, N, H]
    empty = torch.rand(splits, tokens, heads) < 0.4
    empty[:, -1] = True  # the last token: no share saw a key
    sums[empty], maxima[empty] = 0.0, 0.0
    part_out[empty] = float("nan")
    part_ml = torch.stack([maxima, sums], dim=-1)  # [S, N, H, 2]
    out = torch.full((tokens, heads, head_dim), float("nan"))
    combine_shares(part_out, part_ml, out)
    top = maxima.masked_fill(empty, float("-inf")).amax(dim=0)  # [N, H]
    weights = torch.exp(maxima - top.nan_to_num(neginf=0.0)).masked_fill(empty, 0.0)  # [S, N, H]
    total = (weights * sums).sum(dim=0)  # [N, H]
    numerator = (weights[..., None] * part_out.nan_to_num(nan=0.0)).sum(dim=0)[..., :head_dim]
    expected = numerator / torch.where(total == 0, 1.0, total)[..., None]
    assert torch.isfinite(out).all() and torch.equal(out[-1], torch.zeros_like(out[-1]))
    return float((out - expected).abs().max())


def store_mismatches() -> int:
    """The fused cache write against the torch one: keys and values laid out as a model hands
    them over ([N, Hkv, D] projected, viewed as [Hkv, N, D]) and contiguous, float32, float16 and
    bfloat16, head sizes a power of two and not: -> how many cache elements differ."""
    wrong = 0
    for dtype, tokens, head_dim, strided in ((torch.float32, 7, 16, True), (torch.float16, 1, 80, True),
                                             (torch.bfloat16, 5, 64, True), (torch.float32, 3, 8, False)):
        rows, kv_heads, length = 4, 3, 12
        history = torch.randn(2, rows, kv_heads, length, head_dim).to(dtype)  # keys, values
        slots = torch.randperm(rows * length)[:tokens]
        token_rows, token_positions = slots // length, slots % length  # distinct (row, position) pairs
        new = torch.randn(2, tokens, kv_heads, head_dim).to(dtype).transpose(1, 2)  # [2, Hkv, N, D]
        new = new if strided else new.contiguous()
        caches = [history.clone(), history.clone()]
        cache_module.store(caches[0][0], caches[0][1], token_rows, token_positions, new[0], new[1])  # torch (CPU)
        store_kv(caches[1][0], caches[1][1], token_rows, token_positions, new[0], new[1])
        wrong += int((caches[0] != caches[1]).sum())
    return wrong


def main() -> int:
    torch.manual_seed(0)
    worst = apart = 0.0
    cases = itertools.product(([1], [1] * 6, [3, 1, 5], [40, 2]), (None, (1, 20), (4, 100)), (None, 30),
                              (False, True))
    for counts, sparse, window, tree in cases:
        if tree and window is not None:
            continue  # refused by design (a window counts positions, tree slots are not positions)
        unsplit = None
        for splits in (1, 2, 4, 8):
            difference, output = error(counts, sparse, splits, window, tree)
            worst = max(worst, difference)
            unsplit = output if unsplit is None else unsplit
            apart = max(apart, float((output - unsplit).abs().max()))
    print(f"largest difference from the reference: {worst:.2e}; split from unsplit: {apart:.2e}")
    filler = [filler_error(splits) for splits in (1, 2, 4, 8)]
    filler_out, filler_shift = max(f[0] for f in filler), max(f[1] for f in filler)
    print(f"tokens in no group: largest output {filler_out:.2e}; real tokens moved by {filler_shift:.2e}")
    combined = max(combine_error(splits) for splits in (2, 4, 8))
    print(f"combine against torch, empty shares holding NaN: largest difference {combined:.2e}")
    wrong = store_mismatches()
    print(f"fused cache write against the torch one: {wrong} elements differ")
    return 0 if worst < 1e-5 and apart < 1e-5 and filler_out == 0 and filler_shift < 1e-5 and combined < 1e-5 and wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
