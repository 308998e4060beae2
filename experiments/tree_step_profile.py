"""Where a token-tree step's time goes on the GPU, against a chain's: one call each at batch 1 on
the gpu zoo (compiled graphs, as the bench runs them), under torch.profiler. Prints per method the
wall time per step, the host ops with the most self CPU time, and the device time by kernel."""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specdec import SamplingParams, generate
from specdec.drafters import ModelDrafter
from specdec.drafters.tree import TreeSpec
from specdec.policies import FixedPolicy
from specdec.verifiers import PaddingFreeVerifier, TreeVerifier
from specdec.zoo import load
from specdec.zoo.prompts import heldout_prompts

zoo = load("gpu", device="cuda", dtype=torch.bfloat16)
records = heldout_prompts(zoo.heldout_texts(), zoo.tokenizer, 4, 128)
prompts = [zoo.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
model = zoo.drafters["drafter-4L-narrow"]
temperature = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
methods = {
    "chain k=6": dict(drafter=ModelDrafter(model, cuda_graphs=True, compile=True), policy=FixedPolicy(6),
                      verifier=PaddingFreeVerifier()),
    "tree 64": dict(drafter=ModelDrafter(model, cuda_graphs=True, compile=True, tree=TreeSpec(6, 4)),
                    policy=FixedPolicy(64), verifier=TreeVerifier()),
}
for name, kwargs in methods.items():
    call = dict(max_new_tokens=128, cuda_graphs=True, compile=True, sampling=SamplingParams(temperature=temperature),
                eos_token_id=zoo.tokenizer.eos_token_id, **kwargs)
    generate(zoo.target, [prompts[0]], **call)
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = generate(zoo.target, [prompts[1]], **call)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    print(f"\n=== {name}: {out.stats.steps} steps, tau {out.stats.tau:.2f}, {1e3 * wall / out.stats.steps:.2f} ms a step; "
          f"draft {1e3 * out.stats.draft_time_s / out.stats.steps:.2f} ms, verify "
          f"{1e3 * out.stats.verify_time_s / out.stats.steps:.2f} ms a step (device)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = generate(zoo.target, [prompts[2]], **call)
        torch.cuda.synchronize()
    steps = out.stats.steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(f"(profiled call: {steps} steps)")
