"""The driver's advise/prefetch calls build the right cudaMemLocation (fake cuda-bindings, CPU only)."""

import enum
import types

import pytest

from um_lab.cuda import driver


class _Loc:
    type = None
    id = None


@pytest.fixture
def fake_runtime(monkeypatch):
    rt = types.SimpleNamespace(calls=[])
    rt.cudaMemLocation = _Loc
    rt.cudaMemLocationType = enum.IntEnum("T", {"cudaMemLocationTypeDevice": 1, "cudaMemLocationTypeHost": 2})
    rt.cudaMemoryAdvise = enum.IntEnum("A", {"cudaMemAdviseSetPreferredLocation": 3, "cudaMemAdviseSetAccessedBy": 5})

    def mem_advise(ptr, n, advice, loc):  # CUDA 13 name: location-taking, no _v2
        rt.calls.append(("advise", ptr, n, int(advice), int(loc.type), loc.id))
        return (0,)

    def prefetch(ptr, n, loc, flags, stream):
        rt.calls.append(("prefetch", ptr, n, int(loc.type), loc.id, flags, stream))
        return (0,)

    rt.cudaMemAdvise = mem_advise
    rt.cudaMemPrefetchAsync = prefetch
    monkeypatch.setattr(driver, "_cudart", lambda: rt)
    return rt


def test_named_calls_translate_to_location_calls(fake_runtime):
    driver.advise(4096, 8192, "SetPreferredLocation", "cpu", 3)
    driver.advise(4096, 8192, "SetAccessedBy", "gpu", 3)
    driver.prefetch(4096, 8192, "gpu", 3, stream=77)
    driver.prefetch(4096, 8192, "cpu", 3)
    assert fake_runtime.calls == [
        ("advise", 4096, 8192, 3, 2, 0),  # host location ignores the device index
        ("advise", 4096, 8192, 5, 1, 3),
        ("prefetch", 4096, 8192, 1, 3, 0, 77),
        ("prefetch", 4096, 8192, 2, 0, 0, 0),
    ]


def test_cuda_12_v2_names_are_preferred_and_errors_raise(fake_runtime):
    fake_runtime.cudaMemAdvise_v2 = lambda ptr, n, advice, loc: (fake_runtime.calls.append("v2"), (1,))[1]
    with pytest.raises(RuntimeError, match="cudaMemAdvise"):
        driver.advise_raw(0, 1, 3, 1, 0)
    assert fake_runtime.calls == ["v2"]
