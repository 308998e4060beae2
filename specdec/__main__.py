"""Command line: python -m specdec demo [--device cuda] [--json FILE]."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="speculative vs plain decoding on tiny models, checked token for token")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    demo.add_argument("--json", dest="json_path", help="also write the table as JSON to this file")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.device, args.json_path, args.max_new_tokens, args.num_draft_tokens)
    return 2


if __name__ == "__main__":
    sys.exit(main())
