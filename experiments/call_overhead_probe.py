"""Where does a generate() call's wall time go, without a profiler? (issue 36: the zoo's best
speculative method at batch 1 against Hugging Face's static cache; the bench times whole calls,
so a call's set-up, prefill and tear-down count beside its steps.)

Runs generate() on the gpu zoo's shapes (random weights: nothing is accepted, so every step
emits one token; the step's work is the same as with trained weights) at batch 1, plain decoding
and k draft tokens from a graphed drafter of the zoo's 4-layer shape, and splits each call's
wall time with perf_counter wrappers (about a microsecond each) into: set-up (input checks,
Engine construction: runners, locks, drafter start), admission (the prefill, waited for), the
steps (their count, host ms each, and the device ms of the draft and verify phases each), and
tear-down (close, statistics). Prints the median call of ``--calls``.

    PYTHONPATH=. python experiments/call_overhead_probe.py --compile            # GPU
    PYTHONPATH=. python experiments/call_overhead_probe.py --device cpu --tiny  # a smoke run
"""

from __future__ import annotations

import functools
import json
import sys
import time

import numpy as np
import torch

from specdec import Engine, generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.bench.harness import environment
from specdec.bench.pipeline import random_model

from host_step_profile import TINY, ZOO_DRAFTER, ZOO_TARGET, probe_arguments


class Stopwatch:
    """Wall seconds spent inside wrapped methods, per name, since the last ``reset``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds = {}


def synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def probe(target, prompts, options: dict, new_tokens: int, calls: int, device: str, watch: Stopwatch) -> dict:
    """The median call's parts in ms (by wall time), and its steps."""
    for _ in range(2):  # sizes the caches, compiles and captures
        generate(target, prompts, max_new_tokens=new_tokens, eos_token_id=[], **options)
    records = []
    for _ in range(calls):
        synchronise(device)
        watch.reset()
        started = time.perf_counter()
        out = generate(target, prompts, max_new_tokens=new_tokens, eos_token_id=[], **options)
        synchronise(device)
        wall = time.perf_counter() - started
        s, stats = watch.seconds, out.stats
        parts = dict(wall=wall, set_up=s.get("init", 0.0), admit=s.get("admit", 0.0), steps=s.get("step", 0.0),
                     close=s.get("close", 0.0))
        parts["other"] = wall - sum(v for k, v in parts.items() if k != "wall")
        records.append(dict({k: 1000 * v for k, v in parts.items()}, num_steps=stats.steps,
                            step_host_ms=1000 * s.get("step", 0.0) / stats.steps,
                            draft_device_ms=1000 * stats.draft_time_s / stats.steps,
                            verify_device_ms=1000 * stats.verify_time_s / stats.steps))
    walls = [r["wall"] for r in records]
    return records[int(np.argsort(walls)[len(walls) // 2])]


def main(argv: list[str] | None = None) -> int:
    parser = probe_arguments(__doc__)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ks", default="0,4", help="draft lengths (0: plain decoding)")
    parser.add_argument("--calls", type=int, default=9)
    parser.set_defaults(context=128)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if args.tiny else ZOO_TARGET
    target = random_model(shape, args.device, seed=0, dtype=dtype)
    drafter_model = random_model(dict(TINY, num_hidden_layers=1) if args.tiny else ZOO_DRAFTER, args.device, seed=1,
                                 dtype=dtype)
    graphs = dict(cuda_graphs=True, compile=args.compile) if cuda else {}
    watch = Stopwatch()
    for name, label in (("__init__", "init"), ("admit", "admit"), ("step", "step"), ("close", "close")):
        watch.wrap(Engine, name, label)
    prompts = [[(7 * i + j) % shape["vocab_size"] for j in range(args.context)] for i in range(args.batch)]
    results = []
    for k in map(int, args.ks.split(",")):
        options = dict(graphs, attention="fast" if cuda else "reference", policy=FixedPolicy(k))
        if k:
            options["drafter"] = ModelDrafter(drafter_model, **graphs)
        row = dict(k=k, **probe(target, prompts, options, args.new_tokens, args.calls, args.device, watch))
        results.append(row)
        print(f"k={k}: call {row['wall']:.2f} ms = set-up {row['set_up']:.2f} + admit {row['admit']:.2f} + "
              f"{row['num_steps']} steps {row['steps']:.2f} ({row['step_host_ms']:.3f} ms each; device draft "
              f"{row['draft_device_ms']:.3f} + verify {row['verify_device_ms']:.3f}) + close {row['close']:.2f} + "
              f"other {row['other']:.2f}")
    if args.out:
        with open(args.out, "w") as handle:
            env = dict(environment(args.device), command=" ".join(["python experiments/call_overhead_probe.py"] + sys.argv[1:]))
            json.dump(dict(environment=env, device=args.device, batch=args.batch, context=args.context, new_tokens=args.new_tokens,
                           compile=args.compile, rows=results), handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
