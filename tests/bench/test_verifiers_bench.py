"""The verifiers part (issue 35): a smoke run on the tiny zoo (CPU), whose three verifiers give the
same outputs with the padding each layout implies; its targets from rows made by hand; the
spread workload's lengths."""

import numpy as np

from specdec.batch import BatchState
from specdec.bench.common import BenchSettings
from specdec.bench.report import markdown
from specdec.bench.verifiers import SPREAD_MAX, SpreadLengths, run_verifiers, verifier_targets


def test_a_smoke_run_on_the_tiny_zoo(tiny_zoo_root):
    settings = BenchSettings(preset="tiny", device="cpu", batch_sizes=(4,), num_prompts=4, batch1_prompts=2,
                             prompt_tokens=24, max_new_tokens=8, repeats=1, zoo_dir=str(tiny_zoo_root / "tiny"),
                             parts=("verifiers",))
    result = run_verifiers(settings, log=lambda *_: None)
    rows = {(r["workload"], r["verifier"]): r for r in result["rows"]}
    assert not any(r["error"] for r in result["rows"])
    assert all(r["identical"] for r in result["rows"])  # every layout gives the padded verifier's output
    for workload in ("spread", "lookup"):
        padded, packed = rows[(workload, "padded")], rows[(workload, "padding-free")]
        assert packed["padding_fraction"] == 0
        assert rows[(workload, "decomposed 0")]["padding_fraction"] == 0  # the widest width with no padding
        for cost in ("0.25", "1"):  # never more padding than one piece a row
            assert 0 <= rows[(workload, f"decomposed {cost}")]["padding_fraction"] <= padded["padding_fraction"]
    assert rows[("spread", "padded")]["padding_fraction"] > 0.2  # lengths 0..6 in rows of one width: much padding
    env = {"command": "c", "commit": "x", "time": "t"}
    assert "| spread | 4 | decomposed 0.25 |" in markdown({"environment": env, "verifiers": result})


def test_targets_where_padding_wastes_over_thirty_percent():
    def row(workload, batch, verifier, padding, verify_ms):
        return dict(workload=workload, batch=batch, verifier=verifier, padding_fraction=padding, verify_ms=verify_ms,
                    error="")

    rows = [row("spread", 16, "padded", 0.45, 3.0), row("spread", 16, "padding-free", 0.0, 2.0),
            row("spread", 16, "decomposed 0", 0.0, 2.2), row("spread", 16, "decomposed 0.25", 0.04, 2.1),
            row("spread", 16, "decomposed 1", 0.2, 1.8),  # faster, but with 20% padding: not the one judged
            row("lookup", 16, "padded", 0.2, 3.0), row("lookup", 16, "padding-free", 0.0, 2.0),
            row("lookup", 16, "decomposed 0", 0.0, 1.9)]
    found = {t["target"]: t for t in verifier_targets(rows)}
    assert len(found) == 2  # lookup's padded layout wastes only 20%: no target there
    padding = found["spread, batch 16: decomposed padding <= 5% (padded wastes 45%)"]
    assert padding["met"] and padding["detail"] == "decomposed 0"
    speed = found["spread, batch 16: decomposed (padding <= 5%) verify step <= padding-free's"]
    assert not speed["met"] and speed["detail"] == "decomposed 0.25" and speed["value"] == 1.05  # 2.1 against 2.0


def test_spread_lengths_cover_every_length_and_repeat_with_the_seed():
    batch = BatchState([np.zeros(3, dtype=np.int64)] * 64, 8, np.arange(64), np.zeros(0, dtype=np.int64))
    first = SpreadLengths(seed=1).plan(batch, 1).num_draft_tokens
    assert set(first.tolist()) == set(range(SPREAD_MAX + 1))
    assert np.array_equal(first, SpreadLengths(seed=1).plan(batch, 1).num_draft_tokens)
