"""The long-context bench end to end on the tiny zoo (CPU, no graphs, nominal hardware): every
method runs, greedy outputs equal plain decoding's, and the report carries the tau table, the
modelled speed-ups and the targets. The zoo's SPIRe drafts are built, kept and loaded."""

import json

from specdec.bench.long_context import LongContextSettings, add_speedups, markdown, run, targets
from specdec.zoo import build, load


def test_the_zoo_builds_its_spire_drafts_once_and_loads_them(tiny_zoo_root):
    logs = []
    build("tiny", out=tiny_zoo_root / "tiny", device="cpu", progress=False, log=logs.append)
    assert not any("SPIRe" in line for line in logs)  # already built with the zoo: not again
    zoo = load("tiny", out=tiny_zoo_root / "tiny")
    assert sorted(zoo.spire) == ["spire", "spire-no-feedback", "spire-random-init"]
    assert zoo.spire["spire"].source_layers == (1,) and not zoo.spire["spire-no-feedback"].feedback
    manifest = json.loads((tiny_zoo_root / "tiny" / "spire" / "manifest.json").read_text())
    assert set(manifest["drafts"]) == set(zoo.spire)


def test_a_smoke_run_on_the_tiny_zoo(tiny_zoo_root, tmp_path):
    settings = LongContextSettings(preset="tiny", device="cpu", contexts=(64, 160), batch_sizes=(1, 3), ks=(2, 3),
                                   max_new_tokens=6, table_context=64, table_batch=2,
                                   zoo_dir=str(tiny_zoo_root / "tiny"), out=str(tmp_path))
    result = run(settings, log=lambda *_: None)
    rows = result["rows"]
    assert {(r["context"], r["batch"]) for r in rows} == {(64, 1), (64, 3), (160, 1), (160, 3)}
    assert {r["method"] for r in rows} == {"plain", "small", "self", "spire"}
    assert all(not r["error"] for r in rows)
    assert all(r["identical"] for r in rows if r["method"] != "plain")  # greedy: the target's own output
    assert all(r["speedup"] > 0 and r["modelled_speedup"] > 0 for r in rows if r["method"] != "plain")
    assert len(result["tau_table"]) == 2 + 3 + 1  # the tiny zoo's two small drafts, SPIRe and its ablations, MagicDec
    assert {t["target"].split(":")[0] for t in result["targets"]} >= {"MagicDec's regime"}
    text = markdown(result)
    assert "| 160 | 3 | SPIReDrafter" in text and "MagicDec" in text


def test_the_targets_read_the_best_k_of_each_method():
    rows = [dict(context=4096, batch=64, method=m, k=k, tokens_per_s=v, tau=2.0, draft_s=0.1, verify_s=0.2, error="")
            for m, k, v in [("plain", 0, 100.0), ("small", 2, 110.0), ("small", 4, 120.0), ("self", 4, 140.0),
                            ("spire", 2, 160.0), ("spire", 4, 150.0)]]
    found = {t["target"]: t for t in targets(rows)}
    assert found["SPIRe at batch 64, context 4096: >= 1.5x plain decoding"]["value"] == 1.6
    assert found["SPIRe at batch 64, context 4096: >= 1.35x the best small drafter"]["value"] == round(160 / 120, 3)
    assert found["SPIRe at batch 64, context 4096: >= 1.1x SelfSpeculativeDrafter"]["met"]


def test_targets_take_the_issues_batch_64_and_report_device_phase_ratios_beside_wall_clock():
    def row(batch, method, k, wall, device):
        return dict(context=4096, batch=batch, method=method, k=k, tokens_per_s=wall, device_tokens_per_s=device,
                    tau=2.0, draft_s=0.1, verify_s=0.2, error="")

    rows = [row(64, "plain", 0, 100.0, 200.0), row(64, "spire", 3, 130.0, 340.0),
            row(128, "plain", 0, 150.0, 300.0), row(128, "spire", 3, 300.0, 600.0)]
    add_speedups(rows)
    assert rows[1]["speedup"] == 1.3 and rows[1]["device_speedup"] == 1.7
    found = {t["target"]: t for t in targets(rows)}
    plain = found["SPIRe at batch 64, context 4096: >= 1.5x plain decoding"]
    assert plain["value"] == 1.3 and not plain["met"] and plain["detail"].endswith("device phases: 1.70x")
    assert not any("batch 128" in name for name in found)
