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

**A lost worker replaced in place** (``PSLAUNCH_RESTART_SCOPE=process``, see
:mod:`trainer.kv.recovery`). A worker whose connection closes, or that reports
a failure, is taken out of the job instead: one line names it and says that
the scheduler waits for its replacement, at most ``PS_START_TIMEOUT``; then
the scheduler aborts the job as above, naming the worker. Barriers and the
final handshake wait for the replacement meanwhile. A ``REGISTER`` with
``replacement`` >= 1 and the worker's task id takes that rank at once, also
while the old worker still looks connected (the launcher starts a replacement
only once the old process ended), and gets ``READY`` with ``recovery``. A
worker that sends no heartbeat for ``PS_HEARTBEAT_TIMEOUT`` is named once and
keeps its place; it is aborted only after ``PS_HEARTBEAT_TIMEOUT +
PS_START_TIMEOUT`` of silence. A lost server still ends the job. A
``REGISTER`` that does not fit (not a replacement, no such worker, a
malformed one) is turned away or dropped; it never ends the scheduler.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

import pscontract as pc
from pscontract import ClusterEnv

from . import protocol as P
from . import recovery as R
from .errors import KVAbortError, own_rank, report_cause
from .transport import CLEAN_LINGER_MS, Hub, Verbose, scheduler_address

logger = logging.getLogger(__name__)


@dataclass
class Lost:
    """A worker taken out of the job, waiting for its replacement (scope process)."""

    node: NodeInfo
    since: float
    why: str


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
    #: its heartbeat silence was reported (scope process: it keeps its place)
    silent: bool = False

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

    def __init__(self, env: ClusterEnv, secret: bytes, replace_workers: bool | None = None) -> None:
        self.env = env
        #: a lost worker will be replaced (PSLAUNCH_RESTART_SCOPE=process): wait for it
        self.replacing = (R.replaces_workers(os.environ) if replace_workers is None
                          else replace_workers)
        #: worker rank -> the lost worker whose replacement is awaited
        self.lost: dict[int, Lost] = {}
        self.book: list[list[Any]] = []
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
        number = info.get("replacement")
        if (role == "worker" and self.replacing and type(number) is int and number >= 1
                and self._take_over(peer, info, number)):
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

    # --- a lost worker and its replacement (scope process) ---------------------------------
    def _replaceable(self, node: NodeInfo) -> bool:
        """A worker whose loss the job waits out (its replacement will take its rank)."""
        return (self.replacing and node.role == "worker" and not node.finalized
                and node.culprit(self.env.num_workers)[1] is not None)

    def _remove(self, node: NodeInfo) -> None:
        """Take ``node`` out of the job's tables (its connection may linger: it is a stranger now)."""
        self.nodes.pop(node.peer.rid, None)
        for waiting in self.barriers.values():
            waiting.discard(node.peer.rid)

    def _lose(self, node: NodeInfo, why: str, now: float) -> None:
        """Wait for ``node``'s replacement, saying so in one line."""
        self._remove(node)
        rank = node.culprit(self.env.num_workers)[1]
        assert rank is not None
        self.lost[rank] = Lost(node, now, why)
        logger.warning("%s %s %s: waiting up to %g s (%s) for its replacement", self.v.who,
                       node.name, why, self.env.start_timeout, pc.START_TIMEOUT)

    def _take_over(self, peer: P.Peer, info: dict[str, Any], number: int) -> bool:
        """A replacement's REGISTER: give it its predecessor's rank. False when it replaces
        nobody (before the start: then it registers as any worker does)."""
        task = info.get("task_id")
        if type(task) is not int or not 0 <= task < self.env.num_workers:
            self.hub.drops.drop("malformed", peer.label)
            return True
        old = next((n for n in self.nodes.values() if n.role == "worker" and n.task_id == task),
                   None)
        lost = next((r for r, x in self.lost.items() if x.node.task_id == task), None)
        if old is None and lost is None:
            if self.ready:  # every worker is in place: it replaces nobody
                logger.warning("%s turned away a replacement for worker task %d (pid %s on %s): "
                               "that worker is neither lost nor registered", self.v.who, task,
                               info.get("pid"), info.get("host"))
                self.hub.drops.drop("malformed", peer.label)
                return True
            return False
        prev = old if old is not None else self.lost[lost].node  # type: ignore[index]
        # every field read (a malformed one raises here) before anything changes
        node = NodeInfo(peer=peer, role="worker", task_id=task,
                        host=str(info.get("host", peer.address)), port=int(info.get("port") or 0),
                        pid=int(info.get("pid") or 0), order=prev.order, rank=prev.rank)
        if old is not None:  # its REGISTER proves the old process gone: no need to wait for it
            self._remove(old)
        if lost is not None:
            del self.lost[lost]
        self.nodes[peer.rid] = node
        peer.label = node.name
        peer.info = node
        logger.warning("%s %s (replacement %d) takes the place of %s", self.v.who, node.name,
                       number, prev.name)
        if self.ready:
            self.hub.send_json(peer, P.READY, {
                "rank": node.rank, "num_workers": self.env.num_workers,
                "num_servers": self.env.num_servers, "servers": self.book, "recovery": True})
        elif len(self.nodes) == sum(self.expected.values()):
            self._start()
        return True

    def _start(self) -> None:
        nodes = sorted(self.nodes.values(), key=lambda n: n.order)
        assign_ranks(nodes, self.env.num_workers)
        servers = sorted((n for n in nodes if n.role == "server"), key=lambda n: n.rank)
        self.book = book = [[n.host, n.port] for n in servers]
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
            if self._replaceable(node):
                self._lose(node, f"failed ({reason or 'no reason given'})", now)
                return False
            self.abort(f"{node.name} failed: {reason or 'no reason given'}",
                       node.culprit(self.env.num_workers))
        elif cmd == P.FINALIZE:
            node.finalized = True
            done = sum(1 for n in self.nodes.values() if n.finalized)
            self.v("Barrier count for finalize : %d", done)
            if self.ready and done == len(self.nodes) and not self.lost:
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
        for rank, lost in list(self.lost.items()):
            if now - lost.since > env.start_timeout:
                self.abort(f"{lost.node.name} {lost.why}, and no replacement registered within "
                           f"{env.start_timeout:g} s ({pc.START_TIMEOUT})", ("worker", rank))
        timeout = env.heartbeat_timeout
        if timeout > 0 and env.heartbeat_interval > 0:
            for n in list(self.nodes.values()):
                if not n.finalized:
                    self._check_silence(n, now - n.last_seen, timeout)

    def _check_silence(self, n: NodeInfo, silent: float, timeout: float) -> None:
        """Abort for a node silent too long; under scope process a silent worker keeps its
        place (a busy one on a loaded host) and only a long silence ends the job."""
        limit = timeout
        if self._replaceable(n):
            if silent <= timeout:
                n.silent = False
                return
            if not n.silent:
                n.silent = True
                logger.warning("%s %s sent no heartbeat for %g s (%s); it keeps its place until "
                               "its connection closes or a replacement registers", self.v.who,
                               n.name, timeout, pc.HEARTBEAT_TIMEOUT)
            limit = timeout + self.env.start_timeout
        elif self.replacing:
            limit = R.silence_limit(timeout, True)
        if silent > limit:
            self.abort(f"{n.name} sent no heartbeat for {limit:g} s "
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
                    if node is not None and self._replaceable(node):
                        self._lose(node, "disconnected (it exited or was killed)", now)
                    elif node is not None and not node.finalized:
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
