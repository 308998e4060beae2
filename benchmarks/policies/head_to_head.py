"""Head-to-head rounds: issue 5's targets timed again, apart from the grid that chose their
references (``bench.py`` runs them at the end of each cell).

The grid times every method of a cell in ``repeats`` interleaved rounds and reads each from its
median pass. Two things blur a target read from it:

- the winner's curse: the best fixed length in hindsight is the fastest of up to 13 medians, each
  off by the machine's noise, so the one that comes out fastest is more often than not one that
  drew a lucky spell, and every policy reads low against it;
- the noise itself: the median of a few passes of the very same work moves from round to round
  by as much as the margins the targets judge (``targets.same_decision_pairs``).

So each cell then times the targets' policies (``CONTENDERS``) and their references as the grid
chose them (plain decoding; the best fixed length of the policy's drafter; the best single
drafter at the bandit's length) in ``rounds`` more rounds, every entry once per round in an
order rotated from round to round, plus a twin: the first best fixed pair a second time, whose
ratio to itself is the cell's own A/A check. A comparison reads the median over rounds of the
paired ratio: the policy's tokens/s in a round over the reference's in the same round, so a slow
spell of a round's length falls on both.

Invariant: the references are chosen from the grid's passes only, never from these rounds, so
these rounds measure them without selection; every pass's output is compared with plain
decoding's (``identical``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# the policies timed head to head: (family, variant); GoodputPolicy "finish" and the call bandit
# are the variants BENCHMARKS.md reads the targets from
CONTENDERS = (("goodput", "finish"), ("batch_adaptive", ""), ("bandit", "batch-call"))
# each family's references, as issue 5's targets name them
REFERENCES = {"goodput": ("plain", "best_fixed"), "batch_adaptive": ("best_fixed",), "bandit": ("best_single",)}


def is_reference(relation: str, family: str, drafters: Sequence[str], length: int,
                 policy_drafters: Sequence[str], policy_length: int) -> bool:
    """Whether a run (its family, drafters and length) is a candidate for a policy's reference
    (the policy's drafters and length): plain decoding ("plain"); plain decoding or any fixed
    length of the policy's drafter ("best_fixed"); a fixed pair of one of its drafters at its own
    length ("best_single"). The fastest candidate is the reference, here and in the grid's
    targets (targets.py)."""
    if relation == "plain":
        return family == "plain"
    if relation == "best_fixed":
        return family == "plain" or (family == "fixed" and tuple(drafters) == tuple(policy_drafters))
    if relation == "best_single":
        return family == "fixed" and length == policy_length and drafters[0] in policy_drafters
    raise ValueError(f"unknown reference {relation!r}; one of plain, best_fixed, best_single")


def reference_index(methods: Sequence, rates: dict[int, float], policy, relation: str) -> int | None:
    """The grid's choice of ``policy``'s reference: the fastest candidate (is_reference) by
    ``rates`` (method index -> tokens/s of its median pass; failed methods absent)."""
    candidates = [i for i, m in enumerate(methods)
                  if is_reference(relation, m.family, m.drafters, m.length, policy.drafters, policy.length)]
    return max((i for i in candidates if i in rates), key=rates.__getitem__, default=None)


def plan(methods: Sequence, rates: dict[int, float]) -> tuple[list[int], list[tuple[int, int, str]]]:
    """-> (entries: the method index of each entry, in the order of a round's first pass;
    comparisons: (policy entry, reference entry, relation)). Each contender that ran gets its
    references; a method is one entry however many compare with it, but for the twin: the
    first best-fixed reference once more, compared with its first entry ("twin")."""
    entries: list[int] = []
    comparisons: list[tuple[int, int, str]] = []

    def enter(index: int) -> int:
        if index not in entries:
            entries.append(index)
        return entries.index(index)

    for family, variant in CONTENDERS:
        for i, method in enumerate(methods):
            if (method.family, method.variant) != (family, variant) or i not in rates:
                continue
            found = [(relation, reference_index(methods, rates, method, relation)) for relation in REFERENCES[family]]
            found = [(relation, j) for relation, j in found if j is not None]
            if found:
                mine = enter(i)
                comparisons += [(mine, enter(j), relation) for relation, j in found]
    twin_of = next((b for _, b, relation in comparisons if relation == "best_fixed"), None)
    if twin_of is not None:
        entries.append(entries[twin_of])
        comparisons.append((len(entries) - 1, twin_of, "twin"))
    return entries, comparisons


def round_orders(count: int, rounds: int) -> list[list[int]]:
    """``rounds`` orders of ``count`` entries, each rotated one further than the last, so every
    entry runs at every place of a round about equally often."""
    return [[(i + r) % count for i in range(count)] for r in range(rounds)]


def run_rounds(count: int, rounds: int, timed_pass: Callable[[int], tuple],
               labels: Sequence[str] | None = None) -> list[list[tuple]]:
    """Every entry once per round (``round_orders``) -> per entry, per round what
    ``timed_pass(entry)`` returned: (seconds, sequences), or (seconds, sequences, steps, mean
    draft tokens, each drafter's share of row-steps). A pass that raises raises RuntimeError
    naming the entry (its ``labels`` name) and the round."""
    passes: list[list[tuple]] = [[] for _ in range(count)]
    for number, order in enumerate(round_orders(count, rounds), start=1):
        for entry in order:
            try:
                passes[entry].append(timed_pass(entry))
            except Exception as error:
                name = labels[entry] if labels is not None else f"entry {entry}"
                raise RuntimeError(f"{name}, round {number} of {rounds}: {type(error).__name__}: {error}") from error
    return passes


def paired_ratios(policy: list[tuple], reference: list[tuple]) -> list[float]:
    """Per round: the policy pass's tokens/s over the reference pass's (passes as run_rounds returns them)."""
    rate = lambda timed: sum(map(len, timed[1])) / timed[0]
    return [rate(a) / rate(b) for a, b in zip(policy, reference)]


def record(methods: Sequence, entries: list[int], comparisons: list[tuple[int, int, str]],
           passes: list[list[tuple]], plain_sequences: list) -> dict:
    """The cell's head-to-head result (JSON): every entry's passes (their seconds, tokens, and
    where the passes tell them, steps, mean draft tokens and the share of row-steps each of the
    method's drafters proposed in: what an adaptive policy chose in each round) and whether each
    output equals plain decoding's, and every comparison's paired ratios and their median
    (``identical``: the policy's passes; a reference's own are in its entry)."""
    described = []
    for e, i in enumerate(entries):
        timed = passes[e]
        entry = {"method": methods[i].name, "family": methods[i].family, "variant": methods[i].variant,
                 "pass_seconds": [p[0] for p in timed], "tokens": [sum(map(len, p[1])) for p in timed],
                 "identical": all(p[1] == plain_sequences for p in timed)}
        if timed and all(len(p) >= 4 for p in timed):
            entry["pass_steps"] = [int(p[2]) for p in timed]
            entry["pass_mean_draft_tokens"] = [float(p[3]) for p in timed]
        names = list(methods[i].drafters)
        if timed and names and all(len(p) >= 5 and len(p[4]) == len(names) for p in timed):
            entry["pass_drafter_use"] = [dict(zip(names, map(float, p[4]))) for p in timed]
        described.append(entry)
    found = []
    for a, b, relation in comparisons:
        paired = paired_ratios(passes[a], passes[b])
        found.append({"policy": described[a]["method"], "family": described[a]["family"],
                      "variant": described[a]["variant"], "reference": relation,
                      "reference_method": described[b]["method"], "paired": paired, "median": float(np.median(paired)),
                      "identical": described[a]["identical"]})
    return {"rounds": len(passes[0]) if passes else 0, "entries": described, "comparisons": found}


def twin_ratios(records: list[dict]) -> list[dict]:
    """Each cell's A/A check: its twin comparison -> [{workload, batch, method, median, low, high}]
    (low and high: the smallest and largest paired ratio)."""
    return [{"workload": r["workload"], "batch": r["batch"], "method": c["policy"], "median": c["median"],
             "low": min(c["paired"]), "high": max(c["paired"])}
            for r in records for c in r["comparisons"] if c["reference"] == "twin"]


def markdown_lines(records: list[dict], target_table: list[str]) -> list[str]:
    """The report's head-to-head section: how the rounds ran, ``target_table`` (the lines of the
    targets' table, targets.target_table), every comparison of every cell, then
    what the adaptive policies chose round by round (where the record keeps it)."""
    if not records:
        return []
    rounds = sorted({r["rounds"] for r in records if not r.get("error")}) or sorted({r["rounds"] for r in records})
    lines = ["", "## Targets, head to head", "",
             f"After each cell's grid, its targeted policies and their references as the grid chose them were timed in "
             f"{'/'.join(map(str, rounds))} more rounds, every entry once per round in rotated order, with the first best "
             "fixed pair twice (its twin: the cell's A/A check). A ratio is the median over rounds of the policy's "
             "tokens/s over the reference's in the same round (head_to_head.py).", "", *target_table]
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["", "Head-to-head rounds that failed (their targets fail there): " +
                  "; ".join(f"{r['workload']} b{r['batch']}: {r['error']}" for r in failed) + "."]
    twins = twin_ratios(records)
    if twins:
        lines += ["", "A/A check, each cell's twin (the same fixed pair timed twice a round): median paired ratio "
                  "(smallest-largest): " + "; ".join(f"{t['workload']} b{t['batch']} {t['median']:.3f} "
                                                     f"({t['low']:.2f}-{t['high']:.2f})" for t in twins) + "."]
    lines += ["", "| workload | batch | policy | reference | reference run | median ratio | paired ratios | identical |",
              "|---|---|---|---|---|---|---|---|"]
    for r in records:
        for c in r["comparisons"]:
            lines.append(f"| {r['workload']} | {r['batch']} | {c['policy']} | {c['reference']} | {c['reference_method']} | "
                         f"{c['median']:.3f} | {' '.join(f'{x:.2f}' for x in c['paired'])} | "
                         f"{'yes' if c['identical'] else 'no'} |")
    chose = [(r, e) for r in records for e in r["entries"]
             if e["family"] not in ("plain", "fixed") and e.get("pass_mean_draft_tokens")]
    if chose:
        lines += ["", "What the adaptive policies chose head to head, round by round: steps, mean draft tokens, "
                  "and each drafter's share of row-steps where the policy has several:", "",
                  "| workload | batch | policy | steps | mean draft tokens | drafters |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['batch']} | {e['method']} | {' '.join(map(str, e['pass_steps']))} | "
                  f"{' '.join(f'{k:.2f}' for k in e['pass_mean_draft_tokens'])} | {_drafter_shares(e)} |" for r, e in chose]
    return lines


def _drafter_shares(entry: dict) -> str:
    """An entry's drafter shares by round ("a 25% b 50%; b 100%"), said once with ", every round"
    when every round had the same; empty for a method of one drafter (or none recorded)."""
    use = entry.get("pass_drafter_use") or []
    if not use or len(use[0]) < 2:
        return ""
    rounds = [" ".join(f"{name} {share:.0%}" for name, share in shares.items() if share > 0) or "none" for shares in use]
    return f"{rounds[0]}, every round" if len(set(rounds)) == 1 else "; ".join(rounds)
