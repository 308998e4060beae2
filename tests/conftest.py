import os

# One thread for torch and the BLAS libraries unless the caller chose: the tests' models are tiny,
# and on a two-core machine thread pools cost more than they save (the CPU suite ran 189 s with
# one thread against 233 s with two); the README's command runs one test process per core (-n 2)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
