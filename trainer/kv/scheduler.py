"""The scheduler: registration, ranks, the address book, barriers, liveness and shutdown.

Life of a job, as the scheduler sees it:

1. Bind ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``. Bare TCP connections (the
   launcher's "is it listening yet" probe) are harmless: nothing is served
   before a peer has proven the job secret.
2. Wait for ``DMLC_NUM_WORKER`` workers and ``DMLC_NUM_SERVER`` servers to
   ``REGISTER``, at most ``PS_START_TIMEOUT`` seconds, then give out ranks
   (worker rank = ``DMLC_TASK_ID``, server rank = ``DMLC_TASK_ID -
   DMLC_NUM_WORKER``; registration order without task ids) and send every
   node ``READY`` with the servers' addresses.
3. Run barriers per group (workers, servers, all) and answer heartbeats.
4. When every node has sent ``FINALIZE``, answer ``DONE`` to all and exit 0.

Unlike ps-lite, a node that dies (its connection closes, or it sends no
heartbeat for ``PS_HEARTBEAT_TIMEOUT`` seconds), reports a failure, or has
not registered in time makes the scheduler send ``ABORT`` with a reason
naming that node to everyone, and exit non-zero. Nothing waits forever.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import zmq

import pscontract as pc
from pscontract import ClusterEnv

from . import protocol as P
from .errors import KVAbortError, own_rank, report_cause
from .transport import CLEAN_LINGER_MS, Hub, Verbose, scheduler_address

logger = logging.getLogger(__name__)


@dataclass
class NodeInfo:
    """A registered worker or server."""

    peer: P.Peer
    role: str
    task_id: int | None
    host: str
    port: int
    pid: int
    order: int
    rank: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    finalized: bool = False

    @property
    def name(self) -> str:
        rank = "" if self.rank < 0 else f" {self.rank}"
        task = "" if self.task_id is None else f"task {self.task_id}, "
        return f"{self.role}{rank} ({task}pid {self.pid} on {self.host})"

    def culprit(self, num_workers: int) -> tuple[str, int | None]:
        """``(role, rank)`` for a cause line: the rank given, or the one its task id implies."""
        if self.rank >= 0:
            return self.role, self.rank
        return self.role, own_rank(self.role, self.task_id, num_workers)


def assign_ranks(nodes: list[NodeInfo], num_workers: int) -> None:
    """Set ``rank`` on each node: from ``DMLC_TASK_ID`` when those form a valid
    numbering, else by task id order, else by registration order."""
    for role, offset in (("worker", 0), ("server", num_workers)):
        group = [n for n in nodes if n.role == role]
        if all(n.task_id is not None for n in group):
            wanted = sorted(n.task_id - offset for n in group)  # type: ignore[operator]
            if wanted == list(range(len(group))):
                for n in group:
                    n.rank = n.task_id - offset  # type: ignore[operator]
                continue
            group.sort(key=lambda n: (n.task_id, n.order))
        else:
            group.sort(key=lambda n: n.order)
        for rank, n in enumerate(group):
            n.rank = rank


class Scheduler:
    """The scheduler role. :meth:`run` returns on success and raises on failure.

    Args:
        env: the process's contract.
        secret: the job's HMAC key.
    """

    def __init__(self, env: ClusterEnv, secret: bytes) -> None:
        self.env = env
        self.v = Verbose(env.verbose, "H")
        self.ctx = zmq.Context()
        self.hub = Hub(self.ctx, secret, env.mac_payload, self.v, watch=True)
        self.host = scheduler_address(env)
        self.nodes: dict[bytes, NodeInfo] = {}
        self.expected = {"worker": env.num_workers, "server": env.num_servers}
        self.ready = False
        self.barriers: dict[int, set[bytes]] = {}
        self.started = time.monotonic()

    # --- helpers -------------------------------------------------------------------
    def _members(self, group: int) -> list[NodeInfo]:
        roles = {P.GROUP_WORKERS: ("worker",), P.GROUP_SERVERS: ("server",),
                 P.GROUP_ALL: ("worker", "server")}[group]
        return [n for n in self.nodes.values() if n.role in roles]

    def _missing(self) -> tuple[str, tuple[str, int | None] | None]:
        """Who has not registered, in words, and the first of them as ``(role, rank)``."""
        have = [n for n in self.nodes.values()]
        ids = {n.task_id for n in have if n.task_id is not None}
        total = self.env.num_workers + self.env.num_servers
        if ids or not have:
            names, first = [], None
            for t in range(total):
                if t in ids:
                    continue
                if t < self.env.num_workers:
                    names.append(f"worker {t} (task {t})")
                    first = first or ("worker", t)
                else:
                    names.append(f"server {t - self.env.num_workers} (task {t})")
                    first = first or ("server", t - self.env.num_workers)
            if names and len(names) + len(have) == total:
                return ", ".join(names), first
        parts, role_missing = [], None
        for role in ("worker", "server"):
            got = sum(1 for n in have if n.role == role)
            if got < self.expected[role]:
                parts.append(f"{self.expected[role] - got} of {self.expected[role]} {role}s")
                role_missing = role_missing or (role, None)
        return " and ".join(parts) or "nobody", role_missing

    def abort(self, reason: str, culprit: tuple[str, int | None] | None = None) -> None:
        """Name the cause (``culprit``: ``(role, rank)`` of the process at fault), tell
        every node to abort with ``reason``, then raise KVAbortError."""
        role, rank = culprit if culprit is not None else (None, None)
        report_cause(reason, role, rank)
        for rid in list(self.nodes):
            self.hub.send_json(self.nodes[rid].peer, P.ABORT, {"reason": reason})
        self.v("is stopping (aborted)")
        raise KVAbortError(reason)

    # --- message handlers -------------------------------------------------------------
    def _register(self, peer: P.Peer, msg: P.Message) -> None:
        info = msg.json()
        role = info.get("role") if isinstance(info, dict) else None
        if role not in ("worker", "server"):
            self.hub.drops.drop("malformed", peer.label)
            return
        if self.ready or sum(1 for n in self.nodes.values() if n.role == role) >= self.expected[role]:
            count_var = pc.NUM_WORKER if role == "worker" else pc.NUM_SERVER
            reason = (f"one {role} more than {count_var}={self.expected[role]} "
                      f"registered (pid {info.get('pid')} on {info.get('host')}): "
                      "a process of another run, or a wrong count")
            self.hub.send_json(peer, P.ABORT, {"reason": reason})
            logger.warning("%s turned away %s", self.v.who, reason)
            return
        task = info.get("task_id")
        node = NodeInfo(peer=peer, role=role, task_id=task if isinstance(task, int) else None,
                        host=str(info.get("host", peer.address)), port=int(info.get("port") or 0),
                        pid=int(info.get("pid") or 0), order=len(self.nodes))
        for other in self.nodes.values():
            if node.task_id is not None and other.task_id == node.task_id:
                self.abort(f"{node.name} and {other.name} both have {pc.TASK_ID}={node.task_id}: "
                           "every process of the job needs its own task id",
                           node.culprit(self.env.num_workers))
        self.nodes[peer.rid] = node
        peer.label = node.name
        peer.info = node
        if len(self.nodes) == sum(self.expected.values()):
            self._start()

    def _start(self) -> None:
        nodes = sorted(self.nodes.values(), key=lambda n: n.order)
        assign_ranks(nodes, self.env.num_workers)
        servers = sorted((n for n in nodes if n.role == "server"), key=lambda n: n.rank)
        book = [[n.host, n.port] for n in servers]
        for n in nodes:
            n.peer.label = n.name
            self.v("assign rank=%d to node role=%s, ip=%s, port=%d, task=%s, pid=%d",
                   n.rank, n.role, n.host, n.port, n.task_id, n.pid)
        for n in nodes:
            self.hub.send_json(n.peer, P.READY, {
                "rank": n.rank, "num_workers": self.env.num_workers,
                "num_servers": self.env.num_servers, "servers": book})
        self.ready = True
        self.v("the scheduler is connected to %d workers and %d servers",
               self.env.num_workers, self.env.num_servers)

    def _barrier(self, node: NodeInfo, group: int) -> None:
        if group not in P.GROUP_NAMES:
            self.hub.drops.drop("malformed", node.name)
            return
        members = self._members(group)
        if node not in members:
            self.hub.drops.drop("malformed", node.name)
            return
        waiting = self.barriers.setdefault(group, set())
        waiting.add(node.peer.rid)
        self.v("Barrier count for %s : %d", P.GROUP_NAMES[group], len(waiting))
        if len(waiting) == len(members) == self._expected_members(group):
            del self.barriers[group]
            for m in members:
                self.hub.send(m.peer, P.RELEASE, key=group)

    def _expected_members(self, group: int) -> int:
        if group == P.GROUP_WORKERS:
            return self.env.num_workers
        if group == P.GROUP_SERVERS:
            return self.env.num_servers
        return self.env.num_workers + self.env.num_servers

    def _handle(self, peer: P.Peer, msg: P.Message, now: float) -> bool:
        """Handle one message; True when the job is complete."""
        node: NodeInfo | None = self.nodes.get(peer.rid)
        cmd = msg.cmd
        if node is None:
            if cmd == P.REGISTER:
                self._register(peer, msg)
            elif cmd == P.HEARTBEAT:
                self.hub.send(peer, P.HEARTBEAT)
            else:
                self.hub.drops.drop("unregistered", peer.label)
            return False
        node.last_seen = now
        if cmd == P.HEARTBEAT:
            self.hub.send(peer, P.HEARTBEAT)
        elif cmd == P.BARRIER:
            self._barrier(node, msg.key)
        elif cmd == P.FAIL:
            info = msg.json()
            reason = info.get("reason") if isinstance(info, dict) else None
            self.abort(f"{node.name} failed: {reason or 'no reason given'}",
                       node.culprit(self.env.num_workers))
        elif cmd == P.FINALIZE:
            node.finalized = True
            done = sum(1 for n in self.nodes.values() if n.finalized)
            self.v("Barrier count for finalize : %d", done)
            if self.ready and done == len(self.nodes):
                for n in self.nodes.values():
                    self.hub.send(n.peer, P.DONE)
                return True
        elif cmd == P.REGISTER:
            pass  # a duplicate: harmless
        else:
            self.hub.drops.drop("unexpected", node.name)
        return False

    def _check_timers(self, now: float) -> None:
        env = self.env
        if not self.ready and now - self.started > env.start_timeout:
            missing, first = self._missing()
            self.abort(f"timed out after {env.start_timeout:g} s ({pc.START_TIMEOUT}) waiting for "
                       f"{missing} to register with the scheduler at "
                       f"{self.host}:{env.root_port}: check that they started and can reach it",
                       first)
        timeout = env.heartbeat_timeout
        if timeout > 0 and env.heartbeat_interval > 0:
            for n in self.nodes.values():
                if not n.finalized and now - n.last_seen > timeout:
                    self.abort(f"{n.name} sent no heartbeat for {timeout:g} s "
                               f"({pc.HEARTBEAT_TIMEOUT}): it hangs, or its host is unreachable",
                               n.culprit(self.env.num_workers))

    # --- main loop ----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until every node has finalized; raise KVAbortError when the job fails."""
        env = self.env
        try:
            self.hub.bind(self.host, env.root_port, what="the scheduler")
            self.v("Bind to role=scheduler, ip=%s, port=%d", self.host, env.root_port)
            poller = zmq.Poller()
            for sock in self.hub.sockets():
                poller.register(sock, zmq.POLLIN)
            tick = 0.5
            if env.heartbeat_interval > 0:
                tick = min(tick, env.heartbeat_interval)
            while True:
                poller.poll(tick * 1000)
                now = time.monotonic()
                self.hub.service(now)
                # Map closed connections to peers before reading messages, so a new
                # peer that got a recycled fd is never blamed; handle them after the
                # messages, so a FAIL sent just before dying is what gets reported.
                gone = self.hub.gone()
                # A peer that closed may have left more than one batch of messages
                # (its FAIL or FINALIZE behind heartbeats): read them all first.
                for peer, msg in self.hub.receive(1 << 30 if gone else 64):
                    try:
                        done = self._handle(peer, msg, now)
                    except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError):
                        self.hub.drops.drop("malformed", peer.label)
                        continue
                    if done:
                        self.v("is stopping")
                        stats = self.hub.stats()
                        self.hub.close(CLEAN_LINGER_MS)
                        self._report_drops()
                        self.v("is stopped (%s)", stats)
                        return
                for peer in gone:
                    self.hub.forget(peer)
                    node = self.nodes.get(peer.rid)
                    if node is not None and not node.finalized:
                        self.abort(f"{node.name} disconnected before the end of the job: it "
                                   "exited or was killed (see its output)",
                                   node.culprit(self.env.num_workers))
                self._check_timers(now)
        except BaseException:
            self._report_drops()
            self.v("is stopped (%s)", self.hub.stats())
            self.hub.close(1000)
            raise
        finally:
            self.ctx.term()

    def _report_drops(self) -> None:
        if self.hub.drops.total:
            logger.warning("%s refused or dropped %d connections or messages (%s)", self.v.who,
                           self.hub.drops.total, self.hub.drops.summary())


def run(env: ClusterEnv, secret: bytes) -> None:
    """Run the scheduler role of this process (see :class:`Scheduler`)."""
    logger.debug("scheduler pid %d", os.getpid())
    Scheduler(env, secret).run()
