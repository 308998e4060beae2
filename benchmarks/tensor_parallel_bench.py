"""Tensor-parallel targets, measured (issue 35, point 3): plain and speculative decoding of
random-weight Llama shapes sharded over the GPUs of one host by transformers' own tensor-parallel
plan (``tp_plan="auto"``), against the bandwidth floor of the sharded step, and the scaling of one
shape from one GPU to several.

On a machine with two GPUs, from the repository root (104 s on two H200s with --new-tokens 32
--repeats 2, CUDA graphs throughout; with the defaults, 64 new tokens and 3 repeats, an estimated
2-3 minutes, up to about 5 when the sharded target falls back to eager mode; rank 0 writes
tensor_parallel.json and tensor_parallel.md into --out after each phase and each sharded batch
size, so a run cut short still leaves what it measured; --no-graphs runs eagerly throughout):

    SPECDEC_COMMIT=<commit> torchrun --standalone --nproc_per_node 2 \\
        benchmarks/tensor_parallel_bench.py --device cuda --out benchmarks/results/tp_h200

(SPECDEC_COMMIT names the commit where the tree travels without its .git.)

and on the CPU, as a smoke run on tiny shapes over gloo (what tests/bench/test_tensor_parallel_bench.py runs):

    torchrun --standalone --nproc_per_node 2 benchmarks/tensor_parallel_bench.py --device cpu --preset tiny \\
        --out /tmp/tp --batch-sizes 1 3 --new-tokens 6 --prompt-tokens 5 --repeats 1 --k 3

Preset "gpu": the "big" shape is SHAPES["llama-30B"] (LLaMA-1 30B, 32.5B parameters, 65 GB in
bf16: it fits on one H200, but its one-GPU floor is about 15 ms a step, twice the two-GPU one),
the "scaling" shape SHAPES["llama-8B"]; bf16; the drafter is pipeline.DRAFTER_SHAPE (4 layers of
width 1024) over the target's vocabulary, replicated on every rank. Phases, each on every rank in
lockstep unless said otherwise:

1. bandwidth: each rank's copy bandwidth (bandwidth.copy_bandwidth), measured at the same time.
2. one GPU: rank 0 alone (the others wait at a host barrier) decodes the scaling shape unsharded
   on its GPU, plain, with CUDA graphs and eagerly.
3. sharded: the scaling shape, then the big one, sharded over every rank (random_sharded_llama):
   per batch size, plain decoding (FixedPolicy(0)) and speculative decoding (FixedPolicy(k)),
   CUDA graphs where they work with the sharded target (a graphed call that fails on any rank
   sends that shape's remaining calls to eager mode, and the failure is recorded).

What is measured: a call's decoding time is its wall time between device syncs less its prefill
(generate()'s stats), over its steps: ms per step (the whole loop's iteration, host work included)
and tokens per second; the median call of ``repeats`` after a warm-up call (of an even number,
the slower middle one: middle_call), rank 0's clock. tau is the tokens a row-step emits: random
weights accept few drafts, so tau stays near 1 and speculation is not expected to win here; the
rows show what a step of each kind costs. The floor of a plain step (floor_seconds): the slowest
rank's bytes read per step (its shard of the weights plus its KV heads' cache) over its copy
bandwidth. Targets: the big shape's plain step at batch 1 at >= 60% of its floor on the GPUs it is
sharded over; the scaling shape's plain step on them >= 1.5x faster than on one GPU (in the same
mode), at each batch size.

Invariants checked and recorded: the target's parameters are DTensors (its tensor-parallel group
is found, so generate() runs it tensor-parallel, rank 0 deciding); each rank caches its own
share of the KV heads; every rank ends with the same tokens; and speculative output equals plain
decoding's on the same sharded target (bf16 on GPUs: a pass of k + 1 tokens can round a near-tie
otherwise than a pass of one, so agreement is reported beside identity, and a difference does not
fail the run; float32 on the CPU: identical).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's specdec, however it is installed

from specdec import generate  # noqa: E402
from specdec.bench.bandwidth import SHAPES, copy_bandwidth  # noqa: E402
from specdec.bench.common import agreement, synchronise  # noqa: E402
from specdec.bench.harness import environment as base_environment  # noqa: E402
from specdec.bench.pipeline import DRAFTER_SHAPE, random_model  # noqa: E402
from specdec.bench.report import provenance, target_lines  # noqa: E402
from specdec.distributed import tensor_parallel_group  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.policies import FixedPolicy  # noqa: E402
from specdec.runner import release_runners, runners_of  # noqa: E402

TINY_SHAPES = {  # CPU smoke runs: heads and widths that split over two ranks
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=96),
    "tiny-wide": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=96),
}
TINY_DRAFTER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=96)
# big: the shape held to the floor target; scaling: the shape measured on one GPU and sharded; drafter: a
# replicated drafter's shape, its vocabulary the target's
PRESETS = {
    "gpu": dict(big="llama-30B", scaling="llama-8B", shapes=SHAPES, drafter=DRAFTER_SHAPE),
    "tiny": dict(big="tiny-wide", scaling="tiny", shapes=TINY_SHAPES, drafter=TINY_DRAFTER),
}
FLOOR_TARGET = 0.60  # issue 35: the big shape's batch-1 plain step at >= 60% of the sharded floor
SCALING_TARGET = 1.5  # issue 35: the scaling shape's plain step >= 1.5x faster sharded than on one GPU
GRAPHS, EAGER = "CUDA graphs", "eager"


@dataclass
class Settings:
    preset: str = "gpu"
    device: str = "cuda"
    batch_sizes: tuple[int, ...] = (1, 16)
    k: int = 4  # draft tokens a speculative step
    new_tokens: int = 64
    prompt_tokens: int = 128  # random token ids a prompt
    repeats: int = 3  # timed calls after the warm-up; the median is reported (middle_call)
    graphs: bool = True  # CUDA graphs where they work (CUDA only)
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError on settings the bench cannot run."""
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {sorted(PRESETS)}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' (NCCL) or 'cpu' (gloo), got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA GPU is visible")
        counts = dict(k=self.k, new_tokens=self.new_tokens, prompt_tokens=self.prompt_tokens, repeats=self.repeats)
        for name, value in counts.items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.batch_sizes or any(not (isinstance(b, int) and b >= 1) for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be ints >= 1, got {self.batch_sizes!r}")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def context(self) -> int:
        """Cached positions a row's plain step reads, on average over the decoding."""
        return self.prompt_tokens + self.new_tokens // 2


# ---- shapes and models --------------------------------------------------------------------------------------------

def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)


def llama_parameters(shape: dict) -> int:
    """Parameters of an untied Llama of ``shape``: the embedding table and the head (vocab x hidden
    each); a layer's query and output projections (hidden x hidden), key and value projections
    (hidden x kv_heads * head_dim), three MLP matrices (hidden x intermediate) and two norms
    (hidden); the final norm."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    kv_width = shape["num_key_value_heads"] * (hidden // shape["num_attention_heads"])
    layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * shape["intermediate_size"] + 2 * hidden
    return 2 * vocab * hidden + shape["num_hidden_layers"] * layer + hidden


def check_shardable(name: str, shape: dict, world: int) -> None:
    """Raise ValueError unless ``shape`` splits evenly over ``world`` tensor-parallel ranks: every
    rank attends with its own query heads and caches its own KV heads, and holds an equal slice
    of the MLP's intermediate width."""
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"the tensor-parallel size must be an int >= 1, got {world!r}")
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise ValueError(f"{name}: hidden_size {shape['hidden_size']} does not divide into "
                         f"{shape['num_attention_heads']} attention heads")
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError(f"{name}: {shape['num_attention_heads']} attention heads do not group evenly over "
                         f"{shape['num_key_value_heads']} KV heads")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if shape[key] % world:
            raise ValueError(f"{name}: {key} = {shape[key]} does not divide by the tensor-parallel size {world} "
                             "(one process per GPU); pick a shape whose heads and MLP width split evenly")


def random_sharded_llama(shape: dict, dtype: torch.dtype, seed: int):
    """A random-weight Llama of ``shape`` sharded over every process of the job by transformers'
    tensor-parallel plan, the sharding ``from_pretrained(folder, tp_plan="auto")`` gives, without
    a checkpoint: ``from_pretrained(None, config=..., state_dict={}, distributed_config=
    DistributedConfig(tp_plan="auto", tp_size=world))`` builds the model on the meta device, shards
    it (DTensor placeholders and the plan's forward hooks), and, every weight being missing from the
    empty state dict, allocates each rank's local shards on its device and initialises them with
    the model's own init (normal, std config.initializer_range = 0.02; norms 1), transformers 5.17
    and 5.24 alike. Replicated parameters are then broadcast from rank 0, since each rank draws its
    own (5.17 replicates the embedding table). Invariant: every parameter the plan shards is a
    DTensor, so specdec.distributed.tensor_parallel_group finds the group."""
    from transformers import DistributedConfig, LlamaForCausalLM

    world = dist.get_world_size()
    check_shardable("target", shape, world)
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(None, config=llama_config(shape), state_dict={}, dtype=dtype,
                                             distributed_config=DistributedConfig(tp_plan="auto", tp_size=world))
    group = tensor_parallel_group(model)
    if group is None:
        raise RuntimeError("transformers did not shard the model (no DTensor parameters): is the job under torchrun "
                           "with a tensor-parallel plan for Llama in this transformers version?")
    replicate_from_first_rank(model, group)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def replicate_from_first_rank(module: torch.nn.Module, group=None) -> int:
    """Broadcast every parameter and buffer of ``module`` that is not sharded (not a DTensor) from
    the group's first rank, in place, so every rank holds the same replicated tensors; -> their
    number. group None: the whole job."""
    from torch.distributed.tensor import DTensor

    source = 0 if group is None else dist.get_global_rank(group, 0)
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not isinstance(t, DTensor)]
    for tensor in tensors:
        dist.broadcast(tensor.data, src=source, group=group)
    return len(tensors)


def replicated_checksum(module: torch.nn.Module) -> float:
    """The sum of every parameter that is not sharded (not a DTensor), in float64: equal on every
    rank when the replicated weights are (replicate_from_first_rank)."""
    from torch.distributed.tensor import DTensor

    return float(sum(p.detach().double().sum() for p in module.parameters() if not isinstance(p, DTensor)))


def release(*models) -> None:
    """Drop the runners (caches, captured graphs) kept with ``models`` and the device memory they held."""
    for model in models:
        release_runners(model)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the bandwidth floor --------------------------------------------------------------------------------------------

def step_bytes(model, batch: int, context: int) -> dict:
    """Bytes one plain-decoding step of ``batch`` rows reads on this rank. weights: the rank's local
    part of every parameter (a DTensor's local shard, a replicated parameter whole), except the
    input embedding table, of which a step reads one row per token, of its local width (unless the
    table is tied to the head, which reads it whole); kv: each row's ``context`` cached positions,
    keys and values, of the rank's KV heads (num_key_value_heads over the tensor-parallel size,
    as each rank's cache holds them) in every layer."""
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    weights = sum(local(p).numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        table = local(embedding)  # [vocab or its shard, hidden or its shard]
        weights += (batch - table.shape[0]) * table.shape[1] * table.element_size()
    config = model.config
    group = tensor_parallel_group(model)
    ranks = 1 if group is None else dist.get_world_size(group)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * (config.num_key_value_heads // ranks) * head_dim * model.dtype.itemsize
    return {"weights": int(weights), "kv": int(batch * context * kv_per_token)}


def floor_seconds(bytes_per_rank: list[int], bandwidth_per_rank: list[float]) -> float:
    """The bandwidth floor of one step that ranks take in lockstep: max over ranks r of bytes_r /
    bandwidth_r, the slowest rank's bytes read (step_bytes: weights + KV) over its copy bandwidth
    (bytes per second). With one rank it is bandwidth.floor_seconds's one-GPU floor; sharded over
    two ranks of equal bandwidth, each reading half the sharded weights and half the KV heads, it is
    about half of that (a little more: norms are replicated, read by both)."""
    if not bytes_per_rank or len(bytes_per_rank) != len(bandwidth_per_rank):
        raise ValueError(f"one byte count and one bandwidth a rank, got {len(bytes_per_rank)} and "
                         f"{len(bandwidth_per_rank)}")
    if any(b <= 0 for b in bandwidth_per_rank):
        raise ValueError(f"bandwidths must be positive, got {bandwidth_per_rank}")
    return max(count / bandwidth for count, bandwidth in zip(bytes_per_rank, bandwidth_per_rank))


def cpu_copy_bandwidth(size_bytes: int = 64 * 1024**2, repeats: int = 5) -> float:
    """Host memory copy bandwidth in bytes per second (read + write), for smoke runs on the CPU."""
    source = torch.empty(size_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    return 2 * size_bytes * repeats / (time.perf_counter() - started)


# ---- timing ---------------------------------------------------------------------------------------------------

def random_prompts(batch: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``tokens`` random ids, the same on every rank (seeded)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, tokens)).tolist()


def timed_call(target, prompts, drafter_model, k: int, new_tokens: int, graphs: bool, device: str) -> dict:
    """One generate() call, plain when k = 0, else speculative with ``drafter_model`` drafting k
    tokens a step. step_ms: (wall - prefill) / steps, the wall clock around the call between device
    syncs and the prefill from its stats, so a step is a whole iteration of the loop (drafting,
    verification, host work); tokens_per_s: tokens emitted after the prefill over that time;
    draft_ms and verify_ms: device time of the two phases per step; tau: tokens a row-step emits."""
    drafter = ModelDrafter(drafter_model, cuda_graphs=graphs) if k else None
    synchronise(device)
    started = time.perf_counter()
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(k), max_new_tokens=new_tokens,
                   eos_token_id=[], cuda_graphs=graphs)
    synchronise(device)
    stats = out.stats
    decoding = time.perf_counter() - started - stats.prefill_time_s
    return dict(step_ms=1000 * decoding / stats.steps, tokens_per_s=stats.emitted / decoding, tau=stats.tau,
                steps=stats.steps, draft_ms=1000 * stats.draft_time_s / stats.steps,
                verify_ms=1000 * stats.verify_time_s / stats.steps, sequences=out.sequences)


def measure(target, prompts, drafter_model, k: int, settings: Settings, graphs: bool) -> dict:
    """The call of median step time among ``settings.repeats`` timed calls (of an even number, the
    slower of the two middle ones: index repeats // 2 of the calls sorted by step time), after one
    warm-up call that sizes the caches and captures the graphs, so nothing is allocated or
    captured while timed."""
    def call() -> dict:
        return timed_call(target, prompts, drafter_model, k, settings.new_tokens, graphs, settings.device)

    call()
    runs = sorted((call() for _ in range(settings.repeats)), key=lambda run: run["step_ms"])
    return runs[len(runs) // 2]


def all_ranks(ok: bool, control) -> bool:
    """Whether ``ok`` holds on every rank (a host-side all-reduce over the control group)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control)
    return bool(flag.item())


def gathered(value, control) -> list:
    """``value`` from every rank, in rank order (over the host-side control group)."""
    values = [None] * dist.get_world_size(control)
    dist.all_gather_object(values, value, group=control)
    return values


def measure_sharded(target, prompts, drafter_model, k: int, settings: Settings, graphs: bool, control):
    """measure() on every rank, with CUDA graphs if ``graphs``; when a graphed measurement fails on
    any rank, every rank drops the runners and measures eagerly. -> (result, graphs used, the error
    that sent it to eager mode or None). Every rank takes the same branch (the control group agrees)."""
    if graphs:
        result, error = None, None
        try:
            result = measure(target, prompts, drafter_model, k, settings, True)
        except Exception as failure:  # noqa: BLE001 - recorded, and the shape goes on eagerly
            error = f"{type(failure).__name__}: {failure}"[:500]
        if all_ranks(error is None, control):
            return result, True, None
        release(target, drafter_model)
        return measure(target, prompts, drafter_model, k, settings, False), False, error or "failed on another rank"
    return measure(target, prompts, drafter_model, k, settings, False), False, None


# ---- phases -----------------------------------------------------------------------------------------------------

def _timing(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "sequences"}


def _plain_row(name, gpus, mode, batch, result, bytes_per_rank, bandwidths) -> dict:
    floor = floor_seconds([b["weights"] + b["kv"] for b in bytes_per_rank], bandwidths)
    return dict(shape=name, gpus=gpus, mode=mode, batch=batch, decoding="plain", **_timing(result),
                floor_ms=1000 * floor, fraction_of_floor=floor / (result["step_ms"] / 1000),
                step_bytes_per_rank=bytes_per_rank)


def one_gpu_phase(name: str, shape: dict, settings: Settings, bandwidth: float, log) -> list[dict]:
    """Rank 0 alone: ``shape`` unsharded on its device, plain decoding at every batch size, with CUDA
    graphs (on CUDA) and eagerly; a failed mode is recorded as a row's error."""
    device = f"cuda:{torch.cuda.current_device()}" if settings.device == "cuda" else "cpu"
    model = random_model(shape, device, seed=settings.seed, dtype=settings.dtype)
    modes = [True, False] if settings.device == "cuda" and settings.graphs else [False]
    rows = []
    for graphs in modes:
        for batch in settings.batch_sizes:
            prompts = random_prompts(batch, settings.prompt_tokens, shape["vocab_size"], seed=batch)
            mode = GRAPHS if graphs else EAGER
            try:
                result = measure(model, prompts, None, 0, settings, graphs)
                row = _plain_row(name, 1, mode, batch, result, [step_bytes(model, batch, settings.context)], [bandwidth])
            except Exception as failure:  # noqa: BLE001 - recorded, and the run goes on
                row = dict(shape=name, gpus=1, mode=mode, batch=batch, decoding="plain",
                           error=f"{type(failure).__name__}: {failure}"[:500])
            rows.append(row)
            log(describe(row))
        release(model)
    del model
    release()
    return rows


def sharded_phase(name: str, shape: dict, drafter_shape: dict, settings: Settings, bandwidths: list[float],
                  control, log, emit) -> dict:
    """``shape`` sharded over every rank, a replicated drafter over its vocabulary: per batch size,
    plain and speculative decoding (k draft tokens), whose two rows go to ``emit`` as soon as they
    are measured. -> what the shape's sharding was."""
    world = dist.get_world_size()
    target = random_sharded_llama(shape, settings.dtype, seed=settings.seed)
    device = str(target.device)
    drafter_model = random_model({**drafter_shape, "vocab_size": shape["vocab_size"]}, device, seed=settings.seed + 1,
                                 dtype=settings.dtype)
    replicate_from_first_rank(drafter_model)
    graphs, refusal, rows = settings.device == "cuda" and settings.graphs, None, []
    for batch in settings.batch_sizes:
        prompts = random_prompts(batch, settings.prompt_tokens, shape["vocab_size"], seed=batch)
        plain, plain_graphs, error = measure_sharded(target, prompts, drafter_model, 0, settings, graphs, control)
        graphs, refusal = plain_graphs, refusal or error
        fast, fast_graphs, error = measure_sharded(target, prompts, drafter_model, settings.k, settings, graphs, control)
        graphs, refusal = fast_graphs, refusal or error
        bytes_per_rank = gathered(step_bytes(target, batch, settings.context), control)
        same_everywhere = all_ranks(gathered(fast["sequences"], control)[0] == fast["sequences"], control)
        rows.append(_plain_row(name, world, GRAPHS if plain_graphs else EAGER, batch, plain, bytes_per_rank, bandwidths))
        rows.append(dict(shape=name, gpus=world, mode=GRAPHS if fast_graphs else EAGER, batch=batch,
                         decoding=f"speculative k={settings.k}", **_timing(fast),
                         identical=fast["sequences"] == plain["sequences"],
                         agreement=agreement(fast["sequences"], plain["sequences"]), same_on_every_rank=same_everywhere))
        for row in rows[-2:]:
            log(describe(row))
        emit(rows[-2:])
    info = dict(parameters=llama_parameters(shape), shape=shape, gpus=world, dtype=str(settings.dtype),
                tensor_parallel=tensor_parallel_group(target) is not None,
                dtensor_parameters=sum(type(p).__name__ == "DTensor" for p in target.parameters()),
                local_kv_heads=gathered(int(runners_of(target)["target"].cache.keys[0].shape[1]), control),
                replicated_checksums=gathered(replicated_checksum(target), control),
                graphs=graphs, graphs_refused=refusal, drafter=drafter_shape | {"vocab_size": shape["vocab_size"]})
    release(target, drafter_model)
    del target, drafter_model
    release()
    return info


def targets(rows: list[dict], big: str, scaling: str, world: int, batch_sizes) -> list[dict]:
    """The issue's targets, each met or not: the big shape's batch-1 plain step at >= FLOOR_TARGET of
    its sharded floor; the scaling shape's plain step >= SCALING_TARGET x faster sharded than on one
    GPU, per batch size, against the one-GPU run in the sharded run's mode."""
    def plain(shape, gpus, batch, mode=None):
        return next((r for r in rows if r["shape"] == shape and r["gpus"] == gpus and r["batch"] == batch
                     and r["decoding"] == "plain" and "error" not in r and mode in (None, r["mode"])), None)

    found = []
    big_row = plain(big, world, 1)
    found.append(dict(target=f"{big}, batch 1, plain decoding on {world} GPUs: >= {FLOOR_TARGET:.0%} of the "
                      f"{world}-GPU bandwidth floor",
                      value=round(big_row["fraction_of_floor"], 3) if big_row else "not measured",
                      met=bool(big_row and big_row["fraction_of_floor"] >= FLOOR_TARGET),
                      detail=f"{big_row['step_ms']:.2f} ms a step against a floor of {big_row['floor_ms']:.2f} ms, "
                             f"{big_row['mode']}" if big_row else "no batch-1 plain row"))
    for batch in batch_sizes:
        sharded = plain(scaling, world, batch)
        single = plain(scaling, 1, batch, sharded["mode"]) if sharded else None
        ratio = single["step_ms"] / sharded["step_ms"] if sharded and single else None
        found.append(dict(target=f"{scaling}, batch {batch}, plain step: one GPU / {world} GPUs >= {SCALING_TARGET}",
                          value=round(ratio, 3) if ratio else "not measured", met=bool(ratio and ratio >= SCALING_TARGET),
                          detail=f"{single['step_ms']:.2f} ms on one GPU, {sharded['step_ms']:.2f} ms on {world}, "
                                 f"{sharded['mode']}" if ratio else "a run is missing"))
    return found


def run(settings: Settings, control, log=print, report=lambda result: None, env: dict | None = None) -> dict:
    """Every phase (module docstring) on every rank; -> the result (rank 0's timings), which
    ``report`` receives after each phase, complete or not."""
    settings.check()
    preset, world = PRESETS[settings.preset], dist.get_world_size()
    shapes = preset["shapes"]
    for role in ("scaling", "big"):
        check_shardable(preset[role], shapes[preset[role]], world)
    bandwidth = copy_bandwidth() if settings.device == "cuda" else cpu_copy_bandwidth()
    bandwidths = gathered(bandwidth, control)
    result = dict(environment=env or {}, settings=asdict(settings) | {"context": settings.context,
                                                                        "dtype": str(settings.dtype)},
                  big=preset["big"], scaling=preset["scaling"], bandwidth_bytes_per_s=bandwidths, shapes={}, rows=[],
                  targets=[], complete=False)
    log(f"copy bandwidth per rank: {', '.join(f'{b / 1e12:.2f}' for b in bandwidths)} TB/s")
    if dist.get_rank() == 0:
        result["rows"] += one_gpu_phase(preset["scaling"], shapes[preset["scaling"]], settings, bandwidths[0], log)
        report(result)
    dist.barrier(group=control)

    def emit(rows: list[dict]) -> None:
        result["rows"] += rows
        report(result)

    for name in dict.fromkeys([preset["scaling"], preset["big"]]):
        result["shapes"][name] = sharded_phase(name, shapes[name], preset["drafter"], settings, bandwidths, control,
                                               log, emit)
        report(result)
    result["targets"] = targets(result["rows"], preset["big"], preset["scaling"], world, settings.batch_sizes)
    result["complete"] = True
    report(result)
    return result


# ---- the report ---------------------------------------------------------------------------------------------------

def describe(row: dict) -> str:
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] > 1 else ' '}"
    head = f"{row['shape']:>10} {gpus} {row['mode']:<11} batch {row['batch']:>3} {row['decoding']:<15}"
    if "error" in row:
        return f"{head} FAILED {row['error'][:300]}"
    floor = f", floor {row['floor_ms']:.2f} ms ({row['fraction_of_floor']:.0%})" if "floor_ms" in row else ""
    same = f", identical {row['identical']} (agreement {row['agreement']:.3f})" if "identical" in row else ""
    return f"{head} {row['step_ms']:8.2f} ms/step {row['tokens_per_s']:9.1f} tok/s tau {row['tau']:.2f}{floor}{same}"


def middle_call(repeats: int) -> str:
    """Which of ``repeats`` timed calls measure() reports, in words: the median of an odd number;
    of an even number the call at index repeats // 2 by step time, the slower middle one."""
    if repeats == 1:
        return "one call"
    if repeats % 2:
        return f"median of {repeats} calls"
    return "the slower of 2 calls" if repeats == 2 else f"the slower middle call of {repeats}"


def markdown(result: dict) -> str:
    """The rows and targets as markdown, with the run's provenance."""
    settings = result["settings"]
    sizes = "; ".join(f"{name}: {info['parameters']:,} parameters over {info['gpus']} GPUs, "
                      f"{info['dtensor_parameters']} DTensor parameters, KV heads per rank {info['local_kv_heads']}, "
                      f"{'CUDA graphs' if info['graphs'] else 'eager'}"
                      + (f" (graphs refused: {info['graphs_refused'][:200]})" if info["graphs_refused"] else "")
                      for name, info in result["shapes"].items())
    bandwidth = ", ".join(f"{b / 1e12:.2f}" for b in result["bandwidth_bytes_per_s"])
    lines = ["## Tensor-parallel targets (issue 35, point 3)" + ("" if result["complete"] else " (incomplete run)"), "",
             f"{provenance(result['environment'])} Random-weight Llama shapes, {settings['dtype']}, greedy; prompts of "
             f"{settings['prompt_tokens']} random tokens, {settings['new_tokens']} new tokens; speculative: k = "
             f"{settings['k']} from a random drafter replicated on every rank (random weights accept few drafts: tau "
             f"near 1); {middle_call(settings['repeats'])} after a warm-up. Floor: the slowest rank's bytes a plain "
             f"step reads (its weight shards and its KV heads' cache at {settings['context']} positions) over its copy "
             f"bandwidth ({bandwidth} TB/s per rank). {sizes}.", "",
             "| shape | GPUs | mode | batch | decoding | ms/step | tok/s | tau | floor ms | of floor | identical to plain "
             "| agreement |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        head = f"| {row['shape']} | {row['gpus']} | {row['mode']} | {row['batch']} | {row['decoding']} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error'][:100]} | | | | | | |")
            continue
        floor = f"{row['floor_ms']:.2f} | {row['fraction_of_floor']:.0%}" if "floor_ms" in row else "- | -"
        same = (f"{'yes' if row['identical'] else 'no'} | {row['agreement']:.3f}" if "identical" in row else "- | -")
        lines.append(f"{head} {row['step_ms']:.2f} | {row['tokens_per_s']:.1f} | {row['tau']:.2f} | {floor} | {same} |")
    return "\n".join(lines + ["", *target_lines(result["targets"])]) + "\n"


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_parallel.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "tensor_parallel.md").write_text(markdown(result))


def environment(settings: Settings, control, argv: list[str]) -> dict:
    """Versions, commit ($SPECDEC_COMMIT where the tree has no .git), time, the command, and every rank's device."""
    env = base_environment(settings.device)
    world = dist.get_world_size()
    script = "benchmarks/tensor_parallel_bench.py"
    env["command"] = f"torchrun --standalone --nproc_per_node {world} {script} {' '.join(argv)}"
    env["world_size"] = world
    cuda = settings.device == "cuda"
    env["devices"] = gathered(torch.cuda.get_device_name() if cuda else platform.machine(), control)
    if cuda:
        version = torch.cuda.nccl.version()  # a tuple (an int in old releases)
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return env


def parse(argv: list[str]) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda: NCCL, one GPU a process; cpu: gloo")
    parser.add_argument("--out", required=True, help="folder for tensor_parallel.json and tensor_parallel.md (rank 0)")
    parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-graphs", action="store_true", help="eager only (graphs are tried by default on CUDA)")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    settings = Settings(preset=args.preset, device=args.device, batch_sizes=tuple(args.batch_sizes), k=args.k,
                        new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, repeats=args.repeats,
                        graphs=not args.no_graphs)
    try:
        settings.check()
    except ValueError as error:
        parser.error(str(error))
    return settings, args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    settings, args = parse(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run under torchrun with --nproc_per_node 2 or more: the target is sharded over the "
                         "processes, and rank 0 measures the one-GPU baseline itself")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # every weight is "missing" from the empty state dict: by design
    hf_logging.disable_progress_bar()
    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=args.collective_timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    try:
        control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD  # host-side agreement
        rank0 = dist.get_rank() == 0
        env = environment(settings, control, argv)
        out = Path(args.out)
        run(settings, control, log=(lambda line: print(line, flush=True)) if rank0 else (lambda line: None),
            report=(lambda result: write(result, out)) if rank0 else (lambda result: None), env=env)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
