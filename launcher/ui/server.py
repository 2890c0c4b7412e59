"""The live job page's server: standard library only (``http.server.ThreadingHTTPServer``, one
daemon thread per connection), serving one :class:`~launcher.ui.model.JobView`.

Nothing is served without the job's secret (docs/usage.md, "The job page"): the token
(``secrets.token_urlsafe(32)``) travels only in the URL's fragment, which browsers never send; a
tiny bootstrap page (the 403 answer to ``GET /``, the same for every job, no job data) posts it once in the
``X-Pslaunch-Token`` header to ``POST /session``, which answers with an HttpOnly, SameSite=Strict
session cookie. Every other request without a session's cookie gets 403, and so does any request
whose ``Host`` is not this server's (DNS rebinding). Every answer carries a strict
Content-Security-Policy: the page loads nothing from elsewhere and runs no inline script but the
bootstrap's (allowed by its hash).

``/events`` is a server-sent-events stream: the snapshot, then every event of the model's log,
resumable with ``Last-Event-ID`` (a replay from the model's ring, or a new snapshot when the ring no
longer holds the events after it); a comment every :data:`KEEPALIVE` seconds keeps proxies from
closing it. Each viewer has its own cursor into the ring and writes from its own thread, with no
lock held: a slow or stuck viewer stalls only itself (and is dropped after :data:`WRITE_TIMEOUT`);
the supervisor never waits for one. Whatever comes from the network (a malformed request, a
disconnect, a flood of connections) ends at most that connection, never the launcher.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from ..node import safefiles
from .model import JobView

log = logging.getLogger(__name__)

#: the session cookie's name, + ``_<port>``: each job's page its own (a browser sends 127.0.0.1's
#: cookies to every port, so one name would have two pages overwrite each other's session)
COOKIE = "pslaunch_session"
TOKEN_HEADER = "X-Pslaunch-Token"
KEEPALIVE = 15.0  # seconds between SSE comments while nothing happens
POLL = 0.25  # a viewer looks for new lines this often (lines are batched, never pushed one by one)
WRITE_TIMEOUT = 30.0  # a viewer that takes no bytes this long is dropped
READ_TIMEOUT = 10.0  # a request must arrive whole within this
MAX_CONNECTIONS = 64  # at once; more are closed at once
MAX_SESSIONS = 64  # session cookies remembered (the oldest is forgotten)
MAX_STREAMS = 16  # /events streams at once
CHUNK = 64 * 1024
STATIC = {"/": ("page.html", "text/html; charset=utf-8"),
          "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/static/app.css": ("app.css", "text/css; charset=utf-8")}

#: the bootstrap page's script: the token from the fragment to a session cookie, then the page
BOOTSTRAP_SCRIPT = (
    "(function(){var m=/[#&]token=([^&]+)/.exec(location.hash);var say=function(t){document.body.textContent=t;};"
    "if(!m){say('pslaunch: open the job page at the address pslaunch printed (it ends in #token=...)');return;}"
    "fetch('/session',{method:'POST',credentials:'same-origin',headers:{'X-Pslaunch-Token':decodeURIComponent(m[1])}})"
    ".then(function(r){if(r.status===204){location.replace('/');}else{say('pslaunch: this token is not this job\\'s "
    "(403); open the address pslaunch printed for it');}},function(){say('pslaunch: the job page does not answer "
    "(has the job ended?)');});})();")
BOOTSTRAP = ("<!doctype html><html><head><meta charset=\"utf-8\"><title>pslaunch job page</title></head><body>"
             "403: open the job page at the address pslaunch printed.<script>" + BOOTSTRAP_SCRIPT +
             "</script></body></html>").encode()
_HASH = base64.b64encode(hashlib.sha256(BOOTSTRAP_SCRIPT.encode()).digest()).decode()
CSP = (f"default-src 'none'; script-src 'self' 'sha256-{_HASH}'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"))


def parse_address(text: Optional[str], option: str = "--ui") -> tuple[str, int]:
    """``[HOST:]PORT`` (``8080``, ``0.0.0.0:8080``, ``[::1]:8080``; empty: a free port) ->
    ``(host, port)``; host 127.0.0.1 unless one is written. A one-line error names the fix."""
    text = (text or "").strip()
    usage = f"give [HOST:]PORT, e.g. {option} 8080 or {option} 127.0.0.1:8080 ({option} alone: a free port)"
    if not text:
        return "127.0.0.1", 0
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{option} {text}: an IPv6 address goes in brackets ([::1]:8080); {usage}")
    if not port.isdigit() or len(port) > 5 or int(port) > 65535:
        raise ConfigError(f"{option} {text}: {port!r} is not a port (0-65535); {usage}")
    if sep and not host:
        raise ConfigError(f"{option} {text}: no host before the colon; {usage}")
    if host and not all(c.isalnum() or c in ".-_:%" for c in host):
        raise ConfigError(f"{option} {text}: {host!r} is not a host name or address; {usage}")
    return host or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    """``host`` is this machine alone (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


class PageServer(ThreadingHTTPServer):
    """The page's HTTP server for one job; :meth:`open` binds it (errors are one-line
    :class:`~launcher.errors.ConfigError`\\s), :meth:`start` serves from a daemon thread."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, view: JobView, host: str, port: int, log_dir: Optional[str] = None) -> None:
        self.view = view
        self.log_dir = log_dir
        self.token = secrets.token_urlsafe(32)
        self.sessions: list[str] = []
        self.stopping = threading.Event()
        self.streams = 0
        self._active = 0
        self._count_lock = threading.Lock()
        self._static = _load_static()
        self.host_written = host
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)
        self.port = self.server_address[1]
        self.cookie = f"{COOKIE}_{self.port}"
        self.hosts = self._allowed_hosts()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def open(cls, view: JobView, host: str, port: int, log_dir: Optional[str] = None) -> PageServer:
        """Bind ``host:port``; a port in use or an address not of this machine is a one-line error."""
        where = f"--ui {host}:{port}"
        try:
            return cls(view, host, port, log_dir)
        except socket.gaierror:
            raise ConfigError(f"{where}: no such host name; give an address of this machine "
                              "(--ui alone: 127.0.0.1 on a free port)") from None
        except OSError as e:
            if e.errno == 98:  # EADDRINUSE
                raise ConfigError(f"{where}: port {port} is in use; choose another port, or give --ui alone for a "
                                  "free one") from None
            if e.errno == 99:  # EADDRNOTAVAIL
                raise ConfigError(f"{where}: {host} is not an address of this machine; give one of its addresses "
                                  "(--ui alone: 127.0.0.1)") from None
            if e.errno == 13:  # EACCES
                raise ConfigError(f"{where}: port {port} needs privileges; choose a port above 1023") from None
            raise ConfigError(f"{where}: cannot listen there: {e.strerror or e}") from None

    # -- addresses --------------------------------------------------------------------------------

    def _display_host(self) -> str:
        """The host a viewer types: the one written, this machine's name for a wildcard address."""
        host = self.host_written
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"[{host}]" if ":" in host else host

    @property
    def address(self) -> str:
        """``http://127.0.0.1:PORT/``: the page's address without its token (``--summary-json``)."""
        return f"http://{self._display_host()}:{self.port}/"

    @property
    def url(self) -> str:
        """The address with the token in its fragment: what the user opens (a secret)."""
        return f"{self.address}#token={self.token}"

    def _allowed_hosts(self) -> set[str]:
        """The ``Host`` headers this server answers (anything else may be DNS rebinding)."""
        names = {"127.0.0.1", "localhost", "[::1]", self._display_host().lower(), self.host_written.lower()}
        if self.host_written in ("0.0.0.0", "::"):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return {f"{n}:{self.port}" for n in names}

    def host_allowed(self, host: Optional[str]) -> bool:
        """``Host`` is this server's: its name or a loopback name with the port; on a wildcard address
        also any IP literal (a rebinding attack needs a DNS name) with the port."""
        if not host:
            return False
        host = host.strip().lower()
        if host in self.hosts:
            return True
        name, _, port = host.rpartition(":")
        return self.host_written in ("0.0.0.0", "::") and port == str(self.port) and _is_ip(name)

    # -- sessions ---------------------------------------------------------------------------------

    def token_ok(self, given: Optional[str]) -> bool:
        return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode())

    def new_session(self) -> str:
        session = secrets.token_urlsafe(32)
        with self._count_lock:
            self.sessions.append(session)
            del self.sessions[:-MAX_SESSIONS]
        return session

    def session_ok(self, cookie_header: Optional[str]) -> bool:
        """A cookie of ``Cookie:`` is one of our sessions (each compared in constant time)."""
        if not cookie_header:
            return False
        pairs = (p.strip().partition("=") for p in cookie_header.split(";"))
        given = [v.strip() for k, _, v in pairs if k == self.cookie]
        with self._count_lock:
            sessions = list(self.sessions)
        ok = False
        for g in given:
            for s in sessions:
                ok |= hmac.compare_digest(g.encode("utf-8", "replace"), s.encode())
        return ok

    def static(self, path: str) -> Optional[tuple[bytes, str]]:
        return self._static.get(path)

    # -- threads ----------------------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, but at most :data:`MAX_CONNECTIONS` at once (more are closed)."""
        with self._count_lock:
            full = self._active >= MAX_CONNECTIONS
            if not full:
                self._active += 1
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that broke its handler ends its connection alone, quietly (debug log)."""
        log.debug("job page: a request from %s failed", client_address[0] if client_address else "?", exc_info=True)

    def start(self) -> PageServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="pslaunch-ui", daemon=True)
        self._thread.start()
        return self

    def close(self, drain: float = 1.0) -> None:
        """Stop serving: each stream sends what it has not sent yet (the job's end) and ends,
        for at most ``drain`` seconds; then the socket closes (the threads are daemons)."""
        self.stopping.set()
        end = time.monotonic() + drain
        while self.streams and time.monotonic() < end:
            time.sleep(0.01)
        if self._thread is not None:
            self.shutdown()
            self._thread.join(2.0)
        self.server_close()


def _load_static() -> dict[str, tuple[bytes, str]]:
    """The page's files (package data of ``launcher.ui``), read once: a missing one is a 404."""
    out = {}
    folder = resources.files("launcher.ui") / "static"
    for route, (name, ctype) in STATIC.items():
        try:
            out[route] = ((folder / name).read_bytes(), ctype)
        except OSError:
            continue
    return out


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (see the module docstring). Never logs a request line."""

    server: PageServer
    timeout = READ_TIMEOUT
    server_version = "pslaunch"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def end_headers(self) -> None:
        for name, value in HEADERS:
            self.send_header(name, value)
        super().end_headers()

    def _answer(self, code: int, body: bytes = b"", ctype: str = "text/plain; charset=utf-8",
                extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _forbidden(self) -> None:
        if self.command == "GET" and urlsplit(self.path).path == "/":
            self._answer(403, BOOTSTRAP, "text/html; charset=utf-8")
        else:
            self._answer(403, b"403: this job page needs its token; open the address pslaunch printed\n")

    def _allowed(self) -> bool:
        """The Host is ours and the request carries a session's cookie (else 403 was sent)."""
        if self.server.host_allowed(self.headers.get("Host")) and self.server.session_ok(self.headers.get("Cookie")):
            return True
        self._forbidden()
        return False

    def do_POST(self) -> None:
        if not self.server.host_allowed(self.headers.get("Host")) or urlsplit(self.path).path != "/session" \
                or not self.server.token_ok(self.headers.get(TOKEN_HEADER)):
            self._forbidden()
            return
        session = self.server.new_session()
        self._answer(204, extra=(("Set-Cookie", f"{self.server.cookie}={session}; HttpOnly; SameSite=Strict; Path=/"),))

    def do_GET(self) -> None:
        if not self._allowed():
            return
        path = urlsplit(self.path).path
        found = self.server.static(path)
        if found is not None:
            self._answer(200, *found)
        elif path == "/api/state":
            body = json.dumps(self.server.view.snapshot(), separators=(",", ":")).encode()
            self._answer(200, body, "application/json")
        elif path == "/events":
            self._events()
        elif path.startswith("/logs/") and path.endswith(".log"):
            self._log_file(unquote(path[len("/logs/"):-len(".log")]))
        else:
            self._answer(404, b"404: no such page\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _other(self) -> None:
        if self._allowed():
            self._answer(405, b"405: the job page is read-only\n")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other

    # -- the full log of a process --------------------------------------------------------------

    def _log_file(self, name: str) -> None:
        """``--log-dir``'s file of a process of this job, as it is now (no link followed)."""
        view = self.server.view
        if self.server.log_dir is None or name not in view.rows or view.rows[name].log is None:
            self._answer(404, b"404: no such log (pslaunch keeps the full logs with --log-dir)\n")
            return
        try:
            dfd = safefiles.open_dir(self.server.log_dir, "--log-dir")
        except (OSError, safefiles.Refused):
            self._answer(404, b"404: the log directory cannot be read\n")
            return
        try:
            fd = safefiles.open_file(dfd, f"{name}.log", os.O_RDONLY)
        except (OSError, ValueError, safefiles.Refused):
            self._answer(404, b"404: no such log yet\n")
            return
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if self.command == "HEAD":
                return
            left = size
            while left > 0:
                data = f.read(min(CHUNK, left))
                if not data:
                    break
                self.wfile.write(data)
                left -= len(data)

    # -- server-sent events ---------------------------------------------------------------------

    def _events(self) -> None:
        """The SSE stream (see the module docstring), until the viewer goes or the server stops."""
        server = self.server
        with server._count_lock:
            full = server.streams >= MAX_STREAMS
            if not full:
                server.streams += 1
        if full:
            self._answer(503, b"503: too many viewers of this job page\n")
            return
        try:
            self.connection.settimeout(WRITE_TIMEOUT)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.end_headers()
            if self.command != "HEAD":
                self._stream(_event_id(self.headers.get("Last-Event-ID")))
        except (OSError, ValueError):
            pass  # (the viewer went: its stream ends, nothing else does)
        finally:
            with server._count_lock:
                server.streams -= 1

    def _stream(self, last: Optional[int]) -> None:
        view = self.server.view
        view.viewer(+1)
        try:
            self.wfile.write(b"retry: 1000\n\n")
            wrote = time.monotonic()
            while True:
                events = view.events_after(last) if last is not None else None
                if events is None:
                    last, data = view.snapshot_message()
                    self.wfile.write(data)
                elif events:
                    last = events[-1][0]
                    self.wfile.write(b"".join(e[1] for e in events))
                elif self.server.stopping.is_set():
                    return  # (the server stops, and this viewer has every event: the job's end too)
                elif time.monotonic() - wrote >= KEEPALIVE:
                    self.wfile.write(b": k\n\n")
                else:
                    view.wait(last or 0, POLL)
                    continue
                self.wfile.flush()
                wrote = time.monotonic()
        finally:
            view.viewer(-1)


def _event_id(value: Optional[str]) -> Optional[int]:
    """``Last-Event-ID`` as an id (None: absent or not one of ours)."""
    if value is None or not value.strip().isdigit() or len(value.strip()) > 18:
        return None
    return int(value.strip())
