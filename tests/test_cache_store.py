"""The KV cache write (cache.store): each token's key and value land at (row, position) of every
KV head and nothing else changes; on a GPU the one Triton kernel (triton_cache, FUSED_STORE)
writes bitwise what the two index_put writes do, for the layouts a model hands over, inside a
CUDA graph too, and on a GPU other than the current one."""

import pytest
import torch

from specdec import cache as cache_module


def random_write(tokens: int, head_dim: int, dtype: torch.dtype, device: str, strided: bool = True,
                 rows: int = 5, kv_heads: int = 3, length: int = 40, seed: int = 0):
    """-> caches (keys, values) [2, R, Hkv, L, D], token rows and positions [N] (distinct pairs),
    new keys and values [2, Hkv, N, D]: strided as a model's ([N, Hkv, D] viewed), or contiguous."""
    generator = torch.Generator().manual_seed(seed)
    caches = torch.randn(2, rows, kv_heads, length, head_dim, generator=generator).to(device=device, dtype=dtype)
    slots = torch.randperm(rows * length, generator=generator)[:tokens].to(device)
    new = torch.randn(2, tokens, kv_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    new = new.transpose(1, 2)  # [2, Hkv, N, D]
    return caches, slots // length, slots % length, new if strided else new.contiguous()


def test_store_writes_each_token_at_its_row_and_position_only():
    caches, rows, positions, new = random_write(7, 8, torch.float64, "cpu")
    expected = caches.clone()
    for n in range(7):
        expected[:, rows[n], :, positions[n]] = new[:, :, n]
    cache_module.store(caches[0], caches[1], rows, positions, new[0], new[1])
    assert torch.equal(caches, expected)


def _both_ways(caches, rows, positions, new, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the caches after the index_put writes, and after the fused kernel."""
    results = []
    for fused in (False, True):
        monkeypatch.setattr(cache_module, "FUSED_STORE", fused)
        written = caches.clone()
        cache_module.store(written[0], written[1], rows, positions, new[0], new[1])
        results.append(written)
    return results[0], results[1]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("tokens", [1, 2, 37, 200])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
@pytest.mark.parametrize("strided", [True, False], ids=["model layout", "contiguous"])
def test_fused_store_equals_index_put(dtype, tokens, head_dim, strided, monkeypatch):
    caches, rows, positions, new = random_write(tokens, head_dim, dtype, "cuda", strided, length=60)
    torch_written, fused_written = _both_ways(caches, rows, positions, new, monkeypatch)
    assert not torch.equal(torch_written, caches)  # something was written
    assert torch.equal(fused_written, torch_written)


@pytest.mark.cuda
def test_fused_store_replays_from_a_cuda_graph():
    """Captured once, a replay writes the tokens whose rows, positions, keys and values the static
    buffers hold at replay time."""
    caches, rows, positions, new = random_write(9, 64, torch.bfloat16, "cuda")
    static = [rows.clone(), positions.clone(), new.clone()]
    target = caches.clone()
    cache_module.store(target[0], target[1], *static[:2], static[2][0], static[2][1])  # compiles the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache_module.store(target[0], target[1], *static[:2], static[2][0], static[2][1])
    _, rows, positions, new = random_write(9, 64, torch.bfloat16, "cuda", seed=1)
    for buffer, value in zip(static, (rows, positions, new)):
        buffer.copy_(value)
    target.copy_(caches)
    graph.replay()
    expected = caches.clone()
    expected[0][rows, :, positions] = new[0].transpose(0, 1)
    expected[1][rows, :, positions] = new[1].transpose(0, 1)
    assert torch.equal(target, expected)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fused_store_writes_a_cache_on_another_gpu_than_the_current_one(monkeypatch):
    """A model split over GPUs (device_map) runs its later layers while cuda:0 is current."""
    caches, rows, positions, new = random_write(5, 64, torch.float32, "cuda:1")
    with torch.cuda.device(0):
        torch_written, fused_written = _both_ways(caches, rows, positions, new, monkeypatch)
    assert torch.equal(fused_written, torch_written)
