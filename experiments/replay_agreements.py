"""Greedy agreements for replaying decoding (specdec.policies.simulate.replay_call), shared by
experiments/sim_trace_replay.py and experiments/sim_finish_batch_replay.py: the `cpu` zoo's target decodes
each request of the named workloads greedily (``new_tokens`` tokens, EOS suppressed), and
drafter-2L's greedy token at each generated position, given the target's own tokens before it, is
compared with the target's. With greedy decoding that is exactly what a draft of k tokens from
there gets accepted. Cached as JSON at ``cache`` (delete it after rebuilding the zoo).
"""
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specdec import zoo
from benchmarks.policies.workloads import STANDARD, WorkloadGenerator


def record_agreements(count: int, cache: Path, new_tokens: int = 128, names: Sequence[str] = tuple(STANDARD)) -> dict:
    """workload -> {"agreement": [[bool] * new_tokens per request], "prompt_tokens": [int]}."""
    if cache.exists():
        return json.loads(cache.read_text())
    models = zoo.load("cpu")
    target, drafter = models.target, models.drafters["drafter-2L"]
    workloads = WorkloadGenerator(models.heldout_texts(), models.tokenizer, prompt_tokens=256).standard(count, names=names)
    out = {}
    for name, workload in workloads.items():
        rows, lengths = [], []
        for ids in workload.prompts():
            prompt = torch.tensor([ids])
            with torch.no_grad():
                generated = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                            attention_mask=torch.ones_like(prompt))[0, len(ids):]  # [N]
                logits = drafter(torch.cat([prompt[0], generated])[None]).logits[0]  # [P + N, V]
            guesses = logits[len(ids) - 1: len(ids) - 1 + new_tokens].argmax(-1)  # [N] the drafter's token at each position
            rows.append((guesses == generated).tolist())
            lengths.append(len(ids))
        out[name] = {"agreement": rows, "prompt_tokens": lengths}
        print(f"{name}: drafter-2L agrees with the target at {np.mean(rows):.3f} of positions", flush=True)
    cache.write_text(json.dumps(out))
    return out
