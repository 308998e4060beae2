"""Training SPIRe drafts (zoo/spire_train.py): the held-out mixed loss falls for the full draft
and its ablations, and a trained draft saved and loaded gives the same loss."""

import numpy as np
import torch

from specdec.drafters import SpireDraft
from specdec.zoo.spire_train import block_starts, evaluate_spire, train_spire
from specdec.zoo.train import Schedule, random_windows
from tests.tiny import make_model


def test_training_lowers_the_held_out_loss_and_the_trained_draft_saves(tmp_path):
    target = make_model("llama", num_layers=4, dtype=torch.float32, max_positions=128)
    stream = np.random.default_rng(0).integers(0, 96, size=5_000)
    held_out = next(random_windows(stream, 8, 48, seed=99))[:, :-1]
    drafts = {"full": SpireDraft.from_target(target, window=8),
              "no feedback": SpireDraft.from_target(target, window=8, feedback=False),
              "random init": SpireDraft.from_target(target, window=8, random_init=True)}
    before = {name: evaluate_spire(d, target, held_out) for name, d in drafts.items()}
    schedule = Schedule(steps=40, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=4)
    reports = train_spire(drafts, target, random_windows(stream, 8, 48, seed=1), schedule, torch.device("cpu"),
                          block=4, progress=False)
    after = {name: evaluate_spire(d, target, held_out) for name, d in drafts.items()}
    for name in drafts:
        assert reports[name].steps == 40 and np.isfinite(reports[name].final_loss)
        assert after[name] < before[name] - 0.02, (name, before[name], after[name])
    drafts["full"].save(tmp_path)
    loaded = SpireDraft.load(tmp_path)
    assert abs(evaluate_spire(loaded, target, held_out) - after["full"]) < 1e-6


def test_blocks_start_every_k_tokens_and_leave_room_for_their_predictions():
    assert block_starts(12, 4, "cpu").tolist() == [0, 4, 8]
    assert block_starts(11, 4, "cpu").tolist() == [0, 4]
