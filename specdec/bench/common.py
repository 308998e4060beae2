"""What the benchmark parts share: their settings, the zoo and prompts they run on, one timed
run of generate() over a prompt set, and how outputs are compared."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import generate
from ..policies import FixedPolicy
from ..verifiers import PaddingFreeVerifier
from ..zoo import build, load
from ..zoo.prompts import heldout_prompts


@dataclass
class BenchSettings:
    preset: str = "gpu"
    device: str = "cuda"
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    num_prompts: int = 64
    batch1_prompts: int = 8
    prompt_tokens: int = 128
    max_new_tokens: int = 128
    num_draft_tokens: int = 4
    peers: bool = True
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU; float32 makes "identical" exact on GPU too
    zoo_dir: str | None = None
    compile: bool | None = None  # ours with torch.compile inside the CUDA graphs; None: on CUDA
    repeats: int = 3  # timed passes of each of our methods and of HF static (median); slow HF peers: one
    parts: tuple[str, ...] = ("zoo", "bandwidth")  # bandwidth: random 1B/8B Llama step times (CUDA only)
    bandwidth_shapes: tuple[str, ...] = ("llama-1B", "llama-8B")
    tree_temperatures: tuple[float, ...] = (0.0, 0.8)  # the trees part: greedy and sampled


def synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(target, prompts, batch, drafter, k, settings, eos, graphs, compiled, verifier=None,
                   sampling=None, policy=None, details: dict | None = None) -> tuple[list[list[int]], float, float]:
    """-> (outputs, median seconds of the timed passes, tau). policy: default FixedPolicy(k);
    details: if given, receives the last pass's padding_fraction and verify_s_per_step."""
    kwargs = dict(drafter=drafter, verifier=verifier or PaddingFreeVerifier(), policy=policy or FixedPolicy(k),
                  max_new_tokens=settings.max_new_tokens, eos_token_id=eos, cuda_graphs=graphs, compile=compiled,
                  sampling=sampling)
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    # warm up on the call with the longest prompt: it sizes the caches and graphs, so nothing is
    # allocated or captured inside the timed window
    generate(target, max(chunks, key=lambda c: max(map(len, c))), **kwargs)
    timings = []
    for _ in range(settings.repeats):  # the median pass is reported
        synchronise(settings.device)
        started = time.perf_counter()
        outputs = [generate(target, chunk, **kwargs) for chunk in chunks]
        synchronise(settings.device)
        timings.append(time.perf_counter() - started)
    seconds = float(np.median(timings))
    if details is not None:
        stats = [out.stats for out in outputs]
        details.update(padding_fraction=sum(s.padding_tokens for s in stats) / max(sum(s.target_tokens for s in stats), 1),
                       verify_s_per_step=sum(s.verify_time_s for s in stats) / max(sum(s.steps for s in stats), 1))
    sequences = [s for out in outputs for s in out.sequences]
    steps = sum(r.steps for out in outputs for r in out.stats.requests)
    return sequences, seconds, sum(map(len, sequences)) / steps


def zoo_and_prompts(settings: BenchSettings):
    """The built zoo in the bench's dtype and its held-out prompts, as token ids."""
    build(settings.preset, out=settings.zoo_dir, device=settings.device)
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if settings.device.startswith("cuda") else "float32")
    zoo = load(settings.preset, out=settings.zoo_dir, device=settings.device, dtype=getattr(torch, dtype))
    records = heldout_prompts(zoo.heldout_texts(), zoo.tokenizer, settings.num_prompts, settings.prompt_tokens)
    return zoo, [zoo.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]


def graph_options(settings: BenchSettings) -> tuple[bool, bool]:
    """(cuda_graphs, compile) for our methods: graphs on CUDA, compiled unless turned off."""
    graphs = settings.device.startswith("cuda")
    return graphs, graphs if settings.compile is None else (settings.compile and graphs)  # compile needs graphs


def agreement(outputs: list[list[int]], expected: list[list[int]] | None) -> float:
    """Mean fraction of each expected output reproduced before the first differing token."""
    if expected is None:
        return float("nan")
    fractions = []
    for got, want in zip(outputs, expected):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        fractions.append(1.0 if got == want else same / max(len(want), 1))
    return sum(fractions) / len(fractions)


