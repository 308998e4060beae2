"""``python -m specdec bench --parts trees``: one drafter of the zoo as chains and as token trees,
greedy and at temperature 0.8, at every batch size of the run, side by side in one process.

Rows per (temperature, batch), the largest tree first and then plain decoding (the reference, so that a
run cut short still compares): plain decoding; chains of k = 4 and 6 (PaddingFreeVerifier); trees
of 16, 32 and 64 nodes (TreeVerifier, TREE_SPEC), whose children are sampled without replacement
(real q) and, at temperature 0.8, also top-k with q one-hot (deterministic siblings), at the same
budget. Greedy rows are compared token for token with plain decoding. The report gives each
row's tau and tok/s as ratios to the best chain of its (temperature, batch), and the targets of
issue 32: the best greedy tree at batch 1 against the best chain (tau >= 1.2x, tok/s >= 1.15x),
real q against one-hot q at temperature 0.8, and the smallest batch at which the best chain's
tok/s overtakes the best tree's.
"""

from __future__ import annotations

import time

from ..drafters import ModelDrafter
from ..drafters.tree import TreeSpec
from ..types import SamplingParams
from ..verifiers import PaddingFreeVerifier, TreeVerifier
from .common import BenchSettings, agreement, graph_options, timed_generate, zoo_and_prompts

TREE_DRAFTER = "drafter-4L-narrow"  # the zoo drafter with the best chains (BENCHMARKS.md, peers)
CHAIN_LENGTHS = (4, 6)
TREE_BUDGETS = (16, 32, 64)
TREE_SPEC = TreeSpec(depth=6, branching=4)  # pool of 84 candidates; 20 nodes fed to the drafter a row


def run_trees(settings: BenchSettings, log=print, progress=None) -> dict:
    """-> {"drafter": name, "spec": ..., "rows": [...]} (each row: method, shape, size, children,
    temperature, batch, tokens, seconds, tokens_per_s, tau, identical, error)."""
    zoo, prompts = zoo_and_prompts(settings)
    target, eos = zoo.target, zoo.tokenizer.eos_token_id
    graphs, compiled = graph_options(settings)
    name = TREE_DRAFTER if TREE_DRAFTER in zoo.drafters else min(zoo.drafters)
    model = zoo.drafters[name]
    rows: list[dict] = []
    result = {"drafter": name, "spec": {"depth": TREE_SPEC.depth, "branching": TREE_SPEC.branching}, "rows": rows}

    def methods(temperature: float):
        """The largest tree first (its runners, caches and captured graphs, cover every later method),
        then plain decoding (the reference, early, so that a run cut short can still compare)."""
        kinds = [True] if temperature == 0 else [True, False]
        trees = []
        for budget in sorted(TREE_BUDGETS, reverse=True):
            for sampled in kinds:
                spec = TreeSpec(TREE_SPEC.depth, TREE_SPEC.branching, sampled=sampled)
                children = "sampled" if sampled else "top-k"
                label = f"tree {budget}" + ("" if temperature == 0 else f" ({children} children)")
                trees.append((label, "tree", budget, children, ModelDrafter(model, cuda_graphs=graphs, compile=compiled,
                                                                             tree=spec), TreeVerifier()))
        yield trees[0]
        yield "plain decoding", "plain", 0, None, None, PaddingFreeVerifier()
        for k in sorted(CHAIN_LENGTHS, reverse=True):
            yield f"chain k={k}", "chain", k, None, ModelDrafter(model, cuda_graphs=graphs, compile=compiled), \
                PaddingFreeVerifier()
        yield from trees[1:]

    for temperature in settings.tree_temperatures:
        sampling = SamplingParams(temperature=temperature)
        for batch in sorted(settings.batch_sizes, reverse=True):
            chosen = prompts[: settings.batch1_prompts] if batch == 1 else prompts[: max(batch, settings.num_prompts)]
            outputs, batch_rows = {}, []
            for method, shape, size, children, drafter, verifier in methods(temperature):
                started = time.perf_counter()
                row = dict(method=method, shape=shape, size=size, children=children, temperature=temperature,
                           batch=batch, tokens=0, seconds=float("nan"), tokens_per_s=float("nan"), tau=None,
                           identical=None, agreement=float("nan"), error="")
                try:
                    out, seconds, tau = timed_generate(target, chosen, batch, drafter, size, settings, eos, graphs,
                                                       compiled, verifier=verifier, sampling=sampling)
                    outputs[method] = out
                    row.update(tokens=sum(map(len, out)), seconds=seconds, tokens_per_s=sum(map(len, out)) / seconds,
                               tau=tau)
                except Exception as error:  # noqa: BLE001 - reported in the results, not swallowed
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                batch_rows.append(row)
                plain = outputs.get("plain decoding")
                if temperature == 0 and plain is not None:  # greedy: each output against plain decoding's
                    for done in batch_rows:
                        if done["method"] in outputs and done["shape"] != "plain" and done["identical"] is None:
                            done.update(identical=outputs[done["method"]] == plain,
                                        agreement=agreement(outputs[done["method"]], plain))
                if progress is not None:  # after every row: a run cut short keeps what it measured
                    progress(result)
                log(f"trees T={temperature} batch {batch:>3} {method:<32} "
                    + (f"FAILED {row['error']}" if row["error"] else
                       f"{row['tokens_per_s']:10.1f} tok/s, tau {row['tau']:.2f}")
                    + ("" if row["identical"] is None else f", identical {row['identical']}")
                    + f" ({time.perf_counter() - started:.0f} s)")
    result["targets"] = tree_targets(rows)
    return result


def _best(rows, shape, temperature, batch, key, children=None):
    candidates = [r for r in rows if r["shape"] == shape and r["temperature"] == temperature and r["batch"] == batch
                  and not r["error"] and (children is None or r["children"] == children)]
    return max(candidates, key=lambda r: r[key], default=None)


def tree_targets(rows: list[dict]) -> list[dict]:
    """Issue 32's targets, each with its measured ratio and whether it is met."""
    targets = []
    for key, name, bar, shown in (("tau", "tau", 1.2, ".2f"), ("tokens_per_s", "tok/s", 1.15, ".0f")):
        tree, chain = _best(rows, "tree", 0.0, 1, key), _best(rows, "chain", 0.0, 1, key)
        if tree and chain:
            ratio = tree[key] / chain[key]
            targets.append(dict(target=f"greedy batch 1: best tree {name} >= {bar}x best chain {name}",
                                value=round(ratio, 3), met=ratio >= bar,
                                detail=f"{tree['method']} {tree[key]:{shown}} vs {chain['method']} {chain[key]:{shown}}"))
    sampled = {(r["size"], r["batch"]): r for r in rows
               if r["shape"] == "tree" and r["temperature"] > 0 and r["children"] == "sampled" and not r["error"]}
    onehot = {(r["size"], r["batch"]): r for r in rows
              if r["shape"] == "tree" and r["temperature"] > 0 and r["children"] == "top-k" and not r["error"]}
    pairs = sorted(set(sampled) & set(onehot))
    if pairs:
        ratios = [sampled[p]["tau"] / onehot[p]["tau"] for p in pairs]
        targets.append(dict(target="T=0.8: trees with real q (sampled children) accept more than one-hot q, same budget",
                            value=round(min(ratios), 3),
                            detail="tau ratios by (budget, batch): " + ", ".join(
                                f"{p}: {r:.2f}" for p, r in zip(pairs, ratios)), met=min(ratios) > 1.0))
    for temperature in sorted({r["temperature"] for r in rows}):
        batches = sorted({r["batch"] for r in rows if r["temperature"] == temperature})
        overtaken = None
        for batch in batches:
            tree, chain = (_best(rows, s, temperature, batch, "tokens_per_s") for s in ("tree", "chain"))
            if tree and chain and chain["tokens_per_s"] > tree["tokens_per_s"]:
                overtaken = batch
                break
        targets.append(dict(target=f"T={temperature}: the smallest batch at which the best chain's tok/s overtakes the "
                                   "best tree's (report)", value=overtaken,
                            detail="none of the batch sizes run" if overtaken is None else f"batch {overtaken}",
                            met=None))
    return targets
