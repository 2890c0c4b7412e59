"""``--report FILE.html``: the job page's content as one static, self-contained HTML file, written
when the job ends, that a browser opens from disk, offline, years later.

Pure: :func:`render_report` turns a snapshot (the dict ``/api/state`` returns; the contract is in
``model.py``) into the page. No script at all, nothing loaded from anywhere (its own
Content-Security-Policy says so: ``default-src 'none'``; styles inline, images only ``data:``):
the chart is inline SVG (``svg.py``), the logs are ``<details>`` blocks (open for the processes
that failed). Every value from the job is HTML-escaped: a line that prints ``<script>`` shows as
text.

What it shows, top to bottom: the header (job id, command, tracker, backend, final state, exit
code, attempt k/N, start, end, duration); the first failure and its last lines; the attempts and
their causes (when there was a restart); the process table, states coloured; the throughput
chart; each process's last lines, stderr in brown, and the name of its full ``--log-dir`` file
(``worker-0.log``, relative: the report knows no directory) when the job wrote them.

Size: the logs are most of it, one line of text each, with markup only around stderr lines and
a time prefix (``1:02``). The sample job (7 processes, 199 lines) makes 33 kB; 256 processes with
1,000 kept lines of 75 characters each make 21.7 MB, of which 19.2 MB is the lines' own text (the
chart: 250 kB), rendered in 0.6 s of CPU (``tests/unit/test_ui_report.py``, measured with
``time.process_time`` on this project's 2-core machine).
"""

from __future__ import annotations

import time
from html import escape
from typing import Any, Iterable, Mapping, Optional, Sequence
from urllib.parse import quote

from .svg import format_rate, format_time, throughput_svg

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

STATES = ("starting", "running", "restarting", "succeeded", "failed", "stopped")

_CSS = """
:root{color-scheme:light;--fg:#111827;--dim:#6b7280;--line:#e5e7eb;--bg2:#f6f7f9}
*{box-sizing:border-box}
body{margin:0;padding:16px 20px 40px;font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);
background:#fff}
h1{font-size:18px;margin:0 0 8px;font-weight:600}
h1 .id{font-family:ui-monospace,Menlo,Consolas,monospace;font-weight:500}
h2{font-size:14px;margin:22px 0 6px;font-weight:600}
code,pre,.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
dl.head{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:4px 18px;margin:0;
padding:10px 12px;background:var(--bg2);border:1px solid var(--line);border-radius:6px}
dl.head div{min-width:0}dl.head .wide{grid-column:1/-1}
dt{color:var(--dim);font-size:11px;text-transform:uppercase;letter-spacing:.04em}
dd{margin:0;overflow-wrap:anywhere}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;line-height:18px}
.s-starting,.s-restarting{color:#92400e;background:#fef3c7}
.s-running{color:#1e40af;background:#dbeafe}
.s-succeeded{color:#166534;background:#dcfce7}
.s-failed{color:#991b1b;background:#fee2e2}
.s-stopped{color:#374151;background:#eceef1}
#failure{border:1px solid #fca5a5;border-left:4px solid #dc2626;background:#fef2f2;border-radius:6px;
padding:8px 12px;margin:14px 0 0}
#failure h2{margin:0 0 6px;color:#991b1b}
#failure pre{margin:0;padding:6px 8px;background:#fff;border:1px solid #fecaca;border-radius:4px}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:0;tab-size:4}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:2px 8px;border-bottom:1px solid var(--line);white-space:nowrap;vertical-align:top}
th{font-size:11px;color:var(--dim);text-transform:uppercase;letter-spacing:.04em;font-weight:600;
background:var(--bg2)}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.last{white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:34em}
tr.state-failed td{background:#fff5f5}
td.state{font-weight:600}
tr.state-failed td.state{color:#b91c1c}tr.state-succeeded td.state{color:#15803d}
tr.state-running td.state{color:#1d4ed8}tr.state-stopped td.state{color:#6b7280}
tr.state-starting td.state,tr.state-restarting td.state{color:#b45309}
#chart{border:1px solid var(--line);border-radius:6px;padding:6px;overflow-x:auto}
#chart svg{display:block;max-width:100%;height:auto}
details{border:1px solid var(--line);border-radius:6px;margin:4px 0}
details[open]{margin:6px 0}
summary{cursor:pointer;padding:3px 8px;background:var(--bg2);border-radius:6px}
summary .dim{color:var(--dim);font-size:12px}
details .scroll{display:flex;flex-direction:column-reverse;max-height:30em;overflow:auto;
border-top:1px solid var(--line)}
details pre{padding:6px 8px;line-height:1.35}
pre em{font-style:normal;color:#92400e}
.dim{color:var(--dim)}
.note{color:var(--dim);font-size:12px;margin:2px 0 6px}
footer{margin-top:24px;color:var(--dim);font-size:11px}
"""


def render_report(snapshot: Mapping[str, Any], logs_at: str = ".") -> str:
    """The report of the job ``snapshot`` describes: one HTML document, as a string;
    ``logs_at``: where the ``--log-dir`` files are, relative to where the report is written."""
    job = snapshot.get("job") or {}
    procs = list(snapshot.get("processes") or [])
    title = f"pslaunch {job.get('id') or 'job'}: {job.get('state') or '?'}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="referrer" content="no-referrer">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        _header(job, procs),
        _failure(snapshot.get("failure")),
        _attempts(job),
        _process_table(procs),
        _chart(snapshot.get("throughput") or {}, job, procs),
        _logs(procs, snapshot.get("logs") or {}, bool(job.get("logs")), logs_at),
        f'<footer>Written by pslaunch when the job ended{_at(job.get("end"))}. A static page: '
        "no script, nothing loaded from the network.</footer>",
        "</body></html>",
        "",
    ]
    return "\n".join(p for p in parts if p)


# --- sections ----------------------------------------------------------------------------------------


def _header(job: Mapping[str, Any], procs: Sequence[Mapping[str, Any]]) -> str:
    """The job's identity and outcome."""
    state = str(job.get("state") or "?")
    start, end = job.get("start"), job.get("end")
    duration = (end - start) if isinstance(end, (int, float)) and isinstance(start, (int, float)) \
        else job.get("elapsed")
    attempt = int(job.get("attempt") or 0) + 1
    allowed = int(job.get("max_restarts") or 0) + 1
    roles: dict = {}
    for p in procs:
        roles[p.get("role")] = roles.get(p.get("role"), 0) + 1
    cells = [
        ("state", f'<span id="job-state" class="badge s-{_e(state)}">{_e(state)}</span>'),
        ("exit code", _e(_dash(job.get("exit_code")))),
        ("attempt", f'<span id="job-attempt">{attempt}/{allowed}</span>'),
        ("tracker", _e(_dash(job.get("tracker")))),
        ("backend", _e(_dash(job.get("backend")))),
        ("processes", _e(", ".join(f"{n} {r}{'s' if n > 1 else ''}" for r, n in roles.items()) or "none")),
        ("start", _e(_when(start))),
        ("end", _e(_when(end))),
        ("duration", f'<span id="job-elapsed">{_e(_duration(duration))}</span>'),
    ]
    grid = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in cells)
    command = f'<div class="wide"><dt>command</dt><dd><code>{_e(_dash(job.get("command")))}</code></dd></div>'
    return (f'<header><h1>pslaunch job <span class="id">{_e(job.get("id") or "?")}</span></h1>'
            f'<dl class="head">{command}{grid}</dl></header>')


def _failure(failure: Optional[Mapping[str, Any]]) -> str:
    """The first failure, at the top: its headline and last lines."""
    if not failure:
        return ""
    lines = "\n".join(_e(x) for x in failure.get("lines") or [])
    body = f"<pre>{lines}</pre>" if lines else '<p class="note">(it printed nothing)</p>'
    return (f'<section id="failure"><h2>First failure: {_e(failure.get("headline") or failure.get("name"))}</h2>'
            f"{body}</section>")


def _attempts(job: Mapping[str, Any]) -> str:
    """One row per attempt, with why it ended (only when there was more than one)."""
    attempts = job.get("attempts") or []
    if len(attempts) < 2:
        return ""
    start0 = job.get("start")
    rows = []
    for a in attempts:
        s, e = a.get("start"), a.get("end")
        rows.append(
            f"<tr><td class=\"num\">{int(a.get('attempt') or 0) + 1}</td><td>{_e(_offset(s, start0))}</td>"
            f"<td>{_e(_duration(e - s) if _num(s) and _num(e) else '-')}</td>"
            f"<td>{_e(_dash(a.get('reason')))}</td><td class=\"num\">{_e(_dash(a.get('exit_code')))}</td>"
            f"<td>{_e(_cause(a.get('cause')))}</td><td>{_e(_dash(a.get('hosts') or None))}</td></tr>")
    return ('<section id="attempts"><h2>Attempts</h2><table><thead><tr><th class="num">#</th><th>began</th>'
            '<th>lasted</th><th>ended by</th><th class="num">exit</th><th>cause</th><th>hosts</th></tr></thead>'
            "<tbody>" + "".join(rows) + "</tbody></table></section>")


def _process_table(procs: Sequence[Mapping[str, Any]]) -> str:
    """One row per process, with the live page's cells and classes."""
    rows = []
    for p in procs:
        state = str(p.get("state") or "?")
        cells = [
            ("role", _e(p.get("role") or "")),
            ("rank num", _e(_dash(p.get("rank")))),
            ("host", _e(_dash(p.get("host")))),
            ("pid num", _e(_dash(p.get("pid")))),
            ("state", _e(state)),
            ("exit num", _e(_exit(p))),
            ("cpu num", _e("-" if not _num(p.get("cpu")) else f"{p['cpu']:.1f}")),
            ("rss num", _e(_bytes(p.get("rss")))),
            ("speed num", _e("-" if not _num(p.get("speed")) else format_rate(p["speed"]))),
            ("lines num", _e(_dash(p.get("lines")))),
            ("last mono", _e(p.get("last_line") or "")),
        ]
        rows.append(f'<tr data-name="{_e(p.get("name"))}" class="state-{_e(state)}">'
                    + "".join(f'<td class="{c}">{v}</td>' for c, v in cells) + "</tr>")
    head = "".join(f"<th{' class=num' if n else ''}>{h}</th>" for h, n in (
        ("role", 0), ("rank", 1), ("host", 0), ("pid", 1), ("state", 0), ("exit", 1), ("cpu %", 1), ("rss", 1),
        ("samples/s", 1), ("lines", 1), ("last line", 0)))
    return (f'<section><h2>Processes ({len(procs)})</h2><table id="procs"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></section>")


def _chart(throughput: Mapping[str, Any], job: Mapping[str, Any], procs: Sequence[Mapping[str, Any]]) -> str:
    """The throughput chart, restarts marked."""
    start0 = job.get("start")
    restarts = [a["start"] - start0 for a in (job.get("attempts") or [])[1:]
                if _num(a.get("start")) and _num(start0)]
    labels = {str(p.get("name")): str(p.get("label") or p.get("name")) for p in procs}
    svg = throughput_svg(throughput, attempts=restarts, width=1200, height=340, labels=labels)
    points = svg.split('data-points="', 1)[1].split('"', 1)[0]
    return (f'<section><h2>Throughput</h2><div id="chart" data-points="{points}">{svg}</div>'
            '<p class="note">From the Speedometer lines the workers printed; time since the job began.</p>'
            "</section>")


def _logs(procs: Sequence[Mapping[str, Any]], logs: Mapping[str, Any], files: bool, logs_at: str) -> str:
    """Each process's last lines in a ``<details>`` (open when it failed)."""
    blocks = []
    stamps: dict = {}
    names = [str(p.get("name")) for p in procs]
    extra = [n for n in logs if n not in names]  # (lines of a name the table lacks: shown too)
    by_name = {str(p.get("name")): p for p in procs}
    for name in names + sorted(extra):
        p = by_name.get(name, {})
        lines = logs.get(name) or []
        state = str(p.get("state") or "")
        seen = int(p["lines"]) if _num(p.get("lines")) else len(lines)
        kept = f"last {len(lines)} of {seen} lines" if seen > len(lines) else f"{len(lines)} lines"
        link = ""
        if files and p.get("log"):
            log = str(p["log"])
            link = f' · <a class="log-link" href="{_e(_relative(log, logs_at))}">{_e(log)}</a>'
        head = (f"<summary><b>{_e(p.get('label') or name)}</b> <span class=\"dim\">{_e(_dash(p.get('host')))} · "
                f"</span><span class=\"badge s-{_e(state)}\">{_e(state or '?')}</span> "
                f"<span class=\"dim\">{kept}</span>{link}</summary>")
        earlier = ""
        if lines and _num(lines[0][0]) and lines[0][0] > 1:
            earlier = f'<p class="note">&#8230; {int(lines[0][0]) - 1} earlier lines not kept</p>'
        body = '<p class="note">no output</p>'
        if lines:
            body = f'<div class="scroll"><pre data-name="{_e(name)}">{_log_text(lines, stamps)}</pre></div>'
        blocks.append(f"<details{' open' if state == 'failed' else ''}>{head}{earlier}{body}</details>")
    return '<section id="log"><h2>Logs</h2>' + "\n".join(blocks) + "</section>"


def _log_text(lines: Iterable[Sequence[Any]], stamps: dict) -> str:
    """The lines as text: a time prefix each (``m:ss`` since the job began), stderr lines in
    ``<em>`` (brown): the only markup. Escaped in one pass over the whole text, with stderr marked
    by two control characters first (a line has none: the snapshot's lines are printable text,
    and any that came through are removed), which makes 256,000 lines cost ~0.3 s, not ~1.5.
    ``stamps``: second -> its ``m:ss``, shared by the processes of a report."""
    rows = list(lines)
    secs = [int(r[1] + 0.5) if r[1].__class__ in (int, float) else -1 for r in rows]
    seen = set(secs)
    for t in seen.difference(stamps):
        stamps[t] = format_time(t) if t >= 0 else ""
    w = max((len(stamps[t]) for t in seen), default=0)
    texts = [f"{stamps[t]:>{w}} {r[3]}" for t, r in zip(secs, rows)]
    joined = "".join(texts)
    if "\x01" in joined or "\x02" in joined:
        texts = [x.replace("\x01", "").replace("\x02", "") for x in texts]
    marked = "\n".join([f"\x01{x}\x02" if r[2] == "e" else x for x, r in zip(texts, rows)])
    return escape(marked, quote=False).replace("\x01", "<em>").replace("\x02", "</em>")


# --- formatting --------------------------------------------------------------------------------------


def _e(x: Any) -> str:
    return escape(str(x), quote=True)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _dash(x: Any) -> Any:
    return "-" if x is None or x == "" else x


def _exit(p: Mapping[str, Any]) -> str:
    if p.get("signal"):
        return str(p["signal"])
    return "" if p.get("exit_code") is None else str(p["exit_code"])


def _bytes(n: Any) -> str:
    if not _num(n):
        return "-"
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _when(t: Any) -> str:
    if not _num(t):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _at(t: Any) -> str:
    return f", {_when(t)}" if _num(t) else ""


def _offset(t: Any, start: Any) -> str:
    return f"+{format_time(t - start)}" if _num(t) and _num(start) else "-"


def _duration(s: Any) -> str:
    if not _num(s):
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


def _cause(cause: Any) -> str:
    if not isinstance(cause, Mapping):
        return "-" if not cause else str(cause)
    text = ": ".join(str(cause[k]) for k in ("process", "reason") if cause.get(k))
    if cause.get("reported_by"):
        text += f" (reported by {cause['reported_by']})"
    return text or "-"


def _relative(name: str, logs_at: str = ".") -> str:
    """A log file's name as a relative link below ``logs_at``: no scheme, the name's own directory
    dropped (a hostile name stays text)."""
    base = str(name).replace("\\", "/").rsplit("/", 1)[-1]
    parts = [quote(p) for p in logs_at.replace("\\", "/").split("/") if p and p != "."]
    return "./" + "".join(p + "/" for p in parts) + quote(base)
