"""The ssh backend's node agent, run locally through the exact remote command (no ssh): the
bootstrap, the loader and the node bundle imported from memory, then the frames
(``launcher.node.protocol``, transport a)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import PipeChannel, pid_alive, wait_for

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
        assert w.read_until(EXIT).split()[0] == b"3"
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
        assert w.read_until(EXIT).split()[0] == b"4"
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


#: a process that ignores SIGTERM, with a grandchild in its group and one that left it (``setsid``)
_FAMILY = ("import os,signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "s='import time; time.sleep(120)'; c=subprocess.Popen([sys.executable,'-c',s]); "
           "e=subprocess.Popen([sys.executable,'-c','import os; os.setsid(); '+s]); "
           "print(c.pid, e.pid, flush=True); time.sleep(120)")


@pytest.mark.timeout(60)
@pytest.mark.timeout(30)
def test_kill_9_of_a_wrapper_whose_processes_ended_leaves_no_directory() -> None:
    """Each process's error file was collected when it ended; the wrapper's directory of them goes
    with its watchdog when the wrapper is killed."""
    w = Wrapped(py("import os; print(os.environ['PSLAUNCH_ERROR_FILE'], flush=True)"))
    try:
        wait_for(lambda: w.output().strip(), 10, what="the error file's path")
        base = Path(w.output().decode().strip()).parent.parent
        w.read_until(EXIT)
        assert base.name.startswith("pslaunch-errors-") and base.is_dir() and not any(base.iterdir())
        os.kill(w.p.pid, signal.SIGKILL)
        w.p.wait(timeout=10)
        wait_for(lambda: not base.exists(), 10.0, interval=0.1, what=f"{base} to be removed")
    finally:
        w.close()


@pytest.mark.parametrize("python", [sys.executable, OLD_PYTHON], ids=["python3", "python3.6"])
def test_kill_9_of_the_wrapper_leaves_nothing(python: str | None, tmp_path) -> None:
    """Issue 30, 11: the wrapper killed (kill -9, the OOM killer) must not leave its processes under
    init. They get their parent-death signal, and the wrapper's watchdog (a fork of it) stops their
    groups and what left them."""
    if python is None:
        pytest.skip("no Python 3.6 on this machine")
    mark = f"test-{os.getpid()}-{time.monotonic_ns()}/worker-0"
    w = Wrapped(py(_FAMILY), env={"PSLAUNCH_PROCESS": mark, "PATH": os.environ["PATH"]}, grace=1.0,
                python=python)
    pids: list[int] = []
    try:
        pids = [json.loads(w.read_until(STARTED))["pid"]]
        wait_for(lambda: w.output().strip(), 10, what="the grandchildren's pids")
        pids += [int(x) for x in w.output().split()]
        assert all(pid_alive(p) for p in pids)
        environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
        error_dirs = Path(environ[b"PSLAUNCH_ERROR_FILE"].decode()).parent.parent  # (the wrapper's errorfile.Base)
        assert error_dirs.name.startswith("pslaunch-errors-") and error_dirs.is_dir()
        os.kill(w.p.pid, signal.SIGKILL)
        w.p.wait(timeout=10)
        # (the grace is 1 s; whatever survives 20 s is under init for good)
        try:
            wait_for(lambda: not any(pid_alive(p) for p in pids), 20.0, interval=0.1, what="every process to end")
        except AssertionError:
            pass
        left = [p for p in pids if pid_alive(p)]
        assert left == [], f"alive 20 s after kill -9 of the wrapper: {left}"
        # and no error file's directory stays behind (the watchdog removed them)
        wait_for(lambda: not error_dirs.exists(), 10.0, interval=0.1, what=f"{error_dirs} to be removed")
    finally:
        w.close()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


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
        assert w.read_until(EXIT).split()[0] == b"0"
        assert w.output() == b"ran\n"
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_killed_by_signal_is_128_plus_the_signal() -> None:
    w = Wrapped(py("import os,signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    try:
        assert w.read_until(EXIT).split()[0] == b"%d" % (128 + signal.SIGSEGV)
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_exit_code_is_not_delayed_by_a_grandchild_holding_the_pipes() -> None:
    w = Wrapped(py("import subprocess,sys; subprocess.Popen([sys.executable,'-c','import time; time.sleep(20)']); "
                   "print('bye')"))
    try:
        w.read_until(STARTED)
        t0 = time.monotonic()
        assert w.read_until(EXIT).split()[0] == b"0"
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
        assert [int(w.read_until(EXIT, i).split()[0]) for i in (0, 1, 3)] == [0, 4, 7]
        for i, pid in zip((0, 1, 3), pids):
            assert w.output(STDOUT, i).decode().split() == [str(pid), str(pid)]
    finally:
        w.close()


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


# --- what a host sends that pslaunch's wrapper never would (issue 30, 14) ---------------------------


#: the start of a fake node: it reads whatever the launcher sends, in a thread
_DRAIN = ("import os, sys, threading, time\n"
          "threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(0, 65536), b'')], daemon=True).start()\n"
          "out = sys.stdout.buffer\n")


class FakeNodeSession(PipeSession):
    """A host whose channel runs ``script`` (Python, locally) instead of pslaunch's wrapper."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = script

        def run(command: str) -> None:
            self.chan.p = subprocess.Popen([sys.executable, "-c", _DRAIN + script], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.chan.exec_command = run  # type: ignore[method-assign]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


@pytest.mark.timeout(120)
def test_a_host_that_announces_a_huge_answer_is_dropped_without_buffering_it(caplog) -> None:
    """Issue 30, 14 (c): the answer to ``I`` announced as 1 GiB, and 300 MB of it sent: the launcher
    buffered all of it (answers were accepted up to MAX_ANSWER, 1 GiB). Now an answer is accepted at
    its request's length and the host is dropped at the announcement, with one line."""
    from launcher.backends.ssh import RemoteHost

    head = protocol.HEAD.pack(protocol.IFACE_ANSWER, NODE, 1 << 30)
    script = (f"out.write({MAGIC!r} + {head!r})\nout.flush()\nchunk = b'x' * (1 << 20)\n"
              "for _ in range(300):\n    out.write(chunk)\nout.flush()\ntime.sleep(60)\n")
    host = RemoteHost(FakeNodeSession(script), _ssh_spec())  # type: ignore[arg-type]
    before = _rss_mb()
    peak = [before]
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.05):
            peak[0] = max(peak[0], _rss_mb())
    threading.Thread(target=watch, daemon=True).start()
    try:
        host.open()
        t0 = time.monotonic()
        try:
            doc = host.request(protocol.IFACE, b'{"iface": "eth0"}', protocol.IFACE_ANSWER, timeout=30.0)
            error = str(doc.get("error"))
        except Exception as e:  # noqa: BLE001 - the request fails, one way or the other
            error = str(e)
        took = time.monotonic() - t0
        wait_for(lambda: host.closed, 30, what="the reader to let go of the host")
        grown = peak[0] - before
        print(f"a 1 GiB answer announced: request failed after {took:.1f}s, launcher RSS +{grown:.0f} MB")
        assert "more than the" in error, error
        assert grown < 64, f"the launcher buffered {grown:.0f} MB of the announced frame"
        dropped = [r.getMessage() for r in caplog.records if "dropped that host" in r.getMessage()]
        assert "pipe-host announced a 'i' frame of 1,073,741,824 bytes" in host.refused, host.refused
        assert len(dropped) <= 1, dropped
    finally:
        watching.set()
        host.closed = True
        host.session.chan.close()


def _banner_script(nbytes: int, then: str = "time.sleep(60)\n") -> str:
    return ("line = b'Welcome to a host whose login shell says a lot: ' + b'-' * 40 + b'\\n'\n"
            f"n = {nbytes} // len(line)\nfor i in range(0, n, 1000):\n    out.write(line * min(1000, n - i))\n"
            f"out.flush()\n{then}")


@pytest.mark.timeout(120)
def test_a_20_mb_login_banner_is_not_20_mb_of_warnings(caplog) -> None:
    """Issue 30, 14 (d): 20 MB printed before the wrapper's first frame was one warning per line
    (221,219). Now at most SHOWN_LINES lines are shown, one line says how many more were not, and a
    host that prints more than PREAMBLE_MAX before the protocol starts is dropped, with one line."""
    from launcher.backends import ssh

    caplog.set_level("WARNING", logger="launcher.backends.ssh")
    host = ssh.RemoteHost(FakeNodeSession(_banner_script(20 << 20)), _ssh_spec())  # type: ignore[arg-type]
    try:
        host.open()
        wait_for(lambda: host.closed, 60, what="the host to be dropped")
        lines = [r.getMessage() for r in caplog.records if r.name == "launcher.backends.ssh"]
        print(f"a 20 MB banner: {len(lines)} warning lines; {host.refused}")
        assert len(lines) <= ssh.SHOWN_LINES + 2, (len(lines), lines[-3:])
        assert "more lines of its login shell's" in lines[-1] or "more lines of its login shell's" in lines[-2]
        assert "printed more than 1.0 MiB before pslaunch's remote wrapper started" in host.refused, host.refused
    finally:
        host.closed = True
        host.session.chan.close()


@pytest.mark.timeout(120)
def test_a_chatty_login_shell_is_shown_in_part_and_the_host_works(caplog) -> None:
    """Below PREAMBLE_MAX the host is served: SHOWN_LINES lines shown, then one line for the rest."""
    from launcher.backends import ssh

    caplog.set_level("WARNING", logger="launcher.backends.ssh")
    answer = frame(protocol.IFACE_ANSWER, NODE, b'{"address": "10.0.0.1", "interface": "eth0"}')
    then = f"out.write({MAGIC!r} + {answer!r})\nout.flush()\ntime.sleep(60)\n"
    host = ssh.RemoteHost(FakeNodeSession(_banner_script(500_000, then)), _ssh_spec())  # type: ignore[arg-type]
    try:
        host.open()
        doc = host.request(protocol.IFACE, b'{"iface": "eth0"}', protocol.IFACE_ANSWER, timeout=30.0)
        assert doc == {"address": "10.0.0.1", "interface": "eth0"}
        lines = [r.getMessage() for r in caplog.records if r.name == "launcher.backends.ssh"]
        assert len(lines) == ssh.SHOWN_LINES + 1, lines
        hidden = re.match(r"pipe-host: ([0-9,]+) more lines of its login shell's", lines[-1])
        assert hidden and int(hidden.group(1).replace(",", "")) >= 5000, lines[-1]  # (5,554 lines, cut by reads)
        assert not host.refused
    finally:
        host.closed = True
        host.session.chan.close()


@pytest.mark.timeout(120)
def test_a_host_that_never_answers_fails_the_start_once_it_is_lost() -> None:
    """Issue 30, 14 (a): a host silent from the start was declared lost after 4 keep-alive intervals,
    but the start waited for --start-timeout (60 s). Now the start fails at the declaration, with
    one line that names the host."""
    from launcher.backends.ssh import RemoteHost, SSHBackend
    from launcher.errors import LaunchError
    from launcher.runtime.output import Console
    from launcher.spec.job import Host
    from launcher.transport.options import SSHOptions

    line = Host("pipe-host")
    spec = JobSpec(command=("true",), num_workers=1, num_servers=0, launcher="ssh", hosts=(line,),
                   options=SSHOptions(keepalive=0.25), start_timeout=60.0, kill_grace=1.0)
    console = Console(stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"), color=False)
    backend = SSHBackend(spec, console, None)
    host = RemoteHost(FakeNodeSession("time.sleep(120)\n"), spec)  # type: ignore[arg-type]
    backend.hosts = {("root", "pipe-host", 22): host}
    backend.by_line[line] = host
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchError) as e:
            backend.start([ProcSpec(Role.WORKER, 0, 0, line, ("true",), {})])
        took = time.monotonic() - t0
        print(f"a silent host: the start failed after {took:.1f}s (lost after {4 * 0.25:g}s): {e.value}")
        assert "host pipe-host is lost before its processes started: no reply to keep-alives" in str(e.value)
        assert e.value.exit_code == 255
        assert took < 40, f"the start waited {took:.0f}s for a host declared lost after 1 s"
    finally:
        host.closed = True
        host.session.chan.close()


# --- keep-alives: one thread for every host (issue 36) ----------------------------------------------


class TickedHost:
    """What the keep-alive ticker needs of a host: an interval and a tick that says whether to go on."""

    def __init__(self, interval: float, ticks: int) -> None:
        self.interval = interval
        self.left = ticks
        self.ticked: list[float] = []

    def keepalive_tick(self) -> bool:
        self.ticked.append(time.monotonic())
        self.left -= 1
        return self.left > 0


def _keepalive_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-keepalive"]


@pytest.mark.timeout(60)
def test_one_keepalive_thread_ticks_every_host_at_its_interval() -> None:
    """A job on 64 hosts held 64 keep-alive threads, each asleep most of the time; now one thread ticks
    them all, each at its own interval, and ends once no host is left."""
    from launcher.backends.ssh import KeepaliveTicker

    ticker = KeepaliveTicker("test-keepalive")
    hosts = [TickedHost(0.2, 5) for _ in range(64)] + [TickedHost(0.05, 20)]
    t0 = time.monotonic()
    for h in hosts:
        ticker.add(h)
    assert len(_keepalive_threads()) == 1
    wait_for(lambda: ticker.hosts == 0, timeout=30, what="every host to finish its ticks")
    assert all(len(h.ticked) == 5 for h in hosts[:64]) and len(hosts[64].ticked) == 20
    first_gap = min(h.ticked[0] for h in hosts[:64]) - t0
    assert first_gap >= 0.19, f"a 0.2 s host was ticked after {first_gap:.3f}s"  # (not before its interval)
    wait_for(lambda: not _keepalive_threads(), timeout=10, what="the keep-alive thread to end")
    ticker.add(TickedHost(0.05, 1))  # ... and it starts again with the next host
    wait_for(lambda: ticker.hosts == 0, timeout=10, what="the new host's tick")


@pytest.mark.timeout(60)
def test_a_tick_does_not_wait_for_a_host_another_thread_is_sending_to() -> None:
    """The ticker serves every host from one thread, so a tick must not wait for a host: while another
    thread holds the host's send lock (a long frame to a slow host), the tick leaves the ping and the
    silence check out (the send's own stall limit judges the host) and returns at once; the host is
    still ticked."""
    from launcher.backends.ssh import RemoteHost

    session = PipeSession()
    host = RemoteHost(session, _ssh_spec())  # type: ignore[arg-type]
    try:
        host.open()
        with host._send_lock:
            t0 = time.monotonic()
            assert host.keepalive_tick() is True
            assert time.monotonic() - t0 < 0.5
        assert host.keepalive_tick() is True  # (and with the lock free, the ping goes out)
        host.closed = True
        assert host.keepalive_tick() is False  # a closed host needs no more ticks
    finally:
        host.closed = True
        session.chan.close()
