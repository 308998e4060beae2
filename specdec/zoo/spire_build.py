"""The zoo's SPIRe drafts: built from the trained target, trained with zoo/spire_train.py, saved
under the build's ``spire/`` folder (each draft a folder with the draft LM's safetensors and
config, plus ``spire.safetensors`` and ``spire.json``), and loaded with the zoo as ``zoo.spire``.

A preset with a ``SpireRecipe`` (SPIRE_RECIPES) gets the drafts "spire" (the paper's draft), and
with ``ablations`` "spire-no-feedback" (the blocks' own keys and values at fed positions) and
"spire-random-init" (random blocks; the target's embedding, norm and head), all trained on the
same windows. They are a stage of their own, with their own fingerprint (the base build's and
the SPIRe recipe's): adding or changing them neither changes nor rebuilds the rest of the zoo.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..drafters.spire_model import CONFIG_NAME, SpireDraft
from .spire_train import evaluate_spire, train_spire
from .train import Schedule, random_windows, schedule_windows

NAMES = {"spire": {}, "spire-no-feedback": {"feedback": False}, "spire-random-init": {"random_init": True}}


@dataclass(frozen=True)
class SpireRecipe:
    schedule: Schedule
    block: int = 4  # the k the drafts are trained for
    sink: int = 1  # the paper's
    window: int = 64
    ablations: bool = True

    def fingerprint(self, base: str) -> str:
        text = json.dumps({"base": base, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


SPIRE_RECIPES = {
    # seconds on two CPU cores, for tests
    "tiny": SpireRecipe(Schedule(steps=20, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=4), window=8),
    # the long-context bench's; the last tenth on 16K windows, so that the sink's distance is trained
    "gpu-long": SpireRecipe(Schedule(steps=400, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=40,
                                     final_steps=40, final_batch_size=2, final_seq_len=16384)),
}
FOLDER = "spire"


def build_spire(recipe: SpireRecipe, folder: Path, target, train_stream: np.ndarray, eval_stream: np.ndarray,
                device: torch.device, progress: bool = True) -> dict[str, dict]:
    """Train and save the recipe's drafts under ``folder`` -> manifest entries by name."""
    names = list(NAMES) if recipe.ablations else ["spire"]
    drafts = {name: SpireDraft.from_target(target, sink=recipe.sink, window=recipe.window, **NAMES[name])
              for name in names}
    schedule = recipe.schedule
    reports = train_spire(drafts, target, schedule_windows(train_stream, schedule, seed=3), schedule, device,
                          block=recipe.block, description="spire", progress=progress)
    held_out = next(random_windows(eval_stream, 8, schedule.seq_len, seed=4))[:, :-1].to(device)
    target.to(device)
    info = {}
    for name, draft in drafts.items():
        draft.save(folder / name)
        info[name] = {"parameters": sum(p.numel() for p in draft.parameters()),
                      "source_layers": list(draft.source_layers), "final_train_loss": reports[name].final_loss,
                      "heldout_spire_loss": evaluate_spire(draft, target, held_out, block=recipe.block),
                      "train_seconds": reports[name].seconds}
    return info


def ensure_spire(preset: str, folder: Path, base_fingerprint: str, load_target: Callable, streams: Callable,
                 device: torch.device, progress: bool = True, log=print) -> bool:
    """Build the preset's SPIRe drafts under ``folder / "spire"`` unless a build of the same
    fingerprint is there -> whether it built. load_target() gives the trained target (float32),
    streams() the (train, held-out) token streams."""
    recipe = SPIRE_RECIPES.get(preset)
    if recipe is None:
        return False
    fingerprint = recipe.fingerprint(base_fingerprint)
    manifest_path = folder / FOLDER / "manifest.json"
    if manifest_path.is_file() and json.loads(manifest_path.read_text()).get("fingerprint") == fingerprint:
        return False
    log(f"building the SPIRe drafts of zoo '{preset}' (fingerprint {fingerprint})")
    started = time.perf_counter()
    manifest_path.unlink(missing_ok=True)
    train_stream, eval_stream = streams()
    torch.manual_seed(0)
    info = build_spire(recipe, folder / FOLDER, load_target(), train_stream, eval_stream, device, progress=progress)
    manifest = {"fingerprint": fingerprint, "recipe": asdict(recipe), "drafts": info,
                "build_seconds": time.perf_counter() - started}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    log(f"built the SPIRe drafts in {manifest['build_seconds']:.0f} s: " + ", ".join(
        f"{name} held-out loss {entry['heldout_spire_loss']:.3f}" for name, entry in info.items()))
    return True


def load_spire(folder: Path, base_fingerprint: str, preset: str, device, dtype: torch.dtype) -> dict[str, SpireDraft]:
    """The preset's SPIRe drafts, by name, when a build of the current recipe is there (else none)."""
    recipe = SPIRE_RECIPES.get(preset)
    manifest_path = folder / FOLDER / "manifest.json"
    if recipe is None or not manifest_path.is_file():
        return {}
    if json.loads(manifest_path.read_text()).get("fingerprint") != recipe.fingerprint(base_fingerprint):
        return {}
    return {name: SpireDraft.load(folder / FOLDER / name, device=device, dtype=dtype)
            for name in NAMES if (folder / FOLDER / name / CONFIG_NAME).is_file()}
