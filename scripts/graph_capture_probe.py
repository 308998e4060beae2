"""Diagnostic: capture CUDA graphs for each zoo drafter in a fresh process, one at a time,
then all in sequence as the demo does, and report which capture fails."""

import sys
import traceback

import torch

from specdec import generate
from specdec.drafters import ModelDrafter
from specdec.policies import FixedPolicy
from specdec.zoo import load

zoo = load(sys.argv[1] if len(sys.argv) > 1 else "gpu", device="cuda")
prompt = [zoo.tokenizer("import os\n")["input_ids"]]
for name, model in zoo.drafters.items():
    try:
        out = generate(zoo.target, prompt, drafter=ModelDrafter(model, attention="fast", cuda_graphs=True),
                       policy=FixedPolicy(4), max_new_tokens=16, attention="fast", cuda_graphs=True)
        print(f"{name}: graphs captured and ran, tau {out.stats.tau:.2f}", flush=True)
    except Exception as error:  # report and continue: this is a probe
        print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
        traceback.print_exc(limit=3)
        break
