"""bench/step_detail.py's runner keeps what was measured: a failing configuration is recorded, the others kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

from step_detail import run_config  # noqa: E402


def test_a_failing_configuration_is_recorded_and_the_others_are_kept(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    result: dict = {"device": "test", "configs": []}
    run_config(result, str(out), {"model": "a", "policy": "p"}, lambda: {"step_ms": 1.5})

    def broken() -> dict:
        raise RuntimeError("no memory")

    run_config(result, str(out), {"model": "b", "policy": "p"}, broken)
    saved = json.loads(out.read_text())
    assert [c["model"] for c in saved["configs"]] == ["a", "b"]
    assert saved["configs"][0]["step_ms"] == 1.5 and "error" not in saved["configs"][0]
    assert saved["configs"][1]["error"] == "RuntimeError: no memory"
    assert all(c["seconds"] >= 0 for c in saved["configs"])
    assert "no memory" in capsys.readouterr().out

