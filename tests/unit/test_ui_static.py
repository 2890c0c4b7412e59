"""The live job page's static files (``launcher/ui/static``): present, small, loading nothing from the
network, nothing the Content-Security-Policy blocks, and every element the browser tests look for.

The server sends ``default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'``:
an inline script, an ``on...=`` handler or a ``style=`` attribute would be refused by the browser
(and the page would break silently), and any other origin would break the page offline. The DOM
contract is the one of the issue's notes (UI-CONTRACT.md), which tests/browser rely on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.helpers import REPO

STATIC = REPO / "launcher" / "ui" / "static"
FILES = ("page.html", "app.js", "app.css")
BUDGET = 300_000  # bytes, the three together (the bound)
#: id -> the element it must be (None: any)
CONTRACT_IDS = {
    "job-state": None, "job-attempt": None, "job-elapsed": None, "procs": "table", "failure": None,
    "chart": None, "log": None, "filter-role": "select", "filter-rank": "input", "filter-host": "select",
    "search": "input", "search-count": None, "search-prev": "button", "search-next": "button",
}
#: the cells of each process row (td.<class>)
CONTRACT_CELLS = {"role", "rank", "host", "pid", "state", "exit", "cpu", "rss", "speed", "last"}
#: a load from another origin: a scheme's URL, or a scheme-relative //host
EXTERNAL = re.compile(r"""(?ix)
    \b(?:https?|wss?|ftp):// |                                      # any absolute web URL, anywhere
    (?:src|href|action|srcset|poster|data)\s*=\s*["']?\s*// |       # <x src="//host/...">
    url\(\s*["']?\s*// |                                            # CSS url(//host/...)
    @import |                                                       # CSS imports (none needed)
    (?:fetch|EventSource|WebSocket|open)\(\s*["'`]\s*//              # fetch('//host/...')
""")


class Page(HTMLParser):
    """What the CSP and the contract care about in page.html."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: dict[str, str] = {}
        self.scripts: list[dict[str, str | None]] = []
        self.inline_script = ""
        self.bad_attrs: list[str] = []
        self.styles = 0
        self.links: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "id" in a and a["id"]:
            assert a["id"] not in self.ids, f"id {a['id']} twice"
            self.ids[a["id"]] = tag
        self.bad_attrs += [f"<{tag} {k}=>" for k, _ in attrs if k == "style" or k.startswith("on")]
        if tag == "script":
            self.scripts.append(a)
            self._in_script = True
        if tag == "style":
            self.styles += 1
        for k in ("src", "href"):
            if a.get(k):
                self.links.append(str(a[k]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.inline_script += data.strip()


def parsed() -> Page:
    p = Page()
    p.feed((STATIC / "page.html").read_text(encoding="utf-8"))
    return p


def text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def test_the_files_exist_and_stay_under_the_budget() -> None:
    sizes = {f: (STATIC / f).stat().st_size for f in FILES}
    assert all(sizes.values()), sizes
    assert sum(sizes.values()) < BUDGET, sizes


@pytest.mark.parametrize("name", FILES)
def test_nothing_is_loaded_from_another_origin(name: str) -> None:
    found = [m.group(0) for m in EXTERNAL.finditer(text(name))]
    assert not found, f"{name} loads from another origin: {found}"


def test_the_html_has_nothing_the_csp_refuses() -> None:
    p = parsed()
    assert not p.inline_script, "an inline <script> body (CSP script-src 'self' refuses it)"
    assert not p.bad_attrs, f"inline handlers or style attributes: {p.bad_attrs}"
    assert p.styles == 0, "a <style> element (CSP style-src 'self' refuses it)"
    assert [s.get("src") for s in p.scripts] == ["/static/app.js"]
    assert "/static/app.css" in p.links
    # every link is this origin's (a path) or a data: URL (img-src allows data:)
    assert all(u.startswith(("/", "data:")) and not u.startswith("//") for u in p.links), p.links


def test_the_script_builds_no_markup_the_csp_refuses() -> None:
    js = text("app.js")
    # markup built as a string (the chart's SVG): a style or on...= attribute in it would be refused
    assert not re.search(r"""\sstyle\s*=\s*["\\]""", js), "a style= attribute in built markup"
    assert not re.search(r"""\son[a-z]+\s*=\s*["\\]""", js), "an on...= attribute in built markup"
    assert "setAttribute('style'" not in js and 'setAttribute("style"' not in js
    assert "eval(" not in js and "new Function" not in js, "eval: refused without 'unsafe-eval'"
    # the only requests: this origin's paths
    for call in re.findall(r"""(?:fetch|EventSource)\(\s*(['"`][^'"`]*['"`])""", js):
        assert call[1] == "/" and call[2] != "/", call


def test_the_page_carries_the_dom_contract() -> None:
    ids = parsed().ids
    for id_, tag in CONTRACT_IDS.items():
        assert id_ in ids, f"#{id_} missing from page.html"
        assert tag is None or ids[id_] == tag, (id_, ids[id_], tag)
    html = text("page.html")
    assert re.search(r'<div id="chart"[^>]*\bdata-points="0"', html), "#chart starts with data-points"
    assert re.search(r'<table id="procs">.*<tbody>\s*</tbody>', html, re.S), "#procs has an empty tbody"
    js = text("app.js")
    m = re.search(r"const COLS = \[([^\]]*)\]", js)
    assert m, "app.js: the row's cells (COLS)"
    cols = set(re.findall(r"'([a-z]+)'", m.group(1)))
    assert CONTRACT_CELLS <= cols, CONTRACT_CELLS - cols
    for needle in ("tr.dataset.name = name", "'state-' + ", "'log-link'", "box.dataset.points = ",
                   "d.dataset.name = rec.name", "'line err' : 'line'", "el('mark'", "classList.add('current')",
                   "new EventSource('/events')", "fetch('/api/state'"):
        assert needle in js, f"app.js no longer has {needle!r} (a part of the DOM or data contract)"
    for kind in ("snapshot", "lines", "procs", "job", "points", "failure"):
        assert f"on('{kind}'," in js, f"the SSE event {kind!r} is not handled"


def test_the_styles_name_no_font_or_image_to_fetch() -> None:
    css = text("app.css")
    assert "@font-face" not in css
    assert not re.search(r"url\(\s*['\"]?(?!data:)", css), "a url() that is not data: (fetched at load)"


@pytest.mark.skipif(not shutil.which("node"), reason="no node here to check the script's syntax")
def test_the_script_parses(tmp_path: Path) -> None:
    r = subprocess.run(["node", "--check", str(STATIC / "app.js")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
