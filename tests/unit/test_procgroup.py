"""The one reader of ``/proc/<pid>/stat`` (launcher/node/procgroup.py), on real processes."""

from __future__ import annotations

import os
import subprocess

from support.helpers import wait_for

from launcher.node import procgroup
from launcher.runtime.handle import scan_groups


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def test_a_program_name_with_spaces_and_parentheses(tmp_path) -> None:
    odd = tmp_path / "a) (b c) d"  # comm is the program's file name: "pid (a) (b c) d) S ppid ..."
    odd.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(odd), "30"], start_new_session=True)
    try:
        wait_for(lambda: _comm(child.pid) == "a) (b c) d" and procgroup.stat(child.pid).state == "S", 10,
                 what="the child to exec and sleep")
        st = procgroup.stat(child.pid)
        assert (st.pid, st.ppid, st.pgid, st.alive) == (child.pid, os.getpid(), child.pid, True)
        assert st.state == "S" and st.start >= procgroup.stat(os.getpid()).start
        assert child.pid in procgroup.children() and child.pid in (p.pid for p in procgroup.scan())
        assert scan_groups()[child.pid] == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_no_live_child() -> None:
    child = subprocess.Popen(["true"])
    try:
        wait_for(lambda: procgroup.stat(child.pid).state == "Z", 10, what="the child to end")
        st = procgroup.stat(child.pid)
        assert st.state == "Z" and not st.alive
        assert child.pid not in procgroup.children()
        assert child.pid not in (scan_groups() or {}).get(os.getpgid(0), [])
    finally:
        child.wait()
    assert procgroup.stat(child.pid) is None  # reaped: gone


def test_this_process() -> None:
    st = procgroup.stat(os.getpid())
    assert (st.pid, st.ppid, st.pgid, st.state) == (os.getpid(), os.getppid(), os.getpgid(0), "R")
    assert os.getpid() in scan_groups()[os.getpgid(0)]


def test_a_marker_stops_its_own_process_not_one_whose_marker_it_begins() -> None:
    """Worker 1's marker is a prefix of worker 10's: the end of worker 1's agent (``kill_marked``
    of its marker) must not stop worker 10 (before: it did, with SIGKILL). A job's prefix, ending
    in ``/``, finds both."""
    job = f"marker-test-{os.getpid()}"
    procs = {name: subprocess.Popen(["sleep", "30"], env={procgroup.MARK_NAME: f"{job}/{name}"})
             for name in ("worker-1", "worker-10")}
    try:
        by_pid = {p.pid: name for name, p in procs.items()}
        assert [by_pid.get(pid) for pid in procgroup.marked(f"{job}/worker-1")] == ["worker-1"]
        assert sorted(by_pid.get(pid, "?") for pid in procgroup.marked(f"{job}/")) == ["worker-1", "worker-10"]
        assert procgroup.kill_marked(f"{job}/worker-1") == 1
        assert procs["worker-1"].wait(10) == -9
        assert procs["worker-10"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
