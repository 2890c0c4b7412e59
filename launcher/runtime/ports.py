"""The ports the launcher listens on in ``--port-range``: the one place that picks them.

A port is the first free one of the range, from its low end up (or above a given port), by
:func:`pscontract.first_free_port`, the rule the trainer's servers follow in ``PS_PORT_RANGE``
too: a port that is in use, or that this user may not bind, is skipped; any other error of a
bind (an address that is not this host's) ends the search at once.

* :func:`bind_in_range`: a TCP socket bound on one address (the torch store, the doctor's listener);
* :func:`bind_beside`: the hub's socket, beside the scheduler's or the tracker's port;
* :func:`claim_free_port`: the scheduler's port, which the scheduler program binds itself a while
  later: free on every address when chosen, and claimed against the other pslaunch runs on this
  machine (:class:`PortClaim`).

XGBoost's trackers take a port number, not a socket: ``trackers/xgboost_child.py``, run with the
tracker Python and importing nothing of pslaunch, tries the range by the same rule itself.
"""

from __future__ import annotations

import errno
import socket
from typing import Callable, Optional

import pscontract as pc

from ..errors import LaunchError


class NoFreePort(Exception):
    """Every port of ``lo..hi`` (above the one asked) was in use."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__(f"no free port in {lo}-{hi}")
        self.lo, self.hi = lo, hi

    def for_user(self, what: str) -> LaunchError:
        """The job's one line: ``what`` (the scheduler, the torch store) found no port of --port-range."""
        return LaunchError(f"no free port in --port-range {self.lo}-{self.hi} for {what}; free one or give another "
                           "range")


class BindError(OSError):
    """A bind failed for another reason than a port in use (``host`` is not an address of this
    host, say); ``host`` and ``port`` are what it tried."""

    host = ""
    port = 0


def bind_in_range(host: str, lo: int, hi: int, after: int = 0) -> socket.socket:
    """A TCP socket bound on ``host`` (IPv4 or IPv6) and the first free port of ``lo..hi`` above
    ``after``; the caller listens on it.

    Raises:
        NoFreePort: every port of the range is in use.
        BindError: a bind failed for another reason.
    """
    found = pc.first_free_port(lo, hi, lambda port: _bind(host, port), after)
    if found is None:
        raise NoFreePort(lo, hi)
    return found[1]


def bind_beside(host: str, lo: int, hi: int, beside: int) -> socket.socket:
    """A TCP socket on ``host`` for a listener beside the one on port ``beside`` (the hub beside
    the scheduler or the tracker): the first free port of ``lo..hi`` above ``beside``, else the
    first below it, else any port (the nodes are told which).

    Raises:
        BindError: ``host`` is not an address of this host, say.
    """
    for low, high, after in ((lo, hi, beside), (lo, beside - 1, 0)):
        try:
            return bind_in_range(host, low, high, after)
        except NoFreePort:
            continue
    sock = _bind(host, 0)  # (port 0: the system's choice)
    assert sock is not None
    return sock


def _bind(host: str, port: int) -> Optional[socket.socket]:
    """A TCP socket bound on ``host`` and ``port``; None when the port is not free."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        return sock
    except OSError as e:
        sock.close()
        if e.errno in pc.PORT_TAKEN and port:
            return None
        error = BindError(e.errno, e.strerror)
        error.host, error.port = host, port
        raise error from None


def port_is_free(port: int, reuse: bool = True) -> bool:
    """True when nothing holds ``port`` on any address: a bind with ``SO_REUSEADDR`` succeeds, as
    the scheduler's will (libzmq and ps-lite's own set it). Without it (``reuse=False``: a plain
    bind, as a program that binds the port itself may do) the connections that the last job's
    scheduler closed hold the port for a minute (TIME_WAIT)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


class PortClaim:
    """This launcher's claim on its scheduler's port, against every other pslaunch on this machine.

    The scheduler binds its port a while after the launcher found it free (a ps-lite program
    imports for seconds first). Two jobs started together with the same ``--port-range`` would
    both find the same port free, and one of them lose it: if the loser's servers and workers
    reach the winner's scheduler before they are stopped, ps-lite counts them as the winner's
    nodes, and that job goes wrong too. A claim is a Unix socket bound to the abstract name
    ``pslaunch/port/PORT``: per network namespace, as ports are; another pslaunch cannot bind it
    while this one holds it, and the kernel lets go of it when this process ends, however it ends.
    It does not touch the TCP port itself (the scheduler binds that as it likes). Without
    abstract Unix sockets (not Linux) there is no claim, only the race's recovery.
    """

    PREFIX = b"\0pslaunch/port/"

    def __init__(self, sock: Optional[socket.socket]) -> None:
        self._sock = sock

    @classmethod
    def take(cls, port: int) -> Optional[PortClaim]:
        """The claim on ``port``, or None when another pslaunch holds it."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except (OSError, AttributeError):
            return cls(None)
        try:
            sock.bind(cls.PREFIX + str(port).encode())
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:  # claimed
                return None
            return cls(None)  # (no abstract names here)
        return cls(sock)

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def claim_free_port(lo: int, hi: int, after: int = 0) -> tuple[int, PortClaim]:
    """The first port of ``lo..hi`` above ``after`` that no other pslaunch on this machine has
    claimed and that is free, with this launcher's claim on it (release it when the job ends):
    free for a plain bind if one is, else free for a bind with ``SO_REUSEADDR``.

    Raises:
        NoFreePort: every port of the range is claimed or in use.
    """
    def taker(reuse: bool) -> Callable[[int], Optional[PortClaim]]:
        def take(port: int) -> Optional[PortClaim]:
            claim = PortClaim.take(port)
            if claim is not None and not port_is_free(port, reuse):
                claim.release()
                return None
            return claim
        return take

    # A port nothing holds first, which any program can bind; then one that only the closed
    # connections of a job before hold (TIME_WAIT), which libzmq's listeners bind all the same:
    # a --port-range of one port is not refused for a minute after each job.
    found = pc.first_free_port(lo, hi, taker(False), after) or pc.first_free_port(lo, hi, taker(True), after)
    if found is None:
        raise NoFreePort(lo, hi)
    return found
