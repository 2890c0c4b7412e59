"""Ports of a range (``launcher.runtime.ports`` and the rule in ``pscontract``): the first free port
from the low end up, ``after``, a full range, an address that is not this host's, the hub's port
beside the scheduler's, and the claims that keep two pslaunch runs on one machine apart; real
sockets on loopback."""

from __future__ import annotations

import errno
import random
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import pytest

import pscontract as pc
from launcher.errors import ConfigError
from launcher.runtime import ports
from launcher.spec.job import JobSpec

NOT_HERE = "10.200.255.254"  # an address of the test networks that no interface has (the network guard allows it)


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive ports that are free on loopback now, below the ephemeral
    range: no connection that another test makes meanwhile can take one as its local port (a CI
    run met that once: a port of the ephemeral range, free a moment before, held by a client)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, ephemeral - n)  # (Ray's workers take 10002-19999 by default)
        if all(ports.port_is_free(p, reuse=False) for p in range(base, base + n)):
            return base
    pytest.skip(f"no {n} consecutive free ports here")


def _hold(stack: ExitStack, port: int) -> socket.socket:
    s = stack.enter_context(socket.socket())
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


# -- the rule (pscontract) -------------------------------------------------------------------------


def test_the_rule_takes_the_first_port_above_after_and_says_none_when_all_are_taken() -> None:
    tried: list[int] = []

    def take(port: int):
        tried.append(port)
        return f"held {port}" if port in (13, 15) else None

    assert pc.first_free_port(10, 20, take) == (13, "held 13")
    assert tried == [10, 11, 12, 13]
    tried.clear()
    assert pc.first_free_port(10, 20, take, after=13) == (15, "held 15")
    assert tried == [14, 15]
    tried.clear()
    assert pc.first_free_port(10, 20, take, after=15) is None
    assert tried == [16, 17, 18, 19, 20]
    assert pc.first_free_port(10, 20, take, after=5) == (13, "held 13")  # (after below the range: from LOW)


def test_an_error_of_take_ends_the_search() -> None:
    tried: list[int] = []

    def take(port: int):
        tried.append(port)
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    with pytest.raises(OSError):
        pc.first_free_port(10, 20, take)
    assert tried == [10]


def test_one_validator_for_every_port_range() -> None:
    rule = "need 1 <= LOW <= HIGH <= 65535"
    for text, why in (("10-5", rule), ("0-5", rule), ("1-99999", rule),
                      ("9000", "expected LOW-HIGH, for example 9091-9998")):
        with pytest.raises(ValueError) as e:
            pc.parse_port_range(text)
        assert str(e.value) == f"bad port range {text!r}: {why}"
    assert pc.parse_port_range(" 9000 - 9100 ") == (9000, 9100)
    with pytest.raises(ValueError, match=rf"^{rule}$"):
        pc.check_port_range(5, 1)
    pc.check_port_range(1, 65535)
    with pytest.raises(ConfigError) as e:  # the spec asks the same rule
        JobSpec(command=("x",), num_workers=1, num_servers=0, launcher="local", port_range=(5, 1))
    assert str(e.value) == f"--port-range 5-1: {rule}"


# -- bind_in_range -------------------------------------------------------------------------------------


def test_bind_in_range_skips_ports_in_use_and_honours_after() -> None:
    base = _free_run(4)
    with ExitStack() as stack:
        _hold(stack, base)
        got = stack.enter_context(ports.bind_in_range("127.0.0.1", base, base + 3))
        assert got.getsockname() == ("127.0.0.1", base + 1)
        above = stack.enter_context(ports.bind_in_range("127.0.0.1", base, base + 3, after=base + 1))
        assert above.getsockname()[1] == base + 2


def test_a_full_range_is_no_free_port() -> None:
    base = _free_run(2)
    with ExitStack() as stack:
        _hold(stack, base)
        _hold(stack, base + 1)
        with pytest.raises(ports.NoFreePort) as e:
            ports.bind_in_range("127.0.0.1", base, base + 1)
        assert (e.value.lo, e.value.hi) == (base, base + 1)
        with pytest.raises(ports.NoFreePort):
            ports.bind_in_range("127.0.0.1", base, base + 1, after=base + 1)  # (nothing above it)


def test_an_address_that_is_not_this_hosts_ends_the_search_at_its_first_port() -> None:
    base = _free_run(3)
    with pytest.raises(ports.BindError) as e:
        ports.bind_in_range(NOT_HERE, base, base + 2)
    assert (e.value.errno, e.value.host, e.value.port) == (errno.EADDRNOTAVAIL, NOT_HERE, base)
    assert isinstance(e.value, OSError) and e.value.strerror


def test_bind_in_range_binds_ipv6_addresses() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    base = _free_run(1)
    try:
        sock = ports.bind_in_range("::1", base, base)
    except ports.BindError as e:
        pytest.skip(f"no ::1 here: {e}")
    with sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[1] == base


def test_the_hubs_port_is_above_the_schedulers_else_below_else_any() -> None:
    base = _free_run(4)
    sched = base + 2
    with ExitStack() as stack:
        _hold(stack, sched)
        above = stack.enter_context(ports.bind_beside("127.0.0.1", base, base + 3, sched))
        assert above.getsockname()[1] == base + 3
        below = stack.enter_context(ports.bind_beside("127.0.0.1", base, base + 3, sched))
        assert below.getsockname()[1] == base  # the range above is full: the first below
        _hold(stack, base + 1)
        anywhere = stack.enter_context(ports.bind_beside("127.0.0.1", base, base + 3, sched))
        assert not base <= anywhere.getsockname()[1] <= base + 3  # the range is full: the system's choice
    with pytest.raises(ports.BindError):
        ports.bind_beside(NOT_HERE, base, base + 3, sched)


# -- claims: two pslaunch runs on one machine never pick the same scheduler port ---------------------


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _claim_one_free_port() -> tuple[int, ports.PortClaim]:
    """A free port of loopback and this test's claim on it. Between the kernel's answer and the
    claim's look, another test's connection may take that port (the kernel hands out the same
    ephemeral ports; CI once lost 43233 so): then another port."""
    for _ in range(20):
        port = _free_tcp_port()
        try:
            return ports.claim_free_port(port, port)
        except ports.NoFreePort:
            continue
    raise AssertionError("20 free ports in a row were taken before they could be claimed")


def test_a_claimed_port_is_skipped_until_its_claim_is_released() -> None:
    port, claim = _claim_one_free_port()
    assert ports.PortClaim.take(port) is None  # another run's try
    second, other = ports.claim_free_port(port, port + 20)
    assert second > port
    claim.release()
    again = ports.PortClaim.take(port)
    assert again is not None
    again.release()
    other.release()


def test_a_claim_skips_a_port_in_use_and_honours_after() -> None:
    base = _free_run(3)
    with ExitStack() as stack:
        _hold(stack, base)
        port, claim = ports.claim_free_port(base, base + 2)
        assert port == base + 1
        claim.release()
        assert ports.PortClaim.take(base) is not None  # (the port in use was not left claimed)
        port, claim = ports.claim_free_port(base, base + 2, after=base + 1)
        assert port == base + 2
        claim.release()


def test_a_claim_leaves_the_tcp_port_to_the_scheduler() -> None:
    port, claim = _claim_one_free_port()
    try:
        with socket.socket() as s:  # a plain bind, no SO_REUSEADDR: ps-lite's scheduler binds as it likes
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        claim.release()


def test_a_range_whose_every_port_is_claimed_is_no_free_port() -> None:
    port, claim = _claim_one_free_port()
    try:
        with pytest.raises(ports.NoFreePort):
            ports.claim_free_port(port, port)
    finally:
        claim.release()


def test_the_claim_of_a_killed_launcher_is_gone_with_it() -> None:
    # SIGKILL runs no clean-up: the kernel lets go of the claim with the process
    low = _free_tcp_port()  # (the holder says which port it claimed: another test may take this one first)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from launcher.runtime import ports; "
        f"held = ports.claim_free_port({low}, {low + 50}); print(held[0], flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        assert ports.PortClaim.take(port) is None
    finally:
        holder.kill()
        holder.wait()
    claim = ports.PortClaim.take(port)
    assert claim is not None
    claim.release()


def time_wait_port(port: int = 0) -> int:
    """A free port of loopback (``port``, or any) whose listener's side closed a connection first,
    as a scheduler's does at the end of a job: that end waits in TIME_WAIT for a minute (Linux)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as libzmq's listeners)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            conn, _ = listener.accept()
            conn.close()  # the listener's side first
            assert client.recv(1) == b""
    for _ in range(500):  # (the client's FIN moves it to TIME_WAIT: at once on loopback)
        with open("/proc/net/tcp") as f:  # (local address, state 06: TIME_WAIT)
            if any(x.split()[1].endswith(f":{port:04X}") and x.split()[3] == "06" for x in f.readlines()[1:]):
                return port
        time.sleep(0.01)
    raise AssertionError(f"no TIME_WAIT on port {port}")


def test_the_schedulers_port_is_free_again_right_after_a_job() -> None:
    """Before: a probe without SO_REUSEADDR met the last job's TIME_WAIT, and a --port-range of
    one port was refused for a minute after each job ("no free port")."""
    port = time_wait_port(_free_run(1))
    assert ports.port_is_free(port)
    got, claim = ports.claim_free_port(port, port)
    claim.release()
    assert got == port
    with socket.socket() as s:  # what the scheduler does with it: libzmq binds with SO_REUSEADDR
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not ports.port_is_free(port)  # (and a listener still holds it)


def test_a_port_nothing_holds_comes_before_one_in_time_wait() -> None:
    """A program may bind the scheduler's port itself, without SO_REUSEADDR (a test's fake
    scheduler; a user's socket server): a port that the last job's closed connections hold is
    taken only when no port of the range is free for a plain bind. (Taking it first failed 33
    tests of a CI run with 'Address already in use': every job after the first on port 9091.)"""
    base = _free_run(2)
    tw = time_wait_port(base)
    assert ports.port_is_free(tw) and not ports.port_is_free(tw, reuse=False)
    got, claim = ports.claim_free_port(tw, tw + 1)
    claim.release()
    assert got == tw + 1
