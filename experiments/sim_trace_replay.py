"""GoodputPolicy at batch 1 on replayed decoding (BENCHMARKS.md, run 22: "finish" read 0.92-0.93 of the best
fixed length at b1 in all three workloads, where BatchAdaptivePolicy's table read 0.99-1.03).

The acceptance is real text's, not i.i.d.: the `cpu` zoo's target decodes each request greedily (128 new
tokens, EOS suppressed), and drafter-2L's greedy token at each generated position, given the target's own
tokens before it, is compared with the target's (specdec.policies.simulate.replay_call). With greedy decoding
that is exactly what a draft of k tokens from there gets accepted. The `cpu` zoo is not the `gpu` zoo the
benchmark runs, so the figures are the mechanism's, not run 22's.

Step times: the policy's cost model is run 22's b1 profile (the H200, drafter-2L); the "true" step time is
either that model ("model") or what run 22's b1 traces measured (plain 1.25 ms, drafting 1.65 + 0.10 k ms:
"measured"), each step times a lognormal noise of sd 0.1 ("noisy") or not. Per workload: 8 history requests,
then 8 measured ones, one call each, as the benchmark's b1 cells; the policy's prior is fitted to the history's
tau by length, as the benchmark fits it to its tau profile. Printed: tokens/s of fixed k against plain, and
each policy as a fraction of the best fixed k.

Arguments: the number of requests per workload (16: 8 history + 8 measured), then cases (comma-separated
kind[:noisy], kind one of model, measured, spells; all four by default). The agreements are cached in /tmp by
the count alone: delete the cache after rebuilding the zoo. About 3 minutes on 2 CPU cores
with the `cpu` zoo built (`python -m specdec zoo build`).
"""
import json
import sys
from pathlib import Path

import numpy as np

import replay_agreements  # experiments/replay_agreements.py
from specdec.policies import CostModel, FixedPolicy, GoodputPolicy
from specdec.policies.acceptance import rate_from_expected_tokens
from specdec.policies.simulate import replay_call

NEW_TOKENS = 128
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CACHE = Path(f"/tmp/specdec_agreement_cpu_{COUNT}.json")


def record_agreements() -> dict:
    """workload -> {"agreement": [[bool] * NEW_TOKENS per request], "prompt_tokens": [int]}."""
    return replay_agreements.record_agreements(COUNT, CACHE, NEW_TOKENS)


run22 = json.load(open("benchmarks/results/policies_h200_run22.json"))
b1_part = next(p for p in run22["parts"] if p["batch_sizes"] == [1])
MODEL = CostModel.from_dict(b1_part["cost_model"]).subset([1])  # drafter-2L


SPELL_START, SPELL_STEPS, SPELL_DRAFTING, SPELL_PLAIN = 0.02, 20, 1.6, 1.1


def true_step_time(kind: str, noise: bool, rng: np.random.Generator):
    """kind "model", "measured" or "spells" (measured, with spells of the host: from any step, with probability
    SPELL_START, SPELL_STEPS steps in which a whole drafting step costs SPELL_DRAFTING x and a plain step
    SPELL_PLAIN x, as run 22's first b1 request drafted 1.5-1.7x slower for about 20 steps)."""
    spell = [0]

    def seconds(lengths, k):
        drafting = bool(np.any(k))
        if kind == "model":
            return MODEL.step_time(lengths, k, 0) * (float(np.exp(rng.normal(0.0, 0.1))) if noise else 1.0)
        plain, extra = 1.25e-3, (0.40e-3 + 0.10e-3 * int(np.max(k)) if drafting else 0.0)
        if kind == "spells":
            if spell[0] == 0 and rng.random() < SPELL_START:
                spell[0] = SPELL_STEPS
            if spell[0] > 0:
                spell[0] -= 1
                if drafting:  # the whole drafting step SPELL_DRAFTING x
                    plain, extra = plain * SPELL_DRAFTING, extra * SPELL_DRAFTING
                else:
                    plain = plain * SPELL_PLAIN
        return (plain + extra) * (float(np.exp(rng.normal(0.0, 0.1))) if noise else 1.0)
    return seconds


def fitted_rate(agreement, prompt_tokens) -> float:
    """The i.i.d. rate whose tau by length matches these requests' under fixed k (the benchmark's profile
    lengths; rate_from_expected_tokens, as the benchmark fits GoodputPolicy's prior)."""
    tau = {}
    for k in (1, 2, 3, 4, 6, 8):
        calls = [replay_call(FixedPolicy(k), [a], NEW_TOKENS, lambda n, kk: 1.0, p) for a, p in zip(agreement, prompt_tokens)]
        tau[k] = sum(c.tokens for c in calls) / sum(c.steps for c in calls)
    return rate_from_expected_tokens(tau)


def tokens_per_s(make, history, measured, seed, kind, noise) -> float:
    """The measured calls' tokens/s after serving ``history``: the measured calls' noise and spells come from
    one seed's fresh generator, the same for every policy (paired), whatever the history drew."""
    policy = make()
    step = true_step_time(kind, noise, np.random.default_rng([seed, 0]))
    for agreement, prompt in history:
        replay_call(policy, [agreement], NEW_TOKENS, step, prompt)
    step = true_step_time(kind, noise, np.random.default_rng([seed, 1]))
    tokens = seconds = 0.0
    for agreement, prompt in measured:
        call = replay_call(policy, [agreement], NEW_TOKENS, step, prompt)
        tokens, seconds = tokens + call.tokens, seconds + call.seconds
    return tokens / seconds


def main():
    data = record_agreements()
    half = COUNT // 2
    policies = {
        "finish": lambda prior: GoodputPolicy(MODEL, max_draft_tokens=8, search="finish", decide_every=16, prior=prior),
        "finish min_gain 0": lambda prior: GoodputPolicy(MODEL, max_draft_tokens=8, search="finish", decide_every=16,
                                                         prior=prior, min_gain=0.0),
        "exact (per-row)": lambda prior: GoodputPolicy(MODEL, max_draft_tokens=8, search="exact", decide_every=16, prior=prior),
    }
    seeds = range(6)
    cases = [(c.split(":") + [""])[:2] for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else \
        [("model", ""), ("measured", ""), ("measured", "noisy"), ("spells", "noisy")]
    for kind, noise in cases:
        noise = noise == "noisy"
        print(f"\n== true step time: {kind}{', noisy' if noise else ''}")
        for name, entry in data.items():
            pairs = list(zip(entry["agreement"], entry["prompt_tokens"]))
            history, measured = pairs[:half], pairs[half:]
            prior = fitted_rate(*zip(*history))
            fixed = {k: np.mean([tokens_per_s(lambda: FixedPolicy(k), [], measured, s, kind, noise) for s in seeds])
                     for k in range(0, 9)}
            best = max(fixed, key=fixed.get)
            line = " ".join(f"k{k}:{v / fixed[0]:.2f}" for k, v in fixed.items())
            print(f"{name:13s} prior {prior:.3f}  fixed vs plain: {line}  (best k={best})")
            for label, make in policies.items():
                value = np.mean([tokens_per_s(lambda: make(prior), history, measured, s, kind, noise) for s in seeds])
                print(f"    {label:24s} {value / fixed[best]:.3f} of the best fixed k")


if __name__ == "__main__":
    main()
