"""GoodputPolicy "finish" on simulated static batches with straggler rows (BENCHMARKS.md, run 19).

Run 19's cost model (drafter-4L-narrow) is the policy's model. The true step time is launch-bound, read off run
19's traces ("run19-like"), or one where drafting costs less against plain decoding ("fast"). Rows accept at
about 0.83, and each row is a straggler with probability len(stragglers) / 64, at a rate drawn from the list.
Each policy serves 4 calls of history, then one measured call, the same for every policy; 24 seeds.

Printed per case: fixed k against plain decoding, then "finish" as the library has it ("aged": since session 16
the batch's weight in a row's rate ages with the row's drafting steps, FINISH_PRIOR_GRACE, FINISH_PRIOR_FLOOR), as
it was before ("unaged"), and with the trial empirical prior ("emp": an NPMLE of row rates over the history's
rows, a probe not in the library), each as a fraction of the best fixed k. Takes about 15 minutes on 2 CPU cores.
"""
import json
from pathlib import Path
import numpy as np
from specdec.policies import CostModel, GoodputPolicy, FixedPolicy
from specdec.policies.simulate import simulate_call
import specdec.policies.goodput as gp

GRID = np.linspace(0.005, 0.995, 100)

def npmle(successes, trials, iters=300):
    s, t = np.asarray(successes)[:, None], np.asarray(trials)[:, None]
    loglik = s * np.log(GRID)[None] + (t - s) * np.log1p(-GRID)[None]  # [R, G]
    w = np.full(len(GRID), 1.0 / len(GRID))
    for _ in range(iters):
        lp = loglik + np.log(w + 1e-300)[None]
        lp -= lp.max(axis=1, keepdims=True)
        p = np.exp(lp); p /= p.sum(axis=1, keepdims=True)
        w = p.mean(axis=0)
    return w

def emp_samples(weights, successes, trials, samples):
    s, t = np.asarray(successes)[:, None], np.asarray(trials)[:, None]
    lp = s * np.log(GRID)[None] + (t - s) * np.log1p(-GRID)[None] + np.log(weights + 1e-300)[None]
    lp -= lp.max(axis=1, keepdims=True)
    p = np.exp(lp); p /= p.sum(axis=1, keepdims=True)
    cdf = np.cumsum(p, axis=1)  # [B, G]
    B = len(s)
    shift = max(1, -(-B // samples))
    rows = np.arange(B)
    u = (((rows[None, :] + np.arange(samples)[:, None] * shift) % B) + 0.5) / B  # [J, B]
    idx = np.array([[np.searchsorted(cdf[i], u[j, i]) for i in range(B)] for j in range(samples)])
    return GRID[np.minimum(idx, len(GRID) - 1)]

class EmpiricalFinish(GoodputPolicy):
    def _decide(self, active, caps, step_time, remaining):
        rs = self.row_spread
        if rs is not None and len(rs) >= 32:
            rates = np.array(rs._rates); trials = np.array(rs._trials)
            w = npmle(rates * trials, trials)
            orig = gp.posterior_rate_samples
            gp.posterior_rate_samples = lambda S, T, p, w0, J: emp_samples(w, S, T, J)
            try:
                return super()._decide(active, caps, step_time, remaining)
            finally:
                gp.posterior_rate_samples = orig
        return super()._decide(active, caps, step_time, remaining)

class Unaged(GoodputPolicy):
    """"finish" as it was until session 16: the batch's weight in a row's rate does not age (a grace
    longer than any call)."""

    def finish_row_prior_trials(self):
        saved, gp.FINISH_PRIOR_GRACE = gp.FINISH_PRIOR_GRACE, 1 << 20
        try:
            return super().finish_row_prior_trials()
        finally:
            gp.FINISH_PRIOR_GRACE = saved


r = json.load(open(Path(__file__).resolve().parents[1] / 'benchmarks/results/policies_h200_run19.json'))
cm19 = CostModel.from_dict(r['cost_model']).subset([1])

def true_step19(lengths, k):
    rows = len(lengths)
    if k.max(initial=0) == 0:
        return 1e-3 * (1.72 + 0.003 * rows)
    return 1e-3 * (2.3 + 0.25 * k.max() + 0.006 * rows + 0.001 * k.sum() / 4)

def rates_for(rng, n, stragglers, mean=0.83, conc=40):
    base = np.clip(rng.beta(mean * conc, (1 - mean) * conc, n), 0, 0.98)
    # stragglers: each row independently a straggler with probability len(stragglers)/64, rate drawn from the list
    if stragglers:
        is_s = rng.random(n) < len(stragglers) / 64
        base[is_s] = rng.choice(stragglers, is_s.sum())
    return base

def run(make, history, stragglers, step, n=64, seeds=24, **kw):
    vals = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        policy = make()
        for _ in range(history):
            simulate_call(policy, rates_for(rng, n, stragglers, **kw), 128, step, rng)
        if hasattr(policy, 'end_call'):
            policy.end_call()
        # the measured batch's rows and draws are the seed's alone: the same for every policy
        m = simulate_call(policy, rates_for(np.random.default_rng(2000 + seed), n, stragglers, **kw), 128, step,
                          np.random.default_rng(1000 + seed))
        vals.append(m.tokens_per_s)
    return float(np.mean(vals))

def fast_step(lengths, k):  # run-18-like host: drafting cheaper relative to plain
    rows = len(lengths)
    if k.max(initial=0) == 0:
        return 1e-3 * (1.5 + 0.02 * rows)
    return 1e-3 * (1.8 + 0.15 * k.max() + 0.025 * rows + 0.004 * k.sum())

for name, step, n in (("run19-like b64", true_step19, 64), ("run19-like b16", true_step19, 16), ("fast b64", fast_step, 64), ("fast b16", fast_step, 16)):
    for stragglers in ([], [0.3], [0.15, 0.3, 0.4, 0.5]):
        fixed = {k: run(lambda k=k: FixedPolicy(k), 0, stragglers, step, n) for k in (0, 1, 2, 3, 4, 6)}
        best = max(fixed.values())
        line = f"{name} str {stragglers}: fixed " + " ".join(f"{k}:{v/fixed[0]:.2f}" for k, v in fixed.items())
        for label, cls in (("aged", GoodputPolicy), ("unaged", Unaged), ("emp", EmpiricalFinish)):
            f = run(lambda: cls(cm19, max_draft_tokens=8, search='finish', decide_every=16, prior=0.83), 4, stragglers, step, n)
            line += f" | {label} {f/best:.3f}"
        print(line, flush=True)
