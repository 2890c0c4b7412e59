#!/usr/bin/env python3
"""What the job page (``--ui``) costs and how fast it is: the figures of docs/job-page.md.

``memory``: the model alone (``launcher.ui.model.JobView``) fed 256 processes x 50,000 lines of
100 characters (``--procs``, ``--lines``, ``--width``), with one viewer taking the events every
2,560 lines: the process's peak RSS over its RSS before, and the model's own estimate.

``live``: a real local job (``python -m launcher -n 4 -s 0``), each worker printing ``--rate``
lines a second (one in ten a Speedometer line, the others stamped with the time they were
printed), for ``--seconds`` a phase: first without ``--ui`` (the reference), then with it in three
phases with 0, 1 and 2 viewers reading ``/events`` over loopback: the launcher's CPU (utime +
stime of its process, /proc) per phase, and each line's latency from the print to its arrival at
a viewer (median, 99th percentile, max).

    .venv/bin/python scripts/bench_ui.py memory
    .venv/bin/python scripts/bench_ui.py live --seconds 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.ui.model import JobView  # noqa: E402

WORKER = r"""
import os, sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
rank = int(os.environ["DMLC_TASK_ID"])
end = time.time() + seconds
i = 0
while time.time() < end:
    i += 1
    if i % 10 == 0:
        print(f"Epoch[0] Batch [{i}-{i + 10}]\tSpeed: {1000 + rank:.2f} samples/sec", flush=True)
    else:
        print(f"stamp {time.time():.6f} line {i} of rank {rank} " + "x" * 40, flush=True)
    time.sleep(1 / rate)
"""


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def memory(procs: int, lines: int, width: int) -> None:
    view = JobView(["python", "train.py"], "ps", "local")
    view.plan("bench", [NS(name=f"worker-{r}", role="worker", rank=r, label=f"worker {r}", host=None)
                        for r in range(procs)], 0)
    view.viewer(+1)
    before = rss_kib()
    text = "y" * (width - 20)
    t0 = time.perf_counter()
    for i in range(lines):
        for r in range(procs):
            view.add_line(f"worker-{r}", f"{i:08d} {r:04d} {text}", False)
        if i % 10 == 0:
            view.events_after(0)
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    printed = procs * lines * width / 2**20
    print(f"memory: {procs} processes x {lines:,} lines of {width} characters ({printed:,.0f} MiB "
          f"printed): RSS {before / 1024:.1f} MiB before, {rss_kib() / 1024:.1f} MiB after, peak {peak / 1024:.1f} MiB "
          f"(+{(peak - before) / 1024:.1f} MiB); the model's estimate {view.memory() / 2**20:.1f} MiB; "
          f"{took / (procs * lines) * 1e6:.1f} us a line")


class Viewer(threading.Thread):
    """Reads /events; keeps each stamped line's latency."""

    def __init__(self, port: int, cookie: str) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\n\r\n".encode())
        self.latencies: list[float] = []
        self.stop = False

    def run(self) -> None:
        buf = b""
        while not self.stop:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            now = time.time()
            buf += data
            *blocks, buf = buf.split(b"\n\n")
            for block in blocks:
                if b"event: lines" in block:
                    doc = json.loads(block.split(b"data: ", 1)[1])
                    for line in doc["lines"]:
                        m = re.match(r"stamp (\d+\.\d+) ", line[4])
                        if m:
                            self.latencies.append(now - float(m.group(1)))

    def close(self) -> None:
        self.stop = True
        self.sock.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def baseline(seconds: float, rate: float, workers: int) -> None:
    """The same job without ``--ui``: the launcher's CPU without the page (the reference)."""
    with tempfile.TemporaryDirectory() as tmp:
        prog = Path(tmp) / "worker.py"
        prog.write_text(WORKER)
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "-n", str(workers), "-s", "0", "--no-progress",
                                 "python", str(prog), str(rate), str(seconds + 5)],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds - 1)
        cpu = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
        print(f"live: {workers} workers x {rate:g} lines/s, no --ui: launcher CPU {cpu * 100:.2f}% of a core")
        proc.terminate()
        proc.wait(30)


def live(seconds: float, rate: float, workers: int) -> None:
    baseline(seconds, rate, workers)
    with tempfile.TemporaryDirectory() as tmp:
        prog = Path(tmp) / "worker.py"
        prog.write_text(WORKER)
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "-n", str(workers), "-s", "0", "--ui",
                                 "--no-progress", "python", str(prog), str(rate), str(3 * seconds + 5)],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"job page http://127\.0\.0\.1:(\d+)/#token=(\S+)", line)
            if m:
                break
        else:
            raise SystemExit("no job page line")
        threading.Thread(target=lambda: proc.stderr and proc.stderr.read(), daemon=True).start()
        port, token = int(m.group(1)), m.group(2)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/session", headers={"X-Pslaunch-Token": token})
        cookie = (conn.getresponse().getheader("Set-Cookie") or "").split(";")[0]
        time.sleep(2)  # (the workers start)
        viewers: list[Viewer] = []
        for n in (0, 1, 2):
            while len(viewers) < n:
                viewers.append(Viewer(port, cookie))
                viewers[-1].start()
            time.sleep(1)
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(seconds - 1)
            cpu = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
            print(f"live: {workers} workers x {rate:g} lines/s, {n} viewer(s): launcher CPU {cpu * 100:.2f}% of a core")
        lat = sorted(x for v in viewers for x in v.latencies)
        for v in viewers:
            v.close()
        proc.terminate()
        proc.wait(30)
    if lat:
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"live: line latency print -> viewer over {len(lat):,} lines: median {statistics.median(lat) * 1000:.0f} "
              f"ms, p99 {p99 * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--procs", type=int, default=256)
    m.add_argument("--lines", type=int, default=50_000)
    m.add_argument("--width", type=int, default=100)
    live_p = sub.add_parser("live")
    live_p.add_argument("--seconds", type=float, default=20)
    live_p.add_argument("--rate", type=float, default=20)
    live_p.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    if args.what == "memory":
        memory(args.procs, args.lines, args.width)
    else:
        live(args.seconds, args.rate, args.workers)


if __name__ == "__main__":
    main()
