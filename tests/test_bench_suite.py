"""bench/ as a suite: a handful of benchmarks, one current result each, named by what they measure, and
bench/gpu.sh runs only scripts that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
#: words of a development journal, not of a product
JOURNAL = re.compile(r"session ?[0-9]|call [0-9]|issue ?#?[0-9]|round [0-9]", re.IGNORECASE)


def _regular_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
                  and "out" not in p.relative_to(BENCH).parts[:1])


def test_the_suite_is_a_handful_of_scripts_with_at_most_forty_result_files() -> None:
    scripts = sorted(BENCH.glob("*.py"))
    assert 0 < len(scripts) <= 15, [p.name for p in scripts]
    assert not list(BENCH.glob("*/*.py")), "benchmarks live at the top of bench/"
    assert len(_regular_files(RESULTS)) <= 40


def test_nothing_in_bench_or_its_page_speaks_of_how_it_was_developed() -> None:
    texts = [*_regular_files(BENCH), ROOT / "docs" / "benchmarks.md"]
    for path in texts:
        assert not JOURNAL.search(str(path.relative_to(ROOT))), path
        found = JOURNAL.search(path.read_text(errors="replace"))
        assert found is None, f"{path.relative_to(ROOT)}: {found.group(0)!r}"


def test_old_result_names_are_only_links_that_um_lab_still_reads() -> None:
    """The held-out fidelity sets moved to sim_fidelity_heldout/DATE/; a link under an old name stays only while
    um_lab.teaching.fidelity reads that name."""
    from um_lab.teaching import fidelity

    links = sorted(p for p in RESULTS.rglob("*") if p.is_symlink())
    for link in links:
        assert link.resolve().is_file() and link.resolve().is_relative_to(RESULTS.resolve()), link
        assert link.name in (*fidelity.FILES, *fidelity.PREDICTED), f"{link.name}: um_lab no longer reads it"


def test_each_held_out_set_holds_its_predictions_made_before_its_measurement() -> None:
    """A set's folder holds predicted.json until it is measured; then measured.json carries those predictions."""
    folders = sorted((RESULTS / "sim_fidelity_heldout").iterdir())
    assert folders
    for folder in folders:
        files = sorted(p.name for p in folder.iterdir())
        assert files in (["measured.json"], ["predicted.json"]), (folder.name, files)
        if files == ["predicted.json"]:
            predicted = json.loads((folder / "predicted.json").read_text())
            measured = None
        else:
            measured = json.loads((folder / "measured.json").read_text())
            predicted = measured["predictions"]
        assert predicted["date"][:16].replace(":", "") == folder.name
        assert all(r["measured_ms"] is None for r in predicted["rows"])
        if measured is None:
            continue
        assert predicted["date"] < measured["date"]

        def keys(rows: list[dict]) -> set[tuple[str, str, str]]:
            return {(r["model"], json.dumps(r["model_kwargs"], sort_keys=True), r["policy"]) for r in rows}

        assert keys(measured["rows"]) <= keys(predicted["rows"]), folder.name  # every measured row was predicted


def test_every_result_carries_its_date() -> None:
    for path in _regular_files(RESULTS):
        assert "date" in json.loads(path.read_text()), path


def test_gpu_sh_runs_only_scripts_that_exist_and_names_every_suite_it_has() -> None:
    text = (BENCH / "gpu.sh").read_text()
    for script in set(re.findall(r"bench/[a-z0-9_]+\.py", text)):
        assert (ROOT / script).is_file(), script
    suites = set(re.findall(r"^suite_([a-z]+)\(\)", text, re.MULTILINE))
    listed = re.search(r"suites=\(([a-z ]+)\)", text)
    assert listed is not None and set(listed.group(1).split()) == suites
    for suite in suites:
        assert re.search(rf"^#   {suite} ", text, re.MULTILINE), f"the header does not describe {suite}"
