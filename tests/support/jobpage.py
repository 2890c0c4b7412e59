"""A real job with its page (``pslaunch --ui``), and plain HTTP clients of that page.

:class:`UIJob` starts pslaunch in the background, reads both of its streams in threads (so the
job never blocks on a full pipe) and waits for the one line ``pslaunch: job page URL``.
:func:`session_cookie` does what the page's bootstrap script does (``POST /session`` with the
token from the URL's fragment); :class:`SSEClient` reads ``/events`` as an ``EventSource`` would,
``Last-Event-ID`` included. Used by tests/integration/test_job_page.py and scripts/bench_ui.py.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from support.helpers import BIN, REPO, pslaunch_argv, wait_for

SPEEDO = BIN / "speedo.py"
URL_RE = re.compile(r"pslaunch: job page (http://\S+)")


class UIJob:
    """``pslaunch ARGS`` running in the background, its output collected line by line."""

    def __init__(self, args: list[str], env: Optional[dict] = None, cwd: Path = REPO) -> None:
        self.args = args
        self.proc = subprocess.Popen(pslaunch_argv(*args), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, dst), daemon=True)
                         for s, dst in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()
        self.url = ""

    @staticmethod
    def _read(stream, dst: list[str]) -> None:
        for line in stream:
            dst.append(line.rstrip("\n"))

    def output(self) -> str:
        """Everything pslaunch printed so far (stderr, then stdout)."""
        return "\n".join(self.err + self.out)

    def wait_url(self, timeout: float = 60) -> str:
        """The page's URL (with ``#token=...``) from pslaunch's one line."""
        def found() -> Optional[str]:
            for line in self.err + self.out:
                m = URL_RE.search(line)
                if m:
                    return m.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"pslaunch ended ({self.proc.returncode}) before printing the page's URL:\n"
                                     f"{self.output()[-3000:]}")
            return None
        self.url = str(wait_for(found, timeout, what="the 'pslaunch: job page' line"))
        return self.url

    @property
    def origin(self) -> str:
        u = urlsplit(self.url)
        return f"{u.scheme}://{u.netloc}"

    @property
    def address(self) -> tuple[str, int]:
        u = urlsplit(self.url)
        return u.hostname or "", u.port or 80

    @property
    def token(self) -> str:
        return self.url.split("#token=", 1)[1]

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(5)
        return code

    def stop(self) -> None:
        """End the job if it still runs: Ctrl-C, then SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for t in self._readers:
            t.join(5)


def speedo_argv(*args: str) -> list[str]:
    """The command of tests/bin/speedo.py (a training job's output without the training)."""
    return [sys.executable, str(SPEEDO), *args]


# --- plain HTTP ------------------------------------------------------------------------------------

def request(address: tuple[str, int], method: str, path: str, headers: Optional[dict] = None,
            timeout: float = 10) -> tuple[int, dict, bytes]:
    """One request, on a connection of its own: ``(status, headers (lower-case names), body)``."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def session_cookie(address: tuple[str, int], token: str) -> str:
    """``pslaunch_session_PORT=...``: what the bootstrap page gets for the token (``POST /session``)."""
    status, headers, body = request(address, "POST", "/session", {"X-Pslaunch-Token": token})
    assert status == 204, (status, body[:200])
    cookie = headers.get("set-cookie", "")
    return cookie.split(";", 1)[0]


def state(address: tuple[str, int], cookie: str) -> dict:
    """``GET /api/state``: the snapshot."""
    status, _, body = request(address, "GET", "/api/state", {"Cookie": cookie})
    assert status == 200, (status, body[:200])
    return json.loads(body)


class SSEClient:
    """``GET /events`` read as an EventSource does: messages ``(id, event, data)`` with their
    arrival time (``time.time()``); ``last_id`` resumes a stream (``Last-Event-ID``)."""

    def __init__(self, address: tuple[str, int], cookie: str, last_id: Optional[str] = None,
                 timeout: float = 30) -> None:
        self.conn = http.client.HTTPConnection(*address, timeout=timeout)
        headers = {"Cookie": cookie, "Accept": "text/event-stream"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        self.conn.request("GET", "/events", headers=headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.status
        self.last_id: Optional[str] = last_id

    def next(self) -> Optional[tuple[str, str, object, float]]:
        """The next message ``(id, event, parsed data, arrival time)``; None at the end of the stream."""
        fields: dict[str, str] = {}
        while True:
            raw = self.resp.fp.readline()
            if not raw:
                return None
            line = raw.decode("utf-8").rstrip("\r\n")
            if line == "":
                if "data" in fields or "event" in fields:
                    if "id" in fields:
                        self.last_id = fields["id"]
                    data = fields.get("data", "")
                    return (fields.get("id", ""), fields.get("event", "message"),
                            json.loads(data) if data else None, time.time())
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            fields[key] = fields[key] + "\n" + value if key == "data" and key in fields else value

    def close(self) -> None:
        self.conn.close()


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (its threads included) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
