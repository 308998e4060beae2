"""The main job runs end to end on the zoo and every speculative output equals plain decoding."""

import json

from specdec.__main__ import main
from specdec.demo import HEADER, READING


def test_demo_table_is_identical_everywhere(tiny_zoo_root, tmp_path, capsys):
    path = tmp_path / "demo.json"
    argv = ["demo", "--preset", "tiny", "--zoo-dir", str(tiny_zoo_root / "tiny"), "--max-new-tokens", "12",
            "--num-prompts", "4", "--prompt-tokens", "48", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    assert result["environment"]["command"].startswith("python -m specdec") and result["environment"]["torch"]
    rows = result["rows"]
    # plain decoding, prompt lookup and the tiny preset's two drafters, at batch 1 and 8
    assert {r["batch"] for r in rows} == {1, 8} and len(rows) == 8
    assert all(r["identical"] for r in rows) and result["plain_matches_hugging_face"]
    # plain decoding emits one token a step; drafting emits more where drafts are accepted (the tiny
    # preset's drafters are barely trained, but some method gets drafts accepted at both batch sizes)
    assert all(r["tau"] == 1.0 for r in rows if r["method"].startswith("plain"))
    assert all(max(r["tau"] for r in rows if r["batch"] == b) > 1.0 for b in (1, 8))
    printed = capsys.readouterr().out
    assert "equals Hugging Face generate() on prompt 0: yes" in printed
    # the line right under the table says what the speed-ups of tiny models mean
    lines = printed.splitlines()
    assert lines[lines.index(HEADER) + 2 + len(rows)] == READING


def test_zoo_prompts_export(tiny_zoo_root, tmp_path):
    out = tmp_path / "prompts.jsonl"
    assert main(["zoo", "prompts", "--preset", "tiny", "--zoo-dir", str(tiny_zoo_root / "tiny"), "--out", str(out),
                 "--count", "5", "--tokens", "40"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and all(r["id"].startswith("stdlib/") and r["prompt"].endswith("\n") for r in records)
