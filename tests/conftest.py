import os
import sys
from pathlib import Path

# Deterministic cuBLAS for the GPU tests that compare training bit for bit: it must be set before the first
# cuBLAS handle exists, so here, before any test runs (a no-op without a GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py

from fakes import FakePoolAPI, FakeRuntime, drain, install_fake_driver  # noqa: E402


@pytest.fixture
def env():
    """A fake CUDA driver behind the shim and fake torch pools: (source, driver, pool api, runtime)."""
    source, driver = install_fake_driver(cap=1 << 40)
    api, runtime = FakePoolAPI(), FakeRuntime()
    yield source, driver, api, runtime
    drain(source)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); run on the H200 test machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def third(tmp_path, monkeypatch):
    """A third backend (tests/test_backend_registry.py's module), registered by importing it as a user would;
    forgotten afterwards."""
    import importlib

    from test_backend_registry import THIRD_MODULE

    from um_lab.backend import backend_names, unregister_backend

    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "um_lab_third.py").write_text(THIRD_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("um_lab_third")
    try:
        yield module
    finally:
        if "third" in backend_names():  # a test may have unregistered it already
            unregister_backend("third")
        sys.modules.pop("um_lab_third", None)
