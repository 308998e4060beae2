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

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

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


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1

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
        forward = torch.compile(model) if cuda else model
        runs[name] = (model, forward, optimizer, scheduler)
    teacher_forward = None
    if teacher is not None:
        teacher.to(device).eval()
        teacher_forward = torch.compile(teacher) if cuda else teacher
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    losses = {name: float("nan") for name in students}
    tokens_per_step = schedule.batch_size * schedule.seq_len
    started = time.perf_counter()
    bar = tqdm(range(schedule.steps), desc=description, disable=not progress, dynamic_ncols=True)
    for step in bar:
        batch = next(batches).to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
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
            bar.set_postfix(loss=" ".join(f"{v:.3f}" for v in losses.values()), tok_s=f"{(step + 1) * tokens_per_step / elapsed:,.0f}")
    seconds = time.perf_counter() - started
    for model, *_ in runs.values():
        model.eval()
    return {
        name: TrainReport(steps=schedule.steps, tokens_seen=schedule.steps * tokens_per_step, seconds=seconds, final_loss=losses[name])
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
