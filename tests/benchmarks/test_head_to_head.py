"""The policies bench's head-to-head rounds (benchmarks/policies/head_to_head.py): which entries a cell
times (the contenders, their references as the grid chose them, a twin), the rotated rounds,
the paired ratios and their median, the targets read from them (met, not met, failed, output
that differed), and measure_cell running them after the grid with every pass of a learning
policy starting from what its history taught it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.policies import head_to_head
from benchmarks.policies.bench import Method, PolicyBenchSettings, markdown, measure_cell
from benchmarks.policies.targets import head_to_head_targets
from specdec.policies import FixedPolicy
from tests.benchmarks.test_policies_bench import CallCountingPolicy, _row


def _method(name, family, variant="", drafters=(), length=0):
    return Method(name, family, variant, tuple(drafters), length, lambda w: FixedPolicy(length))


def cell_methods():
    """plain; d k=2, k=4; lookup k=4; GoodputPolicy per-row and finish (d); BatchAdaptivePolicy (d);
    the call bandit and the ucb bandit over (lookup, d) at k=4."""
    return [_method("plain", "plain"),
            _method("d k=2", "fixed", drafters=("d",), length=2),
            _method("d k=4", "fixed", drafters=("d",), length=4),
            _method("lookup k=4", "fixed", drafters=("lookup",), length=4),
            _method("goodput per-row", "goodput", "per-row", ("d",), 8),
            _method("goodput finish", "goodput", "finish", ("d",), 8),
            _method("batch adaptive", "batch_adaptive", "", ("d",), 8),
            _method("bandit call", "bandit", "batch-call", ("lookup", "d"), 4),
            _method("bandit ucb", "bandit", "ucb", ("lookup", "d"), 4)]


def test_the_plan_times_each_contender_against_the_grid_s_choice_of_its_references():
    methods = cell_methods()
    # d k=4 is d's fastest (plain slower); lookup k=4 beats d k=4, so it is the bandit's best single drafter
    rates = {0: 100.0, 1: 110.0, 2: 130.0, 3: 140.0, 4: 120.0, 5: 125.0, 6: 128.0, 7: 150.0, 8: 90.0}
    entries, comparisons = head_to_head.plan(methods, rates)
    names = [methods[i].name for i in entries]
    assert names == ["goodput finish", "plain", "d k=4", "batch adaptive", "bandit call", "lookup k=4", "d k=4"]
    pairs = [(names[a], names[b], relation) for a, b, relation in comparisons]
    assert pairs == [("goodput finish", "plain", "plain"), ("goodput finish", "d k=4", "best_fixed"),
                     ("batch adaptive", "d k=4", "best_fixed"), ("bandit call", "lookup k=4", "best_single"),
                     ("d k=4", "d k=4", "twin")]
    assert comparisons[-1][:2] == (6, 2)  # the twin compares with the first entry of its method
    # plain decoding fastest: it is the best fixed length and its own twin; a failed run is never chosen
    rates = {**rates, 0: 200.0}
    del rates[3]
    entries, comparisons = head_to_head.plan(methods, rates)
    pairs = [(methods[entries[a]].name, methods[entries[b]].name, r) for a, b, r in comparisons]
    assert ("goodput finish", "plain", "best_fixed") in pairs and ("plain", "plain", "twin") in pairs
    assert ("bandit call", "d k=4", "best_single") in pairs
    # a contender whose grid run failed is not timed; no contender at all: nothing to time
    without_adaptive = {k: v for k, v in rates.items() if k != 6}
    assert "batch adaptive" not in [methods[i].name for i in head_to_head.plan(methods, without_adaptive)[0]]
    assert head_to_head.plan(methods[:4], rates) == ([], [])
    with pytest.raises(ValueError, match="unknown reference"):
        head_to_head.reference_index(methods, rates, methods[5], "best")


def test_rounds_rotate_so_every_entry_runs_at_every_place():
    orders = head_to_head.round_orders(4, 8)
    assert len(orders) == 8 and all(sorted(o) == [0, 1, 2, 3] for o in orders)
    for entry in range(4):
        places = [o.index(entry) for o in orders]
        assert sorted(places) == [0, 0, 1, 1, 2, 2, 3, 3]
    seen = []
    passes = head_to_head.run_rounds(3, 2, lambda e: (seen.append(e) or (1.0 + e, [[e]])))
    assert seen == [0, 1, 2, 1, 2, 0] and [len(p) for p in passes] == [2, 2, 2] and passes[2][0] == (3.0, [[2]])

    def failing(entry):  # entry 2's second pass raises
        seen.append(entry)
        if entry == 2 and seen.count(2) == 2:
            raise ValueError("out of memory")
        return 1.0, [[entry]]

    seen = []
    with pytest.raises(RuntimeError, match=r"^policy c, round 2 of 3: ValueError: out of memory$"):
        head_to_head.run_rounds(3, 3, failing, labels=["a", "b", "policy c"])


def test_the_record_pairs_each_round_and_reads_the_median():
    """The policy's passes: 2 s, 1 s, 1.1 s for 10 tokens; the reference's: 1 s, 1 s, 1 s for 10
    -> paired ratios 0.5, 1.0, 0.909, median 0.909, where a ratio of medians would say the same
    here but the mean of tokens/s over the rounds would not."""
    methods = cell_methods()
    same = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    passes = [[(2.0, same), (1.0, same), (1.1, same)], [(1.0, same), (1.0, same), (1.0, same)]]
    record = head_to_head.record(methods, [5, 0], [(0, 1, "plain")], passes, plain_sequences=same)
    assert record["rounds"] == 3 and [e["method"] for e in record["entries"]] == ["goodput finish", "plain"]
    [comparison] = record["comparisons"]
    assert comparison["paired"] == pytest.approx([0.5, 1.0, 1.0 / 1.1])
    assert comparison["median"] == pytest.approx(1.0 / 1.1) and comparison["identical"]
    other = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 11]]  # one pass's output differs: not identical
    passes[0][2] = (1.1, other)
    record = head_to_head.record(methods, [5, 0], [(0, 1, "plain")], passes, plain_sequences=same)
    assert not record["entries"][0]["identical"] and record["entries"][1]["identical"]
    assert not record["comparisons"][0]["identical"]
    # a reference's output that differs is its entry's, not the policy's comparison's
    passes[0][2], passes[1][0] = (1.1, same), (1.0, other)
    record = head_to_head.record(methods, [5, 0], [(0, 1, "plain")], passes, plain_sequences=same)
    assert record["comparisons"][0]["identical"] and not record["entries"][1]["identical"]
    assert "pass_steps" not in record["entries"][0]  # passes of (seconds, sequences) say nothing of the work


def test_the_record_keeps_each_rounds_work_and_the_report_shows_the_policies():
    """Passes of (seconds, sequences, steps, mean draft, drafter shares): each entry keeps its
    steps, mean draft and, by name, its drafters' shares by round; the paired ratios read the
    first two only, and the report lists the adaptive policies' choices (not plain decoding's),
    with the shares where a policy has several drafters."""
    methods = cell_methods()
    same = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    passes = [[(2.0, same, 40, 3.5, [1.0]), (1.0, same, 30, 4.25, [0.75])],
              [(1.0, same, 40, 4.0, [0.25, 0.5]), (1.0, same, 20, 4.0, [0.0, 1.0])],
              [(1.0, same, 64, 0.0, []), (1.0, same, 64, 0.0, [])]]
    record = head_to_head.record(methods, [5, 7, 0], [(0, 2, "plain"), (1, 2, "plain")], passes, plain_sequences=same)
    finish, bandit, plain = record["entries"]
    assert finish["pass_steps"] == [40, 30] and finish["pass_mean_draft_tokens"] == [3.5, 4.25]
    assert finish["pass_drafter_use"] == [{"d": 1.0}, {"d": 0.75}]
    assert bandit["pass_drafter_use"] == [{"lookup": 0.25, "d": 0.5}, {"lookup": 0.0, "d": 1.0}]
    assert plain["pass_steps"] == [64, 64] and "pass_drafter_use" not in plain
    assert record["comparisons"][0]["paired"] == pytest.approx([0.5, 1.0])
    lines = head_to_head.markdown_lines([{**record, "workload": "copy", "batch": 4}], [])
    assert "| copy | 4 | goodput finish | 40 30 | 3.50 4.25 |  |" in lines
    assert "| copy | 4 | bandit call | 40 20 | 4.00 4.00 | lookup 25% d 50%; d 100% |" in lines
    assert not any(line.startswith("| copy | 4 | plain | 64") for line in lines)
    bandit["pass_drafter_use"][1] = dict(bandit["pass_drafter_use"][0])  # the same shares in every round: said once
    lines = head_to_head.markdown_lines([{**record, "workload": "copy", "batch": 4}], [])
    assert "| copy | 4 | bandit call | 40 20 | 4.00 4.00 | lookup 25% d 50%, every round |" in lines


def _record(workload, batch, finish_vs_plain, finish_vs_best, call_vs_single, twin=1.0, identical=True):
    comparison = lambda policy, family, variant, relation, ratio: {
        "policy": policy, "family": family, "variant": variant, "reference": relation, "reference_method": "ref",
        "paired": [ratio - 0.01, ratio, ratio + 0.02], "median": ratio, "identical": identical}
    return {"workload": workload, "batch": batch, "rounds": 3, "entries": [],
            "comparisons": [comparison("goodput finish", "goodput", "finish", "plain", finish_vs_plain),
                            comparison("goodput finish", "goodput", "finish", "best_fixed", finish_vs_best),
                            comparison("bandit call", "bandit", "batch-call", "best_single", call_vs_single),
                            comparison("d k=4", "fixed", "", "twin", twin)]}


def _grid_rows(cells, error_at=None):
    rows = []
    for workload, batch in cells:
        for method, family, variant in (("goodput finish", "goodput", "finish"), ("bandit call", "bandit", "batch-call")):
            failed = (workload, batch, family) == error_at
            rows.append({**_row(workload, batch, family, 100.0, variant, ("d",), 4, identical=not failed,
                                error="RuntimeError: boom" if failed else ""), "method": method})
    return rows


def test_targets_from_the_rounds_are_met_only_at_every_batch_size_with_identical_output():
    cells = [("mixed", 1), ("mixed", 8), ("copy", 1), ("copy", 8)]
    records = [_record("mixed", 1, 1.2, 0.97, 1.12), _record("mixed", 8, 1.01, 0.96, 1.11),
               _record("copy", 1, 1.3, 0.99, 0.97), _record("copy", 8, 0.96, 0.94, 0.99)]
    targets = head_to_head_targets({"rows": _grid_rows(cells), "head_to_head": records})
    by = {(t["policy"], t["reference"], t["workload"]): t for t in targets}
    assert len(targets) == 6 and all(t["source"] == "head-to-head" for t in targets)  # the twin is no target
    assert by["goodput", "plain", "mixed"]["met"] and by["goodput", "plain", "mixed"]["per_batch"] == {"1": 1.2, "8": 1.01}
    assert not by["goodput", "plain", "copy"]["met"] and by["goodput", "plain", "copy"]["ratio"] == 0.96  # 0.96 < 0.97
    assert by["goodput", "best_fixed", "mixed"]["met"] and not by["goodput", "best_fixed", "copy"]["met"]
    assert by["bandit", "best_single", "mixed"]["met"] and by["bandit", "best_single", "mixed"]["threshold"] == 1.10
    assert by["bandit", "best_single", "copy"]["met"] and by["bandit", "best_single", "copy"]["threshold"] == 0.95
    # an output that differed in the rounds, or in the grid run: not met however fast
    records[0]["comparisons"][2]["identical"] = False
    rows = _grid_rows(cells)
    rows[1 * 2]["identical"] = False  # goodput finish, mixed b8, in the grid
    by = {(t["policy"], t["reference"], t["workload"]): t for t in
          head_to_head_targets({"rows": rows, "head_to_head": records})}
    assert not by["bandit", "best_single", "mixed"]["met"] and not by["bandit", "best_single", "mixed"]["identical"]
    assert not by["goodput", "plain", "mixed"]["met"]
    # a policy whose grid run failed at a batch size, its comparison missing there, rounds that failed there
    # or none at all (no record): the target fails there, however the other batch sizes read
    records = [_record("mixed", 1, 1.2, 0.97, 1.12), _record("mixed", 8, 1.1, 1.0, 1.2)]
    by = {(t["policy"], t["reference"]): t for t in head_to_head_targets(
        {"rows": _grid_rows(cells[:2], error_at=("mixed", 8, "goodput")), "head_to_head": records})}
    assert by["goodput", "plain"]["per_batch"] == {"1": 1.2, "8": None} and not by["goodput", "plain"]["met"]
    assert by["bandit", "best_single"]["per_batch"] == {"1": 1.12, "8": 1.2} and by["bandit", "best_single"]["met"]
    for broken in ({**records[1], "comparisons": []}, {**records[1], "comparisons": [], "error": "RuntimeError: boom"}, None):
        cell_records = [records[0]] + ([broken] if broken is not None else [])
        by = {(t["policy"], t["reference"]): t for t in head_to_head_targets({"rows": _grid_rows(cells[:2]),
                                                                              "head_to_head": cell_records})}
        assert by["bandit", "best_single"]["per_batch"] == {"1": 1.12, "8": None} and not by["bandit", "best_single"]["met"]
        assert not by["goodput", "best_fixed"]["met"]
    assert head_to_head_targets({"rows": _grid_rows(cells[:2])}) == []  # results from before the rounds


def test_the_report_shows_the_head_to_head_targets_twins_and_comparisons():
    records = [_record("mixed", 1, 1.2, 0.97, 1.12, twin=0.99), _record("mixed", 8, 1.01, 0.96, 1.11, twin=1.02)]
    result = {"environment": {"command": "c", "commit": "abc", "time": "now", "cpu": "x", "torch": "2",
                              "transformers": "5", "specdec": "0.1"},
              "settings": {"preset": "tiny", "dtype": "auto", "max_new_tokens": 8, "batch1_prompts": 2, "num_prompts": 8},
              "drafters": ["lookup", "d"], "policy_drafter": "d", "rows": _grid_rows([("mixed", 1), ("mixed", 8)]),
              "head_to_head": records}
    report = markdown(result)
    assert "## Targets, head to head" in report and "## Targets, from the grid's median pass" in report
    assert ("| GoodputPolicy finish within 5% of the best fixed length in hindsight at every batch size (needs 0.95) | "
            "mixed | 0.96 | 1: 0.97, 8: 0.96 | yes | yes |") in report
    assert "mixed b1 0.990 (0.98-1.01); mixed b8 1.020 (1.01-1.04)" in report
    assert "| mixed | 8 | bandit call | best_single | ref | 1.110 | 1.10 1.11 1.13 | yes |" in report


def test_measure_cell_times_the_contenders_after_the_grid_each_pass_from_the_history_s_copy():
    """A cell of plain decoding, one fixed pair and a learning contender ("goodput finish") at
    batch 2 with a history of 4 requests and 3 head-to-head rounds: the contender serves its
    history once; its 2 grid passes and 3 head-to-head passes each start from a copy of it
    (each pass's 2 calls are its 3rd and 4th); every head-to-head pass equals plain decoding."""
    from specdec.drafters import PromptLookupDrafter
    from tests.tiny import make_model, random_prompts

    target = make_model("llama", seed=0)
    prompts, history = random_prompts(4, 96, seed=1, min_len=4), random_prompts(4, 96, seed=2, min_len=4)
    methods = [Method("plain", "plain", "", (), 0, lambda w: FixedPolicy(0)),
               Method("fixed lookup k=2", "fixed", "", ("lookup",), 2, lambda w: FixedPolicy(2)),
               Method("finish", "goodput", "finish", ("lookup",), 8, lambda w: CallCountingPolicy("learner"))]
    settings = replace(PolicyBenchSettings(device="cpu", max_new_tokens=6, repeats=2, warmup_tokens=2,
                                           head_to_head_rounds=3), timing_threads=None)
    CallCountingPolicy.log = []
    rows, record = measure_cell(target, {"lookup": PromptLookupDrafter()}, methods, "mixed", prompts,
                                np.zeros(4, dtype=np.int64), 2, settings, None, False, False, history=history)
    assert all(not r.get("error") for r in rows), rows
    assert [n for label, n in CallCountingPolicy.log] == [1, 1, 2] + [3, 4] * (2 + 3)
    # finish, plain, the best fixed (the fixed pair, or plain decoding again: one entry), its twin
    best = next(c["reference_method"] for c in record["comparisons"] if c["reference"] == "best_fixed")
    assert record["rounds"] == 3 and len(record["entries"]) == (3 if best == "plain" else 4)
    assert {e["method"] for e in record["entries"]} >= {"finish", "plain"}
    assert all(e["identical"] and len(e["pass_seconds"]) == 3 for e in record["entries"])
    relations = [c["reference"] for c in record["comparisons"]]
    assert relations == ["plain", "best_fixed", "twin"]
    assert all(len(c["paired"]) == 3 and c["median"] > 0 for c in record["comparisons"])
    # no rounds asked for: none timed
    _, none = measure_cell(target, {"lookup": PromptLookupDrafter()}, methods, "mixed", prompts,
                           np.zeros(4, dtype=np.int64), 2, replace(settings, head_to_head_rounds=0), None, False, False)
    assert none is None


def test_the_rounds_option_reaches_the_settings_and_refuses_a_negative_count():
    from benchmarks.policies.bench import parser, settings_from

    assert settings_from(parser().parse_args([])).head_to_head_rounds == 8
    assert settings_from(parser().parse_args(["--head-to-head-rounds", "0"])).head_to_head_rounds == 0
    assert settings_from(parser().parse_args(["--quick"])).head_to_head_rounds == 2
    assert settings_from(parser().parse_args(["--quick", "--head-to-head-rounds", "5"])).head_to_head_rounds == 5
    with pytest.raises(SystemExit, match="--head-to-head-rounds must be >= 0"):
        settings_from(parser().parse_args(["--head-to-head-rounds", "-1"]))


class FailsOnNthMake:
    """A factory of FixedPolicy(2) whose ``n``-th policy raises at its first plan."""

    def __init__(self, n):
        self.n, self.made = n, 0

    def __call__(self, workload):
        self.made += 1
        policy = FixedPolicy(2)
        if self.made == self.n:
            def broken(batch, num_drafters):
                raise RuntimeError("drafter crashed")
            policy.plan = broken
        return policy


def test_a_pass_that_raises_in_the_rounds_records_the_error_and_fails_the_cell_s_targets():
    """BatchAdaptivePolicy (no history: a fresh policy each pass) whose 4th policy raises: the
    warm-up and the 2 grid passes made 3, so the head-to-head's first round raises. The grid's
    rows stand; the record names the method and round; the cell's target fails."""
    from specdec.drafters import PromptLookupDrafter
    from tests.tiny import make_model, random_prompts

    target = make_model("llama", seed=0)
    prompts = random_prompts(4, 96, seed=1, min_len=4)
    methods = [Method("plain", "plain", "", (), 0, lambda w: FixedPolicy(0)),
               Method("fixed lookup k=2", "fixed", "", ("lookup",), 2, lambda w: FixedPolicy(2)),
               Method("adaptive", "batch_adaptive", "", ("lookup",), 8, FailsOnNthMake(4))]
    settings = replace(PolicyBenchSettings(device="cpu", max_new_tokens=6, repeats=2, warmup_tokens=2,
                                           head_to_head_rounds=3), timing_threads=None)
    rows, record = measure_cell(target, {"lookup": PromptLookupDrafter()}, methods, "mixed", prompts,
                                np.zeros(4, dtype=np.int64), 2, settings, None, False, False)
    assert all(not r.get("error") for r in rows), rows
    assert record["error"].startswith("RuntimeError: adaptive, round 1 of 3: RuntimeError: drafter crashed")
    assert record["rounds"] == 3 and record["comparisons"] == []
    grid = [{**_row("mixed", 2, m.family, 100.0, m.variant, m.drafters, m.length), "method": m.name} for m in methods]
    [target_row] = head_to_head_targets({"rows": grid, "head_to_head": [{"workload": "mixed", "batch": 2, **record}]})
    assert target_row["per_batch"] == {"2": None} and not target_row["met"]
    report = markdown({"environment": {"command": "c", "commit": "abc", "time": "now", "cpu": "x", "torch": "2",
                                       "transformers": "5", "specdec": "0.1"},
                       "settings": {"preset": "tiny", "dtype": "auto", "max_new_tokens": 8, "batch1_prompts": 2,
                                    "num_prompts": 8}, "drafters": ["lookup"], "policy_drafter": "lookup", "rows": grid,
                       "head_to_head": [{"workload": "mixed", "batch": 2, **record}]})
    assert "Head-to-head rounds that failed (their targets fail there): mixed b2: RuntimeError: adaptive, round 1" in report
