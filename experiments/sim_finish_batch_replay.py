"""GoodputPolicy at batch 16 on replayed decoding (BENCHMARKS.md, run 25: "finish" read 0.90-0.94 of the best
fixed length in five cells at b4-b64 on a machine whose A/A twins read 0.98-1.04, drafting a mean of 3.1-4.1
tokens at b16 where the best fixed pairs drafted 4 and 6).

Question: does the "finish" objective itself draft shorter than the best fixed length, on real text's
acceptance and a static batch of 16 rows, or does the gap come from the GPU (calibration, spells)? The
acceptance is replayed (specdec.policies.simulate.replay_call): the `cpu` zoo's target decodes each request
greedily (128 new tokens) and drafter-2L's greedy token at each position is compared with the target's, as in
experiments/sim_trace_replay.py. The `cpu` zoo is not the `gpu` zoo, so the figures are the mechanism's.

Step times: the policy's cost model is run 25's b16 profile (drafter-4L-narrow); the "true" step time is what
run 25's b16 traces measured with 13 or more of 16 rows active (median ms by longest draft: plain 1.27, k = 2
1.98, 3 2.08, 4 2.15, 5 2.46, 6 2.76, 7 2.98, 8 3.18; k = 1 read as 1.85), scaled by the active rows' share as
the b16 trace's tail does not say more, with lognormal noise of sd 0.1 ("noisy") or none. Per workload: 2 calls
of 16 as history, then 2 measured calls of 16 (the same for every policy), 8 seeds.

Printed: tokens/s of fixed k against plain, then each policy as a fraction of the best fixed k with its mean
draft. Arguments: requests per workload (default 64: 32 history + 32 measured), the cases (quiet,noisy), and
"probes" for knobs of "finish" besides the library's defaults. The agreements are cached in
/tmp by the count. About 10 minutes to record on 2 CPU cores with the `cpu` zoo built, then a few minutes.
"""
import json
import sys
from pathlib import Path

import numpy as np

import replay_agreements  # experiments/replay_agreements.py
from specdec.policies import CostModel, FixedPolicy, GoodputPolicy
from specdec.policies.acceptance import rate_from_expected_tokens
from specdec.policies.simulate import replay_call

NEW_TOKENS, ROWS = 128, 16
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CACHE = Path(f"/tmp/specdec_agreement_cpu_batch_{COUNT}.json")
TRUE_MS = {0: 1.27, 1: 1.85, 2: 1.98, 3: 2.08, 4: 2.15, 5: 2.46, 6: 2.76, 7: 2.98, 8: 3.18}
# "dear": drafting costs 2.8 + 0.4 k ms, so that on the gpu-like text the best fixed k only ties plain decoding
DEAR_MS = {0: 1.27, **{k: 2.8 + 0.4 * k for k in range(1, 9)}}


def markov_agreements(count: int, seed: int = 0, stay: float = 0.95, back: float = 0.7, jitter: float = 0.05) -> list:
    """Synthetic bursty acceptance like the gpu zoo's drafter-4L-narrow (tau 1.83 / 3.51 / 4.79 at k = 1 / 4 / 8
    against run 25's b16 profile's 1.82 / 3.46 / 4.57): per row a two-state chain, agreeing after an agreement
    with probability ``stay`` and after a disagreement with ``back``, each jittered per row by ``jitter``."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        stay_i = float(np.clip(stay + rng.normal(0, jitter), 0, 0.995))
        back_i = float(np.clip(back + rng.normal(0, jitter), 0.01, 1))
        state, row = bool(rng.random() < 0.8), []
        for _ in range(NEW_TOKENS):
            row.append(state)
            state = bool(rng.random() < (stay_i if state else back_i))
        rows.append(row)
    return rows


run25 = json.load(open("benchmarks/results/policies_h200_run25.json"))
b16_part = next(p for p in run25["parts"] if p["batch_sizes"] == [16])
MODEL = CostModel.from_dict(b16_part["cost_model"]).subset([1])  # drafter-4L-narrow


def true_step_time(table: dict, noise: bool, rng: np.random.Generator):
    """seconds(lengths [A], k [A]): the table's ms for the step's longest draft, times the noise."""
    def seconds(lengths, k):
        return table[int(np.max(k))] * 1e-3 * (float(np.exp(rng.normal(0.0, 0.1))) if noise else 1.0)
    return seconds


def fitted_rate(calls) -> float:
    tau = {}
    for k in (1, 2, 3, 4, 6, 8):
        done = [replay_call(FixedPolicy(k), agreement, NEW_TOKENS, lambda n, kk: 1.0) for agreement in calls]
        tau[k] = sum(c.tokens for c in done) / sum(c.steps * ROWS for c in done)
    return rate_from_expected_tokens(tau)


def run(make, history, measured, seed, table, noise):
    """tokens/s and mean longest draft of the measured calls after serving the history (paired noise)."""
    policy = make()
    step = true_step_time(table, noise, np.random.default_rng([seed, 0]))
    for agreement in history:
        replay_call(policy, agreement, NEW_TOKENS, step)
    step = true_step_time(table, noise, np.random.default_rng([seed, 1]))
    tokens = seconds = 0.0
    drafts = []
    for agreement in measured:
        call = replay_call(policy, agreement, NEW_TOKENS, step)
        tokens, seconds = tokens + call.tokens, seconds + call.seconds
        drafts += call.max_lengths
    return tokens / seconds, float(np.mean(drafts))


def policies() -> dict:
    def goodput(**options):
        return lambda prior: GoodputPolicy(MODEL, max_draft_tokens=8, decide_every=16, prior=prior, **options)
    found = {"finish": goodput(search="finish"), "exact (per-row)": goodput(search="exact")}
    if len(sys.argv) > 3 and sys.argv[3] == "probes":  # knobs of "finish", none of them the library's defaults
        found.update({
            "finish min_gain 0": goodput(search="finish", min_gain=0.0),
            "finish min_gain 0.03": goodput(search="finish", min_gain=0.03),
        })
    return found


def main():
    recorded = replay_agreements.record_agreements(COUNT, CACHE, NEW_TOKENS, names=("continuation", "mixed"))
    data = {**recorded, "gpu-like markov": {"agreement": markov_agreements(COUNT)}}
    dear = len(sys.argv) > 4 and sys.argv[4] == "dear"
    table = DEAR_MS if dear else TRUE_MS
    seeds = range(8)
    for noise in [c == "noisy" for c in (sys.argv[2] if len(sys.argv) > 2 else "quiet,noisy").split(",")]:
        case = "dear drafting" if dear else "run 25's b16 traces"
        print(f"\n== true step time: {case}{', noisy' if noise else ''}")
        for name, entry in data.items():
            rows = [np.array(a, dtype=bool) for a in entry["agreement"]]
            calls = [np.stack(rows[i: i + ROWS]) for i in range(0, len(rows) - ROWS + 1, ROWS)]
            history, measured = calls[: len(calls) // 2], calls[len(calls) // 2:]
            prior = fitted_rate(history)
            fixed = {k: np.mean([run(lambda: FixedPolicy(k), [], measured, s, table, noise)[0] for s in seeds]) for k in range(9)}
            best = max(fixed, key=fixed.get)
            print(f"{name:13s} prior {prior:.3f}  fixed vs plain: "
                  + " ".join(f"k{k}:{v / fixed[0]:.2f}" for k, v in fixed.items()) + f"  (best k={best})")
            for label, make in policies().items():
                results = [run(lambda: make(prior), history, measured, s, table, noise) for s in seeds]
                print(f"    {label:18s} {np.mean([r[0] for r in results]) / fixed[best]:.3f} of the best fixed k, "
                      f"mean longest draft {np.mean([r[1] for r in results]):.2f}", flush=True)


if __name__ == "__main__":
    main()
