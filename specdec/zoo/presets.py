"""Recipes of the zoo's presets: what corpus, tokenizer, target and drafters each builds.

A recipe is plain data; its fingerprint (a hash of every field and the recipe version) names a
build, so a build with the same recipe is reused and any change rebuilds. Fields added after
the first recipes (marked ``OMIT_AT_DEFAULT``) are hashed only when they differ from their
default, so the earlier recipes keep their fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass

from .train import OMIT_AT_DEFAULT, Schedule

RECIPE_VERSION = 1


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model. ``init_from_target`` copies the target's embeddings, final
    norm, head and first ``layers`` blocks (needs the target's width): a strong start for a drafter."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    init_from_target: bool = False


@dataclass(frozen=True)
class Recipe:
    name: str
    vocab_size: int
    tokenizer_bytes: int  # characters of training text the tokenizer learns from
    train_tokens: int  # size of the tokenised training stream
    eval_tokens: int  # size of the held-out stream for the held-out loss
    site_packages: bool
    max_positions: int
    target: Shape
    target_schedule: Schedule
    drafters: dict[str, Shape] = field(default_factory=dict)
    distill_schedule: Schedule | None = None
    rope_theta: float | None = field(default=None, metadata=OMIT_AT_DEFAULT)  # None: LlamaConfig's default

    def fingerprint(self) -> str:
        text = json.dumps({"version": RECIPE_VERSION, **_hashed(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def longest_seq_len(self) -> int:
        """The longest training window of the target or the drafters."""
        schedules = [s for s in (self.target_schedule, self.distill_schedule) if s is not None]
        return max(s.longest_seq_len for s in schedules)


def _hashed(value):
    """``dataclasses.asdict``, but without the fields marked OMIT_AT_DEFAULT while at their default."""
    if is_dataclass(value):
        return {f.name: _hashed(getattr(value, f.name)) for f in fields(value)
                if f.metadata != OMIT_AT_DEFAULT or getattr(value, f.name) != f.default}
    if isinstance(value, dict):
        return {key: _hashed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hashed(item) for item in value]
    return value


PRESETS = {
    # seconds on two CPU cores: for tests and the notebook's smoke run
    "tiny": Recipe(
        name="tiny",
        vocab_size=384,
        tokenizer_bytes=400_000,
        train_tokens=120_000,
        eval_tokens=8_000,
        site_packages=False,
        max_positions=512,
        target=Shape(layers=2, hidden=64, heads=2, intermediate=128),
        target_schedule=Schedule(steps=40, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5),
        drafters={
            "drafter-1L": Shape(layers=1, hidden=64, heads=2, intermediate=128, init_from_target=True),
            "drafter-narrow": Shape(layers=1, hidden=32, heads=1, intermediate=64),
        },
        distill_schedule=Schedule(steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5),
    ),
    # the README's main job: under 5 minutes on two CPU cores
    "cpu": Recipe(
        name="cpu",
        vocab_size=1024,  # a small head: two CPU cores afford many more tokens (measured: 2.0 vs 3.0 bits/char)
        tokenizer_bytes=4_000_000,
        train_tokens=3_000_000,
        eval_tokens=60_000,
        site_packages=False,
        max_positions=1024,
        target=Shape(layers=3, hidden=128, heads=4, intermediate=384),
        target_schedule=Schedule(steps=560, batch_size=32, seq_len=128, lr=5e-3, warmup_steps=20),
        drafters={
            "drafter-1L": Shape(layers=1, hidden=128, heads=4, intermediate=384, init_from_target=True),
            "drafter-2L": Shape(layers=2, hidden=128, heads=4, intermediate=384, init_from_target=True),
            "drafter-narrow": Shape(layers=1, hidden=64, heads=2, intermediate=192),
        },
        distill_schedule=Schedule(steps=240, batch_size=32, seq_len=128, lr=3e-3, warmup_steps=15),
    ),
    # one H200, under 8 minutes; the corpus includes the installed packages
    "gpu": Recipe(
        name="gpu",
        vocab_size=8192,
        tokenizer_bytes=30_000_000,
        train_tokens=40_000_000,
        eval_tokens=400_000,
        site_packages=True,
        max_positions=2048,
        target=Shape(layers=12, hidden=512, heads=8, intermediate=1536),
        target_schedule=Schedule(steps=1400, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100),
        drafters={
            "drafter-1L": Shape(layers=1, hidden=512, heads=8, intermediate=1536, init_from_target=True),
            "drafter-2L": Shape(layers=2, hidden=512, heads=8, intermediate=1536, init_from_target=True),
            "drafter-4L-narrow": Shape(layers=4, hidden=256, heads=4, intermediate=768),
        },
        distill_schedule=Schedule(steps=800, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=50),
    ),
    # "gpu"'s shapes for long contexts (issue 33): positions to 16K and a larger RoPE base (Llama 3's);
    # "gpu"'s 64 windows of 512 tokens a step, then the last 10% of steps on 2 windows of 16,384 (as
    # many tokens a step), so positions to 16K are trained. One H100, under 6 minutes. Windows of
    # 2,048 from the start (16 a step) were slower and cost 0.3 nats of held-out loss (measured)
    "gpu-long": Recipe(
        name="gpu-long",
        vocab_size=8192,
        tokenizer_bytes=30_000_000,
        train_tokens=40_000_000,
        eval_tokens=400_000,
        site_packages=True,
        max_positions=16384,
        rope_theta=500_000.0,
        target=Shape(layers=12, hidden=512, heads=8, intermediate=1536),
        target_schedule=Schedule(steps=1400, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                                 final_steps=140, final_batch_size=2, final_seq_len=16384),
        drafters={
            "drafter-1L": Shape(layers=1, hidden=512, heads=8, intermediate=1536, init_from_target=True),
            "drafter-2L": Shape(layers=2, hidden=512, heads=8, intermediate=1536, init_from_target=True),
            "drafter-4L-narrow": Shape(layers=4, hidden=256, heads=4, intermediate=768),
        },
        distill_schedule=Schedule(steps=800, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=50,
                                  final_steps=80, final_batch_size=2, final_seq_len=16384),
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in PRESETS:
        raise ValueError(f"unknown zoo preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
