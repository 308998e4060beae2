"""Diagnostic for the open CUDA-graph capture failure: replay the demo's sequence of calls
(plain decoding, prompt lookup, then each zoo drafter, at batch 1 then 8) with CUDA graphs on,
checking each output against plain decoding, and report the first failure.

    python scripts/graph_capture_probe.py [PRESET] [--prompts N]
"""

import sys
import traceback

import torch

from specdec import generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.zoo import build, load
from specdec.zoo.prompts import heldout_prompts

preset = sys.argv[1] if len(sys.argv) > 1 else "gpu"
count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
build(preset, device="cuda", progress=False)
zoo = load(preset, device="cuda")
records = heldout_prompts(zoo.heldout_texts(), zoo.tokenizer, count, 128)
prompts = [zoo.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
graphs = dict(attention="fast", cuda_graphs=True)
drafters = {"prompt lookup": PromptLookupDrafter()}
drafters.update({n: ModelDrafter(m, **graphs) for n, m in zoo.drafters.items()})
for batch in (1, count):
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    plain = [generate(zoo.target, c, policy=FixedPolicy(0), max_new_tokens=32, **graphs).sequences for c in chunks]
    print(f"batch {batch}: plain decoding ran", flush=True)
    for name, drafter in drafters.items():
        try:
            outs = [generate(zoo.target, c, drafter=drafter, policy=FixedPolicy(4), max_new_tokens=32, **graphs).sequences
                    for c in chunks]
            print(f"batch {batch}: {name}: ran, identical to plain: {outs == plain}", flush=True)
        except Exception as error:  # a probe: report and stop
            print(f"batch {batch}: {name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            traceback.print_exc(limit=4)
            sys.exit(1)
print("no failure")
