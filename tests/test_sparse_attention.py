"""Static sparse attention (sink + window, runner.SparseLayout): the reference backend equals a
per-query loop over the keys the rule names; the fast kernel equals the reference on random
ragged rows with windows shorter and longer than the rows, unsplit and in split-KV shares, and
never reads a value outside the sink and the window. (experiments/kernel_on_cpu.py runs the same
kernel under Triton's interpreter on a CPU.)"""

import types

import numpy as np
import pytest
import torch

from specdec.attention import fast_attention, reference_attention
from specdec.cache import KVCache
from specdec.runner import ModelRunner, PackedLayout, SparseLayout, packed_metadata
from tests.tiny import make_model


def run_backend(backend, layout, cache, query, key, value, sparse, window=None, kv_splits=1):
    meta = packed_metadata(layout, cache, query.device, backend, sparse=sparse, kv_splits=kv_splits)
    return backend(types.SimpleNamespace(layer_idx=0), query, key, value, meta, query.shape[-1] ** -0.5, window)


def random_pass(seed, counts, dtype=torch.float64, device="cpu", heads=4, kv_heads=2, head_dim=8, max_start=90):
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, dtype=np.int64)
    num_rows = len(counts) + 2
    rows = rng.permutation(num_rows)[: len(counts)]
    starts = rng.integers(0, max_start, size=len(counts))
    layout = PackedLayout(rows=rows, starts=starts, counts=counts)
    max_len = int((starts + counts).max()) + 3
    generator = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=dtype)  # noqa: E731
    history = (randn(num_rows, kv_heads, max_len, head_dim), randn(num_rows, kv_heads, max_len, head_dim))
    n = layout.num_tokens
    qkv = randn(1, heads, n, head_dim), randn(1, kv_heads, n, head_dim), randn(1, kv_heads, n, head_dim)
    return rng, layout, history, qkv


def fresh_cache(history, num_rows, max_len):
    cache = KVCache(1, num_rows, max_len)
    cache.keys[0], cache.values[0] = history[0].clone(), history[1].clone()
    return cache


def loop_oracle(layout, history, qkv, sink, window_starts, window=None):
    """Each query's softmax over exactly the keys of its row that the sparse rule names: slot <=
    its own, and below the sink or at its group's window start or later (and in the model's
    sliding window, if any)."""
    query, key, value = qkv
    keys, values = history[0].clone(), history[1].clone()
    heads, kv_heads = query.shape[1], key.shape[1]
    out = torch.zeros(query.shape[2], heads, query.shape[3], dtype=query.dtype)
    n = 0
    for row, start, count in zip(layout.rows, layout.starts, layout.counts):
        for i in range(count):
            keys[row, :, start + i], values[row, :, start + i] = key[0, :, n], value[0, :, n]
            n += 1
    n = 0
    for g, (row, start, count) in enumerate(zip(layout.rows, layout.starts, layout.counts)):
        for i in range(count):
            p = start + i
            seen = [j for j in range(p + 1) if (j < sink or j >= window_starts[g]) and (window is None or j > p - window)]
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = keys[row, kv, seen] @ query[0, h, n] * query.shape[-1] ** -0.5
                out[n, h] = scores.softmax(0) @ values[row, kv, seen]
            n += 1
    return out[None]


@pytest.mark.parametrize("sink", [0, 1, 4])
@pytest.mark.parametrize("window", [3, 40, 1000])
@pytest.mark.parametrize("model_window", [None, 25])
def test_the_reference_attends_to_the_sink_and_the_window_only(sink, window, model_window):
    counts = [1, 3, 1, 5, 2]
    rng, layout, history, qkv = random_pass(sink * 100 + window, counts)
    sparse = SparseLayout.trailing(layout, sink, window)
    cache = fresh_cache(history, len(counts) + 2, history[0].shape[2])
    actual = run_backend(reference_attention, layout, cache, *qkv, sparse, model_window)
    expected = loop_oracle(layout, history, qkv, sink, sparse.window_starts, model_window)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_a_window_that_covers_the_row_is_dense_attention():
    rng, layout, history, qkv = random_pass(7, [1, 4, 2])
    caches = [fresh_cache(history, 5, history[0].shape[2]) for _ in range(2)]
    dense = run_backend(reference_attention, layout, caches[0], *qkv, None)
    covered = run_backend(reference_attention, layout, caches[1], *qkv, SparseLayout.trailing(layout, 2, 10_000))
    assert torch.equal(dense, covered)
    narrow = run_backend(reference_attention, layout, caches[1], *qkv, SparseLayout.trailing(layout, 2, 4))
    assert not torch.allclose(dense, narrow)  # the rule changes the output once it drops keys


def test_bad_sparse_layouts_are_refused():
    model = make_model("llama")
    runner = ModelRunner(model, max_rows=2, max_len=32)
    layout = PackedLayout(rows=np.array([0, 1]), starts=np.array([0, 0]), counts=np.array([3, 2]))
    ids = torch.tensor([1, 2, 3, 4, 5])
    with runner.attached():
        with pytest.raises(ValueError, match="one window start per group"):
            runner.forward(ids, layout, sparse=SparseLayout(sink=1, window_starts=np.array([0])))
        with pytest.raises(ValueError, match="must be non-negative"):
            runner.forward(ids, layout, sparse=SparseLayout(sink=-1, window_starts=np.array([0, 0])))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (32, 8, 128), (6, 2, 80)])
@pytest.mark.parametrize("kind", ["decode", "draft block", "prefill"])
@pytest.mark.parametrize("sink,window,kv_splits", [(1, 64, 1), (16, 100, 4), (0, 7, 1), (4, 5000, 4)])
def test_fast_sparse_equals_reference_and_reads_nothing_else(dtype, tolerance, heads, kv_heads, head_dim, kind, sink,
                                                              window, kv_splits):
    counts = {"decode": [1] * 12, "draft block": [1, 6, 3, 5, 2, 4], "prefill": [150, 37, 260]}[kind]
    rng, layout, history, qkv = random_pass(hash((heads, kind, sink, window)) % 2**31, counts, dtype=dtype,
                                            device="cuda", heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                            max_start=900)
    num_rows, max_len = len(counts) + 2, history[0].shape[2]
    sparse = SparseLayout.trailing(layout, sink, window)
    expected = run_backend(reference_attention, layout, fresh_cache(history, num_rows, max_len), *qkv, sparse)
    # NaN in every slot the rule excludes: a kernel that read one of those values would return NaN
    poisoned = fresh_cache(history, num_rows, max_len)
    for row, start, window_start in zip(layout.rows, layout.starts, sparse.window_starts):
        for cache in (poisoned.keys[0], poisoned.values[0]):
            cache[row, :, min(sink, window_start):window_start] = float("nan")
    actual = run_backend(fast_attention, layout, poisoned, *qkv, sparse, kv_splits=kv_splits)
    assert torch.isfinite(actual).all()
    error = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert error < tolerance


@pytest.mark.cuda
@pytest.mark.parametrize("with_tree", [False, True], ids=["model window", "tree masks"])
def test_fast_sparse_with_a_model_window_or_tree_masks_equals_reference(with_tree):
    """The sparse rule combines with the model's own sliding window, and with tree masks (a tree
    and a sliding window together are refused, see test_tree_exact)."""
    from specdec.runner import TreeLayout

    counts = [3, 4, 2]
    rng, layout, history, qkv = random_pass(11, counts, dtype=torch.float32, device="cuda", max_start=300)
    masks = torch.tensor([1, 3, 5, 1, 3, 7, 9, 1, 3], device="cuda")  # chains and a fork, bits from each group's start
    tree = TreeLayout(positions=None, masks=masks, tree_starts=layout.starts.copy()) if with_tree else None
    sparse = SparseLayout.trailing(layout, 2, 30)
    results = []
    for backend in (reference_attention, fast_attention):
        meta = packed_metadata(layout, fresh_cache(history, 5, history[0].shape[2]), qkv[0].device, backend,
                               tree=tree, sparse=sparse)
        results.append(backend(types.SimpleNamespace(layer_idx=0), *qkv, meta, 8 ** -0.5, None if with_tree else 20))
    error = (results[1] - results[0]).norm() / results[0].norm()
    assert torch.isfinite(results[1]).all() and error < 2e-5


def poison_allocator(*tensors_like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill tensors of these shapes and dtypes with NaN and free them: the caching allocator hands
    their blocks to the next allocations of those sizes, which torch.empty leaves as they are."""
    poisoned = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in tensors_like]
    del poisoned


@pytest.mark.cuda
@pytest.mark.parametrize("kv_splits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("row_start", [None, 100], ids=["long row", "row shorter than the shares"])
def test_a_query_alone_and_in_a_verify_group_gets_the_same_output_bitwise(dtype, kv_splits, row_start):
    """Split-KV shares are assigned by absolute key block, and each (token, head) is combined from
    its own shares only, so a query's output does not depend on the other queries of its pass:
    decoding a token, verifying it inside a group, and doing so with graph filler tokens in no
    group beside it (a larger bucket) agree bitwise; the filler tokens get zeros, even where the
    split kernel's uninitialised buffers held NaN."""
    # two query heads a KV head: one token (2 rows) and five (10) both fill one 16-row block
    rng, layout, history, qkv = random_pass(6, [5], dtype=dtype, device="cuda", heads=4, kv_heads=2, head_dim=64,
                                            max_start=3000)
    if row_start is not None:  # fewer key blocks than shares for 4 and 8: some shares see no key
        layout = PackedLayout(rows=layout.rows, starts=np.array([row_start]), counts=layout.counts)
    cache = fresh_cache(history, 3, history[0].shape[2])
    full = packed_metadata(layout, cache, qkv[0].device, fast_attention, kv_splits=kv_splits)
    cache.write(0, full.token_rows, full.token_positions, qkv[1][0], qkv[2][0])  # all five keys, in both cases
    from specdec.triton_attention import packed_attention

    fillers = 11
    outputs = []
    for first, padding in ((4, 0), (0, 0), (0, fillers)):  # the last query alone, all five, five and filler
        sub = PackedLayout(rows=layout.rows, starts=layout.starts + first, counts=layout.counts - first)
        meta = packed_metadata(sub, cache, qkv[0].device, fast_attention, kv_splits=kv_splits)
        query = torch.cat([qkv[0][0][:, first:], torch.randn(4, padding, 64, device="cuda").to(dtype)], dim=1)
        positions = torch.cat([meta.token_positions, torch.zeros(padding, dtype=torch.int64, device="cuda")])
        tokens = query.shape[1]
        poison_allocator(((tokens, 4, 64), dtype), ((kv_splits, tokens, 4, 64), torch.float32))
        outputs.append(packed_attention(query.transpose(0, 1), cache.keys[0], cache.values[0], positions,
                                        meta.group_rows, meta.group_first_token, meta.group_counts,
                                        meta.max_group_tokens, 0.125, kv_splits=kv_splits))
    if row_start is None:
        assert layout.starts[0] + 5 > 64 * kv_splits  # the row spans every share
    alone, group, padded = outputs
    assert torch.equal(alone[-1], group[-1])
    assert torch.equal(group, padded[:5])
    assert torch.equal(padded[5:], torch.zeros_like(padded[5:]))
