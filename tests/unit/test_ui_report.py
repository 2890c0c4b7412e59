"""``--report``'s page (``launcher/ui/report.py``): golden HTML of the sample job; no script and
nothing external, whatever the job printed; what it shows; the size and time at 256 processes."""

from __future__ import annotations

import copy
import time
from html.parser import HTMLParser

from support.uisample import big_snapshot, check_golden, sample_snapshot

from launcher.ui.report import CSP, render_report

HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>&amp;"\''


class Page(HTMLParser):
    """Every element, attribute and text of a document, as a browser's tokenizer sees them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list = []
        self.attrs: list = []
        self.text: list = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self.attrs.extend((tag, k, v) for k, v in attrs)

    handle_startendtag = handle_starttag

    def handle_data(self, data) -> None:
        self.text.append(data)


def assert_inert(html: str) -> Page:
    """No script of any kind and nothing loaded from anywhere: no <script>, <iframe>, <object>,
    <embed>, <link>, <base>, <img>; no on* handler; no src; every href relative and
    scheme-less; no url() or @import in the CSS; the strict CSP meta first in <head>."""
    page = Page(html)
    assert not {"script", "iframe", "object", "embed", "link", "base", "img", "form", "meta refresh"} & set(page.tags)
    assert "<script" not in html.lower()
    for tag, k, v in page.attrs:
        assert not k.startswith("on"), (tag, k, v)
        assert k not in ("src", "srcset", "action", "formaction", "xlink:href", "background"), (tag, k, v)
        if k == "href":
            assert v.startswith("./") and ":" not in v and "//" not in v, v
        if k == "style":
            raise AssertionError(f"a style attribute: {v}")
    assert "url(" not in html and "@import" not in html
    metas = [(k, v) for tag, k, v in page.attrs if tag == "meta"]
    assert ("content", CSP) in metas and CSP == "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    assert html.index("Content-Security-Policy") < html.index("<title>")
    return page


def test_the_sample_report_golden() -> None:
    html = render_report(sample_snapshot())
    check_golden("ui_report.html", html)
    page = assert_inert(html)
    text = "".join(page.text)
    assert "pslaunch-20261207-090000-ab12" in text and "python train.py --kv-store dist_sync" in text
    assert "First failure: worker 2 on h1 (pid 4112) exited with code 1" in text
    assert "RuntimeError: NaN loss at batch 2300" in text
    assert "worker 3: killed by SIGKILL (out of memory?) (reported by node agent on h2)" in text  # attempts
    assert "h3 left out (lost: no reply to keep-alives; 62s); spare h2 for h3" in text  # (their hosts)
    assert "2/2" in text and "2026-12-07 09:00:00 UTC" in text and "2m 32s" in text
    # the process table: one row per process, in order, with the live page's classes
    rows = [v for tag, k, v in page.attrs if tag == "tr" and k == "data-name"]
    assert rows == ["scheduler", "server-0", "server-1", "worker-0", "worker-1", "worker-2", "worker-3"]
    assert '<tr data-name="worker-2" class="state-failed">' in html
    assert '<td class="exit num">SIGTERM</td>' in html and '<td class="exit num">1</td>' in html
    # logs: the failed process's block open, the others closed; stderr lines marked; relative links
    assert html.count("<details open>") == 1 and html.count("<details>") == 6
    failed = html[html.index("<details open>"):]
    assert failed.index("worker 2") < failed.index("</summary>")
    assert "<em>2:11 RuntimeError: NaN loss at batch 2300</em>" in html
    assert "this &amp; that&gt;" in html
    assert [v for tag, k, v in page.attrs if k == "href"][:2] == ["./scheduler.log", "./server-0.log"]
    assert 'id="chart" data-points="' in html and "restart 1" in html
    assert len(html) < 80_000, len(html)


def test_hostile_text_is_inert_everywhere() -> None:
    snap = copy.deepcopy(sample_snapshot())
    job = snap["job"]
    job["id"] = job["command"] = job["tracker"] = job["backend"] = HOSTILE
    job["attempts"][0]["cause"] = {"process": HOSTILE, "reason": HOSTILE, "reported_by": HOSTILE}
    job["attempts"][1]["reason"] = HOSTILE
    for p in snap["processes"]:
        p.update(host=HOSTILE, last_line=HOSTILE, label=HOSTILE, signal=HOSTILE, log='../x"><script>.log')
    snap["processes"][0]["state"] = HOSTILE
    snap["processes"][1]["name"] = HOSTILE
    snap["logs"][HOSTILE] = [[1, 0.5, "e", HOSTILE], [2, 0.6, "o", HOSTILE]]
    snap["throughput"][HOSTILE] = [[1.0, 5.0], [2.0, 6.0]]
    snap["failure"] = {"name": HOSTILE, "headline": HOSTILE, "lines": [HOSTILE] * 3}
    for lines in snap["logs"].values():
        lines.append([len(lines) + 1, 99.0, "o", HOSTILE])
    html = render_report(snap)
    page = assert_inert(html)
    assert "<img" not in html and "onerror=alert" not in html.replace("onerror=alert(1)&gt;", "")
    # the hostile string shows as the text it is, many times over
    assert sum(t.count('<script>alert("pwned")</script>') for t in page.text) > 20
    hrefs = [v for tag, k, v in page.attrs if k == "href"]
    assert hrefs and all(h == "./x%22%3E%3Cscript%3E.log" for h in hrefs)


def test_a_running_job_with_little_known() -> None:
    snap = {"job": {"id": "j", "state": "running", "start": 1796634000.0, "elapsed": 3.2, "end": None,
                    "attempt": 0, "max_restarts": 0, "logs": False, "attempts": []},
            "processes": [{"name": "worker-0", "role": "worker", "rank": 0, "state": "running"}],
            "throughput": {}, "failure": None, "logs": {}}
    html = render_report(snap)
    page = assert_inert(html)
    text = "".join(page.text)
    assert "3.2 s" in text and "no throughput reported yet" in text and "no output" in text
    assert "First failure" not in text and "Attempts" not in text and "a class" not in html
    assert 'id="job-state" class="badge s-running">running<' in html


def test_lines_dropped_by_the_ring_are_said() -> None:
    snap = sample_snapshot()
    snap["logs"]["worker-0"] = snap["logs"]["worker-0"][-10:]
    html = render_report(snap)
    assert f"{snap['logs']['worker-0'][0][0] - 1} earlier lines not kept" in html
    assert "last 10 of 47 lines" in html


def test_256_processes_of_1000_lines() -> None:
    snap = big_snapshot(workers=253, servers=2, lines=1000, points=1000, width=75)
    assert len(snap["processes"]) == 256
    t0 = time.perf_counter()
    html = render_report(snap)
    took = time.perf_counter() - t0
    assert_inert(html[:20000] + html[-20000:])  # (the whole is checked on the sample; this is its size)
    text_bytes = sum(len(x[3]) for lines in snap["logs"].values() for x in lines)
    # the markup around the lines is small: a time prefix each, <em> around one in ten
    assert len(html) < text_bytes * 1.25 + 500_000, (len(html), text_bytes)
    assert html.count("<details open>") == 1 and html.count("<tr data-name=") == 256
    assert took < 10, took
    print(f"256 processes x 1000 lines: {len(html)} bytes ({text_bytes} of line text), {took * 1000:.0f} ms")


def test_the_links_to_the_full_logs_lead_to_the_log_dir_from_where_the_report_is(tmp_path) -> None:
    """``--report out/job.html --log-dir logs``: the links go ``../logs/worker-0.log``, and a file is there."""
    from launcher.ui.page import write_report

    snap = sample_snapshot()
    snap["job"]["logs"] = True
    (tmp_path / "logs").mkdir()
    (tmp_path / "out").mkdir()
    write_report(str(tmp_path / "out" / "job.html"), snap, str(tmp_path / "logs"))
    html = (tmp_path / "out" / "job.html").read_text()
    assert 'href="./../logs/worker-1.log"' in html, html[:2000]
    assert 'href="./worker-1.log"' in render_report(snap)
