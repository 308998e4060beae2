import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_zoo_root(tmp_path_factory):
    """A zoo root holding the 'tiny' preset, built once per test session (seconds)."""
    from specdec.zoo import build

    root = tmp_path_factory.mktemp("zoo")
    build("tiny", out=root / "tiny", device="cpu", progress=False, log=lambda *_: None)
    return root
