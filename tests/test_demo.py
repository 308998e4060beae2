"""The main job runs end to end and every speculative output equals plain decoding."""

import json

from specdec.__main__ import main


def test_demo_table_is_identical_everywhere(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--max-new-tokens", "16", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert {r["batch"] for r in rows} == {1, 8} and len(rows) == 6
    assert all(r["identical"] for r in rows)
    assert all(r["tau"] >= 1.0 for r in rows)
    assert "identical" in capsys.readouterr().out
