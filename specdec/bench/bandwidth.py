"""Bandwidth efficiency: plain decoding step time of random-weight Llama shapes (about 1B and 8B
parameters) against the hardware's floor, and where a step's time goes: each mode's forward and
host milliseconds, a kernel breakdown, and the compiled step without the changes that bring it
nearer the floor (``ABLATIONS``: merged projections, split-KV attention with one combine and one
cache-write kernel, run-ahead steps), so that each change's gain is measured in the same run.

Invariant: the floor is (weight bytes + KV bytes read per step) / copy bandwidth, with the copy
bandwidth measured in the same run (device-to-device copy of 2 GiB: it reads and writes, so
bytes moved = 2 x size). A step's time is measured inside ``generate()`` (decode wall time over
decode steps, the host loop included), and split into the graph replay's device time (the
forward alone) and the rest (host work per step that the device waits for). Random weights are
fine: only time is measured.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import cache, fusion, generate
from ..policies import FixedPolicy
from ..runner import release_runners, runners_of
from . import peers

SHAPES = {
    "llama-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "llama-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    # LLaMA-1 30B as published (32,528,943,616 parameters, 65 GB in bf16): multi-head attention (52 KV heads of
    # 128) and the 32000-token vocabulary; the tensor-parallel bench (benchmarks/tensor_parallel_bench.py) shards it
    "llama-30B": dict(hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                      num_key_value_heads=52, vocab_size=32000),
}
MODES = {  # name -> generate() options
    "specdec eager (fast attention)": {"attention": "fast"},
    "specdec CUDA graphs": {"attention": "fast", "cuda_graphs": True},
    "specdec CUDA graphs + compile": {"attention": "fast", "cuda_graphs": True, "compile": True},
}
HF_STATIC = "HF static cache + torch.compile"
# the compiled step with some of the changes undone, applied as module settings for the mode's calls (a
# runner of its own): name -> (generate() options, settings for ``_settings``)
ABLATIONS = {
    "graphs + compile, no merging, old attention": (MODES["specdec CUDA graphs + compile"],
                                                     dict(merge=False, attention=False)),
    "graphs + compile, old attention": (MODES["specdec CUDA graphs + compile"], dict(attention=False)),
    "graphs + compile, no run-ahead": (MODES["specdec CUDA graphs + compile"], dict(run_ahead=False)),
}


def copy_bandwidth(size_bytes: int = 2 * 1024**3, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes per second (bytes read + bytes written)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del source, target
    torch.cuda.empty_cache()
    return 2 * size_bytes * repeats / seconds


def random_llama(shape: str, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         **SHAPES[shape])
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def floor_seconds(model, batch: int, context: int, bandwidth: float) -> float:
    """Bytes one decoding step must read / bandwidth: every weight once, except the input
    embedding table, of which a step reads one row per token (unless it is tied to the output
    head, which reads it whole), and each row's KV cache."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        weight_bytes += (batch - embedding.shape[0]) * embedding.shape[1] * embedding.element_size()
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize
    return (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth


def replay_seconds(model, batch: int, repeats: int = 50) -> float:
    """Device time of one replay of the graph a plain decoding step of ``batch`` rows runs (the
    smallest bucket of at least ``batch`` tokens; compiled runners have no size-1 bucket, so at
    batch 1 that is 2 tokens, one of them filler), back to back."""
    graphs = runners_of(model)["target"].graphs
    bucket = min(b for b in graphs.graphs if b >= batch)
    graph = graphs.graphs[bucket][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def kernel_breakdown(model) -> dict:
    """Kernels of one forward of the target's smallest graphed pass, run outside the graph,
    by kind: count and summed device time (ms). Launch gaps are not in these sums."""
    from torch.profiler import ProfilerActivity, profile

    graphs = runners_of(model)["target"].graphs
    runner = graphs.runner
    bucket = min(graphs.graphs)
    with runner.attached(), torch.inference_mode():
        graphs._run_model(bucket)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._run_model(bucket)
            torch.cuda.synchronize()
    kinds: dict[str, dict] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = _kernel_kind(event.name)
        entry = kinds.setdefault(kind, {"count": 0, "ms": 0.0})
        entry["count"] += 1
        entry["ms"] += event.device_time_total / 1000
    return kinds


def _kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "packed_attention" in lowered or "_combine_kernel" in lowered:  # the split-KV combine is attention's
        return "attention"
    if "_store_kernel" in lowered:  # triton_cache's fused cache write
        return "cache write / indexing"
    if any(word in lowered for word in ("gemm", "gemv", "cutlass", "nvjet", "sm90", "cublas", "splitk")):
        return "matmul"
    if "index" in lowered or "scatter" in lowered:
        return "cache write / indexing"
    if lowered.startswith("triton"):
        return "fused (inductor)"
    if "memcpy" in lowered or "memset" in lowered:
        return "copy / fill"
    return "other elementwise / reduction"


def hf_static_step_seconds(model, context: int, new_tokens: int) -> float:
    """Hugging Face's static-cache compiled decoding: (time for 1 + n tokens - time for 1) / n."""
    prompt = [(7 * j) % 1000 for j in range(context)]
    static = peers.StaticCompiled(model, max_cache_len=context + new_tokens + 1)
    try:
        for _ in range(2):  # compile and record its graphs
            static.generate_one(prompt, new_tokens + 1, None)
        times = {}
        for count in (1, new_tokens + 1):
            _, times[count] = static.timed_batch1([prompt], count, None)
        return (times[new_tokens + 1] - times[1]) / new_tokens
    finally:
        static.close()


def _row(shape: str, model, batch: int, mode: str, step: float, floor: float, replay: float | None) -> dict:
    row = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()), "batch": batch, "mode": mode,
           "step_ms": step * 1e3, "floor_ms": floor * 1e3, "fraction_of_floor": floor / step, "tokens_per_s": batch / step}
    if replay is not None:
        row.update(forward_ms=replay * 1e3, host_ms=(step - replay) * 1e3)
    return row


def _describe(row: dict) -> str:
    if "error" in row:
        return f"{row['shape']:>9} batch {row['batch']:>3} {row['mode']:<32} FAILED {row['error'][:300]}"
    split = f" (forward {row['forward_ms']:.2f} + host {row['host_ms']:.2f})" if "forward_ms" in row else ""
    return (f"{row['shape']:>9} batch {row['batch']:>3} {row['mode']:<32} {row['step_ms']:7.2f} ms/step{split}, "
            f"floor {row['floor_ms']:.2f} ms ({row['fraction_of_floor']:.0%})")


@contextlib.contextmanager
def _settings(merge: bool = True, attention: bool = True, run_ahead: bool = True):
    """merge: q/k/v and gate/up merged (fusion.MERGE); attention: split-KV shares at short
    contexts (triton_attention.MIN_SHARE) and the one-kernel cache write (cache.FUSED_STORE);
    run_ahead: each plain step launched before the one before it commits (run_ahead.RUN_AHEAD).
    False runs the engine as it was before each. Restored on exit."""
    from .. import run_ahead as ahead, triton_attention

    saved = fusion.MERGE, triton_attention.MIN_SHARE, cache.FUSED_STORE, ahead.RUN_AHEAD
    fusion.MERGE = saved[0] if merge else False
    triton_attention.MIN_SHARE = saved[1] if attention else 512
    cache.FUSED_STORE = saved[2] and attention
    ahead.RUN_AHEAD = saved[3] if run_ahead else False
    try:
        yield
    finally:
        fusion.MERGE, triton_attention.MIN_SHARE, cache.FUSED_STORE, ahead.RUN_AHEAD = saved


def _specdec_step_seconds(model, prompts, new_tokens: int, options: dict) -> float:
    """Decode wall time per step of plain decoding through generate(), after a warm-up call."""
    for _ in range(2):  # the first call sizes the cache, compiles and captures
        out = generate(model, prompts, policy=FixedPolicy(0), max_new_tokens=new_tokens, **options)
    return (out.stats.wall_time_s - out.stats.prefill_time_s) / out.stats.steps


def _measure_shape(shape: str, batch_sizes, context: int, new_tokens: int, modes, hf_static: bool, ablations: bool,
                   bandwidth: float, log) -> tuple[list[dict], dict]:
    model = random_llama(shape)
    rows, breakdowns = [], {}
    for batch in batch_sizes:
        prompts = [[(7 * i + j) % 1000 for j in range(context)] for i in range(batch)]
        floor = floor_seconds(model, batch, context + new_tokens // 2, bandwidth)
        measurements = ([(mode, MODES[mode], {}) for mode in modes]
                        + ([(name, *ABLATIONS[name]) for name in ABLATIONS] if ablations and batch == 1 else [])
                        + ([(HF_STATIC, None, {})] if hf_static and batch == 1 else []))
        for mode, options, settings in measurements:
            try:
                if options is None:
                    row = _row(shape, model, batch, mode, hf_static_step_seconds(model, context, new_tokens), floor, None)
                else:
                    release_runners(model)  # each mode on a runner of its own (settings apply at its build)
                    with _settings(**settings):
                        step = _specdec_step_seconds(model, prompts, new_tokens, options)
                        graphed = options.get("cuda_graphs", False)
                        replay = replay_seconds(model, batch) if graphed else None
                        row = _row(shape, model, batch, mode, step, floor, replay)
                        if graphed and batch == batch_sizes[0]:
                            breakdowns[f"{shape} {mode}"] = kernel_breakdown(model)
            except Exception as error:  # noqa: BLE001 - reported in the results, and the run goes on
                row = {"shape": shape, "batch": batch, "mode": mode, "error": f"{type(error).__name__}: {error}"[:500]}
            rows.append(row)
            log(_describe(row))
    release_runners(model)
    return rows, breakdowns


def run(shapes=("llama-1B", "llama-8B"), batch_sizes=(1, 16), context: int = 512, new_tokens: int = 64,
        modes=tuple(MODES), hf_static: bool = True, ablations: bool = True, log=print) -> dict:
    """Every shape at every batch size in every mode (and the ablations: the 8B shape at batch 1),
    HF's static cache at batch 1 -> the part's JSON."""
    bandwidth = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows, breakdowns = [], {}
    for shape in shapes:
        shape_rows, shape_breakdowns = _measure_shape(shape, batch_sizes, context, new_tokens, modes, hf_static,
                                                      ablations and shape == "llama-8B", bandwidth, log)
        rows += shape_rows
        breakdowns.update(shape_breakdowns)
        torch.cuda.empty_cache()
    return {"copy_bandwidth_bytes_per_s": bandwidth, "context": context, "new_tokens": new_tokens,
            "rows": rows, "kernel_breakdown": breakdowns}
