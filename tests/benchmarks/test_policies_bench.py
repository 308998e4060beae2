"""``python -m benchmarks.policies`` end to end on CPU (tiny zoo, --quick): it writes JSON,
markdown, two PNGs and the cost model, every run's output equals plain decoding on the same
requests and batch size, and the notebook that reads such a file runs. The targets function is
checked on synthetic rows, where each target's ratio is known. A smoke test, not a timing: no
figure of the CPU run is asserted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.policies.bench import (kind_oracle_bound, main, markdown, merge, pass_work, policy_targets,
                                      same_decision_pairs, timing_conditions)
from benchmarks.policies.targets import head_to_head_targets
from specdec.policies import CostModel, FixedPolicy


@pytest.fixture(scope="module")
def quick_run(tiny_zoo_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("policies")
    # one workload (mixed: copy and continuation requests both) at batch 1 and 8; the grid over
    # workloads is the same code looped (the merge test below covers several cells' results)
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--max-new-tokens", "12",
            "--repeats", "2", "--workloads", "mixed", "--zoo-dir", str(tiny_zoo_root / "tiny"), "--out", str(out)]
    assert main(argv) == 0
    [path] = [p for p in out.glob("policies_tiny_cpu_*.json") if p.name.count(".") == 1]
    return path


def test_the_old_command_points_to_the_new_one(capsys):
    """``python -m specdec bench --policies`` no longer runs the experiment: it exits with an error
    that names the command that does."""
    from specdec.__main__ import main as specdec_main

    assert specdec_main(["bench", "--policies", "--quick"]) == 2
    assert "python -m benchmarks.policies" in capsys.readouterr().err


def test_pass_work_sums_a_passs_calls():
    """Two calls: 10 + 6 steps; row-steps 30 + 20 (by kind), of which drafted 90 + 10 tokens ->
    mean draft 100 / 50 = 2.0; drafter 0 proposed in 25 + 0 row-steps, drafter 1 in 5 + 10."""
    output = lambda steps: SimpleNamespace(stats=SimpleNamespace(steps=steps))
    tally = lambda row_steps, drafted, drafting: SimpleNamespace(
        row_steps=np.array(row_steps, dtype=float), drafted_tokens=np.array(drafted, dtype=float),
        drafting=np.array(drafting, dtype=float))
    tallies = [tally([20, 10], [60, 30], [[20, 0], [5, 5]]), tally([0, 20], [0, 10], [[0, 0], [0, 10]])]
    steps, mean_draft, use = pass_work([output(10), output(6)], tallies)
    assert steps == 16 and mean_draft == pytest.approx(2.0) and use == pytest.approx([0.5, 0.3])
    assert pass_work([output(3)], [tally([0, 0], [0, 0], [[0, 0], [0, 0]])]) == (3, 0.0, [0.0, 0.0])


def test_quick_run_writes_every_output_and_matches_plain_decoding(quick_run):
    result = json.loads(quick_run.read_text())
    rows = result["rows"]
    families = {r["family"] for r in rows}
    assert families == {"plain", "fixed", "goodput", "batch_adaptive", "bandit"}
    assert {r["workload"] for r in rows} == {"mixed"}
    assert {r["batch"] for r in rows} == {1, 8}
    assert all(not r["error"] for r in rows), [r["error"] for r in rows if r["error"]]
    # plain decoding is the reference; every other run equals it token for token (float32 on CPU)
    assert all(r["identical"] is None if r["family"] == "plain" else r["identical"] is True for r in rows)
    # every fixed pair: prompt lookup and one model drafter at k in {2, 4}; four bandits; two goodputs
    fixed = {(r["drafters"][0], r["length"]) for r in rows if r["family"] == "fixed"}
    assert fixed == {(d, k) for d in result["drafters"] for k in (2, 4)} and len(result["drafters"]) == 2
    assert {r["variant"] for r in rows if r["family"] == "bandit"} == {"ucb", "epoch", "batch-level", "batch-call"}
    assert {r["variant"] for r in rows if r["family"] == "goodput"} == {"per-row", "finish"}
    assert sum(1 for r in rows if r["family"] == "fixed") == 4 * 2  # four pairs at two batch sizes
    # two timed passes per run, tokens/s from their median; both passes' outputs checked
    assert all(len(r["pass_seconds"]) == 2 and r["passes_agree"] and r["policy_ms_per_step"] > 0 for r in rows)
    # every pass's steps and mean draft; the row's own are the median pass's (the slower of two)
    assert all(len(r["pass_steps"]) == len(r["pass_mean_draft_tokens"]) == 2 for r in rows)
    slower = [int(np.argmax(r["pass_seconds"])) for r in rows]
    assert all(r["pass_steps"][i] == r["steps"] and r["pass_mean_draft_tokens"][i] == pytest.approx(r["mean_draft_tokens"])
               for r, i in zip(rows, slower))
    assert all(r["pass_mean_draft_tokens"] == [0.0, 0.0] for r in rows if r["family"] == "plain")
    assert all(r["pass_steps"][0] == r["pass_steps"][1] for r in rows if r["family"] == "fixed")  # fixed work every pass
    # the median pass call by call (batch 8: one call of 8 requests; batch 1: one call per request)
    assert all(len(r["call_steps"]) == len(r["call_mean_draft_tokens"]) == (1 if r["batch"] == 8 else 2) for r in rows)
    assert all(sum(r["call_steps"]) == r["steps"] for r in rows)
    assert all(("last_call_trace" in r) == (r["batch"] == 1 and r["family"] != "fixed") for r in rows)
    # every adaptive run traces its steps: [active rows, longest draft, mean draft, drafters used, ms]
    traced = [r for r in rows if r["family"] != "fixed"]
    assert traced and all(r["trace"] and all(len(t) == 6 and t[0] >= 1 and t[4] > t[5] >= 0 for t in r["trace"]) for r in traced)
    assert all(t[1] == 0 for t in rows[0]["trace"])  # plain decoding drafts nothing
    assert all(max(t[3] for t in r["trace"]) >= 1 for r in traced if r["family"] == "bandit")  # bandits draft
    goodput = [r for r in rows if r["family"] == "goodput"]
    assert all(set(r["calibration"]) == {"base_scale", "extra_scale"} for r in goodput)
    # the history (--quick: 4 held-out requests, 2 at batch 1) taught each learning policy before its passes
    given = {w: t["acceptance_rate"] for w, t in result["tau_profile"].items()}  # the prior each policy was made with
    assert all(r["learnt_at_start"]["prior"] == pytest.approx(given[r["workload"]]) for r in goodput)
    # a GoodputPolicy's step-time calibration is fed its history's steps, which a fresh policy's is not (at batch 8
    # the history is one call of 3 steps, a catch-up and a switch, which calibrate nothing)
    assert all(r["learnt_at_start"]["calibrated_steps"] > 0 for r in goodput if r["batch"] == 1)
    assert result["reused_files"] == 0  # no profile or history request shares a file with a measured one
    batch_bandits = [r for r in rows if r["variant"] in ("batch-level", "batch-call")]
    assert batch_bandits and all(sum(r["learnt_at_start"]["pulls"]) > 0 for r in batch_bandits)
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / max(r["pass_seconds"])) for r in rows)  # the slower middle
    # the mixed workload really mixes, and the bandits report what each kind of request used
    assert result["workloads"]["mixed"]["num_copy"] == result["workloads"]["mixed"]["num_continuation"] == 4
    bandit = next(r for r in rows if r["family"] == "bandit" and r["workload"] == "mixed")
    assert set(bandit["drafter_use"]) == {"copy", "continuation"}
    # environment, cost model (fitted in this run, and saved beside the results), tables, targets
    env = result["environment"]
    assert env["commit"] and env["command"].startswith("python -m benchmarks.policies")
    model = CostModel.from_dict(result["cost_model"])
    assert model.num_drafters == 2
    saved = CostModel.load(quick_run.with_name(quick_run.stem + ".cost_model.json"))
    assert saved.as_dict() == model.as_dict()
    assert set(result["tau_profile"]) == {"mixed"}
    assert {t["policy"] for t in result["targets"]} == {"goodput", "batch_adaptive", "bandit"}
    assert len(result["targets"]) == 2 * 2 + 1 + 4  # goodput variants x 2 references, batch-adaptive, bandits
    # each cell then timed its contenders and their references head to head (--quick: 2 rounds), losslessly
    records = result["head_to_head"]
    assert sorted((r["workload"], r["batch"]) for r in records) == sorted((w, b) for w in result["workloads"] for b in (1, 8))
    for record in records:
        assert record["rounds"] == 2 and all(e["identical"] and len(e["pass_seconds"]) == 2 for e in record["entries"])
        # each round's work: plain decoding drafts nothing, a fixed pair its length (less the rows' budget caps)
        for entry in record["entries"]:
            assert len(entry["pass_steps"]) == 2 and all(s > 0 for s in entry["pass_steps"])
            if entry["family"] == "plain":
                assert entry["pass_mean_draft_tokens"] == [0.0, 0.0]
            elif entry["family"] == "fixed":
                assert all(0 < k <= 8 for k in entry["pass_mean_draft_tokens"])
            if entry["family"] == "bandit":  # the call bandit: per round, its drafters' shares of row-steps
                assert all(set(use) == set(result["drafters"]) and 0 < sum(use.values()) <= 1
                           for use in entry["pass_drafter_use"])
        compared = [(c["family"], c["variant"], c["reference"]) for c in record["comparisons"]]
        assert compared[:-1] == [("goodput", "finish", "plain"), ("goodput", "finish", "best_fixed"),
                                 ("batch_adaptive", "", "best_fixed"), ("bandit", "batch-call", "best_single")]
        assert compared[-1] in (("fixed", "", "twin"), ("plain", "", "twin"))  # the best fixed pair, timed twice
    assert len(result["head_to_head_targets"]) == 2 + 1 + 1
    report = quick_run.with_suffix(".md").read_text()
    assert "## Targets" in report and "| target | workload | worst ratio |" in report and "## Targets, head to head" in report
    assert "What the adaptive policies chose head to head, round by round" in report
    assert "Batch sizes measured, by workload: mixed [1, 8]" in report and "Noise check" in report
    for suffix in ("", "_fixed"):
        assert quick_run.with_name(quick_run.stem + suffix + ".png").stat().st_size > 5000
    assert not list(quick_run.parent.glob("*.partial.json"))


def test_a_time_limit_skips_the_remaining_runs_and_still_reports(tiny_zoo_root, tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--max-new-tokens", "4",
            "--batch-sizes", "2", "--workloads", "mixed", "--lengths", "4", "--zoo-dir", str(tiny_zoo_root / "tiny"),
            "--out", str(tmp_path), "--time-limit-s", "0"]
    assert main(argv) == 0
    [path] = [p for p in tmp_path.glob("policies_*.json") if p.name.count(".") == 1]
    result = json.loads(path.read_text())
    assert result["rows"] == [] and len(result["skipped"]) == 1 + 2 + 7  # plain, two fixed, 2 goodput + batch-adaptive + 4 bandits
    assert "Skipped after the time limit: 10 runs" in path.with_suffix(".md").read_text()


def test_results_at_different_batch_sizes_merge_into_one_report(quick_run, tmp_path):
    """Split the quick run by batch size, as two GPU calls would write it; merging gives back its
    rows and targets; parts that overlap or differ in settings are refused."""
    whole = json.loads(quick_run.read_text())
    parts = []
    for batch in (8, 1):
        # the parts may differ in their head-to-head rounds (a per-part setting)
        part = {**whole, "settings": {**whole["settings"], "batch_sizes": [batch], "head_to_head_rounds": batch},
                "rows": [r for r in whole["rows"] if r["batch"] == batch],
                "head_to_head": [r for r in whole["head_to_head"] if r["batch"] == batch]}
        parts.append(tmp_path / f"part{batch}.json")
        parts[-1].write_text(json.dumps(part))
    assert main(["--merge", *map(str, parts), "--out", str(tmp_path), "--name", "merged"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted(map(json.dumps, merged["rows"])) == sorted(map(json.dumps, whole["rows"]))
    assert merged["targets"] == policy_targets(whole) and merged["settings"]["batch_sizes"] == [1, 8]
    assert sorted(map(json.dumps, merged["head_to_head"])) == sorted(map(json.dumps, whole["head_to_head"]))
    assert merged["head_to_head_targets"] == head_to_head_targets(whole) and merged["settings"]["head_to_head_rounds"] == [8, 1]
    assert len(merged["parts"]) == 2 and "part 2 of 2: batch sizes [1]" in (tmp_path / "merged.md").read_text()
    with pytest.raises(SystemExit, match="both measured batch 8"):
        main(["--merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path)])
    # the history's size at batch sizes above 1 may differ from a part of batch 1 alone (which
    # serves batch1_prompts); starting fresh (0) may not
    other = {**json.loads(parts[1].read_text())}
    for history, merges in ((whole["settings"]["history_prompts"] + 4, True), (0, False)):
        other["settings"] = {**other["settings"], "history_prompts": history}
        parts[1].write_text(json.dumps(other))
        argv = ["--merge", *map(str, parts), "--out", str(tmp_path), "--name", "history"]
        if merges:
            assert main(argv) == 0
        else:
            with pytest.raises(SystemExit, match=r"settings differ in \['history_prompts'\]"):
                main(argv)
    # parts of batch sizes above 1 must agree with each other, whichever part comes first
    history = whole["settings"]["history_prompts"]
    other["settings"] = {**other["settings"], "history_prompts": history + 4}
    parts[1].write_text(json.dumps(other))
    third = {**json.loads(parts[0].read_text())}
    third["settings"] = {**third["settings"], "batch_sizes": [16], "history_prompts": history + 8}
    third["rows"] = [{**r, "batch": 16} for r in third["rows"]]
    parts.append(tmp_path / "part16.json")
    parts[2].write_text(json.dumps(third))
    for order in ([1, 0, 2], [0, 1, 2]):
        with pytest.raises(SystemExit, match=r"settings differ in \['history_prompts'\]"):
            main(["--merge", *(str(parts[i]) for i in order), "--out", str(tmp_path)])
    merged = merge([json.loads(parts[i].read_text()) for i in (1, 0)])
    assert merged["settings"]["history_prompts"] == history  # from the part that used it
    parts.pop()
    # cheap passes may be timed more often in one part, and each part profiles its own batch
    # sizes: repeats and the profile's size are recorded per part
    other["settings"] = {**other["settings"], "history_prompts": history, "repeats": 9, "profile_prompts": 3,
                         "tau_profile_repeats": 2}
    merged = merge([json.loads(p.read_text()) for p in parts[:1]] + [other])
    assert merged["settings"]["repeats"] == [whole["settings"]["repeats"], 9]
    assert merged["settings"]["profile_prompts"] == [whole["settings"]["profile_prompts"], 3]
    assert merged["settings"]["tau_profile_repeats"] == [whole["settings"]["tau_profile_repeats"], 2]
    other["settings"] = {**other["settings"], "profile_prompts": whole["settings"]["profile_prompts"],
                         "tau_profile_repeats": whole["settings"]["tau_profile_repeats"]}
    assert f"Timing: {whole['settings']['repeats']}/9 (by part) passes per run" in timing_conditions(merged["settings"], None)
    other["settings"] = {**other["settings"], "repeats": whole["settings"]["repeats"], "max_new_tokens": 99}
    parts[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"settings differ in \['max_new_tokens'\]"):
        main(["--merge", *map(str, parts), "--out", str(tmp_path)])


def test_a_workload_a_part_skipped_merges_from_another_part(quick_run, tmp_path):
    """A part whose time limit skipped one workload at a batch size, and a part that measured
    just that workload there (``--workloads``): the merge holds every row once, and nothing
    skipped."""
    whole = json.loads(quick_run.read_text())
    last = whole["rows"][-1]["workload"]
    cell = lambda r: r["batch"] == 1 and r["workload"] == last
    first = {**whole, "rows": [r for r in whole["rows"] if not cell(r)],
             "skipped": [{"workload": r["workload"], "batch": r["batch"], "method": r["method"]}
                         for r in whole["rows"] if cell(r)]}
    second = {**whole, "settings": {**whole["settings"], "batch_sizes": [1], "workloads": [last]},
              "rows": [r for r in whole["rows"] if cell(r)], "skipped": []}
    merged = merge([first, second])
    assert sorted(map(json.dumps, merged["rows"])) == sorted(map(json.dumps, whole["rows"]))
    assert merged["skipped"] == [] and merged["targets"] == policy_targets(whole)
    assert merged["settings"]["workloads"] == whole["settings"]["workloads"]
    with pytest.raises(ValueError, match=f"both measured batch 1 of workload '{last}'"):
        merge([whole, second])


# --- the targets, on synthetic rows --------------------------------------------------------------
def _row(workload, batch, family, tokens_per_s, variant="", drafters=(), length=0, identical=True, error=""):
    return {"workload": workload, "batch": batch, "family": family, "variant": variant, "drafters": list(drafters),
            "length": length, "method": f"{family} {variant} {'/'.join(drafters)} {length}",
            "tokens_per_s": tokens_per_s, "identical": None if family == "plain" else identical, "error": error,
            "tau": 1.0, "mean_draft_tokens": 0.0, "drafter_use": {}}


def synthetic_rows(goodput=(99.0, 198.0), adaptive=(120.0, 190.0), bandit_mixed=(150.0, 250.0),
                   bandit_copy=(135.0, 220.0)):
    """Two batch sizes (1, 8), workloads mixed and copy. Plain: 100 / 200 tok/s. Drafter d
    (the policies' own): k=2 -> 110 / 180, k=4 -> 130 / 170 (so the best fixed length is k=4 at
    batch 1 and plain decoding at batch 8); lookup at k=4: 120 / 210 on mixed, 140 / 230 on copy."""
    rows = []
    for workload in ("mixed", "copy"):
        lookup = (120.0, 210.0) if workload == "mixed" else (140.0, 230.0)
        for i, batch in enumerate((1, 8)):
            rows += [_row(workload, batch, "plain", (100.0, 200.0)[i]),
                     _row(workload, batch, "fixed", (110.0, 180.0)[i], drafters=("d",), length=2),
                     _row(workload, batch, "fixed", (130.0, 170.0)[i], drafters=("d",), length=4),
                     _row(workload, batch, "fixed", lookup[i], drafters=("lookup",), length=4),
                     _row(workload, batch, "goodput", goodput[i], "per-row", ("d",), 8),
                     _row(workload, batch, "batch_adaptive", adaptive[i], "", ("d",), 8),
                     _row(workload, batch, "bandit", (bandit_mixed if workload == "mixed" else bandit_copy)[i], "ucb",
                          ("lookup", "d"), 4)]
    return rows


def _by(targets, policy, workload, text):
    [found] = [t for t in targets if t["policy"] == policy and t["workload"] == workload and text in t["target"]]
    return found


def test_targets_report_worst_ratios_and_whether_each_is_met():
    targets = policy_targets({"rows": synthetic_rows()})
    assert len(targets) == 2 * 2 + 2 + 2  # goodput (two claims), batch-adaptive, bandit; two workloads each
    plain = _by(targets, "goodput", "mixed", "slower than plain")
    assert plain["per_batch"] == {"1": 0.99, "8": 0.99} and plain["ratio"] == 0.99 and plain["met"]
    best = _by(targets, "goodput", "mixed", "best fixed length")
    # references: k=4 (130) at batch 1, plain decoding (200) at batch 8 -- not lookup, another drafter
    assert best["per_batch"] == {"1": 99.0 / 130.0, "8": 198.0 / 200.0} and not best["met"]
    adaptive = _by(targets, "batch_adaptive", "copy", "best fixed length")
    assert adaptive["ratio"] == pytest.approx(120.0 / 130.0) and not adaptive["met"]
    mixed = _by(targets, "bandit", "mixed", ">= 10%")
    # the best single drafter at k=4: d at batch 1 (130 against lookup's 120), lookup at batch 8 (210)
    assert mixed["per_batch"] == {"1": 150.0 / 130.0, "8": 250.0 / 210.0} and mixed["met"]
    homogeneous = _by(targets, "bandit", "copy", "within 5%")
    assert homogeneous["ratio"] == pytest.approx(220.0 / 230.0) and homogeneous["met"]
    assert homogeneous["threshold"] == 0.95 and mixed["threshold"] == 1.10


def test_targets_fail_on_slow_policies_on_outputs_that_differ_and_on_failed_runs():
    targets = policy_targets({"rows": synthetic_rows(goodput=(96.0, 198.0), adaptive=(130.0, 200.0),
                                                     bandit_mixed=(130.0, 250.0), bandit_copy=(130.0, 220.0))})
    assert not _by(targets, "goodput", "copy", "slower than plain")["met"]  # 0.96 < 0.97 at batch 1
    assert _by(targets, "batch_adaptive", "mixed", "best fixed")["met"]  # equals the best fixed length
    assert not _by(targets, "bandit", "mixed", ">= 10%")["met"]  # 130 / 130 = 1.00 at batch 1
    assert not _by(targets, "bandit", "copy", "within 5%")["met"]  # 130 / 140 = 0.93 at batch 1
    rows = synthetic_rows()
    differs = next(r for r in rows if r["family"] == "bandit" and r["workload"] == "copy" and r["batch"] == 8)
    differs["identical"] = False  # fast but not lossless: not met
    failed = next(r for r in rows if r["family"] == "goodput" and r["workload"] == "mixed" and r["batch"] == 8)
    failed.update(error="RuntimeError: boom", tokens_per_s=float("nan"))
    targets = policy_targets({"rows": rows})
    homogeneous = _by(targets, "bandit", "copy", "within 5%")
    assert not homogeneous["met"] and not homogeneous["identical"]
    broken = _by(targets, "goodput", "mixed", "slower than plain")
    assert broken["per_batch"] == {"1": 0.99, "8": None} and broken["ratio"] == 0.99 and not broken["met"]


def test_kind_oracle_bound_mixes_the_best_drafter_per_kind_against_the_best_single_one():
    """copy / continuation tokens/s at k=4 -- batch 1: a 100 / 50, b 60 / 80 (each wins one
    kind); batch 8: a wins both (300 / 200 against 250 / 150), so nothing is to be gained."""
    rows = []
    for workload, a, b in (("copy", (100.0, 300.0), (60.0, 250.0)), ("continuation", (50.0, 200.0), (80.0, 150.0))):
        for i, batch in enumerate((1, 8)):
            rows += [_row(workload, batch, "fixed", a[i], drafters=("a",), length=4),
                     _row(workload, batch, "fixed", b[i], drafters=("b",), length=4),
                     _row(workload, batch, "fixed", 999.0, drafters=("a",), length=2)]  # another length: ignored
    bound = kind_oracle_bound({"settings": {"bandit_length": 4, "mixed_fraction": 0.5}, "rows": rows})
    # batch 1: the oracle takes a on copy and b on continuation; the best single drafter is b (68.6 against 66.7)
    assert bound[1] == pytest.approx(mix_f(100.0, 80.0, 0.5) / max(mix_f(100.0, 50.0, 0.5), mix_f(60.0, 80.0, 0.5)))
    assert bound[1] > 1.0 and bound[8] == pytest.approx(1.0)
    skewed = kind_oracle_bound({"settings": {"bandit_length": 4, "mixed_fraction": 0.9}, "rows": rows})
    assert skewed[1] == pytest.approx(mix_f(100.0, 80.0, 0.9) / max(mix_f(100.0, 50.0, 0.9), mix_f(60.0, 80.0, 0.9)))
    assert kind_oracle_bound({"rows": []}) == {}


def test_the_a_a_check_pairs_policy_runs_with_the_fixed_pair_that_did_their_work():
    """BatchAdaptivePolicy at batch 8 took the steps and mean draft of drafter d's k=4 (within
    0.02 tokens): paired, with the ratio of median tokens/s and of fastest passes. Not paired:
    at batch 1 it drafted 0.1 tokens more than k=4; at batch 2 as many steps as no fixed pair
    (one with the same mean draft took 45); at batch 4 a fixed pair of the same work but
    another drafter, or one that failed, or a run whose output differed; GoodputPolicy (its
    choices may differ from pass to pass) and bandits, whatever their counts."""
    def run(family, batch, tokens_per_s, steps, mean_draft, passes, drafters=("d",), length=4, variant="", **extra):
        row = _row("mixed", batch, family, tokens_per_s, variant=variant, drafters=drafters, length=length)
        return {**row, "steps": steps, "mean_draft_tokens": mean_draft, "pass_seconds": passes,
                "tokens": tokens_per_s * passes[len(passes) // 2], **extra}

    rows = [run("fixed", 8, 200.0, 40, 3.95, [1.0, 1.1, 1.3]),
            run("fixed", 1, 100.0, 50, 3.90, [2.0, 2.1]),
            run("fixed", 2, 100.0, 45, 3.90, [2.0, 2.1]),
            run("fixed", 4, 100.0, 30, 3.90, [2.0, 2.1], drafters=("e",)),
            run("fixed", 4, 100.0, 30, 3.90, [2.0, 2.1], error="RuntimeError: boom"),
            run("batch_adaptive", 8, 180.0, 40, 3.96, [1.05, 1.2, 1.25], length=8),
            run("batch_adaptive", 1, 100.0, 50, 4.00, [2.0, 2.1], length=8),
            run("batch_adaptive", 2, 100.0, 44, 3.90, [2.0, 2.1], length=8),
            run("batch_adaptive", 4, 100.0, 30, 3.90, [2.0, 2.1], length=8),
            run("goodput", 8, 190.0, 40, 3.95, [1.0, 1.1], length=8, variant="finish"),
            run("bandit", 8, 190.0, 40, 3.95, [1.0, 1.1], drafters=("d", "e"), variant="ucb")]
    pairs = same_decision_pairs(rows)
    assert len(pairs) == 1
    pair = pairs[0]
    assert (pair["batch"], pair["method"], pair["fixed"]) == (8, rows[5]["method"], rows[0]["method"])
    assert pair["median_ratio"] == pytest.approx(0.9) and pair["fastest_ratio"] == pytest.approx(1.0 / 1.05)
    report = markdown({"environment": {"command": "c", "commit": "abc", "time": "now", "cpu": "x", "torch": "2",
                                       "transformers": "5", "specdec": "0.1"},
                       "settings": {"preset": "tiny", "dtype": "auto", "max_new_tokens": 8, "batch1_prompts": 2,
                                    "num_prompts": 8}, "drafters": ["d", "e"], "policy_drafter": "d", "rows": rows})
    assert f"| mixed | 8 | {rows[5]['method']} | {rows[0]['method']} | 0.900 | 0.952 |" in report
    assert same_decision_pairs([r for r in rows if r["family"] != "fixed"]) == []
    rows[5]["identical"] = False  # an output that differed from plain decoding: not a timing check
    assert same_decision_pairs(rows) == []


def mix_f(copy, continuation, fraction):
    return 1.0 / (fraction / copy + (1.0 - fraction) / continuation)


def test_the_report_renders_synthetic_results():
    result = {"environment": {"command": "python -m benchmarks.policies", "commit": "abc", "time": "now",
                              "cpu": "x86_64", "torch": "2", "transformers": "5", "specdec": "0.1"},
              "settings": {"preset": "tiny", "dtype": "auto", "max_new_tokens": 8, "batch1_prompts": 2,
                           "num_prompts": 8},
              "drafters": ["lookup", "d"], "policy_drafter": "d", "rows": synthetic_rows()}
    report = markdown(result)
    assert "| BanditPolicy ucb beats the best single drafter by >= 10% tokens/s (needs 1.10) | mixed | 1.15 |" in report
    assert "## Tokens/s against plain decoding, workload `copy`" in report


def test_the_profile_and_pinning_options_reach_the_settings():
    """--tau-profile-tokens, --profile-repeats, --profile-prompts and --pin-cpu set their fields;
    --quick keeps an option given explicitly; a count below 1 is refused before anything is built."""
    from benchmarks.policies.bench import parser, settings_from

    settings = settings_from(parser().parse_args(["--tau-profile-tokens", "128", "--profile-repeats", "5", "--pin-cpu",
                                                  "--profile-prompts", "8"]))
    assert (settings.tau_profile_tokens, settings.tau_profile_repeats, settings.pin_cpu) == (128, 5, True)
    assert settings.profile_prompts == 8
    default = settings_from(parser().parse_args([]))
    assert (default.tau_profile_tokens, default.tau_profile_repeats, default.pin_cpu, default.prompt_tokens) == (128, 3, False, 256)
    assert default.profile_prompts == 16
    quick = settings_from(parser().parse_args(["--quick", "--profile-repeats", "2"]))
    assert quick.tau_profile_repeats == 2 and quick.prompt_tokens == 128 and quick.tau_profile_tokens == 32
    assert quick.profile_prompts == 4
    assert settings_from(parser().parse_args(["--quick", "--profile-prompts", "6"])).profile_prompts == 6
    for option in ("--tau-profile-tokens", "--profile-repeats", "--repeats", "--profile-prompts"):
        with pytest.raises(SystemExit, match="must be >= 1"):
            settings_from(parser().parse_args([option, "0"]))


def test_the_timing_condition_options_reach_the_settings():
    """By default the timed passes run with one torch thread and 30 ms of GPU work before each;
    --timing-threads 0 leaves the threads alone; negative values are refused."""
    from benchmarks.policies.bench import parser, settings_from

    default = settings_from(parser().parse_args([]))
    assert (default.timing_threads, default.gpu_warmup_ms) == (1, 30.0)
    chosen = settings_from(parser().parse_args(["--timing-threads", "0", "--gpu-warmup-ms", "0"]))
    assert (chosen.timing_threads, chosen.gpu_warmup_ms) == (None, 0.0)
    for option in ("--timing-threads", "--gpu-warmup-ms"):
        with pytest.raises(SystemExit, match="must be >= 0"):
            settings_from(parser().parse_args([option, "-1"]))


def test_the_history_holds_several_calls_at_each_batch_size():
    """At batch B > 1 the history is max(history_calls x B, history_prompts) held-out requests
    (8 calls by default: one call at batch 64 left the batch-scope bandits a visit or two per
    drafter, four left the one-drafter-per-call bandit exploring); batch 1 serves batch1_prompts; --history-calls below 1 is refused."""
    from benchmarks.policies.bench import history_size, parser, settings_from

    default = settings_from(parser().parse_args([]))
    assert default.history_calls == 8
    assert [history_size(default, b) for b in (1, 4, 16, 64)] == [default.batch1_prompts, 32, 128, 512]
    one = settings_from(parser().parse_args(["--history-calls", "1", "--history-prompts", "8"]))
    assert [history_size(one, b) for b in (4, 16)] == [8, 16]
    assert history_size(settings_from(parser().parse_args(["--history-prompts", "0"])), 16) == 0
    with pytest.raises(SystemExit, match="--history-calls >= 1"):
        settings_from(parser().parse_args(["--history-calls", "0"]))


def test_a_pass_holds_pass_calls_calls_at_each_batch_size_above_1(quick_run):
    """At batch B > 1 a timed pass serves max(pass_calls x B, num_prompts) requests (1 call of B
    by default, as before --pass-calls); batch 1 serves batch1_prompts; the report says so; a
    part from before --pass-calls merges with parts of --pass-calls 1 and not of 2; below 1 is refused."""
    from benchmarks.policies.bench import markdown, measured_size, parser, settings_from

    default = settings_from(parser().parse_args(["--num-prompts", "16"]))
    assert default.pass_calls == 1
    assert [measured_size(default, b) for b in (1, 4, 16, 64)] == [default.batch1_prompts, 16, 16, 64]
    four = settings_from(parser().parse_args(["--num-prompts", "16", "--pass-calls", "4"]))
    assert [measured_size(four, b) for b in (1, 4, 16, 64)] == [four.batch1_prompts, 16, 64, 256]
    with pytest.raises(SystemExit, match="--pass-calls must be >= 1"):
        settings_from(parser().parse_args(["--pass-calls", "0"]))
    whole = json.loads(quick_run.read_text())
    old = {**whole, "settings": {k: v for k, v in whole["settings"].items() if k != "pass_calls"},
           "rows": [r for r in whole["rows"] if r["batch"] == 8]}
    old["settings"]["batch_sizes"] = [8]
    assert "batch B: max(B, " in markdown(old)
    for calls, merges in ((1, True), (2, False)):
        new = {**whole, "settings": {**whole["settings"], "batch_sizes": [1], "pass_calls": calls},
               "rows": [r for r in whole["rows"] if r["batch"] == 1]}
        if merges:
            assert merge([old, new])["settings"]["batch_sizes"] == [1, 8]
        else:
            with pytest.raises(ValueError, match=r"settings differ in \['pass_calls'\]"):
                merge([old, new])
    assert "batch B: max(2B, " in markdown({**old, "settings": {**old["settings"], "pass_calls": 2}})


def test_the_history_repeats_its_own_files_rather_than_come_back_to_the_measured_ones(tiny_zoo_root):
    """When the held-out files run out, history_workloads repeats the history's own requests: none
    comes from a file before ``first`` (measured or profiled), and each workload has the rows asked."""
    from benchmarks.policies.bench import PolicyBenchSettings, history_workloads
    from benchmarks.policies.workloads import WorkloadGenerator
    from specdec.zoo import load

    tiny = load("tiny", out=tiny_zoo_root / "tiny")
    generator = WorkloadGenerator(tiny.heldout_texts(), tiny.tokenizer, prompt_tokens=96, seed=0)
    total = generator.available(10_000)
    first = total - 3  # three files left for the history
    earlier = {r.id for r in generator.standard(first)["mixed"].requests}
    history, files = history_workloads(generator, PolicyBenchSettings(), 20, first=first)
    assert files == 3 and set(history) == set(PolicyBenchSettings().workloads)
    for workload in history.values():
        ids = [r.id for r in workload.requests]
        assert len(ids) == 20 and len(set(ids)) == 3 and not set(ids) & earlier
    roomy, files = history_workloads(generator, PolicyBenchSettings(), 2, first=0)  # enough files: distinct ones
    assert files == 2 and len({r.id for r in roomy["copy"].requests}) == 2
    assert history_workloads(generator, PolicyBenchSettings(), 0, first=0) == ({}, 0)


class CallCountingPolicy(FixedPolicy):
    """A FixedPolicy that counts the generate() calls it served; the log holds, per call, the
    count including that call (a copy carries its original's count)."""

    log: list[tuple[str, int]] = []

    def __init__(self, label: str):
        super().__init__(2)
        self.label, self.calls, self._batch = label, 0, None

    def plan(self, batch, num_drafters):
        if batch is not self._batch:
            self._batch, self.calls = batch, self.calls + 1
            CallCountingPolicy.log.append((self.label, self.calls))
        return super().plan(batch, num_drafters)


def test_a_learning_policy_serves_the_history_and_each_pass_starts_from_a_copy():
    """measure_cell with a history of 4 requests at batch 2: a learning policy serves it (2
    calls) after its warm-up call, and each of the 2 timed passes starts from a copy of it (its
    2 calls are the 3rd and 4th that policy served, in both passes); a fixed policy serves no
    history (passes count 1 and 2); without a history the learning one starts fresh too."""
    from dataclasses import replace

    from benchmarks.policies.bench import Method, PolicyBenchSettings, measure_cell
    from specdec.drafters import PromptLookupDrafter
    from tests.tiny import make_model, random_prompts

    target = make_model("llama", seed=0)
    prompts, history = random_prompts(4, 96, seed=1, min_len=4), random_prompts(4, 96, seed=2, min_len=4)
    methods = [Method("fixed", "fixed", "", ("lookup",), 2, lambda w: CallCountingPolicy("fixed")),
               Method("learner", "bandit", "ucb", ("lookup",), 2, lambda w: CallCountingPolicy("learner"))]
    settings = replace(PolicyBenchSettings(device="cpu", max_new_tokens=6, repeats=2, warmup_tokens=2), timing_threads=None)
    for past, learner_calls in ((history, [1, 1, 2, 3, 4, 3, 4]), ([], [1, 1, 2, 1, 2])):
        CallCountingPolicy.log = []
        rows, confirmation = measure_cell(target, {"lookup": PromptLookupDrafter()}, methods, "mixed", prompts, np.zeros(4, dtype=np.int64),
                            2, settings, None, False, False, history=past)
        assert all(not r.get("error") for r in rows), rows
        assert [n for label, n in CallCountingPolicy.log if label == "fixed"] == [1, 1, 2, 1, 2]
        assert [n for label, n in CallCountingPolicy.log if label == "learner"] == learner_calls


def test_checkpoint_file_is_replaced_whole_and_leaves_no_temporary(tmp_path):
    from benchmarks.policies.bench import write_replacing

    path = tmp_path / "run.partial.json"
    write_replacing(path, '{"cells": 1}')
    write_replacing(path, '{"cells": 2}')
    assert path.read_text() == '{"cells": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.partial.json"]
