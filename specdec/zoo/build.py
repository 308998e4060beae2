"""Building and loading the zoo: corpus -> tokenizer -> target -> distilled drafters, each saved
with ``save_pretrained`` (safetensors) and loaded back with ``AutoModelForCausalLM``.

Invariant: a build folder holds a ``manifest.json`` whose fingerprint equals its recipe's; a
build with the same fingerprint is reused as it is, anything else is rebuilt from scratch.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from . import corpus
from .presets import Recipe, Shape, get_recipe
from .spire_build import ensure_spire, load_spire
from .tokenizer import train_tokenizer
from .train import distillation_loss, evaluate, evaluate_by_position, schedule_windows, train

ZOO_DIR_VARIABLE = "SPECDEC_ZOO_DIR"
HELD_OUT_SAMPLE_CHARS = 8_000  # of each held-out file, kept with the build for prompt sets


def zoo_root() -> Path:
    return Path(os.environ.get(ZOO_DIR_VARIABLE, Path.home() / ".cache" / "specdec" / "zoo"))


def build_dir(preset: str, out: str | Path | None = None) -> Path:
    return Path(out) if out is not None else zoo_root() / preset


def is_built(recipe: Recipe, folder: Path) -> bool:
    manifest = folder / "manifest.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("fingerprint") == recipe.fingerprint()


def make_model(shape: Shape, recipe: Recipe, eos_token_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        **({"rope_parameters": {"rope_type": "default", "rope_theta": recipe.rope_theta}}
           if recipe.rope_theta is not None else {}),
    )
    return LlamaForCausalLM(config)


def init_from_target(drafter: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Copy the target's embeddings, final norm, head and first blocks into the drafter."""
    with torch.no_grad():
        drafter.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        drafter.model.norm.load_state_dict(target.model.norm.state_dict())
        drafter.lm_head.load_state_dict(target.lm_head.state_dict())
        for index, layer in enumerate(drafter.model.layers):
            layer.load_state_dict(target.model.layers[index].state_dict())


def _encode_stream(tokenizer, files: list[corpus.SourceFile], max_tokens: int) -> np.ndarray:
    """Files' tokens, EOS after each, until max_tokens: one int32 stream."""
    pieces, total = [], 0
    chunk = 64
    for start in range(0, len(files), chunk):
        texts = [f.read() for f in files[start : start + chunk]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32))
            total += len(ids) + 1
        if total >= max_tokens:
            break
    stream = np.concatenate(pieces)[:max_tokens]
    if len(stream) < max_tokens // 2:
        raise RuntimeError(f"the corpus gave only {len(stream)} tokens; the recipe needs {max_tokens}")
    return stream


def build(preset: str = "cpu", out: str | Path | None = None, device: str | None = None, force: bool = False,
          progress: bool = True, log=print) -> Path:
    """Build a preset into ``out`` (default: $SPECDEC_ZOO_DIR/preset or ~/.cache/specdec/zoo/preset)."""
    recipe = get_recipe(preset)
    folder = build_dir(preset, out)
    run_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not force and is_built(recipe, folder):
        log(f"zoo '{preset}' is already built at {folder} (recipe {recipe.fingerprint()})")
        _ensure_spire(preset, recipe, folder, run_device, progress, log)
        return folder
    log(f"building zoo '{preset}' into {folder} on {run_device} (recipe {recipe.fingerprint()})")
    started = time.perf_counter()
    phases = {}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").unlink(missing_ok=True)

    files = corpus.find_sources(include_site_packages=recipe.site_packages)
    train_files, held_files = corpus.split(files)
    train_files, held_files = corpus.shuffled(train_files), corpus.shuffled(held_files)
    log(f"corpus: {len(files)} Python files ({len(train_files)} train, {len(held_files)} held out)")

    sample, size = [], 0
    for f in train_files:
        if size >= recipe.tokenizer_bytes:
            break
        text = f.read()
        sample.append(text)
        size += len(text)
    tokenizer = train_tokenizer(sample, recipe.vocab_size)
    tokenizer.save_pretrained(folder / "tokenizer")
    train_stream = _encode_stream(tokenizer, train_files, recipe.train_tokens)
    eval_stream = _encode_stream(tokenizer, held_files, recipe.eval_tokens)
    phases["corpus_and_tokenizer_s"] = time.perf_counter() - started
    log(f"tokenizer: {len(tokenizer)} tokens; training stream {len(train_stream):,} tokens, held-out {len(eval_stream):,}")

    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    target = make_model(recipe.target, recipe, eos)
    phase_start = time.perf_counter()
    schedule = recipe.target_schedule
    reports = train({"target": target}, schedule_windows(train_stream, schedule, seed=1),
                    schedule, run_device, description="target", progress=progress)
    phases["target_s"] = time.perf_counter() - phase_start

    drafters = {}
    for name, shape in recipe.drafters.items():
        drafters[name] = make_model(shape, recipe, eos)
        if shape.init_from_target:
            init_from_target(drafters[name], target)
    if drafters:
        phase_start = time.perf_counter()
        schedule = recipe.distill_schedule
        reports.update(train(drafters, schedule_windows(train_stream, schedule, seed=2),
                             schedule, run_device, loss_fn=distillation_loss, teacher=target,
                             description="drafters", progress=progress))
        phases["drafters_s"] = time.perf_counter() - phase_start

    models = {"target": target, **drafters}
    models_info = {}
    eval_schedule = recipe.target_schedule
    for name, model in models.items():
        loss = evaluate(model, eval_stream, eval_schedule.seq_len, eval_schedule.batch_size, run_device)
        model.to("cpu", dtype=torch.float32).save_pretrained(folder / name)
        models_info[name] = {
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokens_seen": reports[name].tokens_seen,
            "train_tokens_per_s": reports[name].tokens_per_s,
            "final_train_loss": reports[name].final_loss,
            "heldout_loss": loss,
        }
        if recipe.longest_seq_len > eval_schedule.seq_len:  # by position, on windows of the longest training length
            longest = recipe.longest_seq_len
            edges = [eval_schedule.seq_len << k for k in range(longest.bit_length())
                     if eval_schedule.seq_len << k < longest]  # 512, 1024, ..., 8192 for 16384
            models_info[name]["heldout_loss_by_position"] = evaluate_by_position(model, eval_stream, longest, edges,
                                                                                 run_device)
        log(f"{name}: {models_info[name]['parameters']:,} parameters, held-out loss {loss:.3f} nats/token")

    with open(folder / "heldout.jsonl", "w", encoding="utf-8") as f:
        for source in held_files[:400]:
            f.write(json.dumps({"id": source.relative_path, "text": source.read()[:HELD_OUT_SAMPLE_CHARS]}) + "\n")
    build_seconds = time.perf_counter() - started
    manifest = {
        "preset": preset,
        "fingerprint": recipe.fingerprint(),
        "recipe": asdict(recipe),
        "models": models_info,
        "tokenizer_vocab": len(tokenizer),
        "train_stream_tokens": int(len(train_stream)),
        "heldout_stream_tokens": int(len(eval_stream)),
        "corpus_files": {"train": len(train_files), "held_out": len(held_files)},
        "build_seconds": build_seconds,
        "phases_s": phases,
        "device": torch.cuda.get_device_name(run_device) if run_device.type == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    log(f"built zoo '{preset}' in {build_seconds:.0f} s at {folder}")
    _ensure_spire(preset, recipe, folder, run_device, progress, log, streams=(train_stream, eval_stream))
    return folder


def _ensure_spire(preset: str, recipe: Recipe, folder: Path, device: torch.device, progress: bool, log,
                  streams: tuple | None = None) -> None:
    """The preset's SPIRe drafts (zoo/spire_build.py), built from the saved target when missing."""
    def token_streams():
        if streams is not None:
            return streams
        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
        train_files, held_files = corpus.split(corpus.find_sources(include_site_packages=recipe.site_packages))
        return (_encode_stream(tokenizer, corpus.shuffled(train_files), recipe.train_tokens),
                _encode_stream(tokenizer, corpus.shuffled(held_files), recipe.eval_tokens))

    load_target = lambda: AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32)  # noqa: E731
    ensure_spire(preset, folder, recipe.fingerprint(), load_target, token_streams, device, progress=progress, log=log)


@dataclass
class Zoo:
    path: Path
    tokenizer: object
    target: torch.nn.Module
    drafters: dict[str, torch.nn.Module]
    manifest: dict
    spire: dict = field(default_factory=dict)  # SPIRe drafts (drafters.SpireDraft) by name, where the preset has them

    def heldout_texts(self) -> list[tuple[str, str]]:
        with open(self.path / "heldout.jsonl", encoding="utf-8") as f:
            return [(r["id"], r["text"]) for r in map(json.loads, f)]


def load(preset: str = "cpu", out: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Zoo:
    """Load a built preset (build it first with ``build`` or ``python -m specdec zoo build``)."""
    folder = build_dir(preset, out)
    if not is_built(get_recipe(preset), folder):
        raise FileNotFoundError(
            f"no build of zoo '{preset}' with the current recipe at {folder}: run "
            f"`python -m specdec zoo build --preset {preset}`"
        )
    manifest = json.loads((folder / "manifest.json").read_text())
    load_model = lambda name: AutoModelForCausalLM.from_pretrained(folder / name, dtype=dtype).to(device).eval()  # noqa: E731
    return Zoo(
        path=folder,
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        target=load_model("target"),
        drafters={name: load_model(name) for name in manifest["models"] if name != "target"},
        manifest=manifest,
        spire=load_spire(folder, manifest["fingerprint"], preset, device, dtype),
    )
