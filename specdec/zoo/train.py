"""Training for the zoo, reusable by later drafters: next-token pretraining, and distillation
of several students against one teacher's probabilities in the same pass.

Losses are plain functions of logits, so others (SPIRe's mixed loss, on-policy variants) plug
in without touching the loop:
- ``next_token_loss``: cross-entropy against the next token;
- ``distillation_loss``: soft cross-entropy, -sum_x p_teacher(x) log q_student(x);
- ``acceptance_loss``: -alpha = -sum_x min(p, q), the expected acceptance of one draft token;
- ``mixed_loss``: w * distillation + (1 - w) * acceptance (SPIRe, arXiv 2504.06419).

The loop: AdamW, linear warm-up then cosine decay, bf16 autocast and ``torch.compile`` on CUDA,
a tqdm bar with loss and tokens/s; held-out loss by ``evaluate``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def next_token_loss(student_logits: torch.Tensor, targets: torch.Tensor, teacher_logits=None) -> torch.Tensor:
    """student_logits: [B, T, V], targets: [B, T]."""
    return F.cross_entropy(student_logits.flatten(0, 1).float(), targets.flatten())


def distillation_loss(student_logits: torch.Tensor, targets, teacher_logits: torch.Tensor) -> torch.Tensor:
    teacher_probs = teacher_logits.float().softmax(-1)  # [B, T, V]
    return -(teacher_probs * student_logits.float().log_softmax(-1)).sum(-1).mean()


def acceptance_loss(student_logits: torch.Tensor, targets, teacher_logits: torch.Tensor) -> torch.Tensor:
    alpha = torch.minimum(teacher_logits.float().softmax(-1), student_logits.float().softmax(-1)).sum(-1)
    return -alpha.mean()


def mixed_loss(weight: float = 0.5) -> Callable:
    def loss(student_logits, targets, teacher_logits):
        return weight * distillation_loss(student_logits, targets, teacher_logits) + (1 - weight) * acceptance_loss(
            student_logits, targets, teacher_logits
        )

    return loss


# a field added after the first recipes, left out of a recipe's fingerprint while it holds its
# default (so the recipes written before it keep their fingerprints and builds)
OMIT_AT_DEFAULT = {"fingerprint": "omit at default"}


@dataclass(frozen=True)
class Schedule:
    """``steps`` optimizer steps of ``batch_size`` windows of ``seq_len`` tokens; with
    ``final_steps``, the last final_steps of them take ``final_batch_size`` windows of
    ``final_seq_len`` instead (a short long-context phase; the learning rate runs on unchanged)."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    final_steps: int = field(default=0, metadata=OMIT_AT_DEFAULT)
    final_batch_size: int | None = field(default=None, metadata=OMIT_AT_DEFAULT)
    final_seq_len: int | None = field(default=None, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        if not 0 <= self.final_steps <= self.steps:
            raise ValueError(f"final_steps must lie in [0, steps={self.steps}], got {self.final_steps}")
        if self.final_steps and (self.final_batch_size is None or self.final_seq_len is None):
            raise ValueError("a schedule with final_steps needs final_batch_size and final_seq_len")

    @property
    def longest_seq_len(self) -> int:
        return max(self.seq_len, self.final_seq_len or 0) if self.final_steps else self.seq_len

    @property
    def tokens(self) -> int:
        """Input tokens over all steps."""
        final = self.final_steps * (self.final_batch_size or 0) * (self.final_seq_len or 0)
        return (self.steps - self.final_steps) * self.batch_size * self.seq_len + final

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def random_windows(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of random windows [B, T+1] from a token stream (inputs and next tokens)."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        yield torch.from_numpy(tokens[starts[:, None] + offsets].astype(np.int64))


def schedule_windows(tokens: np.ndarray, schedule: Schedule, seed: int) -> Iterator[torch.Tensor]:
    """The schedule's batches: random windows of its seq_len, then of its final_seq_len for its
    final_steps (without a final phase, exactly ``random_windows(tokens, batch_size, seq_len, seed)``)."""
    windows = random_windows(tokens, schedule.batch_size, schedule.seq_len, seed)
    if not schedule.final_steps:
        return windows
    final = random_windows(tokens, schedule.final_batch_size, schedule.final_seq_len, seed=seed + 1000)
    return itertools.chain(itertools.islice(windows, schedule.steps - schedule.final_steps), final)


@dataclass
class TrainReport:
    steps: int
    tokens_seen: int
    seconds: float
    final_loss: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_seen / self.seconds if self.seconds else float("nan")


def train(
    students: dict[str, torch.nn.Module],
    batches: Iterator[torch.Tensor],
    schedule: Schedule,
    device: torch.device,
    loss_fn: Callable = next_token_loss,
    teacher: torch.nn.Module | None = None,
    description: str = "train",
    progress: bool = True,
) -> dict[str, TrainReport]:
    """Train every student on the same batches; with a teacher, its logits are computed once per
    batch and shared. Returns a report per student."""
    cuda = device.type == "cuda"
    runs = {}
    for name, model in students.items():
        model.to(device).train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay, betas=(0.9, 0.95), fused=cuda
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor)
        forward = torch.compile(model, dynamic=False) if cuda else model  # a final phase recompiles, static
        runs[name] = (model, forward, optimizer, scheduler)
    teacher_forward = None
    if teacher is not None:
        teacher.to(device).eval()
        teacher_forward = torch.compile(teacher, dynamic=False) if cuda else teacher
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    losses = {name: float("nan") for name in students}
    tokens_seen = 0
    started = time.perf_counter()
    bar = tqdm(range(schedule.steps), desc=description, disable=not progress, dynamic_ncols=True)
    # every zoo model runs LlamaForCausalLM.forward, and dynamo keeps at most recompile_limit (8)
    # compiled versions of one function: a target trained and used as teacher and three drafters,
    # each at two shapes when the schedule has a final phase, need 10 (past the limit: eager)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    recompiles = torch._dynamo.config.patch(**{limit: 64}) if cuda else contextlib.nullcontext()
    with recompiles:
        for step in bar:
            batch = next(batches).to(device, non_blocking=True)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            tokens_seen += inputs.numel()
            teacher_logits = None
            if teacher_forward is not None:
                with torch.no_grad(), autocast:
                    teacher_logits = teacher_forward(input_ids=inputs).logits
            for name, (model, forward, optimizer, scheduler) in runs.items():
                with autocast:
                    logits = forward(input_ids=inputs).logits
                loss = loss_fn(logits, targets, teacher_logits)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                if step % 10 == 0 or step == schedule.steps - 1:
                    losses[name] = loss.item()
            if step % 10 == 0 or step == schedule.steps - 1:
                elapsed = time.perf_counter() - started
                bar.set_postfix(loss=" ".join(f"{v:.3f}" for v in losses.values()), tok_s=f"{tokens_seen / elapsed:,.0f}")
    seconds = time.perf_counter() - started
    for model, *_ in runs.values():
        model.eval()
    return {
        name: TrainReport(steps=schedule.steps, tokens_seen=tokens_seen, seconds=seconds, final_loss=losses[name])
        for name in students
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int, device: torch.device, max_batches: int = 8) -> float:
    """Mean next-token cross-entropy over consecutive held-out windows (nats per token)."""
    model.to(device).eval()
    window = seq_len + 1
    count = min(len(tokens) // window, batch_size * max_batches)
    if count == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window of {window}")
    windows = torch.from_numpy(tokens[: count * window].reshape(count, window).astype(np.int64))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    total, seen = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        with autocast:
            logits = model(input_ids=chunk[:, :-1]).logits
        total += next_token_loss(logits, chunk[:, 1:]).item() * len(chunk)
        seen += len(chunk)
    return total / seen


@torch.no_grad()
def evaluate_by_position(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, edges: Sequence[int],
                         device: torch.device, max_windows: int = 8) -> dict[str, float]:
    """Mean next-token cross-entropy over consecutive held-out windows of seq_len tokens, by the
    position of the predicting token: {"a-b": loss over positions a..b} for consecutive edges
    (0 and seq_len added). Whether far positions work: their loss is no worse than near ones'."""
    model.to(device).eval()
    window = seq_len + 1
    count = min(len(tokens) // window, max_windows)
    if count == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window of {window}")
    bounds = sorted({0, seq_len, *(e for e in edges if 0 < e < seq_len)})
    totals = torch.zeros(seq_len, dtype=torch.float64)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    for index in range(count):
        chunk = torch.from_numpy(tokens[index * window : (index + 1) * window].astype(np.int64))[None].to(device)
        with autocast:
            logits = model(input_ids=chunk[:, :-1]).logits
        losses = F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="none")
        totals += losses.double().cpu()
    return {f"{a}-{b - 1}": float(totals[a:b].mean() / count) for a, b in zip(bounds, bounds[1:])}

