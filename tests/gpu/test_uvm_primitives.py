"""bench/uvm_primitives.py --quick on a real GPU: every section writes rows with sane numbers.

Runs the script in its own process (its managed buffers are tiny, counted and freed there) and checks the
JSON it writes. Skipped cleanly without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
POSITIVE = ("bytes", "useful_bytes", "resident_ms", "remote_ms", "ms", "GBps", "resident_GBps", "ratio")


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uvm_primitives") / "quick.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "uvm_primitives.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_section_writes_rows_without_errors(quick_result):
    rows = quick_result["rows"]
    assert not [r for r in rows if r.get("error") or r.get("skipped")]
    assert {r["group"] for r in rows} == {"remote", "kernel", "migration"}
    assert {"streaming read", "streaming write", "read+write (axpy in place)"} <= {r.get("pattern") for r in rows}
    assert {"prefetch D2H fresh", "prefetch H2D", "fault H2D after prefetch D2H",
            "both directions (D2H + H2D)"} <= {r["name"] for r in rows}
    assert quick_result["managed_live_after"] == 0, "every managed buffer is freed"
    assert 0 < quick_result["managed_limit_bytes"] <= 16 << 30


def test_numbers_are_positive_and_finite(quick_result):
    for row in quick_result["rows"]:
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                assert math.isfinite(value), (key, row)
        for key in POSITIVE:
            if key in row:
                assert row[key] is not None and row[key] > 0, (key, row)
        if row["group"] == "kernel":
            assert row["operand"] and row["bytes"] > 0 and row["resident_ms"] > 0


def test_a_streaming_read_is_slower_remote_than_resident(quick_result):
    reads = [r for r in quick_result["rows"] if r["group"] == "remote" and r.get("pattern") == "streaming read"]
    assert reads
    for row in reads:
        assert row["resident_ms"] < row["remote_ms"], row
