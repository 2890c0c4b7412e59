#!/usr/bin/env python3
"""What the job page (``pslaunch --ui``, issue 33) costs and how fast it is.

1. **Line-to-page latency.** Workers of ``pslaunch --ui`` (local backend) print numbered lines that
   carry the time they were printed (tests/bin/speedo.py: ``tick K of worker R at EPOCH``). A real
   SSE client (``/events``, as the page's EventSource reads it) records when each line arrives;
   with ``--browser``, headless Chromium also records when each line's element appears in the
   page's log pane (a MutationObserver; Chromium's clock is this machine's; lines printed before it
   watched, the backlog the page draws when it opens, do not count). Median, p95 and max
   over ``--lines`` lines, at two rates: a line per worker every 50 ms, and one every 0.5 s.
2. **The launcher's CPU with 0, 1 and 2 viewers**, during a training-like job: a scheduler, a
   server and 4 workers, each worker printing a Speedometer line and a tick line every 0.1 s
   (80 lines/s in all: more than most training jobs print). The launcher's own user+system time
   (its threads, the page's server included) from /proc, over ``--seconds`` after a 3 s warm-up,
   in % of one core; median of ``--repeat`` runs, the cases interleaved. Viewers are SSE clients
   (``--viewers sse``, the default) or Chromium tabs (``--viewers browser``: the tabs' own CPU is
   on the same 2 cores). Without ``--ui`` as the reference.
3. **The launcher's memory at 256 processes printing 50,000 lines each** (``--procs``,
   ``--lines-each``): a real ``-n 256 -s 0`` job on this machine, each process printing 75-character
   lines as fast as it can; the launcher's peak RSS (VmHWM) without ``--ui``, with ``--ui`` and
   nobody watching, and with one SSE viewer throughout. Then the model alone
   (``launcher.ui.model.JobView`` fed the same lines in one process, no pipes), for the bound
   without the rest of the launcher: ``--model-only`` skips the real job.

There is no peer to put beside these figures: Ray's dashboard serves Ray's own cluster state
(a separate process fed by GCS, not a launcher's pipes), and torchrun, horovodrun, TorchX and
dmlc's tracker have no page at all.

    .venv/bin/python scripts/bench_ui.py                     # all three, SSE viewers
    .venv/bin/python scripts/bench_ui.py --browser --viewers browser
    .venv/bin/python scripts/bench_ui.py --only memory --procs 64 --lines-each 10000
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.jobpage import SSEClient, UIJob, proc_cpu_seconds, session_cookie, speedo_argv  # noqa: E402

TICK_RE = re.compile(r"^tick (\d+) of worker (\d+) at ([0-9.]+)$")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def ms(v: float) -> str:
    return f"{v * 1000:.0f} ms"


# --- 1. latency ------------------------------------------------------------------------------------

def sse_latencies(job: UIJob, count: int, timeout: float) -> list[float]:
    """Seconds from print to arrival over /events, for ``count`` tick lines (the snapshot's skipped)."""
    client = SSEClient(job.address, session_cookie(job.address, job.token))
    out: list[float] = []
    end = time.monotonic() + timeout
    try:
        while len(out) < count and time.monotonic() < end:
            msg = client.next()
            if msg is None:
                break
            _id, event, data, arrived = msg
            if event != "lines":
                continue
            for _name, _seq, _t, _s, text in data["lines"]:  # type: ignore[index]
                m = TICK_RE.match(text)
                if m:
                    out.append(arrived - float(m.group(3)))
    finally:
        client.close()
    return out[:count]


OBSERVER_JS = """
window.__arrivals = [];
window.__since = Date.now() / 1000;
var log = document.querySelector('#log');
new MutationObserver(function (records) {
  var now = performance.timeOrigin + performance.now();
  records.forEach(function (r) { r.addedNodes.forEach(function (n) {
    if (n.nodeType === 1 && n.textContent.indexOf('tick ') >= 0) { window.__arrivals.push([n.textContent, now]); }
  }); });
}).observe(log, {childList: true, subtree: true});
"""


def browser_latencies(job: UIJob, count: int, timeout: float, out_dir: Path) -> list[float]:
    """Seconds from print to the line's element in the page's log pane (headless Chromium)."""
    from support.browser import Browser

    out_dir.mkdir(parents=True, exist_ok=True)
    b = Browser(out_dir)
    try:
        b.get(job.url)
        end = time.monotonic() + 30
        while not b.js("return !!document.querySelector('#log')") and time.monotonic() < end:
            time.sleep(0.1)
        b.js(OBSERVER_JS)
        end = time.monotonic() + timeout
        arrivals: list = []
        while time.monotonic() < end:
            arrivals = b.js("return window.__arrivals")
            if len(arrivals) >= count:
                break
            time.sleep(0.5)
        since = b.js("return window.__since")
        b.shot("latency")
    finally:
        b.close()
    found = []
    for text, at in arrivals:
        m = re.search(r"tick \d+ of worker \d+ at ([0-9.]+)", text)
        if m and float(m.group(1)) > since:  # (not the backlog the page drew when it opened)
            found.append(at / 1000 - float(m.group(1)))
    return found[:count]


def latency(count: int, browser: bool) -> None:
    print(f"\n### Line-to-page latency ({count} lines; 2 workers, local backend)\n")
    print("| a line per worker every | client | median | p95 | max | lines |")
    print("|---|---|---|---|---|---|")
    for interval in (0.05, 0.5):
        clients = ["SSE client"] + (["Chromium log pane"] if browser else [])
        for client in clients:
            n = count if interval < 0.1 else max(20, count // 10)
            seconds = n / 2 * interval + 20
            job = UIJob(["--ui", "-n", "2", "-s", "0", *speedo_argv("--seconds", str(seconds),
                                                                     "--interval", str(interval))])
            try:
                job.wait_url()
                if client == "SSE client":
                    lat = sse_latencies(job, n, seconds)
                else:
                    lat = browser_latencies(job, n, seconds, REPO / "test-artifacts" / "bench_ui")
            finally:
                job.stop()
            if not lat:
                print(f"| {ms(interval)} | {client} | - | - | - | 0 |")
                continue
            print(f"| {ms(interval)} | {client} | {ms(statistics.median(lat))} | {ms(pct(lat, 0.95))} "
                  f"| {ms(max(lat))} | {len(lat)} |")


# --- 2. CPU with viewers ---------------------------------------------------------------------------

class SSEViewer(threading.Thread):
    """A viewer that reads /events to the end, as an open page does (after GET /api/state)."""

    def __init__(self, job: UIJob) -> None:
        super().__init__(daemon=True)
        self.client = SSEClient(job.address, session_cookie(job.address, job.token), timeout=60)
        self.messages = 0

    def run(self) -> None:
        try:
            while self.client.next() is not None:
                self.messages += 1
        except OSError:
            pass

    def close(self) -> None:
        self.client.close()


def one_cpu_run(viewers: int, kind: str, seconds: float, ui: bool = True) -> float:
    """% of one core the launcher used over ``seconds`` with ``viewers`` viewers."""
    job = UIJob([*(["--ui"] if ui else []), "-n", "4", "-s", "1",
                 *speedo_argv("--seconds", str(seconds + 15), "--interval", "0.1")])
    opened: list = []
    browser = None
    try:
        if ui:
            job.wait_url()
            if kind == "browser" and viewers:
                from support.browser import Browser

                out = REPO / "test-artifacts" / "bench_ui" / f"cpu-{viewers}-viewers"
                out.mkdir(parents=True, exist_ok=True)
                browser = Browser(out)
                for i in range(viewers):
                    if i:
                        browser.driver.switch_to.new_window("tab")
                    browser.get(job.url)
            else:
                for _ in range(viewers):
                    v = SSEViewer(job)
                    v.start()
                    opened.append(v)
        else:
            time.sleep(2)
        time.sleep(3)  # warm-up: every process started, the viewers got their snapshot
        c0, t0 = proc_cpu_seconds(job.proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = proc_cpu_seconds(job.proc.pid), time.monotonic()
        if browser is not None:
            browser.shot(f"{viewers}-tabs")
    finally:
        for v in opened:
            v.close()
        if browser is not None:
            browser.close()
        job.stop()
    return (c1 - c0) / (t1 - t0) * 100


def cpu(seconds: float, repeat: int, kind: str) -> None:
    cases = [("no --ui", 0, False), ("--ui, 0 viewers", 0, True), ("--ui, 1 viewer", 1, True),
             ("--ui, 2 viewers", 2, True)]
    got: dict[str, list[float]] = {c[0]: [] for c in cases}
    for _ in range(repeat):
        for name, viewers, ui in cases:  # interleaved: load changes hit every case alike
            got[name].append(one_cpu_run(viewers, kind, seconds, ui))
    base = statistics.median(got["--ui, 0 viewers"])
    print(f"\n### The launcher's CPU during a training-like job ({kind} viewers; {seconds:.0f} s, "
          f"median of {repeat})\n")
    print("| case | launcher CPU, % of one core | vs 0 viewers | runs |")
    print("|---|---|---|---|")
    for name, values in got.items():
        m = statistics.median(values)
        delta = "" if name.startswith("no") or name.endswith("0 viewers") else f"{m - base:+.2f}"
        print(f"| {name} | {m:.2f} | {delta} | {', '.join(f'{v:.2f}' for v in values)} |")


# --- 3. memory at 256 processes --------------------------------------------------------------------

FLOOD = ("import os, sys\nw = os.environ.get('DMLC_TASK_ID', '0')\nn = int(sys.argv[1])\nout = sys.stdout\n"
         "for i in range(n):\n"
         "    out.write(f'worker {w:>3} step {i:>6} loss 0.2134 accuracy 0.9312 lr 0.0100 padding xxxxxxx\\n')\n")


def vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def one_memory_run(procs: int, lines: int, ui: bool, viewer: bool) -> tuple[int, float, int]:
    """(peak RSS of the launcher, wall seconds, exit code) of a flood job."""
    job = UIJob([*(["--ui"] if ui else []), "-n", str(procs), "-s", "0", "--no-progress",
                 sys.executable, "-c", FLOOD, str(lines)])
    t0 = time.monotonic()
    peak = 0
    v: Optional[SSEViewer] = None
    try:
        if ui:
            job.wait_url(120)
            if viewer:
                v = SSEViewer(job)
                v.start()
        while job.proc.poll() is None:
            try:
                peak = max(peak, vm(job.proc.pid, "VmHWM"))
            except OSError:
                break
            time.sleep(0.5)
        code = job.wait(600)
    finally:
        if v is not None:
            v.close()
        job.stop()
    return peak, time.monotonic() - t0, code


MODEL_FEED = r"""
import resource, sys, time
from types import SimpleNamespace
from launcher.ui.model import JobView
procs, lines = int(sys.argv[1]), int(sys.argv[2])
view = JobView(["python", "flood.py"], "rabit", "local")
specs = [SimpleNamespace(name=f"worker-{r}", role="worker", rank=r, label=f"worker {r}", host=None)
         for r in range(procs)]
view.plan("bench", specs, 0)
watch = sys.argv[3] == "1"
if watch:
    view.viewer(+1)
t0 = time.perf_counter()
names = [f"worker-{r}" for r in range(procs)]
for i in range(lines):
    for r, name in enumerate(names):
        view.add_line(name, f"worker {r:>3} step {i:>6} loss 0.2134 accuracy 0.9312 lr 0.0100 padding xxxxxxx", False)
took = time.perf_counter() - t0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, view.memory(), took)
"""


def model_run(procs: int, lines: int, watched: bool) -> tuple[int, int, float]:
    r = subprocess.run([sys.executable, "-c", MODEL_FEED, str(procs), str(lines), "1" if watched else "0"],
                       cwd=REPO, capture_output=True, text=True, check=True)
    rss, kept, took = r.stdout.split()
    return int(rss), int(kept), float(took)


def empty_rss() -> int:
    r = subprocess.run([sys.executable, "-c", "import resource, launcher.ui.model; "
                        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                       cwd=REPO, capture_output=True, text=True, check=True)
    return int(r.stdout)


def memory(procs: int, lines: int, model_only: bool) -> None:
    mib = 1024 * 1024
    if not model_only:
        print(f"\n### The launcher's peak RSS: a real job of {procs} processes printing {lines:,} lines each "
              f"({procs * lines / 1e6:.1f} M lines of 75 characters)\n")
        print("| case | launcher peak RSS | job wall time | exit code |")
        print("|---|---|---|---|")
        for name, ui, viewer in (("no --ui", False, False), ("--ui, nobody watching", True, False),
                                 ("--ui, 1 SSE viewer throughout", True, True)):
            peak, wall, code = one_memory_run(procs, lines, ui, viewer)
            print(f"| {name} | {peak / mib:.1f} MiB | {wall:.1f} s | {code} |")
    print(f"\n### The model alone (launcher.ui.model.JobView fed {procs} x {lines:,} lines in one process)\n")
    print("| case | process peak RSS | of it above an idle interpreter | JobView.memory() (kept lines, series, "
          "events) | feeding took |")
    print("|---|---|---|---|---|")
    base = empty_rss()
    for name, watched in (("nobody watching", False), ("a viewer registered (events encoded)", True)):
        rss, kept, took = model_run(procs, lines, watched)
        print(f"| {name} | {rss / mib:.1f} MiB | {(rss - base) / mib:.1f} MiB | {kept / mib:.1f} MiB | {took:.1f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("latency", "cpu", "memory"), action="append")
    ap.add_argument("--lines", type=int, default=400, help="lines whose latency is measured")
    ap.add_argument("--browser", action="store_true", help="also measure latency to Chromium's log pane")
    ap.add_argument("--seconds", type=float, default=20, help="CPU measuring window per run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--viewers", choices=("sse", "browser"), default="sse")
    ap.add_argument("--procs", type=int, default=256)
    ap.add_argument("--lines-each", type=int, default=50_000)
    ap.add_argument("--model-only", action="store_true", help="memory: feed the model only (no 256-process job)")
    a = ap.parse_args()
    os.environ.setdefault("SE_OFFLINE", "true")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # (256 processes: 3 pipes each in the launcher)
    only = set(a.only or ("latency", "cpu", "memory"))
    print(f"pslaunch job page, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}")
    if "latency" in only:
        latency(a.lines, a.browser)
    if "cpu" in only:
        cpu(a.seconds, a.repeat, a.viewers)
    if "memory" in only:
        memory(a.procs, a.lines_each, a.model_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
