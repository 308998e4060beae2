"""Why do identical decoding passes differ by up to 1.7x on the GPU machine? (session 4's runs)

One process, the gpu zoo's target (graphed, compiled) at batch 16 and 128 new tokens, plain
decoding and drafter-4L-narrow k=4. Every round times one pass of each method under each
condition, the order rotated from round to round:
  default     the policy bench's timing (its passes use 256-token prompts; these use 128)
  pinned      the main thread pinned to one core on the GPU's NUMA node (bench.affinity)
  one_thread  torch.set_num_threads(1) (no intra-op worker threads spinning beside the main one)
  gpu_warm    50 ms of GPU work right before the pass (if the GPU clocks down between passes)
Per pass: wall time, and the median and 95th percentile of the host's per-step times (a
uniformly slower pass points at the core's speed, a few long steps at preemption).
Writes noise_probe.json to the folder given (default $OUT).

  python3 scripts/noise_probe.py [--rounds 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import numpy as np
import torch

from specdec import generate
from specdec.bench.affinity import gpu_local_cpus, pinned, torch_threads, warm_gpu
from specdec.bench.harness import synchronise
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.workloads import WorkloadGenerator
from specdec.zoo import load


class StepClock(FixedPolicy):
    """FixedPolicy that keeps each step's host wall time."""

    def __init__(self, k: int):
        super().__init__(k, 0)
        self.step_ms: list[float] = []

    def observe(self, record):
        if record.step_time_s is not None:
            self.step_ms.append(record.step_time_s * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--preset", default="gpu", help="zoo preset (cpu with --device cpu: a smoke test)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")

    zoo = load(args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    eos = zoo.tokenizer.eos_token_id
    prompts = WorkloadGenerator(zoo.heldout_texts(), zoo.tokenizer, 128, seed=0).standard(
        args.batch, ["mixed"])["mixed"].prompts(args.batch)
    drafter_name = "drafter-4L-narrow" if "drafter-4L-narrow" in zoo.drafters else sorted(zoo.drafters)[0]
    drafter = ModelDrafter(zoo.drafters[drafter_name], cuda_graphs=cuda, compile=cuda)
    local = gpu_local_cpus()
    core = local[len(local) // 2]  # away from core 0, where interrupts tend to land
    print(f"GPU-local CPUs {local}; pinning to {core}; torch threads {torch.get_num_threads()}", flush=True)

    def run(k: int) -> tuple[float, list[float]]:
        policy = StepClock(k)
        synchronise(args.device)
        started = time.perf_counter()
        generate(zoo.target, prompts, drafter=drafter if k else None, policy=policy, max_new_tokens=128,
                 eos_token_id=eos, cuda_graphs=cuda, compile=cuda)
        synchronise(args.device)
        return time.perf_counter() - started, policy.step_ms

    started = time.perf_counter()
    for k in (4, 0, 4, 0):
        run(k)  # builds both runners (compile, capture), then once more warm
    print(f"warm in {time.perf_counter() - started:.1f} s", flush=True)

    conditions = {
        "default": contextlib.nullcontext,
        "pinned": lambda: pinned([core]),
        "one_thread": lambda: torch_threads(1),
        "gpu_warm": contextlib.nullcontext,
    }
    names = list(conditions)
    passes = {(c, k): [] for c in names for k in (0, 4)}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for round_number in range(args.rounds):
            order = names[round_number % len(names):] + names[: round_number % len(names)]
            for name in order:
                for k in (0, 4):
                    with conditions[name]():
                        if name == "gpu_warm" and cuda:
                            warm_gpu("cuda", 0.05)
                        seconds, steps = run(k)
                    passes[(name, k)].append({"s": seconds, "step_ms_median": statistics.median(steps),
                                              "step_ms_p95": float(np.percentile(steps, 95))})
    finally:
        gc.enable()

    summary = {}
    for (name, k), rows in passes.items():
        seconds = [r["s"] for r in rows]
        summary[f"{name} k={k}"] = {
            "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "max_over_min": max(seconds) / min(seconds),
            "step_ms_median": statistics.median(r["step_ms_median"] for r in rows),
            "step_ms_median_range": [min(r["step_ms_median"] for r in rows), max(r["step_ms_median"] for r in rows)],
        }
        s = summary[f"{name} k={k}"]
        print(f"{name:10s} k={k}: median {s['median_s'] * 1e3:6.1f} ms  min {s['min_s'] * 1e3:6.1f}  "
              f"max {s['max_s'] * 1e3:6.1f}  max/min {s['max_over_min']:.2f}  step ms median "
              f"{s['step_ms_median']:.3f} (range {s['step_ms_median_range'][0]:.3f}-{s['step_ms_median_range'][1]:.3f})",
              flush=True)
    with open(os.path.join(args.out, "noise_probe.json"), "w") as f:
        json.dump({"gpu_local_cpus": local, "pinned_core": core, "torch_threads": torch.get_num_threads(),
                   "rounds": args.rounds, "drafter": drafter_name, "batch": args.batch, "summary": summary,
                   "passes": {f"{n} k={k}": v for (n, k), v in passes.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
