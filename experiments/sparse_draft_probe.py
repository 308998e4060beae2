"""Probe: the cost of sparse drafting at long context on a random zoo-shaped target (no zoo build).

A random Llama of the gpu zoo's target shape (12 blocks of 512, 8 heads, vocabulary 8192) in
bf16, random prompts of about CONTEXT tokens (ragged +-50%), greedy: plain decoding,
SelfSpeculativeDrafter (sink 16, window 512) and SPIReDrafter (from the target, untrained) at
k = 4, with CUDA graphs. Random weights make acceptance meaningless; what it shows is each
method's draft and verify time per step, and that the paths run at this size.

    python experiments/sparse_draft_probe.py [CONTEXT] [BATCH] [OUT.json]
"""

import json
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import generate
from specdec.drafters import SelfSpeculativeDrafter, SPIReDrafter, SpireDraft
from specdec.policies import FixedPolicy


def main(context: int = 4096, batch: int = 64, out: str | None = None) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4 * context,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    target = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    lengths = rng.integers(context // 2, context * 3 // 2, size=batch)
    prompts = [rng.integers(0, 8192, size=n).tolist() for n in lengths]
    methods = {"plain": (None, 0), "self k=4": (lambda: SelfSpeculativeDrafter(sink=16, window=512), 4),
               "spire k=4": (lambda: SPIReDrafter(SpireDraft.from_target(target), cuda_graphs=True), 4)}
    rows = []
    for name, (make, k) in methods.items():
        generate(target, prompts[:2], drafter=make() if make else None, policy=FixedPolicy(k), max_new_tokens=8,
                 cuda_graphs=True)  # compile kernels
        out_ = generate(target, prompts, drafter=make() if make else None, policy=FixedPolicy(k), max_new_tokens=64,
                        cuda_graphs=True)
        s = out_.stats
        decode = s.wall_time_s - s.prefill_time_s
        row = dict(method=name, context=context, batch=batch, decode_s=decode, prefill_s=s.prefill_time_s,
                   tokens_per_s=sum(map(len, out_.sequences)) / decode, tau=s.tau, steps=s.steps,
                   draft_ms_per_step=1e3 * s.draft_time_s / s.steps, verify_ms_per_step=1e3 * s.verify_time_s / s.steps,
                   max_memory_gb=torch.cuda.max_memory_allocated() / 1e9)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__), f, indent=2)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 4096, int(args[1]) if len(args) > 1 else 64, args[2] if len(args) > 2 else None)
