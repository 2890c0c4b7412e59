# ruff: noqa: UP004, UP031
"""pslaunch's remote wrapper: runs one host's servers and workers for the launcher over one ssh channel.

The ssh backend never installs anything on a host. Per host it runs
``exec python3 -S -c BOOTSTRAP`` on its connection; the bootstrap and :mod:`.ssh_loader` read
the node bundle from the channel's stdin and run this module from memory (the wire format is
:mod:`.ssh_wire`). Standard library only, and Python 3.5 syntax (no f-strings, no
annotations), so an old ``python3`` on a host works. One wrapper per host, not per process: a
login shell and a Python start once per host, however many processes it runs.

Each process runs in a new session and process group (pgid = its pid), with stdin from
/dev/null. The wrapper does not reap a process until the end, so its pgid cannot be reused
while the launcher may still send ``kill -TERM -pgid``. When the channel reaches EOF (the
launcher closed it, died, or its connection dropped), when no keep-alive arrived for
``lost_after`` seconds (the network is down), or on SIGHUP/SIGTERM/SIGINT, the wrapper stops
every group: SIGTERM to those whose process still runs, up to ``grace`` seconds, then SIGKILL
to whatever is left of every group. Then it exits.
"""

import errno
import json
import os
import select
import signal
import subprocess
import time

from .procgroup import (
    become_subreaper,
    exit_status,
    kill_children,
    kill_marked,
    resolve_program,
    signal_group,
    stop_group,
)
from .ssh_wire import HOST_ID, IN_HEAD, MAGIC, OUT_HEAD

OUT_CAP = 4 * 1024 * 1024  # stop reading the processes' pipes while this much waits for the channel


class Child(object):
    def __init__(self, ident):
        self.id = ident
        self.proc = None
        self.pid = 0
        self.mark = ""
        self.streams = {}
        self.code = None
        self.reported = False


class Wrapper(object):
    def __init__(self):
        self.out = bytearray()
        self.inbuf = b""
        self.broken = False
        self.signalled = None
        self.children = []

    # -- channel output ------------------------------------------------------------
    def send(self, kind, ident, payload=b""):
        if not self.broken:
            self.out += OUT_HEAD.pack(kind, ident, len(payload)) + payload

    def send_json(self, kind, ident, obj):
        self.send(kind, ident, json.dumps(obj).encode("utf-8"))

    def flush(self, deadline=None):
        """Write what fd 1 takes now; with ``deadline``, keep trying until then."""
        while self.out and not self.broken:
            try:
                n = os.write(1, bytes(self.out[:65536]))
                del self.out[:n]
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    if deadline is None or time.monotonic() >= deadline:
                        return
                    select.select([], [1], [], max(0.0, min(0.1, deadline - time.monotonic())))
                    continue
                self.broken = True  # the launcher is gone
                del self.out[:]

    # -- channel input ---------------------------------------------------------------
    @staticmethod
    def read_exact(n):
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def read_header(self):
        kind, length = IN_HEAD.unpack(self.read_exact(IN_HEAD.size))
        if kind != b"H":
            raise ValueError("expected a header frame")
        return json.loads(self.read_exact(length).decode("utf-8"))

    def on_input(self, data):
        """Handle launcher frames; only keep-alives follow the header."""
        self.inbuf += data
        while len(self.inbuf) >= IN_HEAD.size:
            kind, length = IN_HEAD.unpack(self.inbuf[:IN_HEAD.size])
            if len(self.inbuf) < IN_HEAD.size + length:
                break
            self.inbuf = self.inbuf[IN_HEAD.size + length:]
            if kind == b"k":
                self.send(b"h", HOST_ID)

    def on_signal(self, signum, frame):
        self.signalled = signum

    # -- processes -------------------------------------------------------------------
    def start(self, spec):
        child = Child(int(spec["id"]))
        self.children.append(child)
        argv = [str(a) for a in spec["argv"]]
        environ = dict(os.environ)
        environ.update(spec.get("env") or {})
        child.mark = environ.get("PSLAUNCH_PROCESS", "")
        cwd = spec.get("cwd") or None
        if cwd and not os.path.isdir(cwd):
            return self.fail(child, "cannot change to directory %s: %s" % (cwd, os.strerror(errno.ENOENT)), 1)
        argv[0] = resolve_program(argv[0], environ, cwd)
        try:
            child.proc = subprocess.Popen(argv, env=environ, cwd=cwd, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, close_fds=True)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return self.fail(child, "cannot run %r: no such program or directory (is it on PATH? give a "
                                 "path such as ./prog)" % argv[0], 127)
            if e.errno == errno.EACCES:
                return self.fail(child, "cannot run %r: permission denied (is it executable?)" % argv[0], 126)
            return self.fail(child, "cannot run %r: %s" % (argv[0], e.strerror or e), 1)
        except Exception as e:  # noqa: BLE001 - ValueError (a NUL byte), ...: the others must stay supervised
            return self.fail(child, "cannot run %r: %s" % (argv[0], e), 1)
        child.pid = child.proc.pid
        self.send_json(b"p", child.id, {"pid": child.pid, "pgid": child.pid})
        child.streams = {child.proc.stdout.fileno(): b"o", child.proc.stderr.fileno(): b"e"}
        for fd in child.streams:
            os.set_blocking(fd, False)

    def fail(self, child, message, code):
        child.code = code
        child.reported = True
        self.send_json(b"f", child.id, {"error": message, "code": code})

    def drain(self, child):
        """Forward everything the child's pipes hold now (never blocks)."""
        for fd in list(child.streams):
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break  # EAGAIN: empty for now
                if not data:
                    del child.streams[fd]
                    os.close(fd)
                    break
                self.send(child.streams[fd], child.id, data)

    def check_exits(self):
        for child in self.children:
            if child.pid and child.code is None:
                child.code = exit_status(child.pid)
                if child.code is not None:
                    # What it wrote before exiting is in the pipes now: forward it, then the code
                    # (a grandchild may keep the pipes open much longer).
                    self.drain(child)
                    self.send_json(b"x", child.id, {"code": child.code})
                    child.reported = True

    def run(self):
        try:
            header = self.read_header()
        except (EOFError, ValueError):
            return 2
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        become_subreaper()  # a process that leaves its group is still ours to stop
        self.out += MAGIC  # whatever a login shell printed before this is not ours
        os.set_blocking(1, False)
        interval = float(header.get("keepalive") or 5.0)
        lost_after = float(header.get("lost_after") or 4 * interval)
        grace = float(header.get("grace") or 0.0)
        try:
            self.supervise(header, lost_after)
        finally:  # whatever went wrong here, what was started goes with the wrapper
            self.stop(grace)
            self.flush(time.monotonic() + 2.0)
        return 0

    def supervise(self, header, lost_after):
        """Start the processes, then relay until EOF, a signal or lost keep-alives."""
        for spec in header["procs"]:
            self.start(spec)
        last_input = time.monotonic()
        while True:
            self.check_exits()
            reason = None
            if self.signalled is not None:
                reason = "signal"
            elif time.monotonic() - last_input > lost_after:
                reason = "lost"
            if reason is not None:
                break
            fds = {}
            if len(self.out) < OUT_CAP:
                for child in self.children:
                    for fd in child.streams:
                        fds[fd] = child
            writers = [1] if self.out and not self.broken else []
            try:
                ready_r, ready_w, _ = select.select([0] + list(fds), writers, [], 0.2)
            except (OSError, ValueError):  # EINTR on old Pythons
                continue
            if ready_w:
                self.flush()
            eof = False
            for fd in ready_r:
                try:
                    data = os.read(fd, 65536)
                except OSError as e:
                    if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                        continue
                    data = b""
                if fd == 0:
                    if not data:
                        eof = True
                    else:
                        last_input = time.monotonic()
                        self.on_input(data)
                    continue
                child = fds[fd]
                if data:
                    self.send(child.streams[fd], child.id, data)
                else:
                    del child.streams[fd]
                    os.close(fd)
            if eof:
                break

    def stop(self, grace):
        """Stop every group: SIGTERM where the process still runs, ``grace`` seconds, then SIGKILL."""
        running = [c for c in self.children if c.pid and c.code is None]
        for c in running:
            stop_group(c.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while running and time.monotonic() < end:
            time.sleep(0.02)
            for c in running:
                c.code = exit_status(c.pid)
            running = [c for c in running if c.code is None]
        for c in self.children:
            if c.pid:
                signal_group(c.pid, signal.SIGKILL)
        for c in self.children:  # what left the groups: re-parented to us, or marked with its process
            if c.mark:
                kill_marked(c.mark)
        for c in self.children:
            if not c.pid:
                continue
            try:
                _, status = os.waitpid(c.pid, 0)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            except ChildProcessError:
                code = -signal.SIGKILL
            self.drain(c)
            if not c.reported:
                self.send_json(b"x", c.id, {"code": code if c.code is None else c.code})
                c.reported = True
        kill_children()  # orphans re-parented to us that carried no mark (a scrubbed environment)

