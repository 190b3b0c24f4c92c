"""The step timeline: its rows sum to the simulator's StepRecord of that step; the figure and the view."""

from __future__ import annotations

import math

import pytest

from um_lab.cuda.timeline import timeline_from_records
from um_lab.errors import InputError, ModelConfigError, PolicyError, SpecError
from um_lab.models import get_model
from um_lab.policy import STEP_PHASES
from um_lab.sim.backend import SimBackend
from um_lab.sim.timeline import MAX_STEADY_SEARCH, StepTimeline, step_timeline
from um_lab.types import RunSpec

GPT2_KNOBS = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 97, "batch_size": 1}
GPT2 = get_model("gpt2-small", **GPT2_KNOBS)
MLP = get_model("mlp", width=64, depth=2, batch_size=8)
REMOTE_TOL = 1e-9  #: relative: remote bytes are a float sum, the rows' parts add up to it up to rounding
POLICIES = ("um-default", "prefetch-all", "offload-optimizer", "zero-copy-params", "input-read-mostly", "gpu-first")


@pytest.fixture(scope="module")
def sim() -> SimBackend:
    return SimBackend()


def record_of(sim: SimBackend, case, policy: str, step: int, **size):
    spec = RunSpec(model=case.name, backend="sim", steps=step + 1, warmup_steps=0, **size)
    return list(sim.run(spec, case, policy))[step]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("step", [None, 0, 4])
def test_rows_sum_to_the_steps_record(sim: SimBackend, policy: str, step: int | None) -> None:
    tl = step_timeline(GPT2, policy, ratio=1.5, step=step, backend=sim)
    assert tl.step == (step if step is not None else tl.step) and tl.source == "sim"
    rec = record_of(sim, GPT2, policy, tl.step, oversubscription_ratio=1.5)
    got = tl.totals()
    assert got["wall_ms"] == rec.wall_ms  # the same arithmetic: exact
    assert got["gpu_page_faults"] == rec.gpu_page_faults
    assert got["evictions"] == rec.evictions
    assert got["htod_bytes"] == rec.htod_bytes
    assert got["dtoh_bytes"] == rec.dtoh_bytes
    assert got["resident_bytes"] == rec.resident_bytes
    assert math.isclose(got["remote_bytes"], rec.remote_bytes, rel_tol=REMOTE_TOL, abs_tol=1e-6)
    assert tl.capacity_bytes == rec.gpu_capacity_bytes
    frame = tl.to_frame()
    assert len(frame) == len(tl.rows) and int(frame["faults"].sum()) == rec.gpu_page_faults
    assert int(frame["htod_bytes"].sum()) == sum(rec.htod_bytes.values())


def test_the_step_is_busy_inside_and_the_moves_add_up(sim: SimBackend) -> None:
    tl = step_timeline(GPT2, "um-default", ratio=1.5, backend=sim)
    assert tl.steady and 1 <= tl.step < MAX_STEADY_SEARCH
    kernels = tl.kernels
    assert len(kernels) == sim.prepare(GPT2).trace.n_ops - 1  # all but the batch copy
    assert sum(r.faults > 0 for r in kernels) >= 2  # faults spread over several kernels, not one lump
    for r in tl.rows:
        assert r.evicted_bytes <= r.dtoh_bytes
        assert r.end_us >= r.start_us
    assert tl.rows[0].kind == "batch-copy" and tl.rows[0].end_us == 0.0
    starts = [r.start_us for r in kernels]
    assert starts == sorted(starts)
    assert all(a.end_us <= b.start_us + 1e-9 for a, b in zip(kernels, kernels[1:], strict=False))
    assert max(r.end_us for r in tl.rows) <= tl.wall_us + 1e-9
    act = [r.resident["act"] for r in kernels]
    assert max(act) > min(act)  # activations come and go within the step


@pytest.mark.parametrize("policy", ["um-default", "prefetch-all"])
def test_resident_never_exceeds_capacity_and_phases_run_in_order(sim: SimBackend, policy: str) -> None:
    for ratio in (1.2, 1.5, 3.0):
        tl = step_timeline(GPT2, policy, ratio=ratio, backend=sim)
        assert tl.capacity_bytes is not None
        assert all(r.resident_bytes <= tl.capacity_bytes for r in tl.rows)
        assert sum(tl.resident_before.values()) <= tl.capacity_bytes
        order = [STEP_PHASES.index(r.phase) for r in tl.rows if r.kind != "batch-copy"]
        assert order == sorted(order) and set(order) == {0, 1, 2}
        spans = tl.phases()
        assert [s.phase for s in spans] == list(STEP_PHASES)
        assert all(a.end_us <= b.start_us + 1e-9 for a, b in zip(spans, spans[1:], strict=False))


def test_two_policies_give_different_timelines(sim: SimBackend) -> None:
    a = step_timeline(GPT2, "um-default", ratio=1.5, backend=sim)
    b = step_timeline(GPT2, "prefetch-all", ratio=1.5, backend=sim)
    assert a.wall_us != b.wall_us
    assert a.totals()["prefetched_bytes"] == 0 < b.totals()["prefetched_bytes"]
    assert {r.kind for r in b.rows} >= {"prefetch-to-gpu"} and "prefetch-to-gpu" not in {r.kind for r in a.rows}
    assert [r.resident_bytes for r in a.kernels] != [r.resident_bytes for r in b.kernels]
    # the same on an MLP, where prefetching moves the optimizer state in before the optimizer runs
    m1 = step_timeline(MLP, "um-default", ratio=1.5, backend=sim)
    m2 = step_timeline(MLP, "prefetch-all", ratio=1.5, backend=sim)
    assert m1.to_frame()["resident_bytes"].tolist() != m2.to_frame()["resident_bytes"].tolist()


def test_a_gpu_that_holds_everything_has_a_quiet_steady_step(sim: SimBackend) -> None:
    tl = step_timeline(GPT2, "um-default", ratio=0.5, backend=sim)
    t = tl.totals()
    assert t["gpu_page_faults"] == 0 and t["evictions"] == 0 and sum(t["htod_bytes"].values()) == 0


def test_a_run_spec_and_a_model_name_give_the_same_timeline(sim: SimBackend) -> None:
    by_case = step_timeline(GPT2, "prefetch-all", ratio=1.5, step=3, backend=sim)
    spec = RunSpec(model="gpt2-small", policy="prefetch-all", model_kwargs=GPT2_KNOBS, oversubscription_ratio=1.5)
    by_spec = step_timeline(spec, step=3, backend=sim)
    by_name = step_timeline("gpt2-small", "prefetch-all", ratio=1.5, step=3, model_kwargs=GPT2_KNOBS, backend=sim)
    assert by_case == by_spec == by_name
    assert by_spec.policy == "prefetch-all" and by_spec.model == "gpt2-small"
    # a size given here replaces the spec's
    assert step_timeline(spec, ratio=3.0, backend=sim).capacity_bytes < by_spec.capacity_bytes  # type: ignore[operator]


def test_bad_input_is_refused_by_name(sim: SimBackend) -> None:
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, step=-1, backend=sim)
    assert e.value.field == "step"
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, step=True, backend=sim)  # type: ignore[arg-type]
    assert e.value.field == "step"
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, "layer-ahead", ratio=1.5, backend=sim)
    assert e.value.field == "policy"
    with pytest.raises(SpecError) as e:
        step_timeline(RunSpec(model="mlp", budget="0.5x"), backend=sim)
    assert e.value.field == "budget"
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, ratio=1.5, capacity_bytes=1 << 30, backend=sim)
    assert e.value.field == "capacity_bytes"
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, ratio=-2, backend=sim)
    assert e.value.field == "oversubscription_ratio"
    with pytest.raises(SpecError) as e:
        step_timeline(GPT2, model_kwargs={"n_layer": 2}, backend=sim)
    assert e.value.field == "model_kwargs"
    with pytest.raises(InputError) as e:
        step_timeline(42, backend=sim)  # type: ignore[arg-type]
    assert e.value.field == "case"
    with pytest.raises(PolicyError):
        step_timeline(GPT2, "no-such-policy", backend=sim)
    with pytest.raises(ModelConfigError):
        step_timeline("gpt2-small", model_kwargs={"n_layers": 1}, backend=sim)


# -- on a GPU: from CUPTI records (synthetic ones here) -------------------------------------------------------

class _Seg:
    def __init__(self, ptr: int, size: int, data_type) -> None:
        self.ptr, self.size, self.data_type = ptr, size, data_type


def test_records_make_time_slices_with_the_records_totals() -> None:
    from um_lab.cuda.residency import Kind
    from um_lab.types import DataType

    mib2 = 2 << 20
    segs = [_Seg(1 << 32, 4 * mib2, DataType.ACT), _Seg(1 << 34, 2 * mib2, DataType.PARAM)]
    evict = 3
    records = [
        (Kind.GPU_PAGE_FAULT, 5, (1 << 32) + 10, 1_000, 1_100, 0),
        (Kind.BYTES_TRANSFER_HTOD, mib2, 1 << 32, 1_200, 1_500, 1),  # fault-driven
        (Kind.BYTES_TRANSFER_HTOD, mib2, 1 << 34, 4_000, 4_400, 7),  # explicit prefetch (cause USER)
        (Kind.BYTES_TRANSFER_DTOH, mib2, 1 << 32, 8_000, 8_600, evict),  # eviction
        (Kind.GPU_PAGE_FAULT, 2, 1 << 34, 20_000, 20_001, 0),  # outside the step: left out
    ]
    tl = timeline_from_records(records, segs, start_ns=0, end_ns=10_000, slices=10,
                               phases={"forward": (0, 5_000), "backward": (5_000, 9_000), "optimizer": (9_000, 10_000)},
                               cause_names={1: "COHERENCE", evict: "EVICTION", 7: "USER"}, model="m", policy="p")
    assert isinstance(tl, StepTimeline) and tl.source == "cupti" and len(tl.rows) == 10
    assert tl.wall_us == 10.0 and tl.rows[-1].end_us == 10.0
    t = tl.totals()
    assert t["gpu_page_faults"] == 5 and t["htod_bytes"]["act"] == mib2 and t["htod_bytes"]["param"] == mib2
    assert t["dtoh_bytes"]["act"] == mib2 and t["evicted_bytes"] == mib2 and t["evictions"] == 1
    assert t["prefetched_bytes"] == mib2
    assert tl.rows[1].faults == 5 and tl.rows[4].prefetched_bytes == mib2 and tl.rows[8].evicted_bytes == mib2
    assert tl.rows[1].resident["act"] == mib2 and tl.rows[8].resident["act"] == 0
    assert tl.rows[9].resident["param"] == mib2
    assert [s.phase for s in tl.phases()] == list(STEP_PHASES)
    with pytest.raises(InputError) as e:
        timeline_from_records(records, segs, start_ns=10, end_ns=10)
    assert e.value.field == "end_ns"
    with pytest.raises(InputError) as e:
        timeline_from_records(records, segs, start_ns=0, end_ns=10, phases={"warmup": (0, 1)})
    assert e.value.field == "phases"


# -- the figure and the view ----------------------------------------------------------------------------------

def test_the_figure_stacks_types_marks_events_and_plays(sim: SimBackend) -> None:
    go = pytest.importorskip("plotly.graph_objects")
    from um_lab.widgets.timeline import timeline_figure

    a = step_timeline(GPT2, "um-default", ratio=1.5, backend=sim)
    b = step_timeline(GPT2, "prefetch-all", ratio=1.5, backend=sim)
    fig = timeline_figure(a, b)
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    names = {tr.name for tr in fig.data}
    assert {"param", "grad", "optim", "act", "input"} <= names
    assert {"page faults", "migrated to GPU", "migrated to host (evicted)", "prefetched"} <= names
    faults = next(tr for tr in fig.data if tr.name == "page faults" and tr.yaxis == "y2")
    assert len(faults.x) == sum(r.faults > 0 for r in a.rows)  # one mark per kernel that faulted
    stacked = [tr for tr in fig.data if tr.stackgroup]
    assert {tr.yaxis for tr in stacked} == {"y", "y3"}  # a residency panel per policy
    # one shared time axis, residency from zero, a capacity line in MiB
    assert [fig.layout[f"xaxis{i}"].matches for i in ("", 2, 3)] == ["x4"] * 3
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis3.range[0] == 0
    assert "MiB" in fig.layout.yaxis.title.text and "ms" in fig.layout.xaxis4.title.text
    from um_lab.widgets.dashboard_data import byte_unit  # the dashboard's unit for the same bytes

    assert byte_unit(a.capacity_bytes)[0] == "MiB" and byte_unit(3 * 2**30)[0] == "GiB"
    cap = [tr for tr in fig.data if tr.name and tr.name.startswith("GPU capacity")]
    assert cap and cap[0].y[0] == pytest.approx(a.capacity_bytes / 2**20)
    bands = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(bands) >= 6  # forward / backward / optimizer in both panels
    assert fig.frames and fig.layout.sliders and fig.layout.updatemenus
    assert fig.layout.updatemenus[0].buttons[0].label == "Play"
    cursor = [i for i, tr in enumerate(fig.data) if tr.name == "now"]
    assert cursor and set(fig.frames[0].traces) == set(cursor)
    assert fig.frames[-1].data[0].x[0] > fig.frames[0].data[0].x[0]
    fig.to_json()  # serialises (static export path)
    one = timeline_figure(a, frames=False)
    assert not one.frames and not one.layout.sliders


def test_the_view_compares_two_policies_and_walks_the_step(sim: SimBackend) -> None:
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from um_lab.widgets import TimelineView

    view = TimelineView(model="gpt2-small", model_kwargs=GPT2_KNOBS, ratio=1.5,
                        policies=("um-default", "prefetch-all"), backend=sim)
    assert view.timelines[0].policy == "um-default" and view.timelines[1] is not None
    assert view.timelines[1].policy == "prefetch-all"
    assert "<" not in view.readout.value.replace("<b>", "").replace("</b>", "").replace("<br>", "")
    before = view.cursor_x()
    label = view.figure.data[[tr.name for tr in view.figure.data].index("now")].text[1]
    view.slider.value = view.slider.max // 2
    assert view.cursor_x() > before and "t = " in view.readout.value
    assert view.figure.data[[tr.name for tr in view.figure.data].index("now")].text[1] != label
    view.policy_b.value = "offload-optimizer"
    assert view.timelines[1] is not None and view.timelines[1].policy == "offload-optimizer"
    view.policy_b.value = ""  # none: one policy alone
    assert view.timelines[1] is None
    static = view.static_figure()  # a plain figure for exports, with Play
    assert "ms" in static.layout.xaxis2.title.text and static.frames
    assert view._repr_mimebundle_() is not None
    cap = view.timelines[0].capacity_bytes
    view.set_workload(ratio=3.0)  # what the panel calls when its workload changes
    assert view.timelines[0].capacity_bytes < cap  # type: ignore[operator]
    view.set_workload(ratio=-1.0)  # refused: said in the status line, and no figure of other settings under it
    assert "oversubscription_ratio" in view.status.value
    assert view.figure is None and view.timelines == (None, None) and view._box.children == ()
    view.set_workload(ratio=3.0)
    assert view.figure is not None and view.timelines[0] is not None
    with pytest.raises(SpecError):
        view.set_workload(modle="mlp")
    with pytest.raises(SpecError):
        TimelineView(model="gpt2-small", model_kwargs=GPT2_KNOBS, ratio=1.5, policies=(), backend=sim)
    lazy = TimelineView(model="mlp", model_kwargs={"width": 64, "depth": 2}, policies=("gpu-first",),
                        simulate_now=False, backend=sim)
    assert lazy.timelines == (None, None) and lazy.figure is None
    lazy.refresh()
    assert lazy.timelines[0] is not None and lazy.timelines[0].policy == "gpu-first" and lazy.timelines[1] is None


def test_steady_compares_the_same_step_and_the_panel_policy_can_be_shown(sim) -> None:
    """Two policies reach their steady step at different steps: "steady" shows one step for both. A policy of
    the user's own (the Lab panel's advice) is offered in the pickers and shown as policy A."""
    pytest.importorskip("ipywidgets")
    from um_lab.policy import Advice, Policy
    from um_lab.widgets.timeline import TimelineView

    view = TimelineView(model="mlp", model_kwargs={"width": 64, "depth": 2}, ratio=1.5,
                        policies=("um-default", "prefetch-all"), backend=sim)
    a, b = view.timelines
    assert a is not None and b is not None and a.step == b.step
    mine = Policy("mine", {"act": Advice(preferred_location="cpu")})
    view.use_policy(mine, "mine (this panel)")
    assert view.policy_a.value == "mine (this panel)" and view.timelines[0].policy == "mine"
    assert "mine (this panel)" in [value for _, value in view.policy_b.options]
    assert view.policy_b.value == "prefetch-all"  # B kept


def test_a_timeline_figure_survives_a_saved_notebook(sim: SimBackend, monkeypatch) -> None:
    """Building the figure sets up the export renderer, as the other figures do: without static images, the
    saved notebook carries it as HTML with plotly.js inlined."""
    pio = pytest.importorskip("plotly.io")
    from um_lab.widgets.timeline import timeline_figure

    monkeypatch.setenv("UM_LAB_STATIC_IMAGES", "0")
    before = pio.renderers.default
    pio.renderers.default = "plotly_mimetype"
    try:
        timeline_figure(step_timeline(GPT2, "um-default", ratio=1.5, backend=sim), frames=False)
        assert pio.renderers.default == "plotly_mimetype+notebook"
    finally:
        pio.renderers.default = before
