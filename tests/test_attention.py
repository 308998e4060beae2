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
@pytest.mark.parametrize("kv_splits", [2, 8])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_split_kv_shares_equal_reference(kind, kv_splits):
    """Split-KV (flash-decoding) shares, combined, give the reference's output."""
    rng = np.random.default_rng(kv_splits)
    counts = LAYOUTS[kind](rng).astype(np.int64)
    rows = np.arange(len(counts))
    starts = rng.integers(0, 3000, size=len(counts))
    layout = PackedLayout(rows=rows, starts=starts, counts=counts)
    max_len = int((starts + counts).max()) + 5
    generator = torch.Generator(device="cuda").manual_seed(kv_splits)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32)  # noqa: E731
    history = (randn(len(counts), 2, max_len, 64), randn(len(counts), 2, max_len, 64))
    n = layout.num_tokens
    query, key, value = randn(1, 8, n, 64), randn(1, 2, n, 64), randn(1, 2, n, 64)
    outputs = []
    for backend, splits in ((reference_attention, 1), (fast_attention, kv_splits)):
        cache = KVCache(1, len(counts), max_len)
        cache.keys[0], cache.values[0] = history[0].clone(), history[1].clone()
        meta = packed_metadata(layout, cache, query.device, backend, kv_splits=splits)
        outputs.append(backend(types.SimpleNamespace(layer_idx=0), query, key, value, meta, 64 ** -0.5, None))
    error = (outputs[1] - outputs[0]).norm() / outputs[0].norm()
    assert torch.isfinite(outputs[1]).all() and error < 2e-5


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
    """How many variants of the fast attention kernel this process has compiled (None where this
    Triton keeps them where we do not look)."""
    from specdec.triton_attention import _packed_attention_kernel

    caches = getattr(_packed_attention_kernel, "device_caches", None)
    if not isinstance(caches, dict):
        return None
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.cuda
def test_eager_passes_compile_no_kernel_once_the_runner_is_built():
    """A runner compiles the kernel's variants when built: an eager pass of any group size or
    token parity afterwards (a catch-up of a few tokens, a prefill of an odd count) compiles
    nothing, so a serving engine does not stall half a second on first sight of one."""
    from specdec.runner import ModelRunner

    target = make_model("llama", dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(target, max_rows=4, max_len=96, attention="fast")
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
