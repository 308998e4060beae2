"""Speculative decoding with a tensor-parallel target: every process runs this script, the target
is sharded over the processes by transformers (``tp_plan="auto"``), the drafter is replicated,
and rank 0 decides each step (specdec/distributed.py).

    torchrun --nproc_per_node 2 examples/tensor_parallel.py --preset cpu            # CPU, gloo
    torchrun --nproc_per_node 2 examples/tensor_parallel.py --preset gpu --device cuda   # GPUs, NCCL

The model zoo must be built first (``python -m specdec zoo build --preset ...``). Rank 0 prints
the outputs and whether they equal the drafter-free decoding of the same sharded target.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.zoo.build import build_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--zoo-dir")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per process)")
    parser.add_argument("--drafter", default=None, help="zoo drafter name (default: the first one)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    folder = build_dir(args.preset, args.zoo_dir)
    dtype = torch.bfloat16 if cuda else torch.float32
    target = AutoModelForCausalLM.from_pretrained(folder / "target", tp_plan="auto", dtype=dtype)
    drafter_name = args.drafter or sorted(p.name for p in folder.glob("drafter-*"))[0]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    drafter = AutoModelForCausalLM.from_pretrained(folder / drafter_name, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in
               ("import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):\n")]
    plain = generate(target, prompts, policy=FixedPolicy(0), max_new_tokens=args.max_new_tokens)
    fast = generate(target, prompts, drafter=ModelDrafter(drafter), policy=FixedPolicy(4),
                    max_new_tokens=args.max_new_tokens)
    if dist.get_rank() == 0:
        for sequence in fast.sequences:
            print(repr(tokenizer.decode(sequence)))
        print(fast.stats.summary())
        print("identical to plain decoding:", fast.sequences == plain.sequences)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
