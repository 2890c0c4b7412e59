# ruff: noqa: UP004, UP031
"""pslaunch's remote wrapper: runs one server or worker for the launcher over an ssh channel.

The ssh backend never installs anything on a host. For each process it runs
``exec python3 -S -c BOOTSTRAP`` over its connection (see
``launcher.backends.ssh.wrapper_command``); the bootstrap reads this file's
source from the channel's stdin and runs it. Standard library only, and
Python 3.5 compatible (no f-strings), so an old ``python3`` on a host works.

Wire protocol after the source:

* launcher -> wrapper (the channel's stdin): one header frame ``H`` with
  JSON ``{"argv", "env", "cwd", "keepalive", "lost_after", "grace"}`` (the
  environment travels here, never on a command line), then single bytes:
  ``k`` is a keep-alive.
* wrapper -> launcher (the channel's stdout), frames of
  ``kind (1 byte) + length (4 bytes, big endian) + payload``:
  ``p`` JSON ``{"pid", "pgid"}`` once the process runs; ``f`` JSON
  ``{"error", "code"}`` if it could not be started; ``o`` / ``e`` the
  process's stdout / stderr bytes; ``h`` the reply to each ``k``;
  ``x`` JSON ``{"code"}`` when the process exited (negative: killed by that
  signal).

The process runs in a new session and process group (pgid = its pid), with
stdin from /dev/null. The wrapper does not reap it until the end, so the
pgid cannot be reused while the launcher may still send ``kill -TERM -pgid``.
When the channel reaches EOF (the launcher closed it, died, or its
connection dropped), when no keep-alive arrived for ``lost_after`` seconds
(the link is down), or on SIGHUP/SIGTERM/SIGINT, the wrapper stops the group:
SIGTERM while the process still runs, up to ``grace`` seconds, then SIGKILL
to whatever is left of the group. Then it exits.
"""

import errno
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time

HEAD = struct.Struct(">cI")
OUT_CAP = 4 * 1024 * 1024  # stop reading the process's pipes while this much waits for the channel


class Wrapper(object):
    def __init__(self):
        self.out = bytearray()
        self.broken = False
        self.signalled = None

    # -- channel output ------------------------------------------------------------
    def send(self, kind, payload=b""):
        if not self.broken:
            self.out += HEAD.pack(kind, len(payload)) + payload

    def send_json(self, kind, obj):
        self.send(kind, json.dumps(obj).encode("utf-8"))

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
        kind, length = HEAD.unpack(self.read_exact(HEAD.size))
        if kind != b"H":
            raise ValueError("expected a header frame")
        return json.loads(self.read_exact(length).decode("utf-8"))

    def drain(self, streams):
        """Forward everything the pipes hold now (never blocks)."""
        for fd in list(streams):
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break  # EAGAIN: empty for now
                if not data:
                    del streams[fd]
                    os.close(fd)
                    break
                self.send(streams[fd], data)

    def on_signal(self, signum, frame):
        self.signalled = signum

    # -- the process -----------------------------------------------------------------
    def fail(self, message, code):
        self.send_json(b"f", {"error": message, "code": code})
        self.flush(time.monotonic() + 5)
        return 0

    def run(self):
        try:
            header = self.read_header()
        except (EOFError, ValueError):
            return 2
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        os.set_blocking(1, False)
        argv = [str(a) for a in header["argv"]]
        environ = dict(os.environ)
        environ.update(header.get("env") or {})
        interval = float(header.get("keepalive") or 5.0)
        lost_after = float(header.get("lost_after") or 4 * interval)
        grace = float(header.get("grace") or 0.0)
        cwd = header.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError as e:
                return self.fail("cannot change to directory %s: %s" % (cwd, e.strerror), 1)
        argv[0] = resolve_program(argv[0], environ)
        try:
            proc = subprocess.Popen(argv, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return self.fail("cannot run %r: no such program or directory (is it on PATH? give a path "
                                 "such as ./prog)" % argv[0], 127)
            if e.errno == errno.EACCES:
                return self.fail("cannot run %r: permission denied (is it executable?)" % argv[0], 126)
            return self.fail("cannot run %r: %s" % (argv[0], e.strerror or e), 1)
        pid = proc.pid
        self.send_json(b"p", {"pid": pid, "pgid": pid})
        streams = {proc.stdout.fileno(): b"o", proc.stderr.fileno(): b"e"}
        for fd in streams:
            os.set_blocking(fd, False)
        code = None
        reported = False
        last_input = time.monotonic()
        while True:
            now = time.monotonic()
            if code is None:
                code = exit_status(pid)
                if code is not None:
                    # What the process wrote before it exited is in the pipes now: forward it,
                    # then the exit code (a grandchild may keep the pipes open much longer).
                    self.drain(streams)
                    self.send_json(b"x", {"code": code})
                    reported = True
            reason = None
            if self.signalled is not None:
                reason = "signal"
            elif now - last_input > lost_after:
                reason = "lost"
            if reason is None:
                readers = [0] + (list(streams) if len(self.out) < OUT_CAP else [])
                writers = [1] if self.out and not self.broken else []
                try:
                    ready_r, ready_w, _ = select.select(readers, writers, [], 0.2)
                except (OSError, ValueError):  # EINTR on old Pythons
                    continue
                if ready_w:
                    self.flush()
                for fd in ready_r:
                    try:
                        data = os.read(fd, 65536)
                    except OSError as e:
                        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                            continue
                        data = b""
                    if fd == 0:
                        if not data:
                            reason = "eof"
                            break
                        last_input = time.monotonic()
                        for _ in range(data.count(b"k")):
                            self.send(b"h")
                    elif data:
                        self.send(streams[fd], data)
                    else:
                        del streams[fd]
                        os.close(fd)
            if reason is not None:
                break
        code = stop(pid, code, grace)
        self.drain(streams)
        if not reported:
            self.send_json(b"x", {"code": code})
        self.flush(time.monotonic() + 2.0)
        return 0


def exit_status(pid):
    """The exit code (negative: killed by that signal) once ``pid`` ended, else None; does not reap."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -signal.SIGKILL
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


def signal_group(pgid, sig):
    if pgid > 1:  # never -1 (every process of the user) or 0 (our own group)
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass


def stop(pid, code, grace):
    """Stop the process group ``pid``: SIGTERM and ``grace`` seconds if it still runs, then SIGKILL.

    Returns the process's exit code and reaps it.
    """
    if code is None:
        signal_group(pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while code is None and time.monotonic() < end:
            time.sleep(0.02)
            code = exit_status(pid)
    signal_group(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return code if code is not None else -signal.SIGKILL
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def resolve_program(argv0, environ):
    """dmlc's rule: a bare name that is not on PATH but is an executable here runs as ``./name``."""
    if "/" in argv0:
        return argv0
    for d in environ.get("PATH", os.defpath).split(os.pathsep):
        if os.access(os.path.join(d or ".", argv0), os.X_OK):
            return argv0
    if os.path.isfile(argv0) and os.access(argv0, os.X_OK):
        return "./" + argv0
    return argv0


if __name__ == "__main__":
    sys.exit(Wrapper().run())
