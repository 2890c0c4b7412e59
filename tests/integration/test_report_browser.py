"""``--report``'s page in a real browser (the system Chromium, headless): it lays out the sample
job, hostile lines stay text, and the page's CSP refuses nothing (there is nothing to refuse: no
script, no load). A screenshot of each page is kept in the test's tmp_path (printed)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess

import pytest
from support.uisample import sample_snapshot

from launcher.ui.report import render_report

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=1">'


def chromium(*args: str, tmp_path) -> subprocess.CompletedProcess:
    """One headless Chromium run, its own profile, no network (--host-resolver-rules maps every
    name to nowhere, so a load that slipped through would fail, and say so in the log)."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0", *args],
        capture_output=True, text=True, timeout=90)


def render(snapshot: dict, tmp_path, name: str) -> tuple[str, str]:
    """The report's DOM after Chromium loaded it from disk, and Chromium's log; a screenshot beside."""
    page = tmp_path / f"{name}.html"
    page.write_text(render_report(snapshot), encoding="utf-8")
    shot = tmp_path / f"{name}.png"
    r = chromium("--window-size=1400,1800", f"--screenshot={shot}", page.as_uri(), tmp_path=tmp_path)
    assert shot.exists() and shot.stat().st_size > 10_000, r.stderr[-2000:]
    print(f"screenshot: {shot}")
    dom = chromium("--dump-dom", page.as_uri(), tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout, r.stderr + dom.stderr


def test_the_sample_report_in_chromium(tmp_path) -> None:
    dom, log = render(sample_snapshot(), tmp_path, "sample")
    assert len(re.findall(r'<tr data-name="[^"]+" class="state-', dom)) == 7
    assert dom.count("<details open") == 1 and "<svg" in dom
    assert "Refused to" not in log and "ERR_NAME_NOT_RESOLVED" not in log, log[-2000:]


def test_hostile_lines_stay_text_in_chromium(tmp_path) -> None:
    snap = copy.deepcopy(sample_snapshot())
    snap["job"]["id"] = snap["job"]["command"] = HOSTILE
    for p in snap["processes"]:
        p["last_line"] = p["host"] = HOSTILE
    for lines in snap["logs"].values():
        lines.append([len(lines) + 1, 150.0, "e", HOSTILE])
    snap["failure"]["lines"].append(HOSTILE)
    dom, log = render(snap, tmp_path, "hostile")
    assert "<script" not in dom and "<img" not in dom
    assert re.search(r"<title>(.*?)</title>", dom)[1].startswith("pslaunch &lt;script&gt;")  # (not "pwned", "1")
    assert dom.count("&lt;script&gt;document.title=") >= 7 + 7 + 2
    assert "Refused to" not in log and "ERR_NAME_NOT_RESOLVED" not in log, log[-2000:]
