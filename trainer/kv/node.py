"""A worker's or server's connection to the scheduler: register, heartbeat, notice loss.

A replacement worker (``PSLAUNCH_REPLACEMENT=k``) says so in its ``REGISTER``
(``replacement``: k), which makes the scheduler give it the lost worker's rank
(:mod:`trainer.kv.recovery`). Under ``PSLAUNCH_RESTART_SCOPE=process`` the
scheduler's heartbeat silence counts only after
:func:`~trainer.kv.recovery.silence_limit`: its closed connection is the
signal that acts at once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence

import zmq

import pscontract as pc
from pscontract import ClusterEnv

from . import protocol as P
from . import recovery as R
from .errors import KVAuthError, KVTimeoutError, own_rank, report_cause
from .transport import Link, Verbose, probe_tcp, scheduler_address

logger = logging.getLogger(__name__)

#: While the scheduler cannot be reached, a line says so this often (seconds), at any PS_VERBOSE.
REPORT_EVERY = 5.0
#: How long a plain TCP probe (to learn why ZeroMQ cannot connect) may take.
PROBE_TIMEOUT = 1.0


class SchedulerSession:
    """Our side of the control plane (one authenticated DEALER to the scheduler).

    The owner polls :attr:`sock` and :attr:`monitor`, passes readable events to
    :meth:`receive`, and calls :meth:`tick` at least every heartbeat interval.

    Args:
        ctx: the process's context.
        env: the process's contract.
        secret: the job's HMAC key.
        verbose: ``PS_VERBOSE`` logging.
    """

    def __init__(self, ctx: zmq.Context, env: ClusterEnv, secret: bytes, verbose: Verbose) -> None:
        self.env = env
        self.v = verbose
        self.host = scheduler_address(env)
        self.name = f"the scheduler at {self.host}:{env.root_port}"
        self.link = Link(ctx, self.host, env.root_port, secret, self.name, "H", env.mac_payload,
                         verbose)
        self.sock = self.link.sock
        self.monitor = self.link.monitor
        now = time.monotonic()
        self.last_rx = now
        self.next_heartbeat = now
        self.connected = False
        self.role = env.role
        self.rank = own_rank(env.role, env.task_id, env.num_workers)
        #: k for the k-th replacement of this worker; 0 for an original process
        self.replacement = R.replacement_number(os.environ) if env.role == "worker" else 0
        self.silence = R.silence_limit(env.heartbeat_timeout, R.replaces_workers(os.environ))

    def connect(self, deadline: float, role: str, host: str, port: int = 0,
                service: Callable[[], None] | None = None,
                also: Sequence[zmq.Socket] = ()) -> None:
        """Authenticate and register; raises KVAuthError or KVTimeoutError.

        While the scheduler cannot be reached it says so: whom it tries at
        ``PS_VERBOSE=1``, and every :data:`REPORT_EVERY` seconds at any level a
        line with the time so far and the reason (from a plain TCP probe:
        refused, unreachable, timed out). ``service`` runs on every wake-up, for
        the sockets in ``also`` (a server keeps its own gate open meanwhile).
        """
        link = self.link
        env = self.env
        started = time.monotonic()
        self.v("connecting to %s (%s %s)", self.name, pc.START_TIMEOUT, f"{env.start_timeout:g} s")
        link.start()
        poller = zmq.Poller()
        poller.register(link.sock, zmq.POLLIN)
        for s in also:
            poller.register(s, zmq.POLLIN)
        next_report = started + REPORT_EVERY
        next_probe = started + 1.0
        reason: str | None = None
        told = False
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._give_up(now - started, reason, host)
            for sock, _ in poller.poll(max(0.0, min(deadline - now, 0.05)) * 1000):
                if sock is link.sock:
                    while link.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        if link.advance(link.sock.recv_multipart(copy=False)):
                            return self._register(role, host, port, started)
            if service is not None:
                service()
            now = time.monotonic()
            try:
                link.tick(now)
            except KVAuthError as e:
                report_cause(str(e), self.role, self.rank)
                raise
            if not link.connected and now >= next_probe:
                reason = probe_tcp(self.host, env.root_port, PROBE_TIMEOUT) or reason
                next_probe = time.monotonic() + REPORT_EVERY - PROBE_TIMEOUT
                if reason and not told:
                    told = True
                    self.v("cannot reach %s: %s; trying again until %s (%g s)", self.name,
                           reason, pc.START_TIMEOUT, env.start_timeout)
            now = time.monotonic()
            if now >= next_report:
                next_report = now + REPORT_EVERY
                waited = now - started
                if not link.connected:
                    logger.warning("%s still cannot reach %s (%.0f s of %g s): %s", self.v.who,
                                   self.name, waited, env.start_timeout,
                                   reason or "no connection yet")
                else:
                    logger.warning("%s is connected to %s, which has not answered its handshake "
                                   "(%.0f s of %g s)", self.v.who, self.name, waited,
                                   env.start_timeout)

    def _give_up(self, waited: float, reason: str | None, host: str) -> None:
        env, link = self.env, self.link
        link.events()
        where = f"from host {socket.gethostname()} ({host})"
        limit = f"within {env.start_timeout:g} s ({pc.START_TIMEOUT})"
        if not link.connected and not link.gate_passed:
            if not link.connects:
                text = (f"cannot reach {self.name} {where} {limit}: "
                        f"{reason or 'no connection could be made'}")
                report_cause(text, self.role, self.rank)
                raise KVTimeoutError(text + "; check that it runs and that this host can reach "
                                     f"it ({pc.ROOT_URI}, {pc.ROOT_PORT}, firewalls)")
        if not link.gate_passed:
            text = (f"something listens at {self.host}:{env.root_port} but is not this job's "
                    f"scheduler (no ZeroMQ handshake {limit}, seen {where})")
            report_cause(text, self.role, self.rank)
            raise KVTimeoutError(text + f": check {pc.ROOT_URI} and {pc.ROOT_PORT}")
        text = f"{self.name} did not answer the handshake {limit} ({where}): it hangs or is overloaded"
        report_cause(text, "scheduler", None)
        raise KVTimeoutError(text)

    def _register(self, role: str, host: str, port: int, started: float) -> None:
        self.connected = True
        self.v("is connected to %s after %.2f s", self.name, time.monotonic() - started)
        info = {"role": role, "task_id": self.env.task_id, "host": host, "port": port,
                "pid": os.getpid(), "hostname": socket.gethostname()}
        if self.replacement:
            info["replacement"] = self.replacement
        self.link.send_json(P.REGISTER, info)
        self.last_rx = time.monotonic()

    def receive(self) -> list[P.Message]:
        """Every verified message waiting on the socket (heartbeat answers are consumed)."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self.link.receive(frames)
            if msg is None:
                continue
            self.last_rx = time.monotonic()
            if msg.cmd != P.HEARTBEAT:
                out.append(msg)
        return out

    def tick(self, now: float) -> str | None:
        """Send a heartbeat when due; return a reason when the scheduler is lost (the
        caller then names it, :meth:`blame`, unless a DONE or ABORT came first)."""
        env = self.env
        if self.link.peer_closed():
            return (f"lost the connection to {self.name}: it exited or was killed "
                    "(see its output)")
        if env.heartbeat_interval > 0 and self.connected:
            if now >= self.next_heartbeat:
                self.link.send(P.HEARTBEAT)
                self.next_heartbeat = now + env.heartbeat_interval
            if self.silence > 0 and now - self.last_rx > self.silence:
                return (f"{self.name} has not answered for {self.silence:g} s "
                        f"({pc.HEARTBEAT_TIMEOUT}): it hangs, or its host is unreachable")
        return None

    def blame(self, reason: str) -> None:
        """Name the scheduler as the cause of the stop (the caller decided it is lost)."""
        report_cause(reason, "scheduler", None)

    def next_due(self, now: float) -> float:
        """When :meth:`tick` should run next (``time.monotonic()`` seconds)."""
        due = now + 0.5
        if self.env.heartbeat_interval > 0 and self.connected:
            due = min(due, self.next_heartbeat)
        return due

    def close(self, linger_ms: int = 0) -> None:
        self.link.close(linger_ms)
