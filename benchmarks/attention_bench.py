"""Attention microbenchmark on one GPU: the fast (Triton) backend against the real-KV floor.

Shapes follow DESIGN §4: 32 query heads, 8 KV heads of size 128, bf16, 8 queries per row, rows
as the batch. Each row's real length is drawn in [max_len / 2, max_len]; the floor is the bytes
that must move (real keys and values read once, queries read, outputs written) over the copy
bandwidth measured in the same run. Medians of triton.testing.do_bench.

    python benchmarks/attention_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import types

import numpy as np
import torch
import triton

from specdec.attention import fast_attention, reference_attention
from specdec.cache import KVCache
from specdec.runner import PackedLayout, packed_metadata

SHAPES = [(16, 4096), (64, 2048), (64, 8192), (128, 8192), (1, 512), (16, 512)]
HEADS, KV_HEADS, HEAD_DIM, QUERIES = 32, 8, 128, 8


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, read plus write."""
    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=50, rep=300, return_mode="median") / 1e3
    return 2 * source.numel() / seconds


def bench_shape(rows: int, max_len: int, bandwidth: float, with_reference: bool) -> dict:
    rng = np.random.default_rng(rows * max_len)
    lengths = rng.integers(max_len // 2, max_len + 1, size=rows)  # real tokens, the new ones included
    layout = PackedLayout(rows=np.arange(rows), starts=lengths - QUERIES, counts=np.full(rows, QUERIES))
    cache = KVCache(1, rows, max_len)
    shape = (rows, KV_HEADS, max_len, HEAD_DIM)
    cache.keys[0] = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    cache.values[0] = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    n = layout.num_tokens
    query = torch.randn(1, HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    key = torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    module = types.SimpleNamespace(layer_idx=0)
    result = {"rows": rows, "max_len": max_len, "mean_real_len": float(lengths.mean())}
    kv_bytes = int(lengths.sum()) * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16
    io_bytes = 2 * n * HEADS * HEAD_DIM * 2 + 2 * n * KV_HEADS * HEAD_DIM * 2  # q in, out, new k/v written
    result["floor_us"] = (kv_bytes + io_bytes) / bandwidth * 1e6
    for name, backend in (("fast", fast_attention), ("reference", reference_attention)):
        if name == "reference" and not with_reference:
            continue
        meta = packed_metadata(layout, cache, torch.device("cuda"), backend)
        call = lambda: backend(module, query, key, value, meta, HEAD_DIM ** -0.5, None)  # noqa: E731
        result[f"{name}_us"] = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
        result[f"{name}_fraction_of_floor"] = result["floor_us"] / result[f"{name}_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    results = []
    print(f"{'rows x max_len':>15} {'floor us':>9} {'fast us':>9} {'of floor':>8} {'reference us':>13}")
    for rows, max_len in SHAPES:
        r = bench_shape(rows, max_len, bandwidth, with_reference=rows * max_len <= 64 * 2048)
        results.append(r)
        ref = f"{r['reference_us']:13.1f}" if "reference_us" in r else f"{'-':>13}"
        print(f"{rows:>6} x {max_len:<6} {r['floor_us']:9.1f} {r['fast_us']:9.1f} {r['fast_fraction_of_floor']:8.0%} {ref}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "copy_bandwidth_bytes_per_s": bandwidth, "heads": HEADS, "kv_heads": KV_HEADS,
                       "head_dim": HEAD_DIM, "queries_per_row": QUERIES, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
