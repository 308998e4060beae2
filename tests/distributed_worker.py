"""One rank of the two-process tensor-parallel test (tests/test_distributed.py), run by torchrun:
loads the saved tiny target with ``tp_plan="auto"`` over gloo, decodes with specdec, and writes
what it saw to OUT/rank{R}.json."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from specdec import SamplingParams, generate
from specdec.distributed import tensor_parallel_group
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.policies import FixedPolicy
from specdec.runner import runners_of


def main(model_dir: str, drafter_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float64)
    drafter_model = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float64)  # replicated
    prompts = json.loads(open(f"{model_dir}/prompts.json").read())
    results = {}
    runs = {
        "plain": dict(policy=FixedPolicy(0)),
        "model": dict(drafter=ModelDrafter(drafter_model), policy=FixedPolicy(3)),
        "lookup": dict(drafter=PromptLookupDrafter(), policy=FixedPolicy(3)),
        "sampled": dict(drafter=ModelDrafter(drafter_model), policy=FixedPolicy(3),
                        sampling=SamplingParams(temperature=1.0), seed=11),
    }
    for name, kwargs in runs.items():
        out = generate(target, prompts, max_new_tokens=12, **kwargs)
        results[name] = out.sequences
    cache = runners_of(target)["target"].cache
    results["local_kv_heads"] = int(cache.keys[0].shape[1])
    results["decides_on_rank0"] = tensor_parallel_group(target) is not None
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
