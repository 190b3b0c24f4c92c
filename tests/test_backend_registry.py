"""Backends are objects found in a registry: a third backend is one new module, with no edits elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import um_lab
from um_lab.backend import (
    backend_class,
    backend_names,
    get_backend,
    register_backend,
    resolve_backend_name,
    unregister_backend,
)
from um_lab.backend_base import Backend, BackendBase
from um_lab.errors import CudaUnavailableError, HostMemoryRefused, SpecError, UmLabError
from um_lab.types import RunSpec, StepRecord

TINY_MLP = {"width": 16, "depth": 1, "batch_size": 4}
REPO = str(Path(__file__).resolve().parent.parent)

#: the whole third backend: a module that defines it and registers it (the test writes it to a folder on
#: sys.path and imports it, as a user would)
THIRD_MODULE = '''
"""A third backend for um_lab: instant, deterministic step records."""

from um_lab.backend import register_backend
from um_lab.backend_base import BackendBase
from um_lab.types import DATA_TYPES, StepRecord

MS = {"um-default": 10.0, "gpu-first": 4.0}


class ThirdBackend(BackendBase):
    name = "third"

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.preflights = []

    def preflight(self, spec, case, policy):
        self.preflights.append((case.name, policy.name))
        return {"checked": case.name}

    def environment(self):
        return {"device": {"name": "third device"}}

    def run(self, spec, case, policy):
        for i in range(spec.warmup_steps + spec.steps):
            yield StepRecord(step=i, wall_ms=MS.get(policy.name, 20.0) * self.scale + i % 2,
                             live_bytes={t.value: 1 << 20 for t in DATA_TYPES}, cap_bytes=None,
                             gpu_capacity_bytes=1 << 30, backend=self.name, policy=policy.name,
                             warmup=i < spec.warmup_steps, telemetry="third")


register_backend("third", ThirdBackend)
'''


# ---------------------------------------------------------------------------- a third backend


def test_a_registered_third_backend_runs_through_run_and_compare(third, tmp_path):
    assert backend_names() == ("cuda", "sim", "third") and resolve_backend_name("third") == "third"
    result = um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, policy="gpu-first", backend="third", steps=4,
                                warmup_steps=1), out_dir=tmp_path / "runs")
    assert result.complete and "-third-" in result.path.name
    records = list(result.records())
    assert len(records) == 5 and all(r.backend == "third" and r.telemetry == "third" for r in records)
    assert result.summary()["median_ms"] == pytest.approx(4.5)
    assert result.model["preflight"] == {"checked": "mlp"}
    env = json.loads((result.path / "environment.json").read_text())
    assert env["backend"] == "third" and env["backend_requested"] == "third" and env["backend_note"] == "third"
    assert env["device"] == {"name": "third device"} and env["calibration_profile"] is None
    assert env["backend_class"] == "um_lab_third.ThirdBackend" and env["measures_residency"] is False

    table = um_lab.compare({"mlp": TINY_MLP}, ["gpu-first"], backend="third", steps=3, warmup_steps=0,
                           out_dir=tmp_path / "cmp")
    assert list(table["policy"]) == ["um-default", "gpu-first"] and (table["backend"] == "third").all()
    assert (table["status"] == "complete").all()
    assert table.set_index("policy").loc["gpu-first", "speedup_vs_um-default"] == pytest.approx(10.0 / 4.0)
    for run_dir in table["run_dir"]:
        assert um_lab.load(run_dir).spec.backend == "third"

    shared = third.ThirdBackend(scale=2.0)  # an instance with options, shared by every run of the sweep
    table = um_lab.compare({"mlp": TINY_MLP}, ["gpu-first"], steps=3, warmup_steps=0, out_dir=tmp_path / "cmp",
                           backend_instance=shared)
    assert (table["backend"] == "third").all() and shared.preflights == [("mlp", "um-default"), ("mlp", "gpu-first")]
    assert table.set_index("policy").loc["um-default", "median_ms"] == pytest.approx(20.0)


def test_a_backend_that_does_not_simulate_capacity_refuses_ratios_before_anything(third, tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match="simulated .* on third size the model instead"):
        um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="third", oversubscription_ratio=1.5),
                   out_dir=out)
    with pytest.raises(ValueError, match="ratios are simulated .* on third"):
        um_lab.compare(["mlp"], ["gpu-first"], ratios=[1.5], backend="third", out_dir=out)
    with pytest.raises(ValueError, match="backend 'third' reports no uncertainty band"):
        um_lab.compare(["mlp"], ["gpu-first"], backend="third", band=True, out_dir=out)
    assert not out.exists()


def test_availability_and_case_checks_are_asked_of_the_class_before_it_is_built(third, tmp_path):
    built, out = [], tmp_path / "runs"

    class Fussy(third.ThirdBackend):
        name = "fussy"
        asleep = False
        refused_models: tuple[str, ...] = ()

        def __init__(self, **options) -> None:
            built.append(options)
            super().__init__(**options)

        @classmethod
        def check_available(cls) -> None:
            if cls.asleep:
                raise CudaUnavailableError("the fussy card is asleep")

        @classmethod
        def check_case(cls, case) -> None:
            if case.name in cls.refused_models:
                raise HostMemoryRefused(10**12, 10**9, f"the input batch of {case.name}")

    register_backend("fussy", Fussy)
    try:
        Fussy.refused_models = ("mlp",)
        with pytest.raises(HostMemoryRefused, match="input batch of mlp"):
            um_lab.compare({"mlp": TINY_MLP}, ["gpu-first"], backend="fussy", out_dir=out)
        table = um_lab.compare({"mlp": TINY_MLP}, ["gpu-first"], backend="fussy", steps=1, warmup_steps=0,
                               out_dir=tmp_path / "kept", keep_going=True)  # left to the runs: Run refuses it
        assert (table["status"] == "refused").all() and len(built) == 1
        built.clear()
        Fussy.asleep = True
        with pytest.raises(CudaUnavailableError, match="fussy card is asleep"):
            um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="fussy"), out_dir=out)
        with pytest.raises(CudaUnavailableError, match="fussy card is asleep"):
            um_lab.compare({"mlp": TINY_MLP}, ["gpu-first"], backend="fussy", out_dir=out)
    finally:
        unregister_backend("fussy")
    assert built == [] and not out.exists()


def test_unknown_names_list_the_registered_backends(third, tmp_path):
    with pytest.raises(UmLabError, match=r"unknown backend 'tpu'; valid: cuda, sim, third, auto"):
        RunSpec(backend="tpu")
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; valid: cuda, sim, third, auto"):
        um_lab.compare(["mlp"], ["gpu-first"], backend="tpu", out_dir=tmp_path)
    unregister_backend("third")
    register_backend("third", "um_lab_third:ThirdBackend")  # lazily, by name: imported on first use
    assert type(get_backend("third", scale=3.0)).__name__ == "ThirdBackend"


# ---------------------------------------------------------------------------------- the registry


def test_registering_checks_names_and_keeps_existing_ones(third):
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_backend("auto", third.ThirdBackend)
    with pytest.raises(ValueError, match="registered already"):
        register_backend("sim", third.ThirdBackend)
    with pytest.raises(ValueError, match="is named 'third'"):
        register_backend("other", third.ThirdBackend)
    with pytest.raises(TypeError, match="must be a class"):
        register_backend("third", lambda: None, replace=True)
    with pytest.raises(ValueError, match="'module:Class'"):
        register_backend("lazy", "no_colon_here")
    assert backend_names() == ("cuda", "sim", "third")
    register_backend("third", third.ThirdBackend, replace=True)


def test_the_built_in_backends_are_objects_with_the_whole_protocol():
    from um_lab.cuda.backend import CudaBackend
    from um_lab.sim.backend import SimBackend

    sim, cuda = get_backend("sim"), CudaBackend(telemetry=False)
    assert type(sim) is SimBackend and backend_class("sim") is SimBackend and backend_class("cuda") is CudaBackend
    for backend in (sim, cuda, CudaBackend()):
        assert isinstance(backend, Backend)
    assert sim.simulates_capacity and sim.measures_residency
    assert not cuda.simulates_capacity and not cuda.measures_residency and CudaBackend().measures_residency
    spec = RunSpec(model="mlp", backend="sim", oversubscription_ratio=2.0)
    assert sim.capacity_for(spec, 1 << 30) == 1 << 29
    assert CudaBackend(cap_bytes=5 << 30).capacity_for(spec, 1 << 30) == 5 << 30
    assert CudaBackend(cap_bytes=5 << 30, allow_oversubscription=True).capacity_for(spec, 1 << 30) is None
    assert sim.preflight(spec, um_lab.get_model("mlp", **TINY_MLP), um_lab.get_policy("um-default")) is None
    if not um_lab.backend.cuda_available():
        with pytest.raises(CudaUnavailableError):
            CudaBackend.check_available()
        assert cuda.environment() == {"device": {"name": "cpu"}}
    with pytest.raises(NotImplementedError):
        BackendBase().run(spec, um_lab.get_model("mlp", **TINY_MLP), um_lab.get_policy("um-default"))


def test_the_registry_imports_no_backend_until_one_is_used():
    code = ("import sys, um_lab, um_lab.backend as b; from um_lab.types import RunSpec; RunSpec(backend='sim'); "
            "RunSpec(backend='cuda'); print(b.backend_names(), [m for m in ('um_lab.sim.backend', "
            "'um_lab.cuda.backend', 'um_lab.runs.runner') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('cuda', 'sim') []"


# ------------------------------------------------------------------------- the simulator's records


def test_sim_records_and_environment_name_the_simulator_and_its_profile(tmp_path):
    import dataclasses

    from um_lab.sim.backend import SimBackend
    from um_lab.sim.profile import profile_sha256

    assert StepRecord(step=0, wall_ms=1.0, live_bytes={}, cap_bytes=None, gpu_capacity_bytes=1).backend != "cuda"
    result = um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=1, warmup_steps=0),
                        out_dir=tmp_path)
    assert [r.backend for r in result.records()] == ["sim"]
    env = result.environment
    assert env["backend"] == "sim" and env["device"] == {"name": "cpu (simulated GPU)"}
    assert env["calibration_profile"] == "h200" and env["measures_residency"] is True
    assert env["calibration_profile_sha256"] == profile_sha256("h200") and len(env["calibration_profile_sha256"]) == 64
    assert "preflight" not in result.model

    base = SimBackend().profile
    mine = SimBackend(dataclasses.replace(base, name="my-card", remote_GBps=base.remote_GBps * 2))
    other = um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=1, warmup_steps=0),
                       out_dir=tmp_path, backend=mine).environment
    assert other["calibration_profile"] == "my-card"
    assert other["calibration_profile_sha256"] == profile_sha256(mine.profile) != env["calibration_profile_sha256"]


def test_a_backend_module_is_enough_even_from_a_fresh_interpreter(tmp_path):
    """The third backend's module, imported by a script: RunSpec, run and load take its name."""
    (tmp_path / "um_lab_third.py").write_text(THIRD_MODULE)
    script = textwrap.dedent(f"""
        import um_lab, um_lab_third
        r = um_lab.run(um_lab.RunSpec(model="mlp", model_kwargs={TINY_MLP!r}, backend="third", steps=2,
                                      warmup_steps=0), out_dir={str(tmp_path / "runs")!r})
        print(r.state, r.environment["backend"], [x.backend for x in r.records()])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])})
    assert out.stdout.strip() == "complete third ['third', 'third']"


# ------------------------------------------------------------- capabilities, options, entry points


def test_capabilities_and_options_are_asked_of_the_class_never_its_name(third):
    from um_lab.backend import backend_options

    assert backend_class("sim").reports_uncertainty_band and not backend_class("cuda").reports_uncertainty_band
    assert not third.ThirdBackend.reports_uncertainty_band and not third.ThirdBackend.simulates_capacity
    assert backend_options("sim") == ("profile", "prefetch_stream")
    assert backend_options("cuda") == ("cap_bytes", "allow_oversubscription", "telemetry")  # a run's lookahead: Budget
    assert backend_options("third") == ("scale",)

    class Open(BackendBase):  # **options names no option: nothing is passed to it by name
        name = "open"

        def __init__(self, **options) -> None:
            self.options = options

    register_backend("open", Open)
    try:
        assert backend_options("open") == ()
    finally:
        unregister_backend("open")


def test_installed_packages_register_backends_through_entry_points(tmp_path, monkeypatch):
    """``[project.entry-points."um_lab.backends"] third = "um_lab_third:ThirdBackend"``: registered by name on
    first use of the registry, imported when first built; the module's own register_backend is no clash."""
    from importlib.metadata import EntryPoint

    import um_lab.backend as registry

    (tmp_path / "um_lab_third.py").write_text(THIRD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    group = registry.ENTRY_POINT_GROUP
    entries = [EntryPoint("third", "um_lab_third:ThirdBackend", group),
               EntryPoint("sim", "um_lab_third:ThirdBackend", group),  # a built-in's name: the built-in stays
               EntryPoint("broken", "no_colon_here", group)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: entries if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_entry_points_read", False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # forgotten after the test
    sys.modules.pop("um_lab_third", None)
    try:
        with pytest.warns(RuntimeWarning, match="entry point broken = 'no_colon_here'.*skipped"):
            assert backend_names() == ("cuda", "sim", "third")
        assert "um_lab_third" not in sys.modules  # by name only, until used
        assert resolve_backend_name("third") == "third" and RunSpec(backend="third").backend == "third"
        kind = backend_class("third")  # imports the module, which registers its class itself: no clash
        assert kind.__module__ == "um_lab_third" and backend_class("sim").__name__ == "SimBackend"
        result = um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="third", steps=1, warmup_steps=0),
                            out_dir=tmp_path / "runs")
        assert result.complete and [r.backend for r in result.records()] == ["third"]
        with pytest.raises(ValueError, match="registered already"):  # another class under its name: refused
            register_backend("third", type("ThirdBackend", (kind,), {}))
    finally:
        sys.modules.pop("um_lab_third", None)


def test_a_plugins_run_folder_reads_back_without_the_plugin(third, tmp_path):
    result = um_lab.run(RunSpec(model="mlp", model_kwargs=TINY_MLP, backend="third", steps=2, warmup_steps=0),
                        out_dir=tmp_path / "runs")
    unregister_backend("third")
    with pytest.raises(SpecError, match="unknown backend 'third'"):
        RunSpec(backend="third")  # a new spec still names a registered backend
    back = um_lab.load(result.path)
    assert back.spec.backend == "third" and len(list(back.records())) == 2
    assert back.spec.to_dict() == result.spec.to_dict()
