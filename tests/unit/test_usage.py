"""Each process's CPU and RSS (issue 33, item 5): :class:`launcher.node.procgroup.UsageMeter` on real
processes, checked against the kernel's own run-time counter (``/proc/<pid>/schedstat``, not the
``stat`` file the meter reads); the ``u`` frame; a real agent that sends it only when asked; the
switch in what the launcher sends (ssh header, task file, rank table); the handles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import wait_for

from launcher.node import procgroup, protocol
from launcher.node.procgroup import UsageMeter
from launcher.node.protocol import Decoder, parse_usage, usage_payload
from launcher.runtime.output import Console
from launcher.runtime.remote import RemoteProcess
from launcher.spec.job import JobSpec, Role
from launcher.spec.plan import ProcSpec

ROOT = Path(__file__).resolve().parents[2]
# (a loop that ends by itself: a run of these tests killed midway leaves no core busy for long)
BUSY = f"{sys.executable} -S -c 'import time; end = time.time() + 120\nwhile time.time() < end: pass'"
#: 200 MB, written (so resident), once a line arrives on stdin
ALLOCATE = (f"{sys.executable} -S -c 'import sys, time; sys.stdin.readline(); b = b\"x\" * (200 << 20); "
            "print(\"ok\", flush=True); time.sleep(60)'")


def _start(command: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", command], start_new_session=True, **kw)


def _stop(p: subprocess.Popen) -> None:
    procgroup.signal_group(p.pid, signal.SIGKILL)
    p.wait()


def _run_ns(pgid: int) -> int:
    """The kernel's CPU time, in ns, of every live process of group ``pgid`` (schedstat: an
    independent counter, kept by the scheduler in nanoseconds)."""
    total = 0
    for p in procgroup.scan() or ():
        if p.pgid == pgid:
            try:
                with open(f"/proc/{p.pid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
    return total


#: how a look finds the processes: every process of /proc, or the tree under this test's process
ROOTS = pytest.mark.parametrize("root", [None, os.getpid()], ids=["scan", "tree"])


def _measure(pgid: int, seconds: float = 1.0, root: int | None = None) -> tuple[tuple[float, int], float]:
    """The meter's ``(cpu, rss)`` of group ``pgid`` over ``seconds``, and the kernel's CPU percent
    over the same interval."""
    meter = UsageMeter()
    ns0, t0 = _run_ns(pgid), time.monotonic()
    meter.look(root)
    time.sleep(seconds)
    meter.look(root)
    ns1, t1 = _run_ns(pgid), time.monotonic()
    value = meter.usage(pgid)
    assert value is not None
    return value, (ns1 - ns0) / 1e9 / (t1 - t0) * 100.0


@ROOTS
def test_a_busy_tree_counts_every_process_of_it(root: int | None) -> None:
    """``sh -c`` that starts two busy loops: the meter sums the tree, and agrees with the kernel's
    run time over the same second. (On an idle 2-core machine that is about 200 %; on a loaded one,
    what the loops got.)"""
    p = _start(f"{BUSY} & {BUSY} & wait")
    try:
        wait_for(lambda: len(procgroup.children(p.pid)) == 2, 10, what="two busy loops")
        time.sleep(0.3)
        (cpu, rss), kernel = _measure(p.pid, 1.5, root)
        print(f"busy tree: meter {cpu:.1f} %, kernel {kernel:.1f} %, rss {rss / 1e6:.1f} MB")
        assert kernel > 5.0  # (they did run: on a loaded machine, not much)
        assert abs(cpu - kernel) <= max(10.0, 0.1 * kernel), (cpu, kernel)
        assert 3e6 < rss < 100e6  # sh and two Pythons without site
    finally:
        _stop(p)


@ROOTS
def test_a_child_that_left_the_group_still_counts(root: int | None) -> None:
    """``setsid`` puts the busy loop in a group of its own; its parent is still the leader's."""
    p = _start(f"setsid {BUSY} & wait")
    loop = wait_for(lambda: procgroup.children(p.pid), 10, what="the busy loop")[0]  # type: ignore[index]
    try:
        wait_for(lambda: procgroup.stat(loop).pgid == loop, 10, what="setsid")
        meter = UsageMeter()
        meter.look(root)
        time.sleep(1.0)
        meter.look(root)
        value, alone = meter.usage(p.pid), meter.usage(loop)
        assert value is not None and alone is not None and alone[0] > 10.0
        assert value[0] >= alone[0] and value[1] > alone[1]  # the loop, and sh beside it
    finally:
        procgroup.signal_group(loop, signal.SIGKILL)  # (it left p's group)
        _stop(p)


@ROOTS
def test_an_idle_process_is_near_zero(root: int | None) -> None:
    p = _start("sleep 60")
    try:
        time.sleep(0.2)
        (cpu, rss), kernel = _measure(p.pid, root=root)
        assert cpu <= 2.0 and kernel <= 2.0, (cpu, kernel)
        assert 0 < rss < 20e6
    finally:
        _stop(p)


@ROOTS
def test_the_rss_of_a_process_that_allocates_200_mb_grows(root: int | None) -> None:
    p = _start(ALLOCATE, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        meter = UsageMeter()
        meter.look(root)
        time.sleep(0.3)
        meter.look(root)
        before = meter.usage(p.pid)
        p.stdin.write(b"go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        assert p.stdout.readline() == b"ok\n"  # type: ignore[union-attr]
        meter.look(root)
        after = meter.usage(p.pid)
        assert before is not None and after is not None
        print(f"rss before {before[1] / 1e6:.1f} MB, after {after[1] / 1e6:.1f} MB")
        # (200 MiB written; pages the interpreter held before may be given back meanwhile)
        assert after[1] - before[1] >= 190 << 20
    finally:
        _stop(p)


def test_no_value_before_two_looks_nor_for_a_zombie_or_a_stranger() -> None:
    meter = UsageMeter()
    p = subprocess.Popen(["true"], start_new_session=True)
    # (a value for a running group is test_local_processes_share_one_look_per_interval's: this
    # test's own group may have no leader, the shell that started pytest having ended, as in CI)
    alive = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        meter.look()
        assert meter.usage(p.pid) is None and meter.usage(alive.pid) is None  # one look: no interval yet
        wait_for(lambda: procgroup.stat(p.pid).state == "Z", 10, what="the child to end")
        meter.look()
        assert meter.usage(p.pid) is None  # ended, not reaped
        assert meter.usage(os.getpid()) is None or os.getpgid(0) == os.getpid()  # no group's leader
    finally:
        p.wait()
        alive.kill()
        alive.wait()
    meter.look()
    assert meter.usage(p.pid) is None  # gone


def test_local_processes_share_one_look_per_interval() -> None:
    from launcher.runtime import local

    p = _start(BUSY)
    try:
        first = local.local_usage(p.pid, interval=0.5)
        looked = local._meter.looked
        assert local.local_usage(p.pid, interval=0.5) == first and local._meter.looked == looked  # not again
        time.sleep(0.6)
        value = local.local_usage(p.pid, interval=0.5)
        assert value is not None and value[0] > 5.0 and local._meter.looked != looked
    finally:
        _stop(p)


# --- the frame ------------------------------------------------------------------------------------------


def test_the_usage_payload() -> None:
    assert usage_payload(99.84, 123456789) == b"99.8 123456789"
    assert protocol.frame(protocol.USAGE, 3, usage_payload(0.0, 4096)) == b"u\x00\x03\x00\x00\x00\x080.0 4096"
    assert parse_usage(b"99.8 123456789") == (99.8, 123456789)
    for bad in (b"", b"1", b"1 2 3", b"x 2", b"1 2.5", b"-1 2", b"1 -2", b"nan 1", b"inf 1", b"\xff 1"):
        assert parse_usage(bad) is None, bad


def _remote() -> RemoteProcess:
    proc = ProcSpec(Role.WORKER, 0, 0, None, ("x",), {})
    return RemoteProcess(proc, Console().proc("w", "worker 0", "worker"), "h", 0)


def test_a_remote_process_keeps_the_last_value_until_it_ends() -> None:
    h = _remote()
    assert h.usage() is None
    h.frame(protocol.USAGE, b"50.0 1000")
    h.frame(protocol.USAGE, b"nonsense")  # ignored: the last good value stays
    h.frame(protocol.USAGE, b"99.5 2000")
    assert h.usage() == (99.5, 2000)
    h.frame(protocol.EXIT, b"0")
    assert h.usage() is None and h.poll() == 0


def _agent_frames(usage: float, seconds: float) -> list[tuple[bytes, int, bytes]]:
    """What a real agent (its own process) writes while it runs a busy loop for ``seconds``."""
    code = ("import sys; from launcher.node.agent import Agent, Channel; "
            f"sys.exit(Agent(1.0, Channel(0, 1), usage={usage!r}).run([{{'id': 2, 'argv': ['sh', '-c', "
            f"'timeout {seconds} {sys.executable} -S -c \"while True: pass\"'], "
            "'env': {'PATH': '/usr/bin:/bin'}}])[0])")
    p = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        out = p.stdout.read()  # type: ignore[union-attr]
        assert p.wait(timeout=30) == 124
    finally:
        p.kill()
        p.wait()
    return Decoder().feed(out)


def test_an_agent_reports_usage_only_when_asked() -> None:
    frames = _agent_frames(0.25, 1.5)
    kinds = [k for k, _, _ in frames]
    assert kinds[0] == protocol.STARTED and kinds[-1] == protocol.EXIT
    usage = [parse_usage(p) for k, i, p in frames if k == protocol.USAGE and i == 2]
    assert 3 <= len(usage) <= 7 and set(kinds) == {protocol.STARTED, protocol.USAGE, protocol.EXIT}
    print("agent's u frames:", usage)
    assert max(u[0] for u in usage if u) > 3.0 and all(u and u[1] > 1e6 for u in usage)
    assert [k for k, _, _ in _agent_frames(0.0, 0.5)] == [protocol.STARTED, protocol.EXIT]  # not asked: none


# --- the switch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ui, report, wanted", [
    (None, None, False), (("127.0.0.1", 8080), None, True), (None, "r.html", True)])
def test_the_switch_reaches_every_kind_of_node(ui, report, wanted) -> None:
    from launcher.backends.batch import build_task_file
    from launcher.backends.mpi.command import rank_layout, rank_table
    from launcher.backends.ssh import wrapper_header

    spec = JobSpec(command=("python", "t.py"), num_workers=1, num_servers=0, ui=ui, report=report)
    assert spec.wants_usage is wanted
    proc = ProcSpec(Role.WORKER, 0, 0, None, ("python", "t.py"), {"PATH": "/bin"})
    header = wrapper_header([(0, proc)], None, keepalive=2.0, grace=3.0, usage=spec.wants_usage)
    doc = build_task_file(spec, [proc])
    _, table = rank_table([proc], rank_layout([proc]), 1.0, usage=spec.wants_usage)
    expected = {"usage": protocol.USAGE_INTERVAL} if wanted else {}
    assert {k: v for k, v in header.items() if k == "usage"} == expected
    assert {k: v for k, v in doc.items() if k == "usage"} == expected
    assert {k: v for k, v in table.items() if k == "usage"} == expected
