"""The documentation site (mkdocs.yml: docs/ and the executed notebooks through mkdocs-jupyter) builds with
``mkdocs build --strict`` (a broken link, a missing anchor or a page left out of the navigation fails it), and
every internal link and anchor of the built HTML resolves.

Skipped when mkdocs or mkdocs-jupyter is missing (``pip install -e ".[docs]"``); where ``$UM_LAB_DOCS_REQUIRED``
is 1, as in ``.ci/run``, that fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_ENV = "UM_LAB_DOCS_REQUIRED"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
PAGES = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))


class Links(HTMLParser):
    """The links (href, src) and the anchors (id, name) of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src") and not (tag == "link" and ("rel", "canonical") in attrs):
                self.links.append(value)
            elif name in ("id", "name") and tag != "meta":
                self.anchors.add(value)


def parse(page: Path) -> Links:
    parser = Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def broken_links(site: Path) -> list[str]:
    """Every internal link of the HTML pages under ``site`` that does not resolve, as ``page: link (why)``:
    a file that is not there, a path out of the site, an anchor the target page lacks."""
    pages = {p.relative_to(site).as_posix(): parse(p) for p in sorted(site.rglob("*.html"))}
    broken = []
    for page, parsed in pages.items():
        if page == "404.html":  # served at any address: its links are absolute on purpose
            continue
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue  # another site (or data:, mailto:): not this check's business
            path = unquote(parts.path)
            if path.startswith("/"):
                broken.append(f"{page}: {link} (absolute: breaks when the site is not served at a domain's root)")
                continue
            target = posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) if path else page
            if target == ".." or target.startswith("../"):
                broken.append(f"{page}: {link} (leads out of the site)")
                continue
            file = site / target
            if file.is_dir():
                target, file = posixpath.join(target, "index.html"), file / "index.html"
            if not file.is_file():
                broken.append(f"{page}: {link} (no {target})")
            elif parts.fragment and target.endswith(".html"):
                anchors = pages[target].anchors if target in pages else parse(file).anchors
                if unquote(parts.fragment) not in anchors:
                    broken.append(f"{page}: {link} (no anchor #{parts.fragment} in {target})")
    return broken


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<a href="a/">ok</a> <a href="a/#here">ok</a> <a href="#top">x</a>'
                                         '<h1 id="top">t</h1> <a href="https://example.org/x">other site</a>'
                                         '<img src="missing.png"> <a href="a/#nowhere">x</a> <a href="../up">x</a>')
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">h</h2><a href="../index.html#top">back</a>'
                                               '<a href="/abs/">x</a>')
    assert broken_links(tmp_path) == [
        "a/index.html: /abs/ (absolute: breaks when the site is not served at a domain's root)",
        "index.html: missing.png (no missing.png)",
        "index.html: a/#nowhere (no anchor #nowhere in a/index.html)",
        "index.html: ../up (leads out of the site)",
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built from the checkout with ``mkdocs build --strict`` into a temporary folder."""
    missing = [name for name in ("mkdocs", "mkdocs_jupyter") if importlib.util.find_spec(name) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (pip install -e '.[docs]')"
        if os.environ.get(REQUIRED_ENV, "").strip() == "1":
            pytest.fail(f"the docs build is required here (${REQUIRED_ENV}=1) but {reason}")
        pytest.skip(f"docs build: {reason}")
    out = tmp_path_factory.mktemp("docs") / "site"
    before = sorted(p.name for p in ROOT.iterdir())
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert sorted(p.name for p in ROOT.iterdir()) == before, "the build left nothing in the checkout (no cache)"
    return out


def test_the_site_has_every_page_and_notebook(site):
    for page in PAGES:
        assert (site / ("index.html" if page == "index" else f"{page}/index.html")).is_file(), page
    home = (site / "index.html").read_text(encoding="utf-8")
    for name in NOTEBOOKS:
        html = (site / "notebooks" / name / "index.html").read_text(encoding="utf-8")
        assert re.search(r'<img [^>]*src="data:image/png;base64,', html), f"{name}: its figures are shown"
        assert "Plotly.newPlot" not in html, f"{name}: no plotly.js inlined per figure"
        assert (site / "notebooks" / name / f"{name}.ipynb").is_file(), f"{name}: the notebook to download"
        assert f'href="notebooks/{name}/"' in home, f"the home page links {name}"


def test_every_internal_link_of_the_site_resolves(site):
    pages = list(site.rglob("*.html"))
    assert len(pages) >= len(PAGES) + len(NOTEBOOKS)
    assert broken_links(site) == []
