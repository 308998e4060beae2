"""Why does GoodputPolicy trail fixed k = 5 at light load on the Engine (BENCHMARKS §9), and what
does admitting a request cost (time to first token 19 ms for plain decoding against 2.4 ms steps)?

On the `gpu` zoo, one Poisson trace per (rate, method) for plain decoding, fixed k = 5 and
GoodputPolicy (its cost model profiled as serve-bench does), recording:
- every step: active rows, the planned lengths of the active rows, host seconds of the step and
  of the plan, device seconds of the draft and verify phases (StepRecord);
- GoodputPolicy's decisions: how many, how many were plain probes, the calibration's scales at
  the end, the predicted goodput of drafting and of plain decoding at each decision;
- admission: host seconds of Engine.admit split into the drafters' start_rows, the prefill
  forward (GPU waited for) and the rest.

    SPECDEC_ZOO_DIR=/tmp/zoo python experiments/serve_light_load_probe.py --out DIR [--rates 5.4,27]

Writes DIR/serve_light_load_probe.json and prints a summary per (rate, method).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from specdec.bench.serve import FIXED, ServeSettings, engine_for, goodput_cost_model
from specdec.load import poisson_arrivals, summarize
from specdec.policies import FixedPolicy, GoodputPolicy
from specdec.replay import replay
from specdec.zoo import build, load
from specdec.zoo.prompts import heldout_prompts


def timed(owner, name: str, seconds: list, sync: bool):
    """Wrap owner.name so that each call's host seconds (GPU waited for when sync) go to ``seconds``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if sync:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        return out

    setattr(owner, name, wrapper)


def probe(zoo, drafter, policy, prompts, arrivals, settings) -> dict:
    steps, admit_s, prefill_s, start_rows_s, decisions, probes = [], [], [], [], [], []
    with engine_for(zoo, drafter, policy, settings) as engine:
        observe = policy.observe

        def observing(record):
            steps.append(dict(rows=len(record.rows), drafted=record.num_drafted[record.rows].tolist(),
                              emitted=record.num_emitted[record.rows].tolist(), step_ms=1e3 * record.step_time_s,
                              plan_ms=1e3 * record.plan_time_s, draft_ms=1e3 * record.draft_time_s,
                              verify_ms=1e3 * record.verify_time_s))
            observe(record)

        policy.observe = observing
        if isinstance(policy, GoodputPolicy):
            decide = policy._decide

            def deciding(active, caps, step_time, remaining):
                lengths = decide(active, caps, step_time, remaining)
                decisions.append(dict(rows=len(active), lengths=np.asarray(lengths)[active].tolist(),
                                      predicted=policy.predicted_goodput, plain=policy.predicted_plain_goodput))
                return lengths

            policy._decide = deciding
            probed = policy.calibration.probed

            def probing(num_rows):
                probes.append(num_rows)
                probed(num_rows)

            policy.calibration.probed = probing
        sync = settings.graphs
        timed(engine, "admit", admit_s, sync)
        timed(engine, "_prefill", prefill_s, sync)
        for d in engine.drafters:
            timed(d, "start_rows", start_rows_s, sync)
        served = replay(engine, prompts, arrivals, settings.max_new_tokens)
    timings = [s.timing for s in served]
    out = dict(summary=summarize(timings), steps=steps, admit_ms=[1e3 * s for s in admit_s],
               prefill_ms=[1e3 * s for s in prefill_s], start_rows_ms=[1e3 * s for s in start_rows_s],
               decisions=decisions, probes=probes)
    if isinstance(policy, GoodputPolicy):
        out["calibration"] = dict(base_scale=policy.calibration.base_scale, extra_scale=policy.calibration.extra_scale)
    return out


def report(rate: float, method: str, got: dict) -> None:
    s = got["summary"]
    steps = got["steps"]
    by_rows = Counter(st["rows"] for st in steps)
    drafted = [d for st in steps for d in st["drafted"]]
    print(f"rate {rate:.1f} {method}: mean latency {s['latency_s']['mean']:.3f} s, TTFT {s['time_to_first_token_s']['mean']*1e3:.1f} ms,"
          f" TPOT {s['time_per_output_token_s']['mean']*1e3:.2f} ms; {len(steps)} steps, rows/step {dict(sorted(by_rows.items()))}")
    print(f"  draft per row-step {np.mean(drafted):.2f}, lengths {dict(sorted(Counter(drafted).items()))};"
          f" step ms median {np.median([st['step_ms'] for st in steps]):.2f}, plan ms mean {np.mean([st['plan_ms'] for st in steps]):.3f},"
          f" draft ms {np.mean([st['draft_ms'] for st in steps]):.2f}, verify ms {np.mean([st['verify_ms'] for st in steps]):.2f}")
    for k in sorted(set(drafted)):
        ks = [st["step_ms"] for st in steps if st["drafted"] and max(st["drafted"]) == k]
        if ks:
            print(f"    max draft {k}: {len(ks)} steps, median step {np.median(ks):.2f} ms")
    print(f"  admit ms mean {np.mean(got['admit_ms']):.2f} (n {len(got['admit_ms'])}), prefill {np.mean(got['prefill_ms'] or [0]):.2f},"
          f" start_rows {np.mean(got['start_rows_ms'] or [0]):.2f}")
    if got["decisions"]:
        print(f"  {len(got['decisions'])} decisions, {len(got['probes'])} probes {dict(Counter(got['probes']))};"
              f" calibration {got['calibration']}")
        zero = sum(1 for d in got["decisions"] if not any(d["lengths"]))
        print(f"  decisions with every row plain: {zero}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--rates", default="5.4,27")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--drafter", default="drafter-1L")
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    settings = ServeSettings(preset=args.preset, device=args.device, num_requests=args.num_requests)
    build(settings.preset, device=settings.device)
    zoo = load(settings.preset, device=settings.device, dtype=torch.bfloat16 if settings.graphs else torch.float32)
    records = heldout_prompts(zoo.heldout_texts(), zoo.tokenizer, settings.num_requests, settings.prompt_tokens)
    prompts = [zoo.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    drafter = args.drafter if args.drafter in zoo.drafters else min(zoo.drafters)
    engine_warm = probe(zoo, drafter, FixedPolicy(3), prompts[:16], np.zeros(len(prompts[:16])), settings)  # warm-up, untimed
    del engine_warm
    cost_model = goodput_cost_model(zoo, drafter, settings)
    results = dict(cost_model=cost_model.as_dict(), runs=[])
    for rate in map(float, args.rates.split(",")):
        arrivals = poisson_arrivals(rate, len(prompts), seed=0)
        for method in ("plain", "k5", "goodput"):
            policy = GoodputPolicy(cost_model, max_draft_tokens=5) if method == "goodput" else FixedPolicy(FIXED[method])
            got = probe(zoo, None if method == "plain" else drafter, policy, prompts, arrivals, settings)
            report(rate, method, got)
            results["runs"].append(dict(rate=rate, method=method, **got))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "serve_light_load_probe.json").write_text(json.dumps(results, default=float))


if __name__ == "__main__":
    main()
