"""Command line.

    python -m specdec demo [--preset cpu|gpu] [--device cuda] [--json FILE] [--prompts FILE]
    python -m specdec bench [--quick] [--parts zoo,bandwidth,trees,verifiers,pipeline] [--preset gpu] [--out benchmarks/results]
    python -m specdec bench --long-context [--contexts 1024,4096,16384] [--batch-sizes 1,16,64] [--ks 2,3,4,5,6]
    python -m specdec serve-bench [--preset gpu] [--loads 0.1,0.5,0.9] [--methods plain,k1,k3,k5,goodput]
    python -m specdec zoo build --preset cpu|gpu|gpu-long|tiny [--out DIR] [--force]
    python -m specdec zoo prompts --preset cpu --out prompts.jsonl [--count N] [--tokens T]
"""

from __future__ import annotations

import argparse
import sys

POLICIES_MOVED = ("`python -m specdec bench --policies` has moved out of the installed package: from the repository "
                  "root, run `python -m benchmarks.policies` with the same options (--help lists them)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec", description="speculative decoding, checked")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="speculative vs plain decoding on the model zoo, checked token for token")
    demo.add_argument("--preset", default="cpu", help="zoo preset: cpu (default), gpu or tiny")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    demo.add_argument("--json", dest="json_path", help="also write the table as JSON to this file")
    demo.add_argument("--prompts", dest="prompts_path", help="JSON lines with 'prompt' (or Spec-Bench 'turns')")
    demo.add_argument("--num-prompts", type=int, default=8)
    demo.add_argument("--prompt-tokens", type=int, default=128)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--num-draft-tokens", type=int, default=4)
    demo.add_argument("--zoo-dir", help="build folder (default: $SPECDEC_ZOO_DIR/PRESET or ~/.cache/specdec/zoo/PRESET)")

    bench = commands.add_parser("bench", help="specdec against Hugging Face in one run, on the zoo")
    bench.add_argument("--preset", default="gpu")
    bench.add_argument("--device", default="cuda" if _cuda() else "cpu")
    bench.add_argument("--quick", action="store_true", help="batch 1 and 16, fewer prompts and tokens")
    bench.add_argument("--batch-sizes", default="1,4,16,64")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--num-draft-tokens", type=int, default=4)
    bench.add_argument("--dtype", default="auto", help="bfloat16 on CUDA and float32 on CPU by default")
    bench.add_argument("--no-peers", action="store_true", help="skip the Hugging Face baselines")
    bench.add_argument("--no-compile", action="store_true", help="ours without torch.compile inside the graphs")
    bench.add_argument("--parts", default="zoo,bandwidth",
                       help="zoo (the model zoo against the peers), bandwidth (1B/8B step times), trees (one "
                            "drafter as chains and token trees, greedy and T=0.8), verifiers (padded, padding-free "
                            "and decomposed verification of ragged draft lengths), pipeline (drafting beside "
                            "verification on a side stream and a second GPU, random weights); comma-separated")
    bench.add_argument("--temperatures", default="0,0.8", help="the trees part's temperatures (0: greedy)")
    bench.add_argument("--repeats", type=int, default=3, help="timed passes of each of our methods (the median)")
    bench.add_argument("--out", default="benchmarks/results", help="folder for the JSON, markdown and PNG")
    bench.add_argument("--zoo-dir")
    bench.add_argument("--long-context", action="store_true",
                       help="sparse drafters (MagicDec, SPIRe) against plain decoding and a small drafter at long "
                            "contexts instead (own options: python -m specdec bench --long-context --help)")

    zoo = commands.add_parser("zoo", help="build the model zoo or export its prompt sets")
    zoo_commands = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_build = zoo_commands.add_parser("build", help="train a preset's tokenizer, target and drafters")
    zoo_build.add_argument("--preset", default="cpu")
    zoo_build.add_argument("--out", help="build folder (default: $SPECDEC_ZOO_DIR/PRESET or ~/.cache/specdec/zoo/PRESET)")
    zoo_build.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    zoo_build.add_argument("--force", action="store_true", help="rebuild even if a build with this recipe exists")
    zoo_prompts = zoo_commands.add_parser("prompts", help="export held-out code prompts as JSON lines")
    zoo_prompts.add_argument("--preset", default="cpu")
    zoo_prompts.add_argument("--zoo-dir", help="build folder of the preset")
    zoo_prompts.add_argument("--out", required=True, help="JSON lines file to write")
    zoo_prompts.add_argument("--count", type=int, default=32)
    zoo_prompts.add_argument("--tokens", type=int, default=128, help="prompt length in tokens, cut at a line boundary")
    return parser


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bench(args) -> int:
    import json
    import time
    from pathlib import Path

    from .bench import BenchSettings, run, write

    settings = BenchSettings(preset=args.preset, device=args.device, num_draft_tokens=args.num_draft_tokens,
                             max_new_tokens=args.max_new_tokens, peers=not args.no_peers, dtype=args.dtype,
                             zoo_dir=args.zoo_dir, compile=False if args.no_compile else None,
                             parts=tuple(args.parts.split(",")),
                             batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                             tree_temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                             repeats=args.repeats)
    if args.quick:
        settings.batch_sizes, settings.num_prompts, settings.batch1_prompts = (1, 16), 16, 4
        settings.max_new_tokens = min(settings.max_new_tokens, 64)
        settings.bandwidth_shapes, settings.repeats = ("llama-8B",), 1
    stem = f"bench_{args.preset}_{args.device.split(':')[0]}_{time.strftime('%Y%m%d_%H%M%S')}"
    partial = Path(args.out) / f"{stem}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    result = run(settings, checkpoint=lambda so_far: partial.write_text(json.dumps(so_far, indent=2)))
    for path in write(result, args.out, stem):
        print(f"wrote {path}")
    partial.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and "--policies" in argv:
        print(POLICIES_MOVED, file=sys.stderr)
        return 2
    if argv[:1] == ["serve-bench"]:  # its own options: specdec/bench/serve.py
        from .bench.serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["bench"] and "--long-context" in argv:  # its own options: specdec/bench/long_context.py
        from .bench.long_context import main as long_context_main

        return long_context_main([a for a in argv[1:] if a != "--long-context"])
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.preset, args.device, args.json_path, args.prompts_path, args.num_prompts,
                         args.prompt_tokens, args.max_new_tokens, args.num_draft_tokens, args.zoo_dir)
    from . import zoo

    if args.zoo_command == "build":
        zoo.build(args.preset, out=args.out, device=args.device, force=args.force)
        return 0
    from .zoo.prompts import heldout_prompts, write_jsonl

    built = zoo.load(args.preset, out=args.zoo_dir)
    prompts = heldout_prompts(built.heldout_texts(), built.tokenizer, args.count, args.tokens)
    write_jsonl(prompts, args.out)
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
