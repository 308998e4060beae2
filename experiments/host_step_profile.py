"""Where does the host time of a plain decoding step go? (issue 36: host time per step at most
0.3 ms at batch 1; the quick bench of 36717cf measured 0.88 ms under CUDA graphs.)

Runs plain decoding of a random-weight Llama shape through generate() at one batch size, under
cProfile for the timed call, and prints each specdec function's own and cumulative host time per
step, the blocking device-to-host copy (the step's one synchronisation, ``HostVerdict`` via
``to_host``) shown apart: its time is the device's, not the host's.

    PYTHONPATH=. python experiments/host_step_profile.py --shape llama-8B --batch 1      # GPU
    PYTHONPATH=. python experiments/host_step_profile.py --device cpu --tiny             # a smoke run

Writes the table as JSON with --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from specdec import generate
from specdec.bench.bandwidth import SHAPES
from specdec.bench.pipeline import random_model
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96)
# the gpu zoo's target and its 4-layer drafter (zoo/presets.py), for the speculative step's host time
ZOO_TARGET = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8192)
ZOO_DRAFTER = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=8192)


def profile_steps(model, batch: int, context: int, new_tokens: int, options: dict,
                  every_function: bool = False) -> tuple[list[dict], int, float]:
    """-> (rows of function, own ms a step, cumulative ms a step, calls a step; steps; wall ms a step).
    options: generate()'s (a drafter and policy for a speculative step; plain decoding by default).
    every_function: torch's and numpy's functions too (builtins: a kernel launch's host cost shows as
    the own time of the torch function that launched it), else specdec's and the synchronisations."""
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(context)] for i in range(batch)]
    options = {"policy": FixedPolicy(0), **options}
    for _ in range(2):  # the first call sizes the cache and captures the graphs
        generate(model, prompts, max_new_tokens=new_tokens, eos_token_id=[], **options)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    out = generate(model, prompts, max_new_tokens=new_tokens, eos_token_id=[], **options)
    profiler.disable()
    wall = time.perf_counter() - started
    steps = out.stats.steps
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        if not every_function and "specdec" not in path and name not in ("synchronize", "cpu", "item"):
            continue
        rows.append(dict(function=f"{path.split('specdec/')[-1]}:{line}({name})", own_ms=1000 * own / steps,
                         cumulative_ms=1000 * cumulative / steps, calls=calls / steps))
    rows.sort(key=lambda r: -(r["own_ms"] if every_function else r["cumulative_ms"]))
    return rows, steps, 1000 * (wall - out.stats.prefill_time_s) / steps


def probe_arguments(doc: str) -> argparse.ArgumentParser:
    """The shape, device and run arguments of the host probes (this one, host_critical_path.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8B", choices=sorted(SHAPES) + ["zoo-gpu"],
                        help="zoo-gpu: the gpu zoo's 49M-parameter target (random weights)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random shape (smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON file for the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = probe_arguments(__doc__)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--every-function", action="store_true",
                        help="list torch's and numpy's functions too, by own time (what launches cost)")
    parser.add_argument("--k", type=int, default=0, help="draft length: > 0 drafts with a random model of the gpu "
                        "zoo's 4-layer drafter shape (random weights: nothing is accepted, the step's work is)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shape = TINY if args.tiny else ZOO_TARGET if args.shape == "zoo-gpu" else SHAPES[args.shape]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = random_model(shape, args.device, seed=0, dtype=dtype)
    options = dict(attention="fast", cuda_graphs=True, compile=args.compile) if cuda else {}
    if args.k:
        drafter_shape = dict(TINY, num_hidden_layers=1) if args.tiny else dict(ZOO_DRAFTER, vocab_size=shape["vocab_size"])
        graphs = dict(cuda_graphs=True, compile=args.compile) if cuda else {}  # as the zoo bench drafts
        options.update(drafter=ModelDrafter(random_model(drafter_shape, args.device, seed=1, dtype=dtype), **graphs),
                       policy=FixedPolicy(args.k))
    rows, steps, wall_ms = profile_steps(model, args.batch, min(args.context, 64 if args.tiny else args.context),
                                         args.new_tokens, options, args.every_function)
    print(f"{steps} steps, {wall_ms:.3f} ms a step under the profiler (wall less prefill)")
    print(f"{'cumulative ms':>13} {'own ms':>8} {'calls':>6}  function (per step)")
    for row in rows[: args.top]:
        print(f"{row['cumulative_ms']:13.3f} {row['own_ms']:8.3f} {row['calls']:6.1f}  {row['function']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(shape="tiny" if args.tiny else args.shape, device=args.device, batch=args.batch, k=args.k,
                           compile=args.compile,
                           steps=steps, wall_ms_per_step=wall_ms, rows=rows), handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
