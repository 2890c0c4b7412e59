"""The docs a newcomer reads: a short README with a table of contents, links that resolve, every
page reachable from the README, and no install from a package index where pslaunch is not published.

Links are read as GitHub renders them: ``[text](target)`` outside code, ``target`` relative to the
page, ``#anchor`` the slug GitHub gives a heading (lower case, punctuation but ``-`` and ``_``
dropped, spaces to ``-``, ``-1``, ``-2`` ... for repeats).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.helpers import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
MAX_README_LINES = 400

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
#: ``pip install pslaunch`` or ``'pslaunch[ssh]'`` without ``@ URL``: an install from a package index
FROM_INDEX = re.compile(r"pip\s+install\s+(?:-\S+\s+)*['\"]?pslaunch(?:\[[^\]]*\])?['\"]?(?=\s|$)(?!\s*@)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code (where ``[x](y)`` is no link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # (http:, https:, mailto: are not checked)


def resolve(page: Path, target: str) -> tuple[Path, str]:
    """The file and the anchor (or "") a relative link of ``page`` points at."""
    where, _, anchor = target.partition("#")
    return ((page.parent / where).resolve() if where else page), anchor


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}: move details to docs/"


def test_the_readme_has_a_table_of_contents_of_its_sections() -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Contents\n(.*?)^## ", text, re.M | re.S)
    assert match, "README.md has no '## Contents' section before its other sections"
    listed = {t[1:] for t in _LINK.findall(match.group(1)) if t.startswith("#")}
    sections = {slug(t) for level, t in _HEADING.findall(_FENCE.sub("", text)) if level == "##"} - {"contents"}
    assert sections <= listed, f"README.md's Contents leaves out: {sorted(sections - listed)}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, anchor = resolve(page, target)
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading '#{anchor}' in {path.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {', '.join(broken)}"


def test_every_page_of_docs_is_reachable_from_the_readme() -> None:
    seen = {README.resolve()}
    todo = [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            path, _ = resolve(page, target)
            if path.suffix == ".md" and path.exists() and path.resolve() not in seen:
                seen.add(path.resolve())
                todo.append(path)
    orphans = [str(p.relative_to(REPO)) for p in PAGES if p.resolve() not in seen]
    assert not orphans, f"no link leads from README.md to: {', '.join(orphans)}"


def test_no_page_installs_pslaunch_from_a_package_index() -> None:
    # pslaunch is not on PyPI: such a line would fetch someone else's package, or nothing
    found = [f"{p.relative_to(REPO)}: {m.group(0)!r}" for p in PAGES
             for m in FROM_INDEX.finditer(p.read_text(encoding="utf-8"))]
    assert not found, "install from a clone or a git URL instead: " + "; ".join(found)


@pytest.mark.parametrize("text, ok", [
    ("pip install pslaunch\n", False),
    ("pip install 'pslaunch[ssh]'   # paramiko\n", False),
    ("pip\ninstall 'pslaunch[trainer]' ...", False),
    ("pip install 'pslaunch[ssh] @ git+https://host/pslaunch.git'\n", True),
    ('pip install "pslaunch[ssh] @ git+file://localhost$PWD"\n', True),
    ("pip install '.[ssh]'\n", True),
    ("pip install pslaunch-extras\n", True),
])
def test_the_index_install_check_tells_an_index_from_a_url(text: str, ok: bool) -> None:
    assert (FROM_INDEX.search(text) is None) is ok


@pytest.mark.parametrize("heading, anchor", [
    ("Addresses: `DMLC_INTERFACE` and `--host-ip`", "addresses-dmlc_interface-and---host-ip"),
    ("`--sync-dst-dir DIR`", "--sync-dst-dir-dir"),
    ("Training over a 1 Gbit/s link", "training-over-a-1-gbits-link"),
    ("XGBoost, PyTorch DDP and other collective jobs", "xgboost-pytorch-ddp-and-other-collective-jobs"),
])
def test_anchors_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
