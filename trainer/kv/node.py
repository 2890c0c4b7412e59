"""A worker's or server's connection to the scheduler: register, heartbeat, notice loss."""

from __future__ import annotations

import os
import socket
import time

import zmq

import pscontract as pc
from pscontract import ClusterEnv

from . import protocol as P
from .transport import Link, Verbose, scheduler_address


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
        host = scheduler_address(env)
        self.name = f"the scheduler at {host}:{env.root_port}"
        self.link = Link(ctx, host, env.root_port, secret, self.name, "H", env.mac_payload,
                         verbose, monitor=True)
        self.sock = self.link.sock
        self.monitor = self.link.monitor
        now = time.monotonic()
        self.last_rx = now
        self.next_heartbeat = now
        self.connected = False

    def connect(self, deadline: float, role: str, host: str, port: int = 0) -> None:
        """Authenticate and register; raises KVAuthError or KVTimeoutError."""
        self.link.handshake(deadline)
        self.connected = True
        self.link.send_json(P.REGISTER, {
            "role": role, "task_id": self.env.task_id, "host": host, "port": port,
            "pid": os.getpid(), "hostname": socket.gethostname()})
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
        """Send a heartbeat when due; return a reason when the scheduler is lost."""
        env = self.env
        if self.link.peer_closed():
            return (f"lost the connection to {self.name}: it exited or was killed "
                    "(see its output)")
        if env.heartbeat_interval > 0 and self.connected:
            if now >= self.next_heartbeat:
                self.link.send(P.HEARTBEAT)
                self.next_heartbeat = now + env.heartbeat_interval
            if env.heartbeat_timeout > 0 and now - self.last_rx > env.heartbeat_timeout:
                return (f"{self.name} has not answered for {env.heartbeat_timeout:g} s "
                        f"({pc.HEARTBEAT_TIMEOUT}): it hangs, or its host is unreachable")
        return None

    def next_due(self, now: float) -> float:
        """When :meth:`tick` should run next (``time.monotonic()`` seconds)."""
        due = now + 0.5
        if self.env.heartbeat_interval > 0 and self.connected:
            due = min(due, self.next_heartbeat)
        return due

    def close(self, linger_ms: int = 0) -> None:
        self.link.close(linger_ms)
