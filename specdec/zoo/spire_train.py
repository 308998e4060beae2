"""Training SPIRe drafts for the zoo (arXiv 2504.06419; ALGORITHMS.md section 8).

Blockwise unrolled distillation for blocks of k tokens: on each window of text, the target runs
once (its logits and the hidden states entering the drafts' source blocks); each draft then runs
``SpireDraft.unrolled_logits`` from block starts 0, k, 2k, ... (target memory before the block,
its own memory inside it) and is trained on the mixed loss
0.5 * cross-entropy(target probs, draft probs) + 0.5 * (-sum min(p, q)), the paper's w = 0.5.
Several drafts (the full one and its ablations) share the target's pass.

Cost per step: one target forward without gradients, and per draft k forwards of its blocks over
T / k positions each (so about one forward and backward over the window), plus attention over
sink + window + k keys per position.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from ..drafters.spire_model import SpireDraft
from .train import Schedule, TrainReport, mixed_loss


def block_starts(seq_len: int, block: int, device) -> torch.Tensor:
    """[S] starts 0, k, 2k, ... of the blocks whose k predictions all have a target token."""
    return torch.arange(0, seq_len - block + 1, block, device=device)


def target_pass(target, inputs: torch.Tensor, layers: set[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The target's logits [B, T, V] and the hidden states entering ``layers`` [B, T, hidden] each."""
    with torch.no_grad():
        out = target(input_ids=inputs, output_hidden_states=True)
    return out.logits, {j: out.hidden_states[j] for j in layers}


def spire_loss(draft: SpireDraft, inputs: torch.Tensor, teacher_logits: torch.Tensor,
               hidden: dict[int, torch.Tensor], block: int, loss_fn: Callable) -> torch.Tensor:
    """The mixed loss of ``draft`` over every block of one batch of windows inputs [B, T]."""
    starts = block_starts(inputs.shape[1], block, inputs.device)  # [S]
    student = draft.unrolled_logits(inputs, hidden, starts, block)  # [B, S, k, V]
    positions = starts[:, None] + torch.arange(block, device=inputs.device)  # [S, k]
    teacher = teacher_logits[:, positions]  # [B, S, k, V]
    return loss_fn(student.flatten(1, 2), None, teacher.flatten(1, 2))


def train_spire(drafts: dict[str, SpireDraft], target, batches: Iterator[torch.Tensor], schedule: Schedule,
                device: torch.device, block: int = 4, loss_fn: Callable | None = None,
                description: str = "spire", progress: bool = True) -> dict[str, TrainReport]:
    """Train every draft on the same windows (``batches`` yields [B, T + 1] token windows, as
    zoo.train.random_windows does) for ``schedule.steps`` steps -> a report per draft."""
    if block < 1:
        raise ValueError(f"block must be >= 1 (the k the drafts are trained for), got {block}")
    loss_fn = mixed_loss(0.5) if loss_fn is None else loss_fn
    cuda = device.type == "cuda"
    target.to(device).eval()
    runs = {}
    for name, draft in drafts.items():
        draft.to(device).train()
        optimizer = torch.optim.AdamW(draft.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay,
                                      betas=(0.9, 0.95), fused=cuda)
        runs[name] = (draft, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor))
    layers = {j for draft in drafts.values() for j in draft.source_layers}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    losses = {name: float("nan") for name in drafts}
    tokens_seen, started = 0, time.perf_counter()
    bar = tqdm(range(schedule.steps), desc=description, disable=not progress, dynamic_ncols=True)
    for step in bar:
        inputs = next(batches).to(device, non_blocking=True)[:, :-1]  # [B, T]: the draft predicts inside the window
        tokens_seen += inputs.numel()
        with autocast:
            teacher_logits, hidden = target_pass(target, inputs, layers)
        for name, (draft, optimizer, scheduler) in runs.items():
            with autocast:
                loss = spire_loss(draft, inputs, teacher_logits, hidden, block, loss_fn)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 20 == 0 or step == schedule.steps - 1:  # a read of the loss waits for the GPU
                losses[name] = loss.item()
        bar.set_postfix({name: f"{value:.3f}" for name, value in losses.items()})
    seconds = time.perf_counter() - started
    for draft, _, _ in runs.values():
        draft.eval()
    return {name: TrainReport(steps=schedule.steps, tokens_seen=tokens_seen, seconds=seconds, final_loss=losses[name])
            for name in drafts}


@torch.no_grad()
def evaluate_spire(draft: SpireDraft, target, windows: torch.Tensor, block: int = 4,
                   loss_fn: Callable | None = None) -> float:
    """The mixed loss on fixed windows [B, T] (held-out text)."""
    loss_fn = mixed_loss(0.5) if loss_fn is None else loss_fn
    teacher_logits, hidden = target_pass(target, windows, set(draft.source_layers))
    return float(spire_loss(draft, windows, teacher_logits, hidden, block, loss_fn))
