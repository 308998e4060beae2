"""Where does a multi-drafter step lose its time? (run 7: the bandits' steps cost 1.3-1.7x a fixed
drafter's, at batch 1 as at batch 64, though they mostly run one drafter per step)

One process, the gpu zoo (graphed, compiled), the `copy` workload's requests (256-token prompts,
128 new tokens), at each batch size given. Every round times one pass of each configuration, the
order rotated from round to round:
  alone <d>        FixedPolicy(4) with drafter d alone (the bench's fixed runs)
  listed <d>       FixedPolicy(4, index of d) with all three drafters given to generate()
                   (what merely listing drafters costs: every drafter's propose runs each step)
  switch every N   the three drafters in turn, N steps each, one drafter per step for the batch
                   (what a batch-level switch costs: the model drafter's catch-up)
  bandit <variant> the bench's BanditPolicy variants
Per configuration (median over rounds): wall seconds, steps, mean host ms per step, and per step
the verify GPU ms, each drafter's GPU ms and host ms, and the policy's host ms (plan + observe).
Writes bandit_overhead_probe.json to the folder given (default $OUT).

  python3 scripts/bandit_overhead_probe.py [--rounds 3] [--batch-sizes 64,1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from specdec import generate
from specdec.bench.affinity import torch_threads
from specdec.bench.harness import synchronise
from specdec.bench.policies import Tally
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import BanditPolicy, FixedPolicy, Policy
from specdec.types import Plan
from specdec.workloads import WorkloadGenerator
from specdec.zoo import load

LENGTH = 4
NAMES = ("prompt lookup", "drafter-4L-narrow", "drafter-2L")


class Switcher(Policy):
    """Every row drafts LENGTH tokens with one drafter, the drafters taken in turn every ``every`` steps."""

    def __init__(self, every: int):
        self.every, self.step = every, 0

    @property
    def max_draft_tokens(self) -> int:
        return LENGTH

    def plan(self, batch, num_drafters):
        index = (self.step // self.every) % num_drafters
        self.step += 1
        return Plan(drafter_index=np.full(batch.num_rows, index, dtype=np.int64),
                    num_draft_tokens=np.full(batch.num_rows, LENGTH, dtype=np.int64))


class Clock(Tally):
    """The policy bench's Tally (host time of the policy's plan and observe calls), keeping each step's record."""

    def __init__(self, inner: Policy, num_rows: int, num_drafters: int):
        super().__init__(inner, np.zeros(num_rows, dtype=np.int64), num_drafters)
        self.records = []

    def observe(self, record):
        super().observe(record)
        self.records.append(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="64,1")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--preset", default="gpu", help="zoo preset (cpu with --device cpu: a smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    zoo = load(args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    eos = zoo.tokenizer.eos_token_id
    models = [n for n in NAMES[1:] if n in zoo.drafters] or sorted(zoo.drafters)[:2]
    names = [NAMES[0], *models]
    drafters = {NAMES[0]: PromptLookupDrafter(), **{n: ModelDrafter(zoo.drafters[n], cuda_graphs=cuda, compile=cuda)
                                                     for n in models}}
    listed = [drafters[n] for n in names]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    generator = WorkloadGenerator(zoo.heldout_texts(), zoo.tokenizer, 256, seed=0)
    prompts_all = generator.standard(max(batch_sizes), ["copy"])["copy"].prompts(max(batch_sizes))

    configs = {}
    for n in names:
        configs[f"alone {n}"] = (lambda n=n: [drafters[n]], lambda: FixedPolicy(LENGTH))
        configs[f"listed {n}"] = (lambda: listed, lambda i=names.index(n): FixedPolicy(LENGTH, i))
    for every in (1, 8):
        configs[f"switch every {every}"] = (lambda: listed, lambda e=every: Switcher(e))
    for variant, strategy, scope in (("ucb", "ucb", "request"), ("batch-level", "epoch", "batch"), ("joint", "ucb", "joint")):
        configs[f"bandit {variant}"] = (lambda: listed, lambda s=strategy, sc=scope: BanditPolicy(LENGTH, strategy=s, scope=sc))

    def run(prompts, config):
        chosen, make = configs[config]
        drafters_given = chosen()
        clock = Clock(make(), len(prompts), len(drafters_given))
        synchronise(args.device)
        started = time.perf_counter()
        generate(zoo.target, prompts, drafter=drafters_given, policy=clock, max_new_tokens=args.new_tokens,
                 eos_token_id=eos, cuda_graphs=cuda, compile=cuda)
        synchronise(args.device)
        seconds = time.perf_counter() - started
        records = clock.records
        steps = len(records)
        per_drafter_gpu = np.sum([r.drafter_time_s for r in records], axis=0) * 1e3 / steps
        per_drafter_host = np.sum([r.drafter_wall_s for r in records], axis=0) * 1e3 / steps
        return {"s": seconds, "steps": steps,
                "step_ms": 1e3 * sum(r.step_time_s or 0.0 for r in records) / steps,
                "verify_gpu_ms": 1e3 * sum(r.verify_time_s for r in records) / steps,
                "draft_gpu_ms": 1e3 * sum(r.draft_time_s for r in records) / steps,
                "drafter_gpu_ms": per_drafter_gpu.round(4).tolist(), "drafter_host_ms": per_drafter_host.round(4).tolist(),
                "policy_ms": 1e3 * clock.policy_s / steps}

    result = {"names": names, "length": LENGTH, "new_tokens": args.new_tokens, "rounds": args.rounds, "batches": {}}
    with torch_threads(1 if cuda else None):
        for batch in batch_sizes:
            prompts = prompts_all[:batch]
            started = time.perf_counter()
            for config in configs:  # warm: runners built, graphs captured, compiled
                run(prompts, config)
            print(f"batch {batch}: warm in {time.perf_counter() - started:.1f} s", flush=True)
            passes = {c: [] for c in configs}
            order = list(configs)
            for round_number in range(args.rounds):
                shift = round_number % len(order)
                for config in order[shift:] + order[:shift]:
                    passes[config].append(run(prompts, config))
            summary = {}
            for config, rows in passes.items():
                median = sorted(rows, key=lambda r: r["s"])[len(rows) // 2]
                summary[config] = {**median, "s_all": [r["s"] for r in rows]}
                print(f"b{batch:<3d} {config:28s} {median['s'] * 1e3:7.1f} ms  {median['steps']:4d} steps  "
                      f"step {median['step_ms']:.3f} ms  verify {median['verify_gpu_ms']:.3f}  draft {median['draft_gpu_ms']:.3f}  "
                      f"drafters gpu {median['drafter_gpu_ms']} host {median['drafter_host_ms']}  policy {median['policy_ms']:.3f}",
                      flush=True)
            result["batches"][str(batch)] = summary
    with open(os.path.join(args.out, "bandit_overhead_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'bandit_overhead_probe.json')}", flush=True)


if __name__ == "__main__":
    main()
