import sys
from pathlib import Path

import pytest
import torch

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
