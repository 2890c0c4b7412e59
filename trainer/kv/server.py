"""A server: holds a shard of the keys and applies the updates (numpy, no torch).

Each stored array is a :class:`Slot` keyed by ``(key id, part)``. Requests:

* ``INIT``: rank 0 sets the initial value.
* ``PUSH`` in **sync** mode: the pushes of all workers for a slot are summed
  (into the first pushed buffer, in place); when the last one arrives the
  optimizer runs once on the sum (or the sum becomes the value when there is
  no optimizer), then every push of the round (pushpull or not) and every held
  pull is answered with the new value: the worker keeps it for the pull that
  nearly always follows a push, which then costs no request. A worker's second
  push before the round completes waits for the next round.
* ``PUSH`` in **async** mode (``F_ASYNC``): applied at once; an optimizer is
  required; no reply unless it fails, or it asks for the value (``F_PULL``).
* ``PULL``: answered at once from the value, or held until the round
  completes when the same worker has pushed into the current round.
* ``SET_OPTIMIZER`` (JSON spec), ``GET_STATES``/``SET_STATES``, ``STOP``.

Values are sent without a copy: a value is always a received ZeroMQ frame
(rank 0's init, or the first push of a round that the others were added to),
and sending a received frame again only shares its reference-counted buffer
(no copy, and none of pyzmq's zero-copy bookkeeping). In sync mode that is
safe because a value is only changed when a round completes, and a round
cannot complete before every worker has pushed again, which each does after it
has received its previous reply. Async replies are copies, taken as they are
sent.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import zmq

import pscontract as pc
from pscontract import ClusterEnv

from . import protocol as P
from .errors import KVAbortError, KVTimeoutError
from .node import SchedulerSession
from .optim import OptimizerError, Updater, create_optimizer
from .transport import CLEAN_LINGER_MS, Hub, Verbose, node_address

logger = logging.getLogger(__name__)

_NP_DTYPES = {code: np.dtype(name) for code, (name, _) in P.DTYPES.items()}


class Slot:
    """One stored array (a key, or one part of a split key) and its sync round."""

    __slots__ = ("value", "frame", "code", "count", "merged", "merged_frame", "pushed", "pending",
                 "backlog")

    def __init__(self, frame: zmq.Frame, code: int) -> None:
        self.frame = frame
        self.value = np.frombuffer(frame.buffer, _NP_DTYPES[code])
        self.code = code
        self.count = self.value.size
        self.merged: np.ndarray | None = None
        self.merged_frame: zmq.Frame | None = None
        self.pushed: set[bytes] = set()
        self.pending: list[tuple[P.Peer, int, int]] = []
        self.backlog: list[tuple[P.Peer, P.Message]] = []


def _key_id(slot_key: Any) -> int:
    """The key id of a ``(key id, part)`` state key: ``wd_mult`` is keyed by key id
    (the worker translates its keys, see :func:`trainer.kv.client.wd_mult_to_ids`)."""
    return slot_key[0]


def _queued(slot: Slot, rid: bytes) -> bool:
    """True when a request of this peer waits for the slot's next round."""
    return any(p.rid == rid for p, _ in slot.backlog)


class Shard:
    """The data plane of a server, free of I/O: slots, sync rounds and the optimizer.

    :meth:`handle` takes a verified request and answers through ``send`` (the
    server passes :meth:`Hub.send <trainer.kv.transport.Hub.send>`; a test can
    pass a recorder), so the round logic is testable on its own.

    Args:
        num_workers: workers per sync round.
        mac_payload: MAC the tensor payloads of replies.
        send: ``send(peer, cmd, key, part, req, status=, dtype=, count=, payload=,
            digest=, copy=)``.
        who: the server's name in log lines.
    """

    def __init__(self, num_workers: int, mac_payload: bool, send: Callable[..., Any],
                 who: str = "S") -> None:
        self.num_workers = num_workers
        self.mac_payload = mac_payload
        self.send = send
        self.who = who
        self.slots: dict[tuple[int, int], Slot] = {}
        self.updater: Updater | None = None

    def handle(self, peer: P.Peer, msg: P.Message) -> bool:
        """Serve one data-plane request; False when ``msg`` is not one."""
        cmd = msg.cmd
        if cmd == P.PUSH:
            self._push(peer, msg)
        elif cmd == P.PULL:
            self._pull(peer, msg)
        elif cmd == P.INIT:
            self._init(peer, msg)
        elif cmd == P.SET_OPTIMIZER:
            self._set_optimizer(peer, msg)
        elif cmd == P.GET_STATES:
            self._get_states(peer, msg)
        elif cmd == P.SET_STATES:
            self._set_states(peer, msg)
        else:
            return False
        return True

    # --- replies -------------------------------------------------------------------------
    def _ack(self, peer: P.Peer, msg: P.Message) -> None:
        self.send(peer, P.REPLY, msg.key, msg.part, msg.req)

    def _error(self, peer: P.Peer, msg: P.Message, text: str) -> None:
        logger.warning("%s refused %s from %s: %s", self.who,
                       P.COMMAND_NAMES.get(msg.cmd, msg.cmd), peer.label, text)
        self.send(peer, P.REPLY, msg.key, msg.part, msg.req, status=P.ST_ERROR,
                      payload=[text.encode()])

    def _send_value(self, peer: P.Peer, key: int, part: int, req: int, slot: Slot,
                    digest: bytes | None, snapshot: bool = False) -> None:
        """Send the slot's value: its frame as it is, or (``snapshot``) a copy taken now."""
        self.send(peer, P.REPLY, key, part, req, dtype=slot.code, count=slot.count,
                      payload=[slot.value if snapshot else slot.frame], digest=digest,
                      copy=snapshot)

    def _slot(self, peer: P.Peer, msg: P.Message) -> Slot | None:
        slot = self.slots.get((msg.key, msg.part))
        if slot is None:
            self._error(peer, msg, f"key {msg.key} (part {msg.part}) was never initialised on this "
                        "server: every worker must call init with the same keys in the same order")
        return slot

    # --- data plane ------------------------------------------------------------------------
    def _init(self, peer: P.Peer, msg: P.Message) -> None:
        slot = self.slots.get((msg.key, msg.part))
        if slot is not None and (slot.pushed or slot.backlog):
            self._error(peer, msg, f"key {msg.key} was initialised again during a push round")
            return
        self.slots[(msg.key, msg.part)] = Slot(msg.frames[0], msg.dtype)
        self._ack(peer, msg)

    def _push(self, peer: P.Peer, msg: P.Message) -> None:
        slot = self._slot(peer, msg)
        if slot is None:
            return
        if msg.dtype != slot.code or msg.count != slot.count:
            self._error(peer, msg, f"push of key {msg.key} has {msg.count} elements of "
                        f"{P.DTYPES[msg.dtype][0]}, but init gave {slot.count} of "
                        f"{P.DTYPES[slot.code][0]}: workers disagree on shapes or key order")
            return
        grad = np.frombuffer(msg.frames[0].buffer, _NP_DTYPES[msg.dtype])
        if msg.flags & P.F_ASYNC:
            self._push_async(peer, msg, slot, grad)
            return
        rid = peer.rid
        if rid in slot.pushed or _queued(slot, rid):  # its next round (keep its order)
            slot.backlog.append((peer, msg))
            return
        slot.pushed.add(rid)
        if slot.merged is None:
            slot.merged = grad
            slot.merged_frame = msg.frames[0]
        else:
            slot.merged += grad
        # Every push is answered with the round's value: a pull nearly always
        # follows, and this spares it a request and a round trip.
        slot.pending.append((peer, msg.req, 1))
        if len(slot.pushed) >= self.num_workers:
            self._complete(msg.key, msg.part, slot)

    def _push_async(self, peer: P.Peer, msg: P.Message, slot: Slot, grad: np.ndarray) -> None:
        if self.updater is None:
            self._error(peer, msg, "dist_async needs an optimizer on the servers: call "
                        "kv.set_optimizer(...) before the first push")
            return
        if slot.pushed:
            self._error(peer, msg, "a dist_async push arrived during a dist_sync round: every "
                        "worker must create the same kvstore type")
            return
        try:
            self.updater((msg.key, msg.part), slot.value, grad)
        except (TypeError, ValueError) as e:
            self._error(peer, msg, f"the optimizer failed on key {msg.key}: {e}")
            return
        if msg.flags & P.F_PULL:
            self._send_async_value(peer, msg, slot)

    def _send_async_value(self, peer: P.Peer, msg: P.Message, slot: Slot) -> None:
        # Other workers' pushes change the value in place at any time: send a copy.
        if self.mac_payload:
            value = slot.value.copy()
            self.send(peer, P.REPLY, msg.key, msg.part, msg.req, dtype=slot.code,
                          count=slot.count, payload=[value], digest=P.payload_digest([value]),
                          copy=True)
        else:
            self._send_value(peer, msg.key, msg.part, msg.req, slot, None, snapshot=True)

    def _complete(self, key: int, part: int, slot: Slot) -> None:
        merged, frame = slot.merged, slot.merged_frame
        assert merged is not None and frame is not None
        slot.merged = slot.merged_frame = None
        slot.pushed = set()
        failed = None
        if self.updater is not None:
            try:
                self.updater((key, part), slot.value, merged)
            except (TypeError, ValueError) as e:
                failed = f"the optimizer failed on key {key}: {e}"
        else:
            slot.value, slot.frame = merged, frame
        pending = slot.pending
        slot.pending = []
        if failed is not None:
            logger.warning("%s %s", self.who, failed)
            for peer, req, _ in pending:
                self.send(peer, P.REPLY, key, part, req, status=P.ST_ERROR,
                          payload=[failed.encode()])
        else:
            digest = None
            if pending and self.mac_payload:
                digest = P.payload_digest([slot.value])
            for peer, req, _ in pending:
                self._send_value(peer, key, part, req, slot, digest)
        # the next round's requests, failed round or not: nobody waits forever
        if slot.backlog:
            backlog = slot.backlog
            slot.backlog = []
            for peer, msg in backlog:
                self.handle(peer, msg)

    def _pull(self, peer: P.Peer, msg: P.Message) -> None:
        slot = self._slot(peer, msg)
        if slot is None:
            return
        if _queued(slot, peer.rid):  # after this worker's queued push
            slot.backlog.append((peer, msg))
        elif peer.rid in slot.pushed:
            slot.pending.append((peer, msg.req, 1))
        elif msg.flags & P.F_ASYNC:
            self._send_async_value(peer, msg, slot)
        else:
            digest = P.payload_digest([slot.value]) if self.mac_payload else None
            self._send_value(peer, msg.key, msg.part, msg.req, slot, digest)

    # --- control ------------------------------------------------------------------------------
    def _set_optimizer(self, peer: P.Peer, msg: P.Message) -> None:
        try:
            self.updater = Updater(create_optimizer(msg.json()), wd_key=_key_id)
        except OptimizerError as e:
            self._error(peer, msg, str(e))
            return
        self._ack(peer, msg)

    def _get_states(self, peer: P.Peer, msg: P.Message) -> None:
        meta: dict[str, Any] = {"optimizer": None, "slots": []}
        frames: list[Any] = []
        if self.updater is not None:
            meta["optimizer"] = self.updater.optimizer.to_spec()
            for (key, part), (count, arrays) in self.updater.get_states().items():
                names = sorted(arrays)
                meta["slots"].append({"key": key, "part": part, "count": count, "names": names})
                frames.extend(np.ascontiguousarray(arrays[n]) for n in names)
        # copy=True: a snapshot, since later pushes update the states in place
        self.send(peer, P.REPLY, msg.key, msg.part, msg.req, payload=[P.dumps(meta), *frames],
                      copy=True)

    def _set_states(self, peer: P.Peer, msg: P.Message) -> None:
        if not msg.frames:
            self._error(peer, msg, "SET_STATES without a description")
            return
        try:
            meta = msg.json()
            spec = meta.get("optimizer")
            entries = meta["slots"]
            if spec is not None:
                self.updater = Updater(create_optimizer(spec), wd_key=_key_id)
            if self.updater is None:
                raise ValueError("no optimizer is set: call kv.set_optimizer(...) first")
            frames = list(msg.frames[1:])
            states: dict[Any, tuple[int, dict[str, np.ndarray]]] = {}
            for entry in entries:
                key, part = int(entry["key"]), int(entry["part"])
                slot = self.slots.get((key, part))
                if slot is None:
                    raise ValueError(f"key {key} (part {part}) is not on this server")
                arrays = {}
                for name in entry["names"]:
                    if not frames:
                        raise ValueError("fewer state arrays than described")
                    a = np.frombuffer(frames.pop(0).buffer, slot.value.dtype)
                    if a.size != slot.count:
                        raise ValueError(f"state {name!r} of key {key} has {a.size} elements, "
                                         f"expected {slot.count}")
                    arrays[str(name)] = a.copy()
                states[(key, part)] = (int(entry["count"]), arrays)
            if frames:
                raise ValueError("more state arrays than described")
        except (P.ProtocolError, OptimizerError, KeyError, TypeError, ValueError,
                OverflowError) as e:
            self._error(peer, msg, f"cannot restore optimizer states: {e}")
            return
        self.updater.set_states(states)
        self._ack(peer, msg)

class Server:
    """The server role. :meth:`run` returns once the job is done and raises on failure.

    Args:
        env: the process's contract.
        secret: the job's HMAC key.
    """

    def __init__(self, env: ClusterEnv, secret: bytes) -> None:
        self.env = env
        self.v = Verbose(env.verbose, "S[?]")
        self.ctx = zmq.Context()
        self.hub = Hub(self.ctx, secret, env.mac_payload, self.v)
        self.sched = SchedulerSession(self.ctx, env, secret, self.v)
        self.shard = Shard(env.num_workers, env.mac_payload, self.hub.send, self.v.who)
        self.rank = -1
        self.stopping = False

    def _hello(self, peer: P.Peer, msg: P.Message) -> None:
        try:
            info = msg.json()
            peer.label = f"worker {int(info['rank'])} (pid {int(info['pid'])} on {info['host']})"
        except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError):
            self.hub.drops.drop("malformed", peer.label)

    def _stop(self, peer: P.Peer, msg: P.Message) -> None:
        self.hub.send(peer, P.REPLY, msg.key, msg.part, msg.req)
        if not self.stopping:
            self.stopping = True
            self.v("is stopping")
            self.sched.link.send(P.FINALIZE)

    def _dispatch(self, peer: P.Peer, msg: P.Message) -> None:
        if self.shard.handle(peer, msg):
            return
        if msg.cmd == P.REGISTER:
            self._hello(peer, msg)
        elif msg.cmd == P.STOP:
            self._stop(peer, msg)
        else:
            self.hub.drops.drop("unexpected", peer.label)

    # --- main loop ---------------------------------------------------------------------------
    def _control(self, msg: P.Message) -> bool:
        """Handle a message from the scheduler; True when the job is done."""
        if msg.cmd == P.READY:
            info = msg.json()
            self.rank = int(info["rank"])
            self.v.who = self.shard.who = f"S[{self.rank}]"
            self.v("is connected to others")
        elif msg.cmd == P.ABORT:
            info = msg.json()
            raise KVAbortError(f"the scheduler aborted the job: {info.get('reason')}")
        elif msg.cmd == P.DONE:
            return True
        return False

    def run(self) -> None:
        """Serve until the scheduler says the job is done; raise on failure."""
        env = self.env
        started = time.monotonic()
        try:
            host = node_address(env)
            port = self.hub.bind(host, port_range=env.port_range, what="this server")
            self.v("Bind to role=server, ip=%s, port=%d", host, port)
            self.sched.connect(started + env.start_timeout, "server", host, port)
            poller = zmq.Poller()
            hub_sock, sched_sock = self.hub.sock, self.sched.sock
            poller.register(hub_sock, zmq.POLLIN)
            poller.register(sched_sock, zmq.POLLIN)
            if self.sched.monitor is not None:
                poller.register(self.sched.monitor, zmq.POLLIN)
            monitor = self.sched.monitor
            next_tick = 0.0
            while True:
                events = poller.poll(max(0.0, next_tick - time.monotonic()) * 1000)
                due = False
                for sock, _ in events:
                    if sock is hub_sock:
                        for peer, msg in self.hub.receive():
                            try:
                                self._dispatch(peer, msg)
                            except P.ProtocolError as e:
                                self.hub.drops.drop(e.reason, peer.label)
                    elif sock is sched_sock:
                        if self._from_scheduler():
                            return self._finish()
                    elif sock is monitor:
                        due = True
                now = time.monotonic()
                if due or now >= next_tick:
                    reason = self.sched.tick(now)
                    if reason:
                        # A DONE or ABORT may have arrived just before the connection closed.
                        if self._from_scheduler():
                            return self._finish()
                        raise KVAbortError(reason)
                    if self.rank < 0 and now - started > env.start_timeout + 5:
                        raise KVTimeoutError(f"{self.sched.name} sent no address book within "
                                             f"{env.start_timeout:g} s ({pc.START_TIMEOUT})")
                    next_tick = self.sched.next_due(now)
        except KVAbortError:
            self._report_drops()
            self.hub.close(0)
            self.sched.close(0)
            raise
        except BaseException as e:
            self._report_drops()
            if self.sched.connected and not isinstance(e, KeyboardInterrupt):
                try:
                    self.sched.link.send_json(P.FAIL, {"reason": f"{type(e).__name__}: {e}"})
                except zmq.ZMQError:
                    pass
            self.hub.close(0)
            self.sched.close(1000)
            raise
        finally:
            self.ctx.term()

    def _from_scheduler(self) -> bool:
        """Handle the scheduler's messages; True when the job is done."""
        done = False
        for msg in self.sched.receive():
            try:
                done = self._control(msg) or done
            except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError):
                self.sched.link.drops.drop("malformed", self.sched.name)
        return done

    def _finish(self) -> None:
        self.v("is stopped")
        self._report_drops()
        self.hub.close(CLEAN_LINGER_MS)
        self.sched.close(CLEAN_LINGER_MS)

    def _report_drops(self) -> None:
        drops = P.DropCounter()
        drops.counts = dict(self.hub.drops.counts)
        for k, n in self.sched.link.drops.counts.items():
            drops.counts[k] = drops.counts.get(k, 0) + n
        if drops.total:
            logger.warning("%s dropped %d invalid messages (%s)", self.v.who, drops.total,
                           drops.summary())


def run(env: ClusterEnv, secret: bytes) -> None:
    """Run the server role of this process (see :class:`Server`)."""
    Server(env, secret).run()
