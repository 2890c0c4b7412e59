"""The ssh backend's node agent, run locally through the exact remote command (no ssh): the
bootstrap, the loader and the node bundle imported from memory, then the frames
(``launcher.node.protocol``, transport a)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.helpers import pid_alive, wait_for

from launcher.backends.ssh import wrapper_command, wrapper_header, wrapper_payload
from launcher.node import protocol
from launcher.node.protocol import (
    ALIVE,
    EXIT,
    FAILED,
    MAGIC,
    NODE,
    PING,
    STARTED,
    STDERR,
    STDOUT,
    frame,
)
from launcher.spec.job import JobSpec, Role
from launcher.spec.plan import ProcSpec


class Wrapped:
    """One host's wrapper started as sshd would: ``$SHELL -c COMMAND`` with pipes for stdin/stdout/stderr."""

    def __init__(self, *argvs: list[str], env: dict | None = None, cwd: str | None = None,
                 keepalive: float = 5.0, grace: float = 1.0, lost_after: float | None = None,
                 python: str = sys.executable) -> None:
        self.p = subprocess.Popen(["sh", "-c", wrapper_command(python)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        procs = [(i, ProcSpec(Role.WORKER, i, i, None, tuple(argv), env or {})) for i, argv in enumerate(argvs)]
        header = wrapper_header(procs, cwd, keepalive, grace)
        if lost_after is not None:
            header["lost_after"] = lost_after
        self.send(wrapper_payload(header))
        self.decoder = protocol.Decoder(marker=MAGIC)
        self.frames: list[tuple[bytes, int, bytes]] = []

    def send(self, data: bytes) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def _pump(self, timeout: float) -> bool:
        fd = self.p.stdout.fileno()  # type: ignore[union-attr]
        if not select.select([fd], [], [], timeout)[0]:
            return True
        data = os.read(fd, 65536)
        if not data:
            return False
        self.frames.extend(self.decoder.feed(data))
        return True

    def read_until(self, kind: bytes, ident: int = 0, timeout: float = 10.0) -> bytes:
        end = time.monotonic() + timeout
        while True:
            for i, (k, n, payload) in enumerate(self.frames):
                if k == kind and n == ident:
                    del self.frames[i]
                    return payload
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind!r} frame for {ident} within {timeout}s; have {self.frames!r}")
            if not self._pump(left):
                raise AssertionError(f"EOF before a {kind!r} frame; have {self.frames!r}; stderr "
                                     f"{self.p.stderr.read()!r}")  # type: ignore[union-attr]

    def output(self, kind: bytes = STDOUT, ident: int = 0) -> bytes:
        """Everything of ``kind`` received so far for process ``ident`` (reads what is ready first)."""
        while select.select([self.p.stdout.fileno()], [], [], 0.01)[0]:  # type: ignore[union-attr]
            if not self._pump(0):
                break
        return b"".join(p for k, n, p in self.frames if k == kind and n == ident)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.timeout(30)
def test_runs_the_process_and_reports_pid_output_and_exit_code(tmp_path) -> None:
    w = Wrapped(py("import os,sys; print(os.environ['FOO'], sys.argv[1:], os.getcwd()); "
                   "sys.stderr.write('err\\n'); sys.exit(3)") + ["a b", "'", "$(id)", ";"],
                env={"FOO": "bar baz"}, cwd=str(tmp_path))
    try:
        info = json.loads(w.read_until(STARTED))
        assert info["pid"] > 1 and info["agent"] == w.p.pid and info["host"] == socket.gethostname()
        assert w.read_until(EXIT) == b"3"
        assert os.getpgid(info["pid"]) == info["pid"]  # a group leader, and not reaped while the agent runs
        out = w.output(STDOUT).decode()
        assert out == f"bar baz ['a b', \"'\", '$(id)', ';'] {tmp_path}\n"
        assert w.output(STDERR) == b"err\n"
        w.p.stdin.close()  # type: ignore[union-attr]
        assert w.p.wait(timeout=10) == 0
    finally:
        w.close()


#: an old Python, as a host may have; pyenv's builds where the machine has them
OLD_PYTHON = next((p for p in ("/root/.pyenv/versions/3.6.15/bin/python3.6", "/usr/bin/python3.6")
                   if os.access(p, os.X_OK)), None)


@pytest.mark.timeout(30)
@pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.6 on this machine")
def test_the_wrapper_runs_on_an_old_python() -> None:
    """The bootstrap, the loader and the bundle's modules it imports run on a host's python3.6."""
    w = Wrapped(py("import sys; print(sys.argv[1]); sys.exit(4)") + ["ok"], python=str(OLD_PYTHON))
    try:
        assert w.read_until(EXIT) == b"4"
        assert w.output(STDOUT) == b"ok\n"
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_process_gets_its_own_group_and_devnull_stdin() -> None:
    w = Wrapped(py("import os,sys; print(os.getpgid(0) == os.getpid() == os.getsid(0), sys.stdin.read() == '')"))
    try:
        w.read_until(EXIT)
        assert w.output().decode().strip() == "True True"
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_keepalive_is_answered() -> None:
    w = Wrapped(py("import time; time.sleep(30)"))
    try:
        w.read_until(STARTED)
        w.send(frame(PING, NODE) + frame(PING, NODE))
        w.read_until(ALIVE, NODE)
        w.read_until(ALIVE, NODE)
    finally:
        w.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["eof", "keepalives-stop", "sighup"])
def test_the_group_dies_when_the_channel_goes(how: str) -> None:
    # a process that ignores SIGTERM and has a grandchild: both must be gone within grace + a bit
    code = ("import signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); print(c.pid, flush=True); "
            "time.sleep(60)")
    w = Wrapped(py(code), keepalive=0.5, grace=1.0, lost_after=1.5)
    try:
        info = json.loads(w.read_until(STARTED))
        wait_for(lambda: w.output().strip(), 10, what="the grandchild's pid")
        pids = [info["pid"], int(w.output().split()[0])]
        assert all(pid_alive(p) for p in pids)
        t0 = time.monotonic()
        if how == "eof":
            w.p.stdin.close()  # type: ignore[union-attr]
        elif how == "sighup":
            os.kill(w.p.pid, signal.SIGHUP)
        # keepalives-stop: just wait (stdin stays open, nothing arrives)
        wait_for(lambda: not any(pid_alive(p) for p in pids), 8, what="the process group to die")
        elapsed = time.monotonic() - t0
        assert elapsed < 6, elapsed
        assert w.p.wait(timeout=5) == 0
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_missing_program_is_reported_with_127() -> None:
    w = Wrapped(["no-such-program-xyz"])
    try:
        info = json.loads(w.read_until(FAILED))
        assert info["code"] == 127 and "no such program" in info["error"]
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_a_process_that_cannot_start_leaves_the_others_supervised() -> None:
    """A start that fails with something other than OSError (Popen's ValueError for a NUL byte)
    is reported; the wrapper does not die and leave the processes it started unsupervised."""
    w = Wrapped(py("import time; time.sleep(30)"), ["echo", "a\0b"])
    try:
        info = json.loads(w.read_until(FAILED, 1))
        assert info["code"] == 1 and "cannot run" in info["error"]
        pid = json.loads(w.read_until(STARTED, 0))["pid"]
        assert pid_alive(pid)
        w.p.stdin.close()  # type: ignore[union-attr]  # the launcher goes: the wrapper stops the group
        wait_for(lambda: not pid_alive(pid), 10, what="the started process to be stopped")
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_a_wrapper_that_fails_stops_what_it_started(tmp_path) -> None:
    """Any error inside the wrapper after it started processes (here a header entry it cannot
    read) still stops them: the wrapper never exits leaving its process groups behind."""
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    header = {"procs": [{"id": 0, "argv": py(code), "env": {}, "cwd": None}, {"id": 1}],
              "keepalive": 5.0, "lost_after": 20.0, "grace": 1.0}
    p = subprocess.Popen(["sh", "-c", wrapper_command(sys.executable)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    pid = None
    try:
        p.stdin.write(wrapper_payload(header))  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        out, _ = p.communicate(timeout=15)  # the wrapper gives up on the bad entry (stdin still open)...
        starts = [json.loads(f[2]) for f in protocol.Decoder(marker=MAGIC).feed(out) if f[:2] == (STARTED, 0)]
        assert starts, "the wrapper died without reporting the process it had started"
        pid = starts[0]["pid"]
        wait_for(lambda: not pid_alive(pid), 5, what="the started process to be stopped")  # ...and takes it along
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        time.sleep(0.5)
        for leftover in {pid, int(pidfile.read_text()) if pidfile.exists() else None} - {None}:
            if pid_alive(leftover):
                os.kill(leftover, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_bad_directory_is_reported(tmp_path) -> None:
    w = Wrapped(["true"], cwd=str(tmp_path / "missing"))
    try:
        info = json.loads(w.read_until(FAILED))
        assert "cannot change to directory" in info["error"] and str(tmp_path / "missing") in info["error"]
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_program_in_cwd_runs_as_dot_slash(tmp_path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    w = Wrapped(["job.sh"], cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    try:
        assert w.read_until(EXIT) == b"0"
        assert w.output() == b"ran\n"
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_killed_by_signal_is_128_plus_the_signal() -> None:
    w = Wrapped(py("import os,signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    try:
        assert w.read_until(EXIT) == b"%d" % (128 + signal.SIGSEGV)
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_exit_code_is_not_delayed_by_a_grandchild_holding_the_pipes() -> None:
    w = Wrapped(py("import subprocess,sys; subprocess.Popen([sys.executable,'-c','import time; time.sleep(20)']); "
                   "print('bye')"))
    try:
        w.read_until(STARTED)
        t0 = time.monotonic()
        assert w.read_until(EXIT) == b"0"
        assert time.monotonic() - t0 < 2.0
        assert w.output() == b"bye\n"
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_large_output_arrives_whole() -> None:
    w = Wrapped(py("import sys; sys.stdout.write('x' * 3000000 + '\\n')"))
    try:
        w.read_until(EXIT, timeout=20)
        assert len(w.output()) == 3000001
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_several_processes_on_one_channel_each_in_its_own_group() -> None:
    code = "import os,sys; print(os.getpid(), os.getpgid(0), flush=True); sys.exit(int(sys.argv[1]))"
    w = Wrapped(py(code) + ["0"], py(code) + ["4"], ["no-such-program-xyz"], py(code) + ["7"])
    try:
        pids = [json.loads(w.read_until(STARTED, i))["pid"] for i in (0, 1, 3)]
        assert len(set(pids)) == 3
        assert json.loads(w.read_until(FAILED, 2))["code"] == 127
        assert [int(w.read_until(EXIT, i)) for i in (0, 1, 3)] == [0, 4, 7]
        for i, pid in zip((0, 1, 3), pids):
            assert w.output(STDOUT, i).decode().split() == [str(pid), str(pid)]
    finally:
        w.close()


class PipeChannel:
    """What RemoteHost uses of a paramiko channel, carried by a local ``sh -c COMMAND`` (no sshd)."""

    def __init__(self) -> None:
        self.p: subprocess.Popen | None = None
        self.timeout = 0.5

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def exec_command(self, command: str) -> None:
        self.p = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)

    def sendall(self, data: bytes) -> None:
        assert self.p is not None and self.p.stdin is not None
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def recv(self, n: int) -> bytes:
        assert self.p is not None and self.p.stdout is not None
        if not select.select([self.p.stdout], [], [], self.timeout)[0]:
            raise socket.timeout
        return os.read(self.p.stdout.fileno(), n)

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return self.p is not None and self.p.poll() is not None

    def recv_exit_status(self) -> int:
        assert self.p is not None
        return self.p.wait()

    def close(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _ssh_spec() -> JobSpec:
    from launcher.transport.options import SSHOptions

    return JobSpec(command=("true",), num_workers=1, num_servers=0, launcher="ssh", options=SSHOptions())


class PipeSession:
    label = "pipe-host"

    def __init__(self) -> None:
        self.chan = PipeChannel()

    def open_channel(self, timeout: float | None = None) -> PipeChannel:
        return self.chan

    def channel_closed(self) -> None:
        pass


@pytest.mark.timeout(120)
def test_a_sync_whose_answer_is_longer_than_an_output_frame_arrives(tmp_path) -> None:
    """30,000 new files: the wrapper's ``s`` answer lists them all (more than MAX_FROM_NODE, 1 MiB) and
    the launcher reads it (it was dropped, and the sync waited 600 s for it)."""
    from launcher.backends.ssh import RemoteHost
    from launcher.transport.wiresync import TreeSync

    src = tmp_path / "src"
    for d in range(30):
        (src / f"directory-{d:02d}").mkdir(parents=True)
        for i in range(1000):
            (src / f"directory-{d:02d}" / f"a-file-with-a-longish-name-{i:04d}.txt").write_bytes(b"x")
    tree = TreeSync(str(src), str(tmp_path / "dst"), [])
    assert len(json.dumps(list(tree.tree))) > protocol.MAX_FROM_NODE
    session = PipeSession()
    host = RemoteHost(session, _ssh_spec())  # type: ignore[arg-type]
    try:
        host.open()
        t0 = time.monotonic()
        target, stats = tree.sync(host.label, lambda k, p, r: host.request(k, p, r, timeout=60.0), host.send)
        assert time.monotonic() - t0 < 60
        assert (target, stats.files) == (str(tmp_path / "dst"), 30000)
        assert (tmp_path / "dst" / "directory-29" / "a-file-with-a-longish-name-0999.txt").read_bytes() == b"x"
    finally:
        host.closed = True
        session.chan.close()


def test_an_answer_dropped_for_its_size_fails_the_request_at_once() -> None:
    """A reply longer than the launcher accepts fails the request with one line, not after its timeout."""
    from launcher.backends.ssh import RemoteHost

    host = RemoteHost(PipeSession(), _ssh_spec())  # type: ignore[arg-type]
    host._dropped(protocol.SYNC_ANSWER, NODE, protocol.MAX_ANSWER + 1)
    host.send = lambda kind, payload=b"": None  # type: ignore[method-assign]
    t0 = time.monotonic()
    doc = host.request(protocol.SYNC, b"{}", protocol.SYNC_ANSWER, timeout=600.0)
    assert time.monotonic() - t0 < 5 and "more than the" in doc["error"]
