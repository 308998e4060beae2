"""The benchmark harness runs end to end on CPU (tiny zoo) and writes JSON, markdown and a plot.
A smoke test of the harness, not a timing: no figure is asserted."""

import json

from specdec.__main__ import main


def test_bench_smoke(tiny_zoo_root, tmp_path, capsys):
    argv = ["bench", "--preset", "tiny", "--device", "cpu", "--quick", "--max-new-tokens", "12",
            "--zoo-dir", str(tiny_zoo_root / "tiny"), "--out", str(tmp_path)]
    assert main(argv) == 0
    [json_path] = tmp_path.glob("bench_tiny_cpu_*.json")
    result = json.loads(json_path.read_text())
    rows = result["rows"]
    ours = [r for r in rows if r["family"] == "specdec"]
    assert {r["batch"] for r in ours} == {1, 16}
    assert all(not r["error"] for r in ours)
    # plain decoding is the reference; everything else equals it exactly (float32 on CPU)
    assert all(r["identical"] is None if r["method"].startswith("specdec plain") else r["identical"] for r in ours)
    peer_names = {r["method"] for r in rows if r["family"] == "peer"}
    assert {"HF eager generate", "HF prompt lookup"} <= peer_names
    assert any(name.startswith("HF assisted generation") for name in peer_names)
    assert all(r["identical"] for r in rows if r["family"] == "peer")
    assert result["environment"]["commit"] and result["environment"]["command"].startswith("python -m specdec")
    assert (tmp_path / json_path.with_suffix(".png").name).stat().st_size > 1000
    assert "| method | batch | tok/s |" in json_path.with_suffix(".md").read_text()
