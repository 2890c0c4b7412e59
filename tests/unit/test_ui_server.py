"""The job page's server (launcher/ui/server.py) over real sockets: 403 without the session's
cookie, with a wrong token and with a foreign Host; the token -> cookie exchange; the CSP and the
other headers on every answer; SSE with Last-Event-ID replay; and network input that must never
hurt the launcher (disconnects, a viewer that reads nothing, garbage)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Iterator, Optional

import pytest

from launcher.errors import ConfigError
from launcher.ui import server as srv
from launcher.ui.model import JobView
from launcher.ui.server import PageServer, parse_address

SECRET_COMMAND = "python train.py --very-private-flag"


@pytest.fixture
def page(tmp_path: Path) -> Iterator[PageServer]:
    view = JobView(SECRET_COMMAND.split(), "ps", "local", logs=True)
    view.plan("pslaunch-t", [NS(name=f"worker-{r}", role="worker", rank=r, label=f"worker {r}", host=None)
                             for r in range(2)], 0)
    server = PageServer.open(view, "127.0.0.1", 0, str(tmp_path)).start()
    try:
        yield server
    finally:
        server.close()


def request(server: PageServer, method: str, path: str, headers: Optional[dict] = None,
            host: Optional[str] = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{server.port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def session(server: PageServer) -> str:
    status, headers, _ = request(server, "POST", "/session", {srv.TOKEN_HEADER: server.token})
    assert status == 204
    return headers["set-cookie"].split(";")[0]


def test_every_route_without_the_cookie_is_403_and_the_bootstrap_holds_no_job_data(page: PageServer) -> None:
    for path in ("/", "/api/state", "/events", "/static/app.js", "/logs/worker-0.log", "/nothing"):
        status, _, body = request(page, "GET", path)
        assert status == 403, path
        assert b"very-private" not in body and b"pslaunch-t" not in body
    status, headers, body = request(page, "GET", "/")
    assert headers["content-type"].startswith("text/html") and b"/session" in body  # (the bootstrap page)
    status, _, _ = request(page, "GET", "/api/state", {"Cookie": f"{page.cookie}=made-up"})
    assert status == 403


def test_the_token_is_exchanged_for_an_httponly_strict_cookie(page: PageServer) -> None:
    assert request(page, "POST", "/session")[0] == 403
    assert request(page, "POST", "/session", {srv.TOKEN_HEADER: page.token[:-1] + "x"})[0] == 403
    assert request(page, "POST", "/session", {srv.TOKEN_HEADER: "é" * 43})[0] == 403
    status, headers, _ = request(page, "POST", "/session", {srv.TOKEN_HEADER: page.token})
    assert status == 204
    cookie = headers["set-cookie"]
    assert re.fullmatch(rf"{page.cookie}=[\w-]{{40,}}; HttpOnly; SameSite=Strict; Path=/", cookie), cookie
    assert page.token not in cookie
    status, headers, body = request(page, "GET", "/api/state", {"Cookie": "other=1; " + cookie.split(";")[0]})
    assert status == 200 and headers["content-type"] == "application/json"
    snap = json.loads(body)
    assert snap["job"]["command"] == SECRET_COMMAND and [p["name"] for p in snap["processes"]] == [
        "worker-0", "worker-1"]


def test_two_jobs_pages_in_one_browser_keep_their_own_cookies(page: PageServer, tmp_path: Path) -> None:
    """A browser sends 127.0.0.1's cookies to every port: each page names its cookie by its port,
    so a second job's page neither overwrites the first's session nor takes it."""
    other = PageServer.open(JobView(["true"], "ps", "local"), "127.0.0.1", 0, str(tmp_path)).start()
    try:
        mine, theirs = session(page), session(other)
        assert mine.split("=")[0] != theirs.split("=")[0]
        both = {"Cookie": f"{mine}; {theirs}"}
        assert request(page, "GET", "/api/state", both)[0] == 200
        assert request(other, "GET", "/api/state", both)[0] == 200
        value = mine.split("=", 1)[1]
        assert request(other, "GET", "/api/state", {"Cookie": f"{other.cookie}={value}"})[0] == 403
    finally:
        other.close()


def test_a_foreign_host_is_refused_even_with_the_cookie(page: PageServer) -> None:
    cookie = session(page)
    for host in (f"localhost:{page.port}", f"127.0.0.1:{page.port}"):
        assert request(page, "GET", "/api/state", {"Cookie": cookie}, host=host)[0] == 200
    for host in (f"evil.example:{page.port}", f"127.0.0.1:{page.port + 1}", "127.0.0.1", ""):
        assert request(page, "GET", "/api/state", {"Cookie": cookie}, host=host)[0] == 403, host
    assert request(page, "POST", "/session", {srv.TOKEN_HEADER: page.token}, host="evil.example")[0] == 403


def test_every_answer_has_the_csp_and_the_bootstrap_script_is_the_one_it_allows(page: PageServer) -> None:
    cookie = session(page)
    answers = [request(page, "GET", "/"), request(page, "GET", "/api/state", {"Cookie": cookie}),
               request(page, "GET", "/nothing", {"Cookie": cookie}), request(page, "PUT", "/", {"Cookie": cookie})]
    assert [a[0] for a in answers] == [403, 200, 404, 405]
    for _, headers, _ in answers:
        csp = headers["content-security-policy"]
        assert csp.startswith("default-src 'none'; script-src 'self' 'sha256-") and "frame-ancestors 'none'" in csp
        assert (headers["x-content-type-options"], headers["referrer-policy"], headers["cache-control"]) == (
            "nosniff", "no-referrer", "no-store")
        assert "python" not in headers.get("server", "").lower()  # (no version to look up)
    script = re.search(rb"<script>(.*)</script>", answers[0][2]).group(1)  # type: ignore[union-attr]
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    assert f"'sha256-{digest}'" in answers[0][1]["content-security-policy"]


def test_the_page_and_its_files_are_served_with_the_cookie(page: PageServer) -> None:
    cookie = session(page)
    status, headers, body = request(page, "GET", "/", {"Cookie": cookie})
    assert status == 200 and headers["content-type"].startswith("text/html") and b"<html" in body


class Events:
    """An SSE client on a raw socket: messages as dicts (id, event, data)."""

    def __init__(self, server: PageServer, cookie: str, last: Optional[int] = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        extra = f"Last-Event-ID: {last}\r\n" if last is not None else ""
        self.sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nCookie: {cookie}\r\n{extra}\r\n"
                          .encode())
        self.buf = b""
        head = self._until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200"), head
        assert b"text/event-stream" in head

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError
            self.buf += data
        out, self.buf = self.buf.split(sep, 1)
        return out

    def next(self) -> dict:
        while True:
            block = self._until(b"\n\n").decode()
            fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and line[0] != ":")
            if "event" in fields:
                return {"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])}

    def close(self) -> None:
        self.sock.close()


def test_sse_starts_with_a_snapshot_and_replays_every_event_after_last_event_id(page: PageServer) -> None:
    cookie = session(page)
    view = page.view
    first = Events(page, cookie)
    snap = first.next()
    assert snap["event"] == "snapshot" and snap["data"]["job"]["id"] == "pslaunch-t"
    view.add_line("worker-0", "before the break", False)
    got = first.next()
    assert got["event"] == "lines" and got["data"]["lines"][0][4] == "before the break"
    first.close()
    for i in range(50):  # (printed while the viewer is away: none may be lost)
        view.add_line("worker-1", f"away {i}", False)
    view.set_state("running")
    again = Events(page, cookie, last=got["id"])
    seen: list[str] = []
    kinds = []
    while len(seen) < 50 or "job" not in kinds:
        m = again.next()
        kinds.append(m["event"])
        if m["event"] == "lines":
            seen += [line[4] for line in m["data"]["lines"]]
    assert "snapshot" not in kinds and seen == [f"away {i}" for i in range(50)]
    again.close()
    stale = Events(page, cookie, last=10**9)  # (an id this job never gave: a snapshot)
    assert stale.next()["event"] == "snapshot"
    stale.close()


def test_a_line_reaches_a_viewer_well_within_a_second(page: PageServer) -> None:
    cookie = session(page)
    viewer = Events(page, cookie)
    viewer.next()
    delays = []
    for i in range(5):
        t0 = time.monotonic()
        page.view.add_line("worker-0", f"now {i}", False)
        m = viewer.next()
        assert m["data"]["lines"][0][4] == f"now {i}"
        delays.append(time.monotonic() - t0)
    viewer.close()
    assert max(delays) < 0.6, delays


def test_viewers_that_vanish_or_read_nothing_never_hold_up_the_job(page: PageServer) -> None:
    cookie = session(page)
    stuck = []
    for _ in range(3):  # viewers that never read: their socket buffers fill up
        s = socket.create_connection(("127.0.0.1", page.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{page.port}\r\nCookie: {cookie}\r\n\r\n".encode())
        stuck.append(s)
    gone = Events(page, cookie)
    gone.next()
    gone.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    gone.close()  # (a reset, mid-stream)
    for junk in (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"GET"):
        with socket.create_connection(("127.0.0.1", page.port)) as s:
            s.sendall(junk)
    t0 = time.monotonic()
    line = "z" * 1500
    for i in range(20_000):  # 30 MB for each viewer: far more than any socket holds
        page.view.add_line(f"worker-{i % 2}", line, False)
        if i % 500 == 0:
            time.sleep(0.01)  # (let the viewers' threads try to write)
    took = time.monotonic() - t0
    assert took < 10, f"the job's lines took {took:.1f}s with stuck viewers"
    status, _, body = request(page, "GET", "/api/state", {"Cookie": cookie})
    assert status == 200 and json.loads(body)["processes"][0]["lines"] == 10_000
    for s in stuck:
        s.close()


def test_the_full_log_is_served_from_the_log_dir_and_no_link_is_followed(page: PageServer, tmp_path: Path) -> None:
    cookie = session(page)
    (tmp_path / "worker-0.log").write_text("line 1\nline 2\n")
    secret = tmp_path.parent / "outside.txt"
    secret.write_text("not yours\n")
    os.symlink(secret, tmp_path / "worker-1.log")
    status, headers, body = request(page, "GET", "/logs/worker-0.log", {"Cookie": cookie})
    assert (status, body) == (200, b"line 1\nline 2\n") and headers["content-type"].startswith("text/plain")
    assert request(page, "GET", "/logs/worker-1.log", {"Cookie": cookie})[0] == 404
    for path in ("/logs/scheduler.log", "/logs/..%2Foutside.txt.log", "/logs/worker-0.log/../x.log"):
        assert request(page, "GET", path, {"Cookie": cookie})[0] == 404, path


@pytest.mark.parametrize("text,expected", [
    ("", ("127.0.0.1", 0)), ("8080", ("127.0.0.1", 8080)), ("0", ("127.0.0.1", 0)),
    ("0.0.0.0:80", ("0.0.0.0", 80)), ("[::1]:9000", ("::1", 9000)), ("myhost:1", ("myhost", 1)),
])
def test_ui_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["70000", "host:", ":80", "::1:80", "a b:80", "x", "8080x"])
def test_bad_ui_addresses_are_one_line_errors(text: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_address(text)
    assert "\n" not in str(e.value) and "[HOST:]PORT" in str(e.value)


def test_a_port_in_use_is_a_one_line_error() -> None:
    view = JobView(["x"], "ps", "local")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is in use; choose another port"):
            PageServer.open(view, "127.0.0.1", port)


def test_a_viewer_gets_the_jobs_end_when_the_page_closes_at_once(page: PageServer) -> None:
    """--ui-linger 0: the server stops right after the job ends; the end still reaches the viewer."""
    cookie = session(page)
    viewer = Events(page, cookie)
    viewer.next()
    time.sleep(0.3)  # (the viewer's thread is waiting for news)
    page.view.add_line("worker-0", "the last line", False)
    page.view.finish("success", 0)
    page.close()
    seen = []
    try:
        while True:
            seen.append(viewer.next())
    except EOFError:
        pass
    viewer.close()
    assert any(m["event"] == "job" and m["data"]["state"] == "succeeded" for m in seen), seen
    assert any(m["event"] == "lines" and m["data"]["lines"][0][4] == "the last line" for m in seen)
