"""``python -m specdec serve-bench``: request latency against request rate on the Engine
(SmartSpec, arXiv 2406.14066, Figure 1 and §5: speculation pays at light load and costs at
saturation; a goodput-driven length tracks the best fixed one at every rate).

On a zoo preset, side by side in one process:
1. Saturation: every request arrives at once, for each method on the Engine (``max_rows`` rows
   refilled as requests finish) and, for plain decoding and each speculative method, on static
   generate() batches of ``max_rows`` requests (the issue's throughput comparison).
2. Capacity: plain decoding's saturated request rate (plain decoding always runs, first: it is
   also every output's reference); the load grid is ``loads`` x capacity, from light load to
   past saturation.
3. For each rate, ``repeats`` Poisson traces (seeded draws scaled to the rate; the same traces
   for every method, whose order rotates from one trace to the next) replayed in real time
   (specdec/replay.py) against plain decoding, fixed k = 1, 3, 5 with the chosen drafter (the zoo
   drafter with the highest saturated throughput at k = 3), GoodputPolicy (a cost model profiled
   first) and, as a diagnostic, GoodputPolicy on that cost model alone ("goodput-model": no
   online calibration of the step time): mean, p50, p90, p99 latency, time to first token, time per output token over the
   requests of every trace, and each trace's mean latency. Greedy; every output is compared with
   plain decoding's.

The results are saved after the saturation runs and after each rate, so a run cut short keeps
what it measured.

Writes serve_*.json, .md and .png (mean latency against rate, one line per method).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import Engine, generate
from ..drafters import ModelDrafter
from ..load import poisson_arrivals, summarize
from ..policies import FixedPolicy, GoodputPolicy
from ..policies.calibration import StepTimeCalibration
from ..policies.profiling import ProfileGrid, profile
from ..replay import replay
from ..zoo import build, load
from ..zoo.prompts import heldout_prompts
from .report import provenance, target_lines

FIXED = {"plain": 0, "k1": 1, "k3": 3, "k5": 5}
GOODPUT = ("goodput", "goodput-model")  # GoodputPolicy as built, and on its profiled cost model alone


class ModelOnlyCalibration(StepTimeCalibration):
    """A diagnostic for "goodput-model": no online correction of the cost model and no plain
    probes, so the policy weighs drafting exactly as profiled (SmartSpec's own setting)."""

    def apply(self, step_time, num_rows):
        return step_time

    def wants_plain_probe(self, num_rows: int) -> bool:
        return False


def model_only_goodput(cost_model) -> GoodputPolicy:
    policy = GoodputPolicy(cost_model, max_draft_tokens=5)
    policy.calibration = ModelOnlyCalibration()
    return policy


@dataclass
class ServeSettings:
    preset: str = "gpu"
    device: str = "cuda"
    num_requests: int = 64
    prompt_tokens: int = 128
    max_new_tokens: int = 128
    max_rows: int = 16
    loads: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.1)  # fractions of plain decoding's capacity
    methods: tuple[str, ...] = ("plain", "k1", "k3", "k5", *GOODPUT)
    zoo_dir: str | None = None
    seed: int = 0
    repeats: int = 1  # Poisson traces per rate (seeds seed, seed + 1, ...)
    out: str = "benchmarks/results"

    @property
    def graphs(self) -> bool:
        return self.device.startswith("cuda")


def drafter_for(zoo, name: str | None, settings: ServeSettings) -> ModelDrafter | None:
    return None if name is None else ModelDrafter(zoo.drafters[name], cuda_graphs=settings.graphs)


def engine_for(zoo, drafter_name: str | None, policy, settings: ServeSettings) -> Engine:
    return Engine(zoo.target, drafter_for(zoo, drafter_name, settings), policy=policy, max_rows=settings.max_rows,
                  max_len=settings.prompt_tokens + settings.max_new_tokens, eos_token_id=zoo.tokenizer.eos_token_id,
                  cuda_graphs=settings.graphs, max_new_tokens=settings.max_new_tokens)


def serve(zoo, drafter_name, policy, prompts, arrivals, settings: ServeSettings) -> tuple[list, list[list[int]], dict]:
    """One trace on a fresh engine -> (each request's RequestTiming, outputs, Engine.load_stats)."""
    with engine_for(zoo, drafter_name, policy, settings) as engine:
        served = replay(engine, prompts, arrivals, settings.max_new_tokens)
        costs = engine.load_stats()
    return [s.timing for s in served], [s.result.token_ids for s in served], costs


def step_costs(costs: list[dict]) -> dict:
    """Engine.load_stats of one or more traces -> what an average step did and cost: active rows,
    draft tokens per row-step, tau (emitted per row-step), host ms per step and of it in the
    policy's plan, device ms of the draft and verify phases, prefill passes per trace and host
    ms per pass."""
    total = {key: sum(c[key] for c in costs) for key in costs[0]}
    steps, row_steps, passes = max(total["steps"], 1), max(total["row_steps"], 1), max(total["prefill_passes"], 1)
    return dict(steps=total["steps"] / len(costs), rows_per_step=total["row_steps"] / steps,
                draft_per_row_step=total["drafted"] / row_steps, tau=total["emitted"] / row_steps,
                step_ms=1000 * total["step_s"] / steps, plan_ms=1000 * total["plan_s"] / steps,
                draft_ms=1000 * total["draft_s"] / steps, verify_ms=1000 * total["verify_s"] / steps,
                prefill_passes=total["prefill_passes"] / len(costs), prefill_ms=1000 * total["prefill_s"] / passes)


def pooled(traces: list[list], costs: list[dict]) -> dict:
    """Latency statistics over the requests of every trace; throughput and span as the mean over
    traces (each trace has its own clock); ``trace_mean_latency_s``: each trace's mean latency;
    ``costs``: step_costs over the traces."""
    summaries = [summarize(timings) for timings in traces]
    summary = summarize([t for timings in traces for t in timings])
    for key in ("span_s", "tokens_per_s", "requests_per_s"):
        summary[key] = float(np.mean([s[key] for s in summaries]))
    summary["trace_mean_latency_s"] = [s["latency_s"]["mean"] for s in summaries]
    summary["costs"] = step_costs(costs)
    return summary


def static_throughput(zoo, drafter_name, k, prompts, settings: ServeSettings) -> tuple[float, int]:
    """Tokens per second of static generate() batches of ``max_rows`` requests, one after another,
    and their steps in all."""
    drafter = drafter_for(zoo, drafter_name, settings)
    chunks = [prompts[i : i + settings.max_rows] for i in range(0, len(prompts), settings.max_rows)]
    options = dict(drafter=drafter, policy=FixedPolicy(k), max_new_tokens=settings.max_new_tokens,
                   eos_token_id=zoo.tokenizer.eos_token_id, cuda_graphs=settings.graphs)
    generate(zoo.target, chunks[0], **options)  # warm-up: runners and graphs
    if settings.graphs:
        torch.cuda.synchronize()
    started = time.perf_counter()
    outs = [generate(zoo.target, chunk, **options) for chunk in chunks]
    if settings.graphs:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return sum(len(s) for out in outs for s in out.sequences) / seconds, sum(out.stats.steps for out in outs)


def goodput_cost_model(zoo, drafter_name: str, settings: ServeSettings):
    """GoodputPolicy's CostModel: the target and the drafter profiled over the engine's shapes
    (batch sizes up to max_rows, contexts from the prompt to prompt plus max_new_tokens)."""
    grid = ProfileGrid.tiny() if not settings.graphs else ProfileGrid(
        batch_sizes=tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= settings.max_rows} | {settings.max_rows})),
        tokens_per_row=(1, 2, 4, 6),
        context_lengths=(settings.prompt_tokens, settings.prompt_tokens + settings.max_new_tokens // 2,
                         settings.prompt_tokens + settings.max_new_tokens), draft_lengths=(1, 2, 4, 5))
    return profile(zoo.target, [drafter_for(zoo, drafter_name, settings)], grid=grid, cuda_graphs=settings.graphs,
                   step_overhead=True)


def run(settings: ServeSettings, log=print, save=lambda result: None) -> dict:
    """The whole bench -> its result; ``save(result)`` is called after the saturation runs and after
    each rate, with what has been measured so far."""
    from .harness import environment

    cuda = settings.device.startswith("cuda")
    build(settings.preset, out=settings.zoo_dir, device=settings.device)
    zoo = load(settings.preset, out=settings.zoo_dir, device=settings.device,
               dtype=torch.bfloat16 if cuda else torch.float32)
    records = heldout_prompts(zoo.heldout_texts(), zoo.tokenizer, settings.num_requests, settings.prompt_tokens)
    prompts = [zoo.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    at_once = np.zeros(len(prompts))
    result = dict(settings=asdict(settings), environment=environment(settings.device), saturation=[], rows=[],
                  command="python -m specdec serve-bench")

    serve(zoo, min(zoo.drafters), FixedPolicy(3), prompts[: settings.max_rows], at_once[: settings.max_rows],
          settings)  # warm-up: the first engine's eager kernels and allocations, untimed
    speeds = {}
    for name in zoo.drafters:  # the drafter of the fixed lengths: the fastest at k = 3, saturated
        timings, _, _ = serve(zoo, name, FixedPolicy(3), prompts, at_once, settings)
        speeds[name] = summarize(timings)["tokens_per_s"]
        log(f"drafter {name}: {speeds[name]:.0f} tok/s saturated at k=3")
    drafter = max(speeds, key=speeds.get)
    result["drafter"] = drafter
    policies = {name: (None if k == 0 else drafter, lambda k=k: FixedPolicy(k)) for name, k in FIXED.items()}
    if any(m in GOODPUT for m in settings.methods):
        cost_model = goodput_cost_model(zoo, drafter, settings)
        result["cost_model"] = cost_model.as_dict()  # what GoodputPolicy predicted from (CostModel.from_dict)
        policies["goodput"] = (drafter, lambda: GoodputPolicy(cost_model, max_draft_tokens=5))
        policies["goodput-model"] = (drafter, lambda: model_only_goodput(cost_model))
    # plain decoding first, always: the reference of every output and the capacity the loads scale
    methods = ["plain"] + [m for m in settings.methods if m in policies and m != "plain"]

    outputs = {}
    for method in methods:
        name, make = policies[method]
        timings, outputs[method], costs = serve(zoo, name, make(), prompts, at_once, settings)
        summary = summarize(timings)
        k = FIXED.get(method)
        static, static_steps = static_throughput(zoo, name, k, prompts, settings) if k is not None else (None, None)
        result["saturation"].append(dict(method=method, engine_tokens_per_s=summary["tokens_per_s"],
                                         requests_per_s=summary["requests_per_s"], static_tokens_per_s=static,
                                         static_steps=static_steps, costs=step_costs([costs]),
                                         identical=outputs[method] == outputs["plain"]))
        log(f"saturated {method}: engine {summary['tokens_per_s']:.0f} tok/s"
            + (f", static generate() {static:.0f} tok/s" if static else ""))
    capacity = next(r["requests_per_s"] for r in result["saturation"] if r["method"] == "plain")
    result["capacity_requests_per_s"] = capacity
    save(result)

    for load_fraction in settings.loads:
        rate = load_fraction * capacity
        traces, costs, identical = {m: [] for m in methods}, {m: [] for m in methods}, {m: True for m in methods}
        for repeat in range(settings.repeats):
            arrivals = poisson_arrivals(rate, len(prompts), seed=settings.seed + repeat)
            turn = repeat % len(methods)  # rotate the order, so no method always runs first
            for method in methods[turn:] + methods[:turn]:
                name, make = policies[method]
                timings, got, cost = serve(zoo, name, make(), prompts, arrivals, settings)
                traces[method].append(timings)
                costs[method].append(cost)
                identical[method] &= got == outputs["plain"]
        for method in methods:
            summary = pooled(traces[method], costs[method])
            result["rows"].append(dict(load=load_fraction, rate=rate, method=method, identical=identical[method],
                                       **summary))
            log(f"load {load_fraction:.2f} ({rate:.1f} req/s) {method:<8} mean latency {summary['latency_s']['mean']:.3f} s"
                f" (traces {', '.join(f'{v:.3f}' for v in summary['trace_mean_latency_s'])}),"
                f" p99 {summary['latency_s']['p99']:.3f} s, identical {identical[method]}")
        result["targets"] = targets(result)
        save(result)
    return result


def targets(result: dict) -> list[dict]:
    """Issue 34's: GoodputPolicy within 5% of the best other method's mean latency at every rate,
    at least 1.5x faster than plain decoding at the lightest load; the engine's saturated
    throughput at least static generate()'s."""
    out = []
    loads = sorted({r["load"] for r in result["rows"]})
    for load_fraction in loads:
        cell = {r["method"]: r["latency_s"]["mean"] for r in result["rows"] if r["load"] == load_fraction}
        others = [v for m, v in cell.items() if m not in GOODPUT]
        if "goodput" not in cell or not others:
            continue
        best = min(others)
        ratio = cell["goodput"] / best
        out.append(dict(target=f"load {load_fraction:.2f}: GoodputPolicy mean latency within 5% of the best other",
                        value=round(ratio, 3), met=ratio <= 1.05))
        if load_fraction == loads[0] and "plain" in cell:
            speedup = cell["plain"] / cell["goodput"]
            out.append(dict(target=f"load {load_fraction:.2f}: GoodputPolicy >= 1.5x faster than plain decoding",
                            value=round(speedup, 3), met=speedup >= 1.5))
    for row in result["saturation"]:
        if row["static_tokens_per_s"]:
            ratio = row["engine_tokens_per_s"] / row["static_tokens_per_s"]
            out.append(dict(target=f"{row['method']}: engine saturated throughput >= static generate() batches",
                            value=round(ratio, 3), met=ratio >= 1.0))
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"{provenance(result['environment'])} Zoo `{s['preset']}`, greedy, {s['num_requests']}"
             f" requests of up to {s['prompt_tokens']} prompt tokens and {s['max_new_tokens']} new tokens, "
             f"{s['max_rows']} rows; drafter {result.get('drafter')}; capacity (plain decoding, saturated) "
             f"{result.get('capacity_requests_per_s', float('nan')):.2f} requests/s.", "",
             "| load | rate (req/s) | method | mean latency (s) | p50 | p90 | p99 | mean TTFT (s) | mean TPOT (ms) "
             "| identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lat = r["latency_s"]
        lines.append(f"| {r['load']:.2f} | {r['rate']:.2f} | {r['method']} | {lat['mean']:.3f} | {lat['p50']:.3f} | "
                     f"{lat['p90']:.3f} | {lat['p99']:.3f} | {r['time_to_first_token_s']['mean']:.3f} | "
                     f"{1000 * r['time_per_output_token_s']['mean']:.2f} | {'yes' if r['identical'] else 'no'} |")
    lines += ["", "| method | engine tok/s (saturated) | static generate() tok/s | engine / static steps | prefill "
              "passes | identical |", "|---|---|---|---|---|---|"]
    for r in result["saturation"]:
        static = "-" if r["static_tokens_per_s"] is None else f"{r['static_tokens_per_s']:.0f}"
        steps = "-" if not r.get("static_steps") else f"{r['costs']['steps']:.0f} / {r['static_steps']}"
        lines.append(f"| {r['method']} | {r['engine_tokens_per_s']:.0f} | {static} | {steps} | "
                     f"{r['costs']['prefill_passes']:.0f} | "
                     f"{'-' if r['method'] == 'plain' else ('yes' if r['identical'] else 'no')} |")
    lines += ["", "What a step did and cost (per step, averaged over the traces; host ms of the whole step and "
              "of the policy's plan, device ms of the draft and verify phases; prefill: host ms per admitting pass):",
              "", "| load | method | rows | draft / row | tau | step ms | plan ms | draft ms | verify ms | "
              "prefill passes | prefill ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in [dict(r, load="sat.") for r in result["saturation"]] + result["rows"]:
        c = r["costs"]
        load = r["load"] if isinstance(r["load"], str) else f"{r['load']:.2f}"
        lines.append(f"| {load} | {r['method']} | {c['rows_per_step']:.1f} | {c['draft_per_row_step']:.2f} | "
                     f"{c['tau']:.2f} | {c['step_ms']:.2f} | {c['plan_ms']:.2f} | {c['draft_ms']:.2f} | "
                     f"{c['verify_ms']:.2f} | {c['prefill_passes']:.0f} | {c['prefill_ms']:.2f} |")
    if result.get("targets"):
        lines += ["", *target_lines(result["targets"])]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        ax.plot([r["rate"] for r in rows], [r["latency_s"]["mean"] for r in rows], "o-", label=method)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("mean request latency (s)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"{result['settings']['preset']} zoo, {result['settings']['max_rows']} rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    defaults = ServeSettings()
    parser = argparse.ArgumentParser(prog="python -m specdec serve-bench", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--max-rows", type=int, default=defaults.max_rows)
    parser.add_argument("--loads", default=",".join(map(str, defaults.loads)),
                        help="request rates as fractions of plain decoding's saturated rate")
    parser.add_argument("--methods", default=",".join(defaults.methods), help="of plain,k1,k3,k5,goodput,goodput-model")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="Poisson traces per rate")
    parser.add_argument("--zoo-dir")
    parser.add_argument("--out", default=defaults.out)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    methods = tuple(args.methods.split(","))
    unknown = [m for m in methods if m not in (*FIXED, *GOODPUT)]
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join((*FIXED, *GOODPUT))}")
    settings = ServeSettings(preset=args.preset, device=args.device, num_requests=args.num_requests,
                             prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                             max_rows=args.max_rows, loads=tuple(float(x) for x in args.loads.split(",")),
                             methods=methods, zoo_dir=args.zoo_dir, repeats=args.repeats, out=args.out)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"serve_{time.strftime('%Y%m%d_%H%M%S')}"

    def save(result: dict) -> None:
        Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
        Path(f"{stem}.md").write_text(markdown(result))

    result = run(settings, save=save)
    save(result)
    plot(result, Path(f"{stem}.png"))
    print(f"wrote {stem}.json, .md and .png")
    return 0
