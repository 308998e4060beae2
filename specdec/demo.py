"""The main job: speculative decoding against plain decoding on the same prompts, checked token
for token, with a table of speed and acceptance.

For now it runs on tiny random models built on the spot: a target, a "drafter" made by
perturbing the target's weights (a stand-in for a distilled small model, so that it agrees
often), and prompt lookup on prompts that repeat themselves. Random weights make the speeds
meaningless as a claim about real models; the point is the checked equality and the
statistics.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from . import generate
from .drafters import ModelDrafter, PromptLookupDrafter
from .policies import FixedPolicy
from .verifiers import PaddingFreeVerifier


@dataclass
class DemoRow:
    method: str
    batch: int
    tokens_per_s: float
    speedup: float
    tau: float
    acceptance_by_position: list[float]
    identical: bool


def tiny_models(device: str, seed: int = 0):
    """A random Llama target and a drafter that agrees with it often."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharper, more realistic next-token distributions
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    return target.to(device).eval(), drafter.to(device).eval()


def repeating_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(0, vocab_size, size=int(rng.integers(8, 24))).tolist()
        prompts.append(phrase + rng.integers(0, vocab_size, size=4).tolist() + phrase[: len(phrase) // 2])
    return prompts


def run(target, drafters: dict, prompts: list[list[int]], batch_sizes, num_draft_tokens: int, max_new_tokens: int):
    """One table row per (method, batch size); every output is checked against plain decoding."""
    rows = []
    for batch in batch_sizes:
        chosen = prompts[:batch]
        generate(target, chosen[:1], max_new_tokens=4)  # warm-up
        plain = generate(target, chosen, policy=FixedPolicy(0), max_new_tokens=max_new_tokens)
        rows.append(_row("plain decoding (k=0)", batch, plain, plain))
        for name, drafter in drafters.items():
            out = generate(target, chosen, drafter=drafter, verifier=PaddingFreeVerifier(),
                           policy=FixedPolicy(num_draft_tokens), max_new_tokens=max_new_tokens)
            rows.append(_row(f"{name} (k={num_draft_tokens})", batch, out, plain))
    return rows


def _row(method, batch, out, plain) -> DemoRow:
    by_position = (out.stats.acceptance_by_position + [float("nan")] * 4)[:4]
    return DemoRow(
        method=method,
        batch=batch,
        tokens_per_s=out.stats.tokens_per_s,
        speedup=out.stats.tokens_per_s / plain.stats.tokens_per_s,
        tau=out.stats.tau,
        acceptance_by_position=by_position,
        identical=out.sequences == plain.sequences,
    )


def format_table(rows: list[DemoRow]) -> str:
    header = f"{'method':<32} {'batch':>5} {'tok/s':>9} {'speed-up':>8} {'tau':>5}  {'acceptance at 1..4':<24} identical"
    lines = [header, "-" * len(header)]
    for row in rows:
        acceptance = " ".join("  - " if np.isnan(a) else f"{a:.2f}" for a in row.acceptance_by_position)
        lines.append(
            f"{row.method:<32} {row.batch:>5} {row.tokens_per_s:>9.1f} {row.speedup:>7.2f}x {row.tau:>5.2f}  "
            f"{acceptance:<24} {'yes' if row.identical else 'NO'}"
        )
    return "\n".join(lines)


def main(device: str = "cpu", json_path: str | None = None, max_new_tokens: int = 64, num_draft_tokens: int = 4) -> int:
    target, drafter_model = tiny_models(device)
    prompts = repeating_prompts(8, target.config.vocab_size)
    drafters = {"model drafter": ModelDrafter(drafter_model), "prompt lookup": PromptLookupDrafter()}
    print(f"target: random Llama, {sum(p.numel() for p in target.parameters()):,} parameters, on {device}")
    rows = run(target, drafters, prompts, (1, 8), num_draft_tokens, max_new_tokens)
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
        print(f"wrote {json_path}")
    if not all(r.identical for r in rows):
        print("ERROR: a speculative output differs from plain decoding")
        return 1
    print("every speculative output is token-identical to plain decoding")
    return 0
