"""The live job page of a real local job (``--ui``): its address line, the token -> cookie
exchange, a line a worker prints reaching ``/events`` while the job runs, a worker killed with
SIGKILL turning failed with its exit code, and what is left afterwards (``--summary-json``'s
address without the token, no token in ``--log-file``, the ``--report`` file)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from support.helpers import pslaunch_argv

pytestmark = pytest.mark.integration

PROGRAM = r"""
import os, sys, time
rank = int(os.environ["DMLC_TASK_ID"])
for i in range(3):
    print(f"Epoch[0] Batch [{i * 10}-{i * 10 + 10}]\tSpeed: {100 * (rank + 1) + i:.2f} samples/sec", flush=True)
    time.sleep(0.2)
time.sleep(1.5)
print(f"only rank {rank} says this at {time.time():.6f}", flush=True)
time.sleep(60)
"""


class Viewer:
    """An SSE client that keeps the page's state as a browser would: rows merged by name."""

    def __init__(self, port: int, cookie: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\n\r\n".encode())
        self.buf = b""
        self.rows: dict[str, dict] = {}
        self.lines: list[tuple[float, list]] = []  # (when it arrived, [name, seq, t, o|e, text])
        self.job: dict = {}
        assert self._block(b"\r\n\r\n").startswith(b"HTTP/1.0 200")

    def _block(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the page closed the stream")
            self.buf += data
        out, self.buf = self.buf.split(sep, 1)
        return out

    def step(self) -> None:
        fields = dict(line.split(": ", 1) for line in self._block(b"\n\n").decode().split("\n")
                      if ": " in line and not line.startswith(":"))
        if "event" not in fields:
            return
        data: Any = json.loads(fields["data"])
        kind = fields["event"]
        if kind == "snapshot":
            self.job = data["job"]
            self.rows = {p["name"]: p for p in data["processes"]}
            for name, lines in data["logs"].items():
                self.lines += [(time.time(), [name, *line]) for line in lines]
        elif kind == "procs":
            self.rows.update({p["name"]: p for p in data["procs"]})
        elif kind == "lines":
            self.lines += [(time.time(), line) for line in data["lines"]]
        elif kind == "job":
            self.job = data

    def until(self, cond: Any, timeout: float, what: str) -> float:
        """Read events until ``cond()``; the seconds it took."""
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no {what} within {timeout}s; rows {self.rows}")
            self.step()
        return time.monotonic() - t0


def address_line(proc: subprocess.Popen, seen: list[str]) -> str:
    """The ``pslaunch: job page ...`` line from stderr (stderr is read on by a thread after)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("pslaunch: job page "):
            threading.Thread(target=lambda: seen.extend(proc.stderr or ()), daemon=True).start()
            return line.strip()
    raise AssertionError("no job page line: " + "".join(seen))


def post_token(port: int, token: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/session", headers={"X-Pslaunch-Token": token})
    r = conn.getresponse()
    assert r.status == 204
    cookie = r.getheader("Set-Cookie") or ""
    conn.close()
    return cookie.split(";")[0]


def test_a_running_jobs_page_shows_its_lines_and_a_killed_worker(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    summary, log_file, report = tmp_path / "s.json", tmp_path / "launcher.log", tmp_path / "report.html"
    proc = subprocess.Popen(
        pslaunch_argv("-n", "2", "-s", "0", "--ui", "--no-progress", "--kill-grace", "2",
                      "--summary-json", str(summary), "--log-file", str(log_file), "--report", str(report),
                      "--log-dir", str(tmp_path / "logs"), "python", str(program)),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    viewer: Optional[Viewer] = None
    try:
        line = address_line(proc, stderr)
        m = re.fullmatch(r"pslaunch: job page http://127\.0\.0\.1:(\d+)/#token=([\w-]{43})", line)
        assert m, line
        port, token = int(m.group(1)), m.group(2)
        viewer = Viewer(port, post_token(port, token))
        viewer.until(lambda: len(viewer.rows) == 2 and all(r["pid"] for r in viewer.rows.values()), 30,
                     "two running workers")
        viewer.until(lambda: any("only rank 1 says" in entry[1][4] for entry in viewer.lines), 30, "rank 1's line")
        arrived, said = next((a, e[4]) for a, e in viewer.lines if "only rank 1 says" in e[4])
        latency = arrived - float(said.rsplit(" ", 1)[1])
        assert latency < 1.0, f"a line took {latency:.3f}s to reach the page"
        assert viewer.rows["worker-0"]["speed"] == 102.0 or viewer.rows["worker-0"]["lines"] >= 3
        pid = viewer.rows["worker-1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        took = viewer.until(lambda: viewer.rows["worker-1"]["state"] == "failed", 2.0, "failed worker 1")
        assert (viewer.rows["worker-1"]["exit_code"], viewer.rows["worker-1"]["signal"]) == (137, "SIGKILL")
        print(f"line latency {latency * 1000:.0f} ms; SIGKILL to a failed row {took * 1000:.0f} ms")
        viewer.until(lambda: viewer.job.get("state") == "failed", 30, "the job's end")
        assert proc.wait(30) == 137
    finally:
        if viewer is not None:
            viewer.sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    doc = json.loads(summary.read_text())
    assert doc["ui"] == f"http://127.0.0.1:{port}/"
    assert token not in summary.read_text() and token not in log_file.read_text()
    assert "job page" not in log_file.read_text()
    assert "worker-1" in report.read_text() and token not in report.read_text()
    with pytest.raises(OSError):  # (the page ends with the job: --ui-linger 0)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
