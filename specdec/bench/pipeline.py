"""``python -m specdec bench --parts pipeline``: SPIN's pipelined speculation (specdec/pipeline.py,
ALGORITHMS.md §9; issue 35) against drafting and verifying in sequence, CUDA only.

Random-weight Llama shapes, bf16, CUDA graphs, greedy (PAIRS): a 1B target ("llama-1B") with a
drafter of 4 layers of width 1024 over the same 128K vocabulary, whose passes are bound by host
time, and an 8B target with a 1B drafter, whose passes read more weights. With random weights
few drafts are accepted, which does not matter here: the bench measures how long steps take, not
how many tokens they emit.
Placements: the drafter on the target's GPU (the pipeline's drafts on a side stream) and, where
two GPUs are seen, on the second one.

Per (placement, batch, pipeline 1 or 2): the decode time (wall less prefill) per cycle, a cycle
being one verification of every row (one step unpipelined, two micro-batch steps pipelined), and
the unpipelined run's draft and verify phases per step (device time, CUDA events). The target
(issue 35): with the drafter on a second GPU, the pipelined cycle at most 1.15x max(draft,
verify) at batch 16 and 64. Outputs are compared with the unpipelined run's (bf16: a pass of
half the rows may round a near-tie the other way, so agreement is reported beside identity).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import generate
from ..drafters import ModelDrafter
from ..policies import FixedPolicy
from .bandwidth import SHAPES
from .common import agreement, synchronise

DRAFTER_SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=SHAPES["llama-1B"]["vocab_size"])
PAIRS = {  # name -> (target shape, drafter shape): a host-bound pair and one whose passes are heavier
    "1B target, 4-layer drafter": (SHAPES["llama-1B"], DRAFTER_SHAPE),
    "8B target, 1B drafter": (SHAPES["llama-8B"], SHAPES["llama-1B"]),
}
TARGET_RATIO = 1.15  # issue 35: pipelined cycle <= 1.15x max(draft, verify), drafter on a second GPU


def random_model(shape: dict, device: str, seed: int, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def measure(target, drafter_model, prompts, pipeline: int, k: int, new_tokens: int, repeats: int) -> dict:
    """The middle of ``repeats`` timed calls by cycle time (the median when ``repeats`` is odd;
    of an even number the slower middle one), after one warm-up call, of one configuration."""
    device = str(target.device)
    runs = []
    for attempt in range(repeats + 1):
        drafter = ModelDrafter(drafter_model, cuda_graphs="auto")
        synchronise(device)
        started = time.perf_counter()
        out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(k), max_new_tokens=new_tokens,
                       eos_token_id=[], cuda_graphs="auto", pipeline=pipeline)
        synchronise(device)
        wall = time.perf_counter() - started
        if attempt:  # the first call warms up (runners, graphs)
            stats = out.stats
            cycles = stats.steps / pipeline
            runs.append(dict(cycle_ms=1000 * (wall - stats.prefill_time_s) / cycles,
                             draft_ms=1000 * stats.draft_time_s / stats.steps,
                             verify_ms=1000 * stats.verify_time_s / stats.steps, steps=stats.steps,
                             tau=stats.tau, sequences=out.sequences))
    return sorted(runs, key=lambda r: r["cycle_ms"])[len(runs) // 2]


def run(batch_sizes=(16, 64), k: int = 4, new_tokens: int = 64, prompt_tokens: int = 128, repeats: int = 3,
        log=print, device: str = "cuda", pairs: dict | None = None) -> dict:
    """pairs: name -> (target, drafter) Llama config fields (default PAIRS; tiny ones for a smoke
    run on the CPU, device "cpu")."""
    rows, targets = [], []
    pairs = pairs or PAIRS
    for name, (target_shape, drafter_shape) in pairs.items():
        _run_pair(name, target_shape, drafter_shape, batch_sizes, k, new_tokens, prompt_tokens, repeats, log, device,
                  rows, targets)
    return dict(settings=dict(pairs={name: dict(target=t, drafter=d) for name, (t, d) in pairs.items()},
                              k=k, new_tokens=new_tokens, prompt_tokens=prompt_tokens, repeats=repeats,
                              batch_sizes=list(batch_sizes)), rows=rows, targets=targets)


def _run_pair(name, target_shape, drafter_shape, batch_sizes, k, new_tokens, prompt_tokens, repeats, log, device,
              rows, targets) -> None:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = random_model(target_shape, "cuda:0" if device.startswith("cuda") else device, seed=0, dtype=dtype)
    placements = {"one GPU": "cuda:0"} if device.startswith("cuda") else {"one device": device}
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        placements["second GPU"] = "cuda:1"
    rng = np.random.default_rng(0)
    for placement, place in placements.items():
        drafter_model = random_model(drafter_shape, place, seed=1, dtype=dtype)
        for batch in batch_sizes:
            prompts = rng.integers(0, target_shape["vocab_size"], size=(batch, prompt_tokens)).tolist()
            sequential = measure(target, drafter_model, prompts, 1, k, new_tokens, repeats)
            pipelined = measure(target, drafter_model, prompts, 2, k, new_tokens, repeats)
            ideal = max(sequential["draft_ms"], sequential["verify_ms"])
            for pipeline, result in ((1, sequential), (2, pipelined)):
                row = dict(models=name, placement=placement, batch=batch, pipeline=pipeline,
                           **{key: value for key, value in result.items() if key != "sequences"},
                           over_ideal=result["cycle_ms"] / ideal,
                           identical=result["sequences"] == sequential["sequences"],
                           agreement=agreement(result["sequences"], sequential["sequences"]))
                rows.append(row)
                log(f"pipeline {name}, {placement:<10} batch {batch:>3} x{pipeline}: cycle {row['cycle_ms']:.2f} ms "
                    f"(draft {sequential['draft_ms']:.2f} / verify {sequential['verify_ms']:.2f} ms in sequence: "
                    f"{row['over_ideal']:.2f}x their max), identical {row['identical']}, "
                    f"agreement {row['agreement']:.3f}")
            if placement == "second GPU":
                ratio = pipelined["cycle_ms"] / ideal
                targets.append(dict(target=f"{name}, batch {batch}: pipelined cycle <= {TARGET_RATIO}x "
                                    "max(draft, verify), drafter on a second GPU", value=round(ratio, 3),
                                    met=bool(ratio <= TARGET_RATIO)))
        del drafter_model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "second GPU" not in placements:
        targets.append(dict(target=f"{name}: pipelining with the drafter on a second GPU", value="not measured",
                            met=False, detail="one GPU seen: run on a machine with two"))
    del target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
