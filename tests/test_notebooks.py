"""The notebooks run top to bottom (at small settings) and are committed without outputs."""

from pathlib import Path

import pytest

# installed by the test extras (CI has them); the GPU image lacks them, so skip there, saying why
nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the [test] extras (nbformat, nbclient)")
NotebookClient = pytest.importorskip("nbclient", reason="the notebook tests need the [test] extras").NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


def test_quickstart_runs(tiny_zoo_root, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_NOTEBOOK_PRESET", "tiny")
    monkeypatch.setenv("SPECDEC_ZOO_DIR", str(tiny_zoo_root))
    path = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert "prompt lookup:" in outputs and "tau" in outputs
    assert any("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))


def test_trees_notebook_runs(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("SPECDEC_TREES_RESULTS", str(root / "benchmarks" / "results"))
    notebook = nbformat.read(root / "notebooks" / "03_trees.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    # the table's header (the targets also say "best chain", so look for the line that has both)
    assert any("best chain" in line and "tree/chain" in line for line in outputs.splitlines())
    assert any("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))


def test_long_context_notebook_runs(tiny_zoo_root, tmp_path, monkeypatch):
    """On a tiny-zoo smoke run of the long-context bench (the committed GPU results are drawn the same way)."""
    from specdec.bench.long_context import main

    results = tmp_path / "results"
    assert main(["--preset", "tiny", "--device", "cpu", "--contexts", "64,160", "--batch-sizes", "1,3", "--ks", "2",
                 "--max-new-tokens", "6", "--table-context", "64", "--zoo-dir", str(tiny_zoo_root / "tiny"),
                 "--out", str(results)]) == 0
    monkeypatch.setenv("SPECDEC_LONG_CONTEXT_RESULTS", str(results))
    root = Path(__file__).resolve().parents[1]
    notebook = nbformat.read(root / "notebooks" / "04_long_context.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert "SPIReDrafter" in outputs and "tau" in outputs and "MagicDec's regime" in outputs
    assert any("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))


def test_serving_notebook_runs(tiny_zoo_root, tmp_path, monkeypatch):
    """On a tiny-zoo smoke run of the serve bench (the committed GPU results are drawn the same way)."""
    from specdec.bench.serve import main

    results = tmp_path / "results"
    assert main(["--preset", "tiny", "--device", "cpu", "--num-requests", "4", "--prompt-tokens", "24",
                 "--max-new-tokens", "5", "--max-rows", "2", "--loads", "0.5,2", "--methods", "k1,goodput",
                 "--repeats", "2", "--zoo-dir", str(tiny_zoo_root / "tiny"), "--out", str(results)]) == 0
    monkeypatch.setenv("SPECDEC_SERVE_RESULTS", str(results))
    root = Path(__file__).resolve().parents[1]
    notebook = nbformat.read(root / "notebooks" / "02_policies.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "serve_" in text and "not identical to plain decoding: []" in text
    assert "GoodputPolicy >= 1.5x faster than plain decoding" in markdown and "| 2.00 |" in markdown
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_spin_notebook_runs(tmp_path, monkeypatch):
    """On the committed GPU results of the verifiers and pipeline parts; its CPU cell checks that
    decomposition and pipelining leave greedy output unchanged."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("SPECDEC_SPIN_RESULTS", str(root / "benchmarks" / "results"))
    notebook = nbformat.read(root / "notebooks" / "05_spin.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "not identical to the padded verifier: []" in text
    assert "2 x micro max" in text and "8B target, 1B drafter" in text
    for name in ("decomposed", "pipelined", "both"):
        assert f"{name:<11} identical to plain decoding: True" in text
    assert "llama-30B on 2 GPUs, batch 1, speculative" in text and "of the 2-GPU bandwidth floor" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
