"""The trees part's targets and table, from rows made by hand (the GPU run writes real ones)."""

from specdec.bench.report import markdown
from specdec.bench.trees import tree_targets


def row(method, shape, size, temperature, batch, tau, tokens_per_s, children=None, error=""):
    return dict(method=method, shape=shape, size=size, children=children, temperature=temperature, batch=batch,
                tokens=100, seconds=1.0, tokens_per_s=tokens_per_s, tau=tau, identical=None, agreement=float("nan"),
                error=error)


ROWS = [
    row("chain k=4", "chain", 4, 0.0, 1, 3.0, 1000.0), row("chain k=6", "chain", 6, 0.0, 1, 3.5, 900.0),
    row("tree 32", "tree", 32, 0.0, 1, 4.4, 1200.0), row("tree 64", "tree", 64, 0.0, 1, 4.0, 1100.0),
    row("tree 16", "tree", 16, 0.0, 1, 9.0, 9000.0, error="failed: not counted"),
    row("chain k=4", "chain", 4, 0.0, 16, 3.0, 5000.0), row("tree 32", "tree", 32, 0.0, 16, 4.4, 4000.0),
    row("tree 32 (sampled)", "tree", 32, 0.8, 1, 3.3, 80.0, "sampled"),
    row("tree 32 (top-k)", "tree", 32, 0.8, 1, 3.0, 90.0, "top-k"),
    row("tree 64 (sampled)", "tree", 64, 0.8, 1, 2.9, 80.0, "sampled"),
    row("tree 64 (top-k)", "tree", 64, 0.8, 1, 3.0, 90.0, "top-k"),
    row("chain k=4", "chain", 4, 0.8, 1, 2.5, 100.0),
]


def test_targets_compare_the_best_tree_with_the_best_chain():
    found = {t["target"]: t for t in tree_targets(ROWS)}
    tau = next(t for t in found.values() if "tau >= 1.2x" in t["target"])
    assert tau["value"] == round(4.4 / 3.5, 3) and tau["met"] is True  # the failed row's 9.0 is ignored
    speed = next(t for t in found.values() if "tok/s >= 1.15x" in t["target"])
    assert speed["value"] == round(1200 / 1000, 3) and speed["met"] is True
    real_q = next(t for t in found.values() if "real q" in t["target"])
    assert real_q["value"] == round(2.9 / 3.0, 3) and real_q["met"] is False  # the worst pair decides
    crossover = {t["target"][:6]: t["value"] for t in found.values() if "overtakes" in t["target"]}
    assert crossover == {"T=0.0:": 16, "T=0.8:": 1}
    assert len(found) == 5


def test_the_table_gives_ratios_to_the_best_chain():
    result = {"environment": {"command": "bench", "commit": "abc", "time": "now", "gpu": "GPU"}, "rows": [],
              "trees": {"drafter": "d", "spec": {"depth": 6, "branching": 4}, "rows": ROWS,
                        "targets": tree_targets(ROWS)}}
    text = markdown(result)
    assert "| 0.0 | 1 | tree 32 | 4.40 | 1200 | 1.26 | 1.20 | - |" in text
    assert "| 0.0 | 1 | tree 16 | failed: failed: not counted" in text
    assert "| method | batch | tok/s | vs specdec plain |" not in text  # no zoo table without zoo rows
