"""Readable results: rounded, unit-bearing summary values, LoadedRun's notebook display, readable tables."""

from __future__ import annotations

import math

import pytest
from test_runner import TINY_MLP, FakeBackend, spec

from um_lab.runs.runner import run
from um_lab.runs.sweep import compare
from um_lab.summary import NOT_MEASURED, format_summary, format_value, readable_table


@pytest.mark.parametrize("key, value, text", [
    ("median_ms", 12.3456, "12.35 ms"),
    ("p90_ms", 1234.5, "1,234.50 ms"),
    ("mean_ms", math.nan, "—"),  # no measured step: undefined, not 0
    ("migrated_bytes", 512, "512 B"),
    ("htod_bytes", 1536, "1.50 KiB"),
    ("peak_live_bytes", 3 * 2**20 + 5, "3.00 MiB"),
    ("gpu_capacity_bytes", 141 * 2**30, "141.00 GiB"),
    ("remote_bytes", None, "—"),
    ("gpu_page_faults", 12345, "12,345"),
    ("gpu_page_faults", 9.0, "9"),  # a count in a float column (NaN elsewhere in it)
    ("evictions", None, "—"),
    ("oversubscription", 1.4999, "1.50"),
    ("ratio", 2.0, "2.00"),
    ("ratio", None, "none"),  # no ratio asked: the profile's card, as --ratios none names it
    ("ratio", math.nan, "none"),  # ... as a float column holds it: never NaN
    ("speedup_vs_um-default", 1.8765, "1.88x"),
    ("last_loss", 6.911341, "6.911"),
    ("policy", "gpu-first", "gpu-first"),
    ("error", math.nan, ""),
])
def test_format_value(key, value, text):
    assert format_value(key, value) == text


def test_format_summary_formats_every_value():
    summary = {"steps": 20, "warmup_steps": 2, "median_ms": 7.0, "migrated_bytes": None,
               "peak_live_bytes": 2**30, "oversubscription": 0.5, "last_loss": None}
    assert format_summary(summary) == {
        "steps": "20", "warmup_steps": "2", "median_ms": "7.00 ms", "migrated_bytes": NOT_MEASURED,
        "peak_live_bytes": "1.00 GiB", "oversubscription": "0.50", "last_loss": NOT_MEASURED}


def test_loaded_run_html_shows_what_ran_and_a_rounded_summary(tmp_path):
    result = run(spec(policy="gpu-first", steps=3, warmup_steps=0), out_dir=tmp_path, backend=FakeBackend())
    page = result._repr_html_()
    # the fake's gpu-first steps take 5, 6, 7 ms; 10 + 1 bytes per type and step moved; 5 types x 1000 live
    assert "<b>mlp</b> under <b>gpu-first</b> on <b>sim</b>: complete, 3/3 steps" in page
    for key, text in [("median_ms", "6.00 ms"), ("p90_ms", "6.80 ms"), ("migrated_bytes", "165 B"),
                      ("peak_live_bytes", "4.88 KiB"), ("gpu_page_faults", "9"), ("remote_bytes", "—"),
                      ("last_loss", "0.3333")]:
        assert f"<th style='text-align:left'>{key}</th><td style='text-align:right'>{text}</td>" in page
    assert "6.000000" not in page and "error" not in page
    assert repr(result).endswith("state='complete', steps=3/3)")


def test_failed_run_html_shows_its_error(tmp_path):
    with pytest.raises(RuntimeError):
        run(spec(steps=5, warmup_steps=0), out_dir=tmp_path, backend=FakeBackend(fail_at=2))
    from um_lab.runs.runlog import list_runs
    from um_lab.runs.runread import load

    page = load(list_runs(tmp_path)[0])._repr_html_()
    assert "failed, 2/5 steps" in page and "error: RuntimeError: fake backend exploded" in page


def test_readable_table_rounds_a_compare_table(tmp_path):
    table = compare({"mlp": TINY_MLP}, ["um-default", "gpu-first"], steps=3, warmup_steps=0, out_dir=tmp_path,
                    backend_instance=FakeBackend())
    readable = readable_table(table)
    rows = {row["policy"]: row for row in readable.to_dict("records")}
    assert rows["um-default"]["median_ms"] == "11.00 ms" and rows["um-default"]["p90_ms"] == "11.80 ms"
    assert rows["gpu-first"]["speedup_vs_um-default"] == "1.83x"  # 11 / 6
    assert rows["um-default"]["speedup_vs_um-default"] == "1.00x"
    assert rows["gpu-first"]["migrated_bytes"] == "165 B" and rows["gpu-first"]["remote_bytes"] == "—"
    assert rows["gpu-first"]["ratio"] == "none" and rows["gpu-first"]["steps"] == "3"
    assert "run_dir" not in readable.columns and "run_dir" in readable_table(table, keep_paths=True).columns
    assert list(readable.columns) == [c for c in table.columns if c != "run_dir"]  # same order
    assert table["median_ms"].dtype.kind == "f"  # the original is left as it was


def test_a_ratio_of_none_reads_none_never_nan_in_tables_and_read_back_csvs(tmp_path):
    import pandas as pd

    table = compare({"mlp": TINY_MLP}, ["gpu-first"], ratios=[None, 1.5], steps=2, warmup_steps=0,
                    out_dir=tmp_path, backend_instance=FakeBackend())
    assert table["ratio"].isna().sum() == 2  # None in a float column: NaN
    for source in (table, pd.read_csv(f"{table.attrs['sweep_dir']}/summary.csv")):
        readable = readable_table(source)
        assert list(readable["ratio"]) == ["none", "none", "1.50", "1.50"]
        text = readable.to_string()
        assert "NaN" not in text and "nan" not in text and "card" not in text
