"""The main job: on the model zoo's held-out code prompts, plain decoding through the library
(k = 0), prompt lookup and each model drafter, all with the padding-free verifier, at batch 1
and batch 8; every speculative output is checked token for token against plain decoding, and
one table reports speed and acceptance.

Batch 1 runs the prompts one generate() call at a time; its figures aggregate those calls.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import generate
from .drafters import ModelDrafter, PromptLookupDrafter
from .policies import FixedPolicy
from .stats import GenerationStats
from .verifiers import PaddingFreeVerifier
from .zoo import build, load
from .zoo.prompts import heldout_prompts, read_prompts


@dataclass
class DemoRow:
    method: str
    batch: int
    tokens_per_s: float
    speedup: float
    tau: float
    acceptance_by_position: list[float]
    identical: bool


@dataclass
class Aggregate:
    """Figures of several generate() calls taken together."""

    sequences: list[list[int]]
    emitted: int
    steps: int
    wall_time_s: float
    drafted_by_position: np.ndarray
    accepted_by_position: np.ndarray

    @classmethod
    def of(cls, outputs) -> "Aggregate":
        stats: list[GenerationStats] = [o.stats for o in outputs]
        width = max(len(s.drafted_by_position) for s in stats)
        pad = lambda values: np.pad(np.asarray(values, dtype=float), (0, width - len(values)))  # noqa: E731
        return cls(
            sequences=[seq for o in outputs for seq in o.sequences],
            emitted=sum(s.emitted for s in stats),
            steps=sum(r.steps for s in stats for r in s.requests),
            wall_time_s=sum(s.wall_time_s for s in stats),
            drafted_by_position=sum(pad(s.drafted_by_position) for s in stats),
            accepted_by_position=sum(pad(s.accepted_by_position) for s in stats),
        )

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.wall_time_s

    @property
    def tau(self) -> float:
        return self.emitted / self.steps

    def acceptance(self, positions: int = 4) -> list[float]:
        rates = [a / d if d else float("nan") for a, d in zip(self.accepted_by_position, self.drafted_by_position)]
        return (rates + [float("nan")] * positions)[:positions]


def run_method(target, prompts, batch, drafter, num_draft_tokens, max_new_tokens, eos) -> Aggregate:
    kwargs = dict(drafter=drafter, verifier=PaddingFreeVerifier(), policy=FixedPolicy(num_draft_tokens),
                  max_new_tokens=max_new_tokens, eos_token_id=eos)
    return Aggregate.of([generate(target, prompts[i : i + batch], **kwargs) for i in range(0, len(prompts), batch)])


def run(target, drafters: dict, prompts, batch_sizes=(1, 8), num_draft_tokens=4, max_new_tokens=64, eos=None, log=print):
    rows = []
    generate(target, prompts[:1], max_new_tokens=4)  # warm-up
    for batch in batch_sizes:
        plain = run_method(target, prompts, batch, None, 0, max_new_tokens, eos)
        rows.append(DemoRow("plain decoding (k=0)", batch, plain.tokens_per_s, 1.0, plain.tau, plain.acceptance(), True))
        log(_format_row(rows[-1]))
        for name, drafter in drafters.items():
            out = run_method(target, prompts, batch, drafter, num_draft_tokens, max_new_tokens, eos)
            rows.append(DemoRow(f"{name} (k={num_draft_tokens})", batch, out.tokens_per_s,
                                out.tokens_per_s / plain.tokens_per_s, out.tau, out.acceptance(),
                                out.sequences == plain.sequences))
            log(_format_row(rows[-1]))
    return rows


# printed under the table: what the speed-ups of small models on this machine mean
READING = ("speed-up is wall time on this machine: models this small are bound by per-step overhead (on a CPU, "
           "or a GPU without CUDA graphs), so drafting gains little or loses here; tau, tokens per target pass, is "
           "the gain that carries over; `python -m specdec bench` on a GPU measures the speed (BENCHMARKS.md)")

HEADER = f"{'method':<30} {'batch':>5} {'tok/s':>9} {'speed-up':>8} {'tau':>5}  {'acceptance at 1..4':<23} identical"


def _format_row(row: DemoRow) -> str:
    acceptance = " ".join("  - " if np.isnan(a) else f"{a:.2f}" for a in row.acceptance_by_position)
    return (f"{row.method:<30} {row.batch:>5} {row.tokens_per_s:>9.1f} {row.speedup:>7.2f}x {row.tau:>5.2f}  "
            f"{acceptance:<23} {'yes' if row.identical else 'NO'}")


def format_table(rows: list[DemoRow]) -> str:
    return "\n".join([HEADER, "-" * len(HEADER), *map(_format_row, rows)])


def plain_matches_hugging_face(target, prompt: list[int], max_new_tokens: int, eos: int) -> bool:
    """The reference itself checked once: our plain decoding equals transformers' greedy generate()."""
    input_ids = torch.tensor([prompt], device=target.device)
    reference = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    ours = generate(target, [prompt], max_new_tokens=max_new_tokens, eos_token_id=eos).sequences[0]
    return ours == reference[0, len(prompt):].tolist()


def main(preset: str = "cpu", device: str = "cpu", json_path: str | None = None, prompts_path: str | None = None,
         num_prompts: int = 8, prompt_tokens: int = 128, max_new_tokens: int = 64, num_draft_tokens: int = 4,
         zoo_dir: str | None = None) -> int:
    build(preset, out=zoo_dir, device=device)
    zoo = load(preset, out=zoo_dir, device=device)
    tokenizer = zoo.tokenizer
    if prompts_path:
        records = read_prompts(prompts_path)[:num_prompts]
    else:
        records = heldout_prompts(zoo.heldout_texts(), tokenizer, num_prompts, prompt_tokens)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-prompt_tokens:] for r in records]
    drafters = {"prompt lookup": PromptLookupDrafter()}
    drafters.update({name: ModelDrafter(model) for name, model in zoo.drafters.items()})
    print(f"zoo '{preset}' at {zoo.path}: target {zoo.manifest['models']['target']['parameters']:,} parameters; "
          f"{len(prompts)} held-out prompts of up to {prompt_tokens} tokens, {max_new_tokens} new tokens, on {device}")
    print(HEADER)
    print("-" * len(HEADER))
    rows = run(zoo.target, drafters, prompts, (1, 8), num_draft_tokens, max_new_tokens, tokenizer.eos_token_id)
    print(READING)
    matches_hf = plain_matches_hugging_face(zoo.target, prompts[0], max_new_tokens, tokenizer.eos_token_id)
    print(f"plain decoding through specdec equals Hugging Face generate() on prompt 0: {'yes' if matches_hf else 'NO'}")
    if json_path:
        from .bench.harness import environment

        result = {
            "environment": environment(device),
            "preset": preset,
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
            "zoo": {k: zoo.manifest[k] for k in ("fingerprint", "models", "build_seconds")},
            "settings": {"prompts": len(prompts), "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
                         "num_draft_tokens": num_draft_tokens},
            "rows": [asdict(r) for r in rows],
            "plain_matches_hugging_face": matches_hf,
        }
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {json_path}")
    if not matches_hf or not all(r.identical for r in rows):
        print("ERROR: a speculative output differs from plain decoding")
        return 1
    print("every speculative output is token-identical to plain decoding")
    return 0
