"""``python -m specdec bench``: specdec against the peers in one process and one run, on the
same prompts and models, greedy, every output compared token for token with plain decoding.

Invariant: every figure in the report was measured in this run; tokens/s counts the tokens
each method returned (identical token counts when outputs match), over wall time with the
device synchronised; each method runs once to warm up (compile, capture) before it is timed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

import specdec

from ..drafters import ModelDrafter, PromptLookupDrafter
from . import peers
from .common import BenchSettings, agreement, graph_options, timed_generate, zoo_and_prompts
from .trees import run_trees


@dataclass
class BenchRow:
    method: str
    family: str  # "specdec" or "peer"
    batch: int
    tokens: int
    seconds: float
    identical: bool | None  # None: no reference output to compare with
    agreement: float  # mean fraction of each reference output reproduced before the first difference
    tau: float | None = None
    error: str = ""  # a method that failed is reported, and the run goes on

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def run(settings: BenchSettings, log=print, checkpoint=None) -> dict:
    """Every part the settings name, in one process; one result dictionary. ``checkpoint`` (if
    given) receives the partial result after every measurement, so a run cut short keeps them."""
    save = checkpoint or (lambda partial: None)
    unknown = set(settings.parts) - {"zoo", "bandwidth", "trees", "verifiers", "pipeline"}
    if unknown:
        raise ValueError(f"unknown benchmark parts {sorted(unknown)}; choose from zoo, bandwidth, trees, verifiers, "
                         "pipeline")
    result = {"environment": environment(settings.device), "settings": asdict(settings), "rows": []}
    if "zoo" in settings.parts:
        result.update(run_zoo(settings, log, lambda zoo_part: save({**result, **zoo_part})))
        save(result)
    if "trees" in settings.parts:
        result["trees"] = run_trees(settings, log, lambda rows: save({**result, "trees": rows}))
        save(result)
    if "verifiers" in settings.parts:
        from .verifiers import run_verifiers

        result["verifiers"] = run_verifiers(settings, log, lambda part: save({**result, "verifiers": part}))
        save(result)
    if "bandwidth" in settings.parts:
        if settings.device.startswith("cuda"):
            from . import bandwidth

            result["bandwidth"] = bandwidth.run(settings.bandwidth_shapes, log=log)
            save(result)
        else:
            log("bandwidth part skipped: it measures CUDA step times")
    if "pipeline" in settings.parts:
        if settings.device.startswith("cuda"):
            from . import pipeline

            result["pipeline"] = pipeline.run(tuple(b for b in settings.batch_sizes if b > 1), repeats=settings.repeats,
                                              log=log)
            save(result)
        else:
            log("pipeline part skipped: it measures CUDA streams and devices")
    return result


def run_zoo(settings: BenchSettings, log=print, progress=None) -> dict:
    """specdec and the peers on the model zoo -> {"zoo": manifest models, "rows": [...]}."""
    zoo, prompts = zoo_and_prompts(settings)
    target, eos = zoo.target, zoo.tokenizer.eos_token_id
    graphs, compiled = graph_options(settings)
    drafters = {"prompt lookup": PromptLookupDrafter()}
    drafters.update({name: ModelDrafter(model, cuda_graphs=graphs, compile=compiled) for name, model in zoo.drafters.items()})
    smallest = min(zoo.drafters, key=lambda n: zoo.manifest["models"][n]["parameters"]) if zoo.drafters else None
    k = settings.num_draft_tokens
    rows: list[BenchRow] = []
    reference: dict[int, list[list[int]]] = {}

    def compared(method, family, batch, out, seconds, expected, tau=None) -> BenchRow:
        return BenchRow(method, family, batch, sum(map(len, out)), seconds,
                        None if expected is None else out == expected, agreement(out, expected), tau)

    def attempt(method, family, batch, measure) -> BenchRow | None:
        """Run one method; a failure becomes a row saying so instead of ending the run."""
        started_method[0] = time.perf_counter()
        try:
            return measure()
        except Exception as error:  # noqa: BLE001 - reported in the results, not swallowed
            row = BenchRow(method, family, batch, 0, float("nan"), False, float("nan"),
                           error=f"{type(error).__name__}: {str(error)[:300]}")
            rows.append(row)
            log(f"{method:<42} batch {batch:>3}: FAILED {row.error}")
            return None

    def part() -> dict:
        ordered = sorted(rows, key=lambda r: (r.family != "specdec", r.batch))  # stable: methods keep their order
        return {"zoo": zoo.manifest["models"], "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in ordered]}

    def add(row: BenchRow | None) -> None:
        if row is None:
            return
        rows.append(row)
        if progress is not None:
            progress(part())
        log(f"{row.method:<42} batch {row.batch:>3}: {row.tokens_per_s:10.1f} tok/s"
            f"{'' if row.tau is None else f', tau {row.tau:.2f}'}, "
            f"identical: {({True: 'yes', False: 'NO', None: 'reference'})[row.identical]} "
            f"({time.perf_counter() - started_method[0]:.0f} s with warm-up)")

    started_method = [time.perf_counter()]
    # largest batch first: its runners (caches, compiled and captured graphs) serve the smaller ones
    for batch in sorted(settings.batch_sizes, reverse=True):
        # batch 1: a few prompts one call at a time; batch B: the prompt set in calls of B
        chosen = prompts[: settings.batch1_prompts] if batch == 1 else prompts[: max(batch, settings.num_prompts)]
        measured = {}

        def measure_plain():
            measured["plain"], seconds, tau = timed_generate(target, chosen, batch, None, 0, settings, eos, graphs, compiled)
            return compared("specdec plain decoding (k=0)", "specdec", batch, measured["plain"], seconds, None, tau)

        add(attempt("specdec plain decoding (k=0)", "specdec", batch, measure_plain))
        if "plain" not in measured:
            continue  # nothing to compare the drafters with at this batch size
        plain = reference[batch] = measured["plain"]
        for drafter_name, drafter in drafters.items():
            name = f"specdec {drafter_name} (k={k})"

            def measure(drafter=drafter, name=name):
                out, seconds, tau = timed_generate(target, chosen, batch, drafter, k, settings, eos, graphs, compiled)
                return compared(name, "specdec", batch, out, seconds, plain, tau)

            add(attempt(name, "specdec", batch, measure))

    if settings.peers:
        chosen, plain = prompts[: settings.batch1_prompts], reference.get(1)
        runs = [("HF eager generate", {}), ("HF prompt lookup", {"prompt_lookup_num_tokens": k})]
        if smallest is not None:
            runs.append((f"HF assisted generation ({smallest})", {"assistant_model": zoo.drafters[smallest]}))
        for name, kwargs in runs:

            def measure(name=name, kwargs=kwargs):
                peers.hf_generate_one(target, chosen[0], 8, eos, **kwargs)  # warm-up
                out, seconds = peers.timed_batch1(target, chosen, settings.max_new_tokens, eos, **kwargs)
                return compared(name, "peer", 1, out, seconds, plain)

            add(attempt(name, "peer", 1, measure))
        if settings.device.startswith("cuda"):

            def measure_compiled():
                longest = max(chosen, key=len)
                # our own compilations share transformers' forward wrappers with this model's: clear
                # them, or Hugging Face's compile hits dynamo's recompile limit and runs eagerly
                # (our captured graphs do not need them any more)
                torch._dynamo.reset()
                static = peers.StaticCompiled(target, max_cache_len=len(longest) + settings.max_new_tokens)
                try:
                    for _ in range(2):  # compile and capture before timing
                        static.generate_one(longest, settings.max_new_tokens, eos)
                    passes = [static.timed_batch1(chosen, settings.max_new_tokens, eos) for _ in range(settings.repeats)]
                    out, seconds = passes[0][0], float(np.median([p[1] for p in passes]))
                finally:
                    static.close()
                return compared("HF static cache + torch.compile", "peer", 1, out, seconds, plain)

            add(attempt("HF static cache + torch.compile", "peer", 1, measure_compiled))
    return part()


def environment(device: str) -> dict:
    """Versions, command, commit and time of a run, and the hardware of ``device``."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "specdec": specdec.__version__, "command": " ".join(["python -m specdec"] + sys.argv[1:]),
           "commit": _git_commit(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit() -> str:
    """The checkout's commit; $SPECDEC_COMMIT where the tree travelled without its .git."""
    commit = _run(["git", "-C", str(Path(__file__).resolve().parents[2]), "rev-parse", "HEAD"])
    return os.environ.get("SPECDEC_COMMIT") or (commit if len(commit) == 40 else "unknown")
