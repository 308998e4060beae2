"""Issue 5's targets, read from a policies bench result (``bench.py``): each policy's
tokens/s over its reference's at the same workload and batch size, met or not, from the grid's
median passes (``policy_targets``) and from the head-to-head rounds (``head_to_head_targets``,
``head_to_head.py``); with two checks of what the timing can tell apart (the fastest pass,
an A/A pairing) and the room the mixed workload leaves a drafter selection.

Invariant: a target reads as met only when every measured batch size meets it and every policy
output there was identical to plain decoding; a failed policy run fails it.
"""

from __future__ import annotations

from . import head_to_head


GOODPUT_VS_PLAIN = 0.97  # never more than 3% slower than plain decoding
WITHIN_BEST_FIXED = 0.95  # within 5% of the best fixed length in hindsight
BANDIT_MIXED_GAIN = 1.10  # beats the best single drafter by 10% on the mixed workload
BANDIT_HOMOGENEOUS = 0.95  # within 5% of the best single drafter on a homogeneous workload


def describe(family: str, variant: str, workload: str, relation: str) -> tuple[str, float]:
    """A target's words and threshold: ``relation`` is the reference ("plain", "best_fixed" or
    "best_single")."""
    if relation == "plain":
        return (f"GoodputPolicy {variant} never more than 3% slower than plain decoding at any batch size",
                GOODPUT_VS_PLAIN)
    if relation == "best_fixed":
        name = f"GoodputPolicy {variant}" if family == "goodput" else "BatchAdaptivePolicy"
        return f"{name} within 5% of the best fixed length in hindsight at every batch size", WITHIN_BEST_FIXED
    if workload == "mixed":
        return f"BanditPolicy {variant} beats the best single drafter by >= 10% tokens/s", BANDIT_MIXED_GAIN
    return f"BanditPolicy {variant} within 5% of the best single drafter", BANDIT_HOMOGENEOUS


# the targets in report order: (family, variant or None for every variant measured, reference)
TARGET_ORDER = [*(t for v in ("per-row", "finish") for t in (("goodput", v, "plain"), ("goodput", v, "best_fixed"))),
                ("batch_adaptive", "", "best_fixed"), ("bandit", None, "best_single")]


def verdict(family: str, variant: str, workload: str, relation: str, per_batch: dict, identical: bool,
            source: str) -> dict:
    """One target's entry: per_batch maps batch size -> ratio (None: the policy's run failed)."""
    description, threshold = describe(family, variant, workload, relation)
    measured = [v for v in per_batch.values() if v is not None]
    failed = len(measured) < len(per_batch)
    worst = min(measured) if measured else float("nan")
    return {"target": description, "policy": family, "variant": variant, "workload": workload, "reference": relation,
            "source": source, "threshold": threshold, "ratio": worst,
            "per_batch": {str(b): v for b, v in sorted(per_batch.items())}, "identical": identical,
            "met": bool(measured) and not failed and identical and worst >= threshold}


def policy_targets(result: dict) -> list[dict]:
    """Issue 5's targets from the grid's median passes, each met or not, with the worst ratio
    over the measured batch sizes and the ratio at each one. A policy's ratio at a batch size is
    its tokens/s over the reference's at the same workload and batch size:

    - GoodputPolicy (each variant, each workload) against plain decoding: >= 0.97;
    - GoodputPolicy and BatchAdaptivePolicy against the best fixed length of their own drafter
      in hindsight (the fastest of plain decoding and every measured k with that drafter): >= 0.95;
    - BanditPolicy (each variant) against the best single drafter (the fastest fixed run of one
      of its drafters at its own draft length): >= 1.10 on the mixed workload, >= 0.95 on each
      homogeneous one.

    A target is met only when every measured batch size meets it and every policy output there
    was identical to plain decoding; a failed policy run fails it."""
    rows = result.get("rows", [])
    ok = [r for r in rows if not r.get("error")]

    def candidates(row: dict, relation: str) -> list[dict]:
        return [r for r in ok if (r["workload"], r["batch"]) == (row["workload"], row["batch"]) and head_to_head.is_reference(
            relation, r["family"], r["drafters"], r["length"], row["drafters"], row["length"])]

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    found = []
    for family, variant, relation in TARGET_ORDER:
        variants = [variant] if variant is not None else dict.fromkeys(r["variant"] for r in rows if r["family"] == family)
        for v in variants:
            for w in workloads:
                mine = [r for r in rows if (r["family"], r["variant"], r["workload"]) == (family, v, w)]
                per_batch, identical = {}, True
                for row in sorted(mine, key=lambda r: r["batch"]):
                    if row.get("error"):
                        per_batch[row["batch"]] = None
                        continue
                    reference = max(candidates(row, relation), key=lambda r: r["tokens_per_s"], default=None)
                    if reference is not None:
                        per_batch[row["batch"]] = row["tokens_per_s"] / reference["tokens_per_s"]
                        identical &= bool(row.get("identical"))
                if per_batch:
                    found.append(verdict(family, v, w, relation, per_batch, identical, "grid"))
    return found


def head_to_head_targets(result: dict) -> list[dict]:
    """The targets of the policies timed head to head (``head_to_head.py``), from each
    comparison's median paired ratio over its rounds, at every (workload, batch size) cell where
    the policy has a grid run. A cell reads as failed (None) where the policy's grid run failed,
    where its rounds failed or did not run (no record: no rounds asked for, or a part from before
    them), or where the comparison is missing; identical needs the policy's grid run and every one
    of its head-to-head passes identical to plain decoding. [] for results without rounds."""
    records = result.get("head_to_head") or []
    if not records:
        return []
    rows = result.get("rows", [])
    by_cell = {(r["workload"], r["batch"]): r for r in records}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    found = []
    for family, variant in head_to_head.CONTENDERS:
        for relation in head_to_head.REFERENCES[family]:
            for w in workloads:
                mine = sorted((r for r in rows if (r["family"], r["variant"], r["workload"]) == (family, variant, w)),
                              key=lambda r: r["batch"])
                per_batch, identical = {}, True
                for row in mine:
                    record = by_cell.get((w, row["batch"]))
                    comparison = None if row.get("error") or record is None else next(
                        (c for c in record["comparisons"] if c["policy"] == row["method"] and c["reference"] == relation), None)
                    if comparison is None:
                        per_batch[row["batch"]] = None
                        continue
                    per_batch[row["batch"]] = comparison["median"]
                    identical &= bool(comparison["identical"]) and bool(row.get("identical"))
                if per_batch:
                    found.append(verdict(family, variant, w, relation, per_batch, identical, "head-to-head"))
    return found


def kind_oracle_bound(result: dict) -> dict[int, float]:
    """What any drafter selection could gain on the mixed workload, per batch size: the best
    drafter for each request kind (the fastest fixed run at the bandit's length on the `copy`
    and on the `continuation` workload) against the best single drafter for both, each
    workload's tokens/s combined as the mixed workload's shares of time (fraction f of copy
    requests: 1 / (f / r_copy + (1 - f) / r_continuation)). An estimate from the homogeneous
    workloads' requests: at batch 1 every request is a call of its own and the two kinds' times
    add; at larger batches serving both kinds in one batch also pays for both drafters, so a
    selection there gains if anything less. The bandit's 1.10 target on `mixed` has no room
    when this is well below 1.10."""
    settings = result.get("settings", {})
    length, fraction = settings.get("bandit_length", 4), settings.get("mixed_fraction", 0.5)
    rates: dict[tuple[int, str], dict[str, float]] = {}
    for r in result.get("rows", []):
        if r["family"] == "fixed" and r["length"] == length and not r.get("error") and r["workload"] in ("copy", "continuation"):
            rates.setdefault((r["batch"], r["workload"]), {})[r["drafters"][0]] = r["tokens_per_s"]
    mix = lambda copy_rate, continuation_rate: 1.0 / (fraction / copy_rate + (1.0 - fraction) / continuation_rate)
    bound = {}
    for batch in sorted({b for b, _ in rates}):
        copy, continuation = rates.get((batch, "copy"), {}), rates.get((batch, "continuation"), {})
        drafters = sorted(set(copy) & set(continuation))
        if not drafters:
            continue
        best_single = max(mix(copy[d], continuation[d]) for d in drafters)
        bound[batch] = mix(max(copy[d] for d in drafters), max(continuation[d] for d in drafters)) / best_single
    return bound


def fastest_pass_rows(rows: list[dict]) -> list[dict]:
    """The rows with tokens/s from each run's fastest timed pass (every pass emits the same
    tokens: their outputs are compared)."""
    return [{**r, "tokens_per_s": r["tokens"] / min(r["pass_seconds"])} if not r.get("error") and r.get("pass_seconds")
            else r for r in rows]


SAME_DRAFT_TOLERANCE = 0.02  # mean draft tokens within which a policy's run counts as a fixed pair's double


def same_decision_pairs(rows: list[dict]) -> list[dict]:
    """An A/A check of the timing: every BatchAdaptivePolicy run that took as many steps as a
    fixed pair of its drafter, with the same mean draft length (within SAME_DRAFT_TOLERANCE
    tokens), so that both did the same decoding work (its table held that pair's length).
    BatchAdaptivePolicy only: its lengths follow its table, so every pass does the same work,
    where GoodputPolicy's choices may differ from pass to pass (the counts are the median
    pass's). Runs whose output differed from plain decoding are left out. Their ratio should
    be 1 up to the machine's noise: its spread is the gap between two runs that noise alone explains.
    -> [{workload, batch, method, fixed, median_ratio, fastest_ratio (None without passes)}]."""
    usable = [r for r in rows if not r.get("error") and r.get("steps") and r.get("identical") is not False]
    fixed = [r for r in usable if r["family"] == "fixed"]
    pairs = []
    for run in usable:
        if run["family"] != "batch_adaptive":
            continue
        twin = next((f for f in fixed if (f["workload"], f["batch"], f["drafters"], f["steps"]) ==
                     (run["workload"], run["batch"], run["drafters"], run["steps"])
                     and abs(f["mean_draft_tokens"] - run["mean_draft_tokens"]) <= SAME_DRAFT_TOLERANCE), None)
        if twin is None:
            continue
        passes = run.get("pass_seconds") and twin.get("pass_seconds")
        pairs.append({"workload": run["workload"], "batch": run["batch"], "method": run["method"], "fixed": twin["method"],
                      "median_ratio": run["tokens_per_s"] / twin["tokens_per_s"],
                      "fastest_ratio": min(twin["pass_seconds"]) / min(run["pass_seconds"]) if passes else None})
    return pairs


def by_batch_text(target: dict) -> str:
    """A target's ratio at each batch size, for the report's tables."""
    return ", ".join(f"{b}: {'failed' if v is None else f'{v:.2f}'}" for b, v in target["per_batch"].items())


def target_table(targets: list[dict]) -> list[str]:
    """The report's table of targets (policy_targets' or head_to_head_targets' entries)."""
    lines = ["| target | workload | worst ratio | ratio by batch size | identical | met |", "|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} (needs {t['threshold']:.2f}) | {t['workload']} | {t['ratio']:.2f} | {by_batch_text(t)} | "
                     f"{'yes' if t['identical'] else 'no'} | {'yes' if t['met'] else 'no'} |")
    return lines
