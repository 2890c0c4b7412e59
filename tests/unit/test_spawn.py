"""``launcher.runtime.spawn.spawn``, the one place that starts a child of the launcher: a new session,
/dev/null or a leash as stdin, pipes (stderr apart or with stdout), only ``pass_fds`` inherited,
the death signal, and the one-line errors (127/126 for a job's process) with every descriptor
closed again; checked against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from launcher.errors import LaunchError
from launcher.runtime.spawn import spawn, spawn_guard, spawning


def _read(fd: int) -> str:
    chunks = []
    with open(fd, "rb") as f:
        chunks.append(f.read())
    return b"".join(chunks).decode()


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


REPORT = """
import os, sys
print(os.getsid(0), os.getpid(), os.readlink("/proc/self/fd/0"))
print(" ".join(sorted(os.listdir("/proc/self/fd"), key=int)))
print("to stderr", file=sys.stderr)
os.write(int(sys.argv[1]), b"passed")
"""


def test_a_child_leads_a_new_session_reads_dev_null_and_gets_only_pass_fds() -> None:
    keep_r, keep_w = os.pipe()
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_w, True)  # (as a descriptor this launcher inherited would be)
    try:
        child = spawn([sys.executable, "-c", REPORT, str(keep_w)], pass_fds=[keep_w])
        out, err = _read(child.stdout), _read(child.stderr)
        assert child.popen.wait(10) == 0
    finally:
        for fd in (keep_w, leak_r, leak_w):
            os.close(fd)
    with open(keep_r, "rb") as f:
        assert f.read() == b"passed"
    first, fds = out.splitlines()
    sid, pid, stdin = first.split()
    assert sid == pid == str(child.pid) and stdin == "/dev/null"
    assert fds.split() == sorted(["0", "1", "2", "3", str(keep_w)], key=int), out  # (3: listdir's)
    assert err == "to stderr\n"


def test_the_leash_and_stderr_with_stdout() -> None:
    child = spawn(["sh", "-c", "cat; echo to stderr >&2"], stdin=subprocess.PIPE, merge_stderr=True)
    assert child.stderr is None and child.popen.stdin is not None
    child.popen.stdin.write(b"from the launcher\n")
    child.popen.stdin.close()
    assert _read(child.stdout) == "from the launcher\nto stderr\n"
    assert child.popen.wait(10) == 0


def test_the_environment_and_directory_are_the_callers(tmp_path) -> None:
    child = spawn(["sh", "-c", 'echo "$MARK $(pwd)"'], {"MARK": "here", "PATH": os.environ["PATH"]}, str(tmp_path))
    assert _read(child.stdout) == f"here {tmp_path}\n"
    _read(child.stderr)
    assert child.popen.wait(10) == 0


def test_a_program_that_cannot_run_is_one_line_and_leaves_no_descriptor(tmp_path) -> None:
    notexec = tmp_path / "notexec"
    notexec.write_text("#!/bin/sh\n")
    notexec.chmod(0o644)
    before = _fds()
    with pytest.raises(LaunchError) as e:
        spawn([str(tmp_path / "nosuch")])
    assert str(e.value) == f"cannot run {tmp_path / 'nosuch'}: No such file or directory"
    with pytest.raises(LaunchError) as e:
        spawn([str(tmp_path / "nosuch")], label="worker 0")
    assert e.value.exit_code == 127 and str(e.value) == (
        f"worker 0: cannot run '{tmp_path / 'nosuch'}': no such program or directory (is it on PATH? give a path "
        "such as ./prog)")
    with pytest.raises(LaunchError) as e:
        spawn([str(notexec)], label="server 1", merge_stderr=True)
    assert e.value.exit_code == 126 and str(e.value) == (
        f"server 1: cannot run '{notexec}': permission denied (is it executable?)")
    with pytest.raises(LaunchError) as e:
        spawn(["true"], cwd=str(tmp_path / "nowhere"))
    assert str(e.value) == "cannot run true: No such file or directory"
    assert _fds() == before
    assert not spawning()


def test_a_nul_byte_in_argv_or_env_is_one_line_and_leaves_no_descriptor() -> None:
    before = _fds()
    with pytest.raises(LaunchError) as e:
        spawn(["true", "a\0b"], label="worker 0")
    assert str(e.value) == "worker 0: cannot run 'true': embedded null byte" and e.value.exit_code == 1
    with pytest.raises(LaunchError) as e:
        spawn(["true"], env={"A": "a\0b"})
    assert str(e.value) == "cannot run true: embedded null byte"
    assert _fds() == before
    assert not spawning()


def test_the_guard_nests_and_holds_while_a_child_starts() -> None:
    assert not spawning()
    with spawn_guard():
        with spawn_guard():
            assert spawning()
        assert spawning()
    assert not spawning()


def test_the_death_signal_comes_when_the_starting_thread_ends() -> None:
    started: list = []

    def start() -> None:
        started.append(spawn(["sleep", "30"], death_signal=signal.SIGTERM))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    child = started[0]
    try:
        assert child.popen.wait(10) == -signal.SIGTERM
    finally:
        child.popen.kill()
        child.popen.wait()
        os.close(child.stdout)
        os.close(child.stderr)
