"""The pipeline part (issue 35): a smoke run on tiny random shapes on the CPU. Pipelined and
unpipelined runs give the same greedy outputs, a pipelined cycle takes two micro-batch steps,
and the report says the second-GPU target was not measured when no second GPU is seen."""

from specdec.bench.pipeline import run
from specdec.bench.report import markdown

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96)


def test_a_smoke_run_on_tiny_shapes():
    result = run(batch_sizes=(4,), new_tokens=8, prompt_tokens=6, repeats=1, log=lambda *_: None, device="cpu",
                 pairs={"tiny": (TINY, {**TINY, "num_hidden_layers": 1})})
    rows = {row["pipeline"]: row for row in result["rows"]}
    assert set(rows) == {1, 2}
    assert rows[2]["identical"] and rows[2]["agreement"] == 1.0
    # random weights accept little: about one token a row-step; pipelined steps hold half the rows,
    # so there are about twice as many of them for the same tokens
    assert 1.5 <= rows[2]["steps"] / rows[1]["steps"] <= 2.5
    assert all(row["cycle_ms"] > 0 and row["draft_ms"] > 0 and row["verify_ms"] > 0 for row in rows.values())
    [target] = result["targets"]
    assert target["value"] == "not measured" and not target["met"]
    text = markdown({"environment": {"command": "c", "commit": "x", "time": "t"}, "pipeline": result})
    assert "| tiny | one device | 4 | 2 |" in text
