"""Attention backends: the fast (Triton) backend equals the reference on fresh random inputs,
for decode, verify and prefill layouts, grouped-query heads, odd head sizes and sliding
windows; generation with it equals Hugging Face's greedy decoding."""

import types

import numpy as np
import pytest
import torch

from specdec import generate
from specdec.attention import fast_attention, reference_attention
from specdec.cache import KVCache
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.runner import PackedLayout, packed_metadata
from tests.tiny import ARCHS, hf_greedy, make_model, perturbed_copy, random_prompts

LAYOUTS = {
    "decode": lambda rng: rng.integers(1, 2, size=12),
    "verify": lambda rng: rng.integers(1, 9, size=10),
    "prefill": lambda rng: rng.integers(20, 300, size=4),
}


def run_backend(backend, layout, cache, query, key, value, window):
    module = types.SimpleNamespace(layer_idx=0)
    meta = packed_metadata(layout, cache, query.device, backend)
    return backend(module, query, key, value, meta, query.shape[-1] ** -0.5, window)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (32, 8, 128), (4, 2, 8), (6, 2, 80)])
@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("window", [None, 16])
def test_fast_equals_reference(dtype, tolerance, heads, kv_heads, head_dim, kind, window):
    rng = np.random.default_rng(hash((heads, head_dim, kind, window)) % 2**32)
    counts = LAYOUTS[kind](rng).astype(np.int64)
    num_rows = len(counts) + 3
    rows = rng.permutation(num_rows)[: len(counts)]
    starts = rng.integers(0, 700, size=len(counts))
    layout = PackedLayout(rows=rows, starts=starts, counts=counts)
    max_len = int((starts + counts).max()) + 5
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(int(rng.integers(1 << 30)))
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=dtype)  # noqa: E731
    caches = []
    history = (randn(num_rows, kv_heads, max_len, head_dim), randn(num_rows, kv_heads, max_len, head_dim))
    for _ in range(2):
        cache = KVCache(1, num_rows, max_len)
        cache.keys[0], cache.values[0] = history[0].clone(), history[1].clone()
        caches.append(cache)
    n = layout.num_tokens
    query, key, value = randn(1, heads, n, head_dim), randn(1, kv_heads, n, head_dim), randn(1, kv_heads, n, head_dim)

    expected = run_backend(reference_attention, layout, caches[0], query, key, value, window)
    actual = run_backend(fast_attention, layout, caches[1], query, key, value, window)

    assert actual.shape == expected.shape == (1, n, heads, head_dim)
    assert torch.isfinite(actual).all()
    error = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert error < tolerance
    assert torch.equal(caches[0].keys[0], caches[1].keys[0]) and torch.equal(caches[0].values[0], caches[1].values[0])


@pytest.mark.cuda
@pytest.mark.parametrize("kv_splits", [2, 4, 8])
@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("longest_start", [3000, 200], ids=["long rows", "rows shorter than the shares"])
def test_split_kv_shares_equal_reference_and_the_unsplit_kernel(kind, kv_splits, longest_start):
    """Split-KV (flash-decoding) shares, merged by the combine kernel, give the reference's output
    and the unsplit kernel's, rows shorter than kv_splits key blocks included (shares that see no
    key)."""
    rng = np.random.default_rng(kv_splits)
    counts = LAYOUTS[kind](rng).astype(np.int64)
    rows = np.arange(len(counts))
    starts = rng.integers(0, longest_start, size=len(counts))
    layout = PackedLayout(rows=rows, starts=starts, counts=counts)
    max_len = int((starts + counts).max()) + 5
    generator = torch.Generator(device="cuda").manual_seed(kv_splits)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32)  # noqa: E731
    history = (randn(len(counts), 2, max_len, 64), randn(len(counts), 2, max_len, 64))
    n = layout.num_tokens
    query, key, value = randn(1, 8, n, 64), randn(1, 2, n, 64), randn(1, 2, n, 64)
    outputs = []
    for backend, splits in ((reference_attention, 1), (fast_attention, kv_splits), (fast_attention, 1)):
        cache = KVCache(1, len(counts), max_len)
        cache.keys[0], cache.values[0] = history[0].clone(), history[1].clone()
        meta = packed_metadata(layout, cache, query.device, backend, kv_splits=splits)
        outputs.append(backend(types.SimpleNamespace(layer_idx=0), query, key, value, meta, 64 ** -0.5, None))
    expected, split, unsplit = outputs
    assert torch.isfinite(split).all()
    assert (split - expected).norm() / expected.norm() < 2e-5
    assert (split - unsplit).norm() / unsplit.norm() < 2e-5


@pytest.mark.cuda
def test_split_count_splits_short_contexts_down_to_min_share(monkeypatch):
    """One row of 8 KV heads over a 512-key cache: shares of MIN_SHARE = 128 keys (4 on a GPU of at
    least 16 processors); with MIN_SHARE = 512 it runs unsplit. Always a power of two."""
    from specdec import triton_attention

    device = torch.device("cuda")
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    splits = triton_attention.split_count(1, 8, 512, device)
    assert splits & (splits - 1) == 0
    if processors >= 16:
        assert splits == 4
    assert triton_attention.split_count(1, 8, 100_000, device) * 8 <= 2 * processors
    monkeypatch.setattr(triton_attention, "MIN_SHARE", 512)
    assert triton_attention.split_count(1, 8, 512, device) == 1


@pytest.mark.cuda
def test_long_rows_decode_exactly_through_split_kv_shares():
    """Few long rows: the runner reads keys in shares (kv_splits > 1), with graphs, and greedy output
    is still Hugging Face's."""
    from specdec.runner import runners_of

    target = make_model("llama", dtype=torch.float32, device="cuda", max_positions=4096)
    prompts = [np.random.default_rng(row).integers(0, 96, size=length).tolist() for row, length in ((0, 3000), (1, 2200))]
    drafter = ModelDrafter(perturbed_copy(target, 0.1), cuda_graphs=True)
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=16, cuda_graphs=True)
    assert runners_of(target)["target"].kv_splits > 1
    assert out.sequences == [hf_greedy(target, p, 16) for p in prompts]


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_kind", ["model", "lookup"])
def test_generation_with_the_fast_backend_equals_hugging_face(arch, drafter_kind):
    target = make_model(arch, dtype=torch.float32, device="cuda")
    drafter = ModelDrafter(perturbed_copy(target, 0.1), attention="fast") if drafter_kind == "model" else PromptLookupDrafter()
    prompts = random_prompts(8, target.config.vocab_size, seed=3)
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(3), max_new_tokens=24, attention="fast")
    assert out.sequences == [hf_greedy(target, p, 24) for p in prompts]


def test_fast_backend_refuses_cpu():
    with pytest.raises(ValueError, match="fast attention backend runs on CUDA"):
        generate(make_model("llama"), [[1, 2]], max_new_tokens=2, attention="fast")


def _compiled_kernel_variants() -> int | None:
    """How many variants of the fast attention's kernels (attention, combine, cache write) this
    process has compiled (None where this Triton keeps them where we do not look)."""
    from specdec.triton_attention import _combine_kernel, _packed_attention_kernel
    from specdec.triton_cache import _store_kernel

    total = 0
    for kernel in (_packed_attention_kernel, _combine_kernel, _store_kernel):
        caches = getattr(kernel, "device_caches", None)
        if not isinstance(caches, dict):
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


@pytest.mark.cuda
@pytest.mark.parametrize("max_len", [96, 512], ids=["unsplit", "split"])
def test_eager_passes_compile_no_kernel_once_the_runner_is_built(max_len):
    """A runner compiles the kernels' variants when built: an eager pass of any group size or
    token parity afterwards (a catch-up of a few tokens, a prefill of an odd count) compiles
    nothing, so a serving engine does not stall half a second on first sight of one."""
    from specdec.runner import ModelRunner

    target = make_model("llama", dtype=torch.bfloat16, device="cuda", max_positions=max_len)
    runner = ModelRunner(target, max_rows=4, max_len=max_len, attention="fast")
    if torch.cuda.get_device_properties(0).multi_processor_count >= 16:  # 8 programs: split over 4 at 512 keys
        assert (runner.kv_splits > 1) == (max_len == 512)
    before = _compiled_kernel_variants()
    if before is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    with runner.attached():  # the model's attention writes this runner's cache
        for counts in ([1], [2], [3, 2], [7], [17], [20, 13], [33], [40, 1, 2]):
            counts = np.array(counts, dtype=np.int64)
            rows = np.arange(len(counts), dtype=np.int64)
            layout = PackedLayout(rows=rows, starts=np.zeros(len(counts), dtype=np.int64), counts=counts)
            token_ids = torch.randint(0, target.config.vocab_size, (int(counts.sum()),), device="cuda")
            runner.forward(token_ids, layout)
    torch.cuda.synchronize()
    assert _compiled_kernel_variants() == before
