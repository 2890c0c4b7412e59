"""Who holds the scheduler's port while a job starts (launcher/run/addresses.py), on real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from test_ports import time_wait_port

from launcher.run import addresses
from launcher.run.addresses import SchedulerWatch, _proc_ip, listener


def test_proc_net_addresses() -> None:
    assert _proc_ip("0100007F") == "127.0.0.1"
    assert _proc_ip("0A01CA0A") == "10.202.1.10"
    assert _proc_ip("00000000000000000000000000000000") == "::"
    assert _proc_ip("0000000000000000FFFF00000100007F") == "127.0.0.1"  # ::ffff:127.0.0.1
    assert _proc_ip("00000000000000000000000001000000") == "::1"


def listening_on(host: str, port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.bind((host, port))
    s.listen()
    return s


def wait_verdict(watch: SchedulerWatch, seconds: float) -> None:
    """Until the watch has a verdict, at most ``seconds``."""
    end = time.monotonic() + seconds
    while watch.verdict is None and time.monotonic() < end:
        time.sleep(0.01)


def _every_listener() -> set[tuple[str, int, str]]:
    """The LISTEN lines of the whole of /proc/net/tcp and tcp6, read to the end."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    hexip, hexport = fields[1].rsplit(":", 1)
                    out.add((_proc_ip(hexip), int(hexport, 16), fields[9]))
    return out


def test_proc_lists_every_listener_and_no_connection() -> None:
    # IPv4, IPv6 and v4-mapped listeners alike; the read stops after the listeners (the kernel lists
    # them first) and still misses none, with connections on the host
    socks = [listening_on("127.0.0.1"), listening_on("::1")]
    dual = socket.socket(socket.AF_INET6)
    dual.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    dual.bind(("::", 0))
    dual.listen()
    socks.append(dual)
    connected = socket.create_connection(("127.0.0.1", socks[0].getsockname()[1]))  # not a listener
    try:
        before = _every_listener()
        found = addresses._proc_listeners()
        after = _every_listener()
        assert found is not None and before & after <= set(found) <= before | after  # (others' tests come and go)
        ports = {(ip, port) for ip, port, _ in found}
        assert ("127.0.0.1", socks[0].getsockname()[1]) in ports
        assert ("::1", socks[1].getsockname()[1]) in ports
        assert ("::", dual.getsockname()[1]) in ports
        assert ("127.0.0.1", connected.getsockname()[1]) not in ports
        assert addresses._listen_inodes(dual.getsockname()[1], "127.0.0.1")  # a wildcard collides
        assert not addresses._listen_inodes(socks[1].getsockname()[1], "127.0.0.1")
        assert listener(os.getpgid(0), "127.0.0.1", socks[0].getsockname()[1]) == "ours"
    finally:
        connected.close()
        for s in socks:
            s.close()


def test_a_listener_on_another_address_of_the_port_is_no_rival() -> None:
    # a scheduler on 127.0.0.1 and someone else's listener on 127.0.0.2, same port: the port
    # is free for the scheduler (its bind succeeds), so it is not "foreign" (a lost race)
    other = listening_on("127.0.0.2")
    port = other.getsockname()[1]
    try:
        assert listener(os.getpgid(0), "127.0.0.1", port) == "none"
        assert listener(os.getpgid(0), "127.0.0.2", port) == "ours"   # this process holds it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
        try:
            assert listener(child.pid, "127.0.0.2", port) == "foreign"   # held, not by the child's group
            assert listener(child.pid, "0.0.0.0", port) == "foreign"     # a wildcard bind collides too
            assert listener(child.pid, "127.0.0.1", port) == "none"
        finally:
            child.kill()
            child.wait()
    finally:
        other.close()


def test_a_wildcard_listener_collides_with_every_address() -> None:
    other = listening_on("0.0.0.0")
    port = other.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert listener(child.pid, "127.0.0.1", port) == "foreign"
    finally:
        child.kill()
        child.wait()
        other.close()


@pytest.mark.timeout(20)
def test_the_watch_says_up_beside_a_listener_on_another_address() -> None:
    # what a job on one address saw while a process of an earlier job still listened on the same
    # port of another address: a "lost" verdict, and a needless restart on the next port
    other = listening_on("127.0.0.2")
    port = other.getsockname()[1]
    code = (f"import socket, time; s = socket.socket(); time.sleep(0.3); s.bind(('127.0.0.1', {port})); "
            "s.listen(); time.sleep(30)")
    sched = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        watch = SchedulerWatch(sched.pid, "127.0.0.1", port).start()
        wait_verdict(watch, 10)
        watch.stop()
        assert watch.verdict == "up"
    finally:
        sched.kill()
        sched.wait()
        other.close()


def _exited(code: int) -> subprocess.Popen:
    """A 'scheduler' that has ended with ``code`` (not yet reaped: the watch peeks with WNOWAIT)."""
    p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"], start_new_session=True)
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    return p


@pytest.mark.timeout(20)
def test_judge_now_blames_the_rival_that_holds_the_port_when_the_scheduler_died() -> None:
    # the supervisor judges a dead scheduler at once, not at the watch thread's next look
    rival = listening_on("127.0.0.1")
    port = rival.getsockname()[1]
    sched = _exited(1)
    try:
        told: list[str] = []
        watch = SchedulerWatch(sched.pid, "127.0.0.1", port, interval=3600,  # the thread never looks
                               on_verdict=told.append)
        assert watch.judge_now() == "lost" and watch.verdict == "lost"
        rival.close()
        assert watch.judge_now() == "lost"  # a verdict stands
        assert told == ["lost"]  # told once, whichever thread reached it
        assert SchedulerWatch(sched.pid, "127.0.0.1", port, interval=3600).judge_now() == "died"
    finally:
        rival.close()
        sched.wait()


@pytest.mark.timeout(20)
def test_a_scheduler_that_crashed_after_its_first_connections_died_and_lost_no_race() -> None:
    """Its port keeps the connections it closed in TIME_WAIT. Before: the probe without
    SO_REUSEADDR took them for a rival, the crash for a lost port race, and the job started
    again on the next port with the traceback thrown away (4 of 6 runs)."""
    port = time_wait_port()
    sched = _exited(1)
    try:
        assert SchedulerWatch(sched.pid, "127.0.0.1", port, interval=3600).judge_now() == "died"
    finally:
        sched.wait()


@pytest.mark.timeout(20)
def test_the_watch_looks_ever_less_often_while_nobody_listens_and_still_sees_a_late_rival() -> None:
    # a ps-lite scheduler imports for seconds before it listens: 10 ms looks cost 110 ms of CPU in
    # 3 s on the cores the job needs; the looks back off to max_interval, and a rival that takes
    # the port late is still seen within it
    probe = listening_on("127.0.0.1")
    port = probe.getsockname()[1]
    probe.close()
    sched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    looks = []

    class Counting(SchedulerWatch):
        def check(self):  # type: ignore[override]
            looks.append(time.monotonic())
            return super().check()

    watch = Counting(sched.pid, "127.0.0.1", port, interval=0.01, max_interval=0.16).start()
    try:
        time.sleep(1.5)
        assert watch.verdict is None
        gaps = [b - a for a, b in zip(looks, looks[1:])]
        assert 5 <= len(looks) <= 20, looks  # every 10 ms, it was about 150
        assert gaps[0] < 0.1 and max(gaps) < 0.5 and gaps[-1] > 0.1, gaps
        rival = listening_on("127.0.0.1", port)
        wait_verdict(watch, 5)
        rival.close()
        assert watch.verdict == "lost"
    finally:
        watch.stop()
        sched.kill()
        sched.wait()


def test_the_tracker_takes_connections_from_the_jobs_hosts_where_the_launcher_knows_them() -> None:
    from launcher import backends
    from launcher.spec.job import Host, JobSpec

    def peers(launcher: str, hosts: tuple[Host, ...], found: dict) -> tuple[str, ...] | None:
        spec = JobSpec(command=("x",), num_workers=2, num_servers=0, launcher=launcher, hosts=hosts)
        return addresses.job_peers(spec, found, backends.get(launcher))

    assert peers("local", (), {}) == ("local",)  # (every process here: any of this machine's addresses)
    assert peers("mpi", (), {}) == ("local",)
    a, b = Host("127.0.0.5"), Host("localhost")
    assert set(peers("ssh", (a, b), {a: "10.0.0.9"}) or ()) >= {"127.0.0.5", "10.0.0.9", "127.0.0.1"}
    assert peers("ssh", (Host("no-such-host.invalid"),), {}) is None  # (an ssh alias, say: no filter)
    assert peers("slurm", (), {}) is None  # (the batch system places them)
    # --host-ip alone may be an address on another network than the one the hosts are known by
    spec = JobSpec(command=("x",), num_workers=2, num_servers=0, launcher="ssh", hosts=(a,), host_ip="10.9.0.1")
    assert addresses.job_peers(spec, {a: "10.0.0.9"}, backends.get("ssh")) is None


@pytest.mark.parametrize("program, ps_lite", [
    ("import zmq, time; print('ready', flush=True); time.sleep(30)", True),   # pyzmq maps libzmq
    ("import json, time; print('ready', flush=True); time.sleep(30)", False),  # a plain program
], ids=["pyzmq", "plain"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["leader", "under-a-shell"])
def test_a_scheduler_that_loads_a_ps_lite_library_is_told_apart(program: str, ps_lite: bool, wrapped: bool) -> None:
    # the hint that a command may not be a ps-lite program is not given to one that imports for seconds
    pytest.importorskip("zmq")
    argv = [sys.executable, "-c", program]
    if wrapped:  # the library is in a child of the group's leader (a wrapper script)
        argv = ["sh", "-c", f"{argv[0]} -c \"{program}\"; :"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            assert addresses.maps_pslite(p.pid) is ps_lite
        finally:
            os.killpg(p.pid, 9)
