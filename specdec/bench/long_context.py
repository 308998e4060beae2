"""``python -m specdec bench --long-context``: sparse drafters where their papers say they matter.

On the zoo's long-context preset, side by side in one process, for every context length (1K, 4K,
16K tokens, ragged +-50% across rows, cut where the target's positions end) and batch size: plain decoding, the best small drafter of
the zoo, ``SelfSpeculativeDrafter`` (MagicDec, sink 16 and window 512) and ``SPIReDrafter`` (the
zoo's SPIRe draft), each at k = 2..6. Greedy; every output is compared with plain decoding's.

Each row times one generate() call's decoding (its wall time less its prefill, which includes
building runners, capturing CUDA graphs and the prompts' device work), so the figures are decode
throughput. Beside it, the device-phase rate: tokens over the CUDA-event time of the draft and
verify phases, what decoding would give with no host time between the phases. Every method
runs with CUDA graphs and without torch.compile (the SPIRe drafter reads target hidden states,
which compiled passes do not keep). A short warm-up of every method first compiles the kernels.

Also: a table like SPIRe's Table 1 (tau at k = 4 for each small draft, SPIRe, its two ablations
and MagicDec, at one context and batch), SPIRe's performance model (bench/roofline.py) for our
sizes with the measured bandwidth and matrix throughput next to every measured speed-up, and
issue 33's targets.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import generate
from ..drafters import ModelDrafter, SelfSpeculativeDrafter, SPIReDrafter
from ..long_context import long_context_prompts
from ..policies import FixedPolicy
from ..zoo import build, load
from .report import provenance, target_lines
from .roofline import Hardware, PassCost, modelled_speedup


@dataclass
class LongContextSettings:
    preset: str = "gpu-long"
    device: str = "cuda"
    contexts: tuple[int, ...] = (1024, 4096, 16384)
    spread: float = 0.5
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    ks: tuple[int, ...] = (2, 3, 4, 5, 6)
    max_new_tokens: int = 64
    sink: int = 16  # MagicDec's
    window: int = 512
    table_context: int = 1024  # where the tau table (SPIRe's Table 1) is measured, at k = 4
    table_batch: int = 16
    zoo_dir: str | None = None
    seed: int = 0
    out: str = "benchmarks/results"
    methods: tuple[str, ...] = ("plain", "small", "self", "spire")

    @property
    def graphs(self) -> bool:
        """CUDA graphs for every method (on CUDA; a CPU smoke run has none)."""
        return self.device.startswith("cuda")


@dataclass
class Method:
    name: str  # plain, small, self, spire, or a table-only variant
    label: str
    make: object = field(repr=False)  # () -> drafter or None


CPU_NOMINAL = Hardware(flops=1e12, bandwidth=5e10)  # a smoke run's stand-in, not a measurement


def measured_hardware(device: str) -> Hardware:
    """Memory bandwidth from a large device copy, matrix throughput from a bf16 GEMM (on CUDA)."""
    if not device.startswith("cuda"):
        return CPU_NOMINAL
    from .bandwidth import copy_bandwidth

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    flops = 20 * 2 * 8192**3 / (time.perf_counter() - started)
    del a
    return Hardware(flops=flops, bandwidth=copy_bandwidth() / 2)  # the copy counts bytes read and written


def decode(target, prompts, drafter, k: int, eos, max_new_tokens: int) -> dict:
    """One greedy call -> its outputs, decode seconds (wall less prefill), tau and phase times."""
    out = generate(target, prompts, drafter=drafter, policy=FixedPolicy(k), max_new_tokens=max_new_tokens,
                   eos_token_id=eos, cuda_graphs="auto")
    stats = out.stats
    seconds = stats.wall_time_s - stats.prefill_time_s
    tokens = sum(map(len, out.sequences))
    device_s = stats.draft_time_s + stats.verify_time_s
    return dict(sequences=out.sequences, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
                tau=stats.tau, draft_s=stats.draft_time_s, verify_s=stats.verify_time_s, steps=stats.steps,
                device_tokens_per_s=tokens / device_s if device_s > 0 else float("nan"))


def methods_of(zoo, settings: LongContextSettings, small_name: str) -> list[Method]:
    spire, graphs = zoo.spire["spire"], settings.graphs
    made = {
        "plain": Method("plain", "plain decoding", lambda: None),
        "small": Method("small", f"small drafter ({small_name})",
                        lambda: ModelDrafter(zoo.drafters[small_name], cuda_graphs=graphs)),
        "self": Method("self", f"SelfSpeculativeDrafter (sink {settings.sink}, window {settings.window})",
                       lambda: SelfSpeculativeDrafter(sink=settings.sink, window=settings.window)),
        "spire": Method("spire", f"SPIReDrafter (sink {spire.sink}, window {spire.window})",
                        lambda: SPIReDrafter(spire, cuda_graphs=graphs)),
    }
    return [made[name] for name in settings.methods]


def cache_shortfall(zoo, prompts, settings: LongContextSettings, share: float = 0.7) -> str | None:
    """Why a cell cannot run, when the KV caches it allocates (target, small drafter, SPIRe draft,
    all at the cell's longest row) would take more than ``share`` of the GPU's memory; else None."""
    positions = max(map(len, prompts)) + settings.max_new_tokens + max(settings.ks) + 1
    models = [zoo.target, *zoo.drafters.values(), *([zoo.spire["spire"].model] if "spire" in zoo.spire else [])]
    needed = sum(PassCost.of_model(m).kv_bytes_per_position for m in models) * (len(prompts) + 1) * positions
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if needed <= share * total:
        return None
    return f"skipped: its KV caches need about {needed / 1e9:.0f} GB of the GPU's {total / 1e9:.0f} GB"


def cell_rows(target, prompts, methods: list[Method], ks, eos, context: int, batch: int, max_new_tokens: int,
              log) -> list[dict]:
    rows, plain = [], None
    for method in methods:
        for k in ([0] if method.name == "plain" else ks):
            started = time.perf_counter()
            row = dict(context=context, batch=batch, method=method.name, label=method.label, k=k, error="")
            try:
                result = decode(target, prompts, method.make(), k, eos, max_new_tokens)
                sequences = result.pop("sequences")
                if method.name == "plain":
                    plain = sequences
                row.update(result, identical=None if plain is None or method.name == "plain" else sequences == plain)
            except torch.cuda.OutOfMemoryError as error:
                row["error"] = f"out of memory: {str(error)[:200]}"
                torch.cuda.empty_cache()
            rows.append(row)
            log(f"long context {context:>6} batch {batch:>3} {method.name:<6} k={k} "
                + (row["error"] if row["error"] else
                   f"{row['tokens_per_s']:9.1f} tok/s, tau {row['tau']:.2f}, identical {row['identical']}")
                + f" ({time.perf_counter() - started:.0f} s)")
    return rows


def choose_small_drafter(zoo, prompts, eos, settings: LongContextSettings, log) -> str:
    """The zoo drafter with the highest decode tok/s at k = 4 on these prompts."""
    speeds = {}
    for name, model in zoo.drafters.items():
        speeds[name] = decode(zoo.target, prompts, ModelDrafter(model, cuda_graphs=settings.graphs), 4, eos,
                              settings.max_new_tokens)["tokens_per_s"]
        log(f"small drafter {name}: {speeds[name]:.1f} tok/s at k=4")
    return max(speeds, key=speeds.get)


def tau_table(zoo, prompts, small_name: str, settings: LongContextSettings, eos, log) -> list[dict]:
    """Tau at k = 4 of each draft (SPIRe's Table 1 on the zoo)."""
    entries = [(f"small draft {name}", lambda m=model: ModelDrafter(m, cuda_graphs=settings.graphs))
               for name, model in zoo.drafters.items()]
    entries += [(label, lambda d=zoo.spire[key]: SPIReDrafter(d, cuda_graphs=settings.graphs))
                for key, label in (("spire", "SPIRe"), ("spire-no-feedback", "SPIRe without feedback memory"),
                                   ("spire-random-init", "SPIRe from random initialisation")) if key in zoo.spire]
    entries.append((f"MagicDec (SelfSpeculativeDrafter, sink {settings.sink}, window {settings.window})",
                    lambda: SelfSpeculativeDrafter(sink=settings.sink, window=settings.window)))
    table = []
    for label, make in entries:
        result = decode(zoo.target, prompts, make(), 4, eos, settings.max_new_tokens)
        table.append(dict(draft=label, tau=result["tau"], tokens_per_s=result["tokens_per_s"]))
        log(f"table 1: {label}: tau {result['tau']:.3f}")
    return table


def modelled(rows: list[dict], zoo, small_name: str, settings: LongContextSettings, hardware: Hardware) -> None:
    """Each speculative row's modelled speed-up, from its measured tau (in place)."""
    target = PassCost.of_model(zoo.target)
    costs = {"small": PassCost.of_model(zoo.drafters[small_name]), "self": target,
             "spire": PassCost.of_model(zoo.spire["spire"].model)}
    spire = zoo.spire["spire"]
    for row in rows:
        if row["method"] == "plain" or row.get("error") or row.get("tau") is None:
            continue
        context = row.get("mean_context", row["context"])
        positions = {"small": context, "self": settings.sink + settings.window + row["k"],
                     "spire": spire.sink + spire.window + row["k"]}[row["method"]]
        row["modelled_speedup"] = modelled_speedup(target, costs[row["method"]], positions, row["batch"], context,
                                                   row["k"], row["tau"], hardware)


def add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up over plain decoding in its cell: wall-clock, and of the device phases."""
    plain = {(r["context"], r["batch"]): r for r in rows if r["method"] == "plain" and not r["error"]}
    for row in rows:
        reference = plain.get((row["context"], row["batch"]))
        if reference is not None and not row["error"]:
            row["speedup"] = row["tokens_per_s"] / reference["tokens_per_s"]
            if "device_tokens_per_s" in reference:
                row["device_speedup"] = row["device_tokens_per_s"] / reference["device_tokens_per_s"]


def best(rows: list[dict], method: str, context: int, batch: int) -> dict | None:
    candidates = [r for r in rows if r["method"] == method and r["context"] == context and r["batch"] == batch
                  and not r["error"]]
    return max(candidates, key=lambda r: r["tokens_per_s"], default=None)


def targets(rows: list[dict]) -> list[dict]:
    """Issue 33's targets, each met or not with its measured ratio, and what stops a missed one."""
    out = []
    contexts = sorted({r["context"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    if contexts and batches:
        longest = contexts[-1]
        chosen = [(b, best(rows, "self", longest, b)) for b in batches]
        chosen = [(b, r) for b, r in chosen if r is not None and "speedup" in r]
        speedups = [(b, r["speedup"]) for b, r in chosen]
        if len(speedups) >= 2:
            grows = all(later > earlier for (_, earlier), (_, later) in zip(speedups, speedups[1:]))
            device = ", ".join(f"{r['device_speedup']:.2f}x" for _, r in chosen if "device_speedup" in r)
            out.append(dict(target=f"MagicDec's regime: at context {longest} the self-speculative speed-up over plain "
                                   "decoding grows with the batch", met=grows,
                            value=", ".join(f"batch {b}: {s:.2f}x" for b, s in speedups),
                            detail=f"device phases: {device}" if device else ""))
    big = 64 if 64 in batches else max(batches, default=None)  # the batch
    for context in [c for c in contexts if c >= 4096]:
        spire = best(rows, "spire", context, big)
        if spire is None:
            continue
        for other, bar, name in (("plain", 1.5, "plain decoding"), ("small", 1.35, "the best small drafter"),
                                 ("self", 1.1, "SelfSpeculativeDrafter")):
            reference = best(rows, other, context, big)
            if reference is None:
                continue
            ratio = spire["tokens_per_s"] / reference["tokens_per_s"]
            detail = (f"SPIRe k={spire['k']} {spire['tokens_per_s']:.0f} tok/s (tau {spire['tau']:.2f}, draft "
                      f"{spire['draft_s']:.2f} s, verify {spire['verify_s']:.2f} s) vs {name} "
                      + (f"{reference['tokens_per_s']:.0f} tok/s" if other == "plain" else
                         f"k={reference['k']} {reference['tokens_per_s']:.0f} tok/s (tau {reference['tau']:.2f}, "
                         f"draft {reference['draft_s']:.2f} s, verify {reference['verify_s']:.2f} s)"))
            if "device_tokens_per_s" in spire and "device_tokens_per_s" in reference:
                detail += (f"; device phases: {spire['device_tokens_per_s'] / reference['device_tokens_per_s']:.2f}x")
            out.append(dict(target=f"SPIRe at batch {big}, context {context}: >= {bar}x {name}",
                            value=round(ratio, 3), met=ratio >= bar, detail=detail))
    return out


def run(settings: LongContextSettings, log=print, checkpoint=None) -> dict:
    from .harness import environment

    cuda = settings.device.startswith("cuda")
    build(settings.preset, out=settings.zoo_dir, device=settings.device)
    zoo = load(settings.preset, out=settings.zoo_dir, device=settings.device,
               dtype=torch.bfloat16 if cuda else torch.float32)
    eos = zoo.tokenizer.eos_token_id
    hardware = measured_hardware(settings.device)
    log(f"hardware: {hardware.bandwidth / 1e12:.2f} TB/s read, {hardware.flops / 1e12:.0f} TFLOP/s bf16")
    texts = zoo.heldout_texts()
    longest = zoo.target.config.max_position_embeddings - settings.max_new_tokens  # rows beyond it are cut there
    prompts = {c: [list(p.token_ids) for p in long_context_prompts(texts, zoo.tokenizer, max(settings.batch_sizes), c,
                                                                   settings.spread, settings.seed, max_tokens=longest)]
               for c in sorted({*settings.contexts, settings.table_context})}
    result = dict(settings=asdict(settings), environment=environment(settings.device), rows=[],
                  hardware=asdict(hardware), command="python -m specdec bench --long-context")
    warm = prompts[min(settings.contexts)][:2]
    small_name = choose_small_drafter(zoo, prompts[settings.table_context][: settings.table_batch], eos,
                                      settings, log)
    result["small_drafter"] = small_name
    methods = methods_of(zoo, settings, small_name)
    for method in methods:  # compile every kernel before anything is timed
        decode(zoo.target, warm, method.make(), 0 if method.name == "plain" else 2, eos, 8)
    for context in settings.contexts:
        for batch in settings.batch_sizes:
            chosen = prompts[context][:batch]
            too_big = cache_shortfall(zoo, chosen, settings) if cuda else None
            if too_big:  # skipped, not attempted: an out-of-memory error mid-run can leave the device fragmented
                log(f"long context {context:>6} batch {batch:>3} skipped: {too_big}")
                result["rows"].append(dict(context=context, batch=batch, method="all", label="all", k=0, error=too_big))
                continue
            rows = cell_rows(zoo.target, chosen, methods, settings.ks, eos, context, batch, settings.max_new_tokens, log)
            for row in rows:
                row["mean_context"] = float(np.mean([len(p) for p in chosen]))
            result["rows"].extend(rows)
            add_speedups(result["rows"])
            modelled(result["rows"], zoo, small_name, settings, hardware)
            if checkpoint is not None:
                checkpoint(result)
    result["tau_table"] = tau_table(zoo, prompts[settings.table_context][: settings.table_batch], small_name,
                                    settings, eos, log)
    result["targets"] = targets(result["rows"])
    return result


def markdown(result: dict) -> str:
    settings = result["settings"]
    lines = [f"{provenance(result['environment'])} Zoo `{settings['preset']}` in bf16, greedy, "
             f"{settings['max_new_tokens']} new tokens, contexts ragged +-{settings['spread']:.0%}; small drafter "
             f"{result.get('small_drafter')}. Decode tok/s (prefill excluded); each method at its best k."
             + (f" {result['note']}" if result.get("note") else ""), "",
             "| context | batch | method | best k | tau | tok/s | speed-up | device-phase speed-up | modelled | "
             "identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for context in sorted({r["context"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows if r["context"] == context}):
            for method in ("plain", "small", "self", "spire"):
                row = best(rows, method, context, batch)
                if row is None:
                    continue
                lines.append(f"| {context} | {batch} | {row['label']} | {row['k'] or '-'} | {row['tau']:.2f} | "
                             f"{row['tokens_per_s']:.0f} | {row.get('speedup', float('nan')):.2f} | "
                             f"{row.get('device_speedup', float('nan')):.2f} | "
                             f"{row.get('modelled_speedup', float('nan')):.2f} | "
                             f"{'-' if row.get('identical') is None else ('yes' if row['identical'] else 'no')} |")
    if result.get("tau_table"):
        lines += ["", "| draft (k = 4) | tau |", "|---|---|"]
        lines += [f"| {entry['draft']} | {entry['tau']:.3f} |" for entry in result["tau_table"]]
    if result.get("targets"):
        lines += ["", *target_lines(result["targets"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    defaults = LongContextSettings()
    parser = argparse.ArgumentParser(prog="python -m specdec bench --long-context")
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--spread", type=float, default=defaults.spread)
    parser.add_argument("--contexts", default=",".join(map(str, defaults.contexts)))
    parser.add_argument("--batch-sizes", default=",".join(map(str, defaults.batch_sizes)))
    parser.add_argument("--ks", default=",".join(map(str, defaults.ks)))
    parser.add_argument("--methods", default=",".join(defaults.methods))
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--table-context", type=int, default=defaults.table_context)
    parser.add_argument("--zoo-dir")
    parser.add_argument("--out", default=defaults.out)
    args = parser.parse_args(argv)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    settings = LongContextSettings(preset=args.preset, device=args.device, spread=args.spread,
                                   contexts=ints(args.contexts), batch_sizes=ints(args.batch_sizes),
                                   ks=ints(args.ks), methods=tuple(args.methods.split(",")),
                                   max_new_tokens=args.max_new_tokens, table_context=args.table_context,
                                   zoo_dir=args.zoo_dir, out=args.out)
    stem = f"long_context_{time.strftime('%Y%m%d_%H%M%S')}"
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{stem}.partial.json"
    result = run(settings, checkpoint=lambda so_far: partial.write_text(json.dumps(so_far, indent=2)))
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (folder / f"{stem}.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    print(f"wrote {folder / stem}.json and .md")
    return 0
