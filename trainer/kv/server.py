"""A server: holds a shard of the keys and applies the updates (numpy, no torch).

Each stored array is a :class:`Slot` keyed by ``(key id, part)``. Requests are
tensor batches (:mod:`trainer.kv.protocol`): every item of a request is served
as below, and the request gets one answer when all its items are done: a
``VALUES`` message with every value in the request's order, or one error.

* ``INIT``: rank 0 sets the initial values.
* ``PUSH`` in **sync** mode: the pushes of all workers for a slot are summed
  (into the first pushed buffer, in place); when the last one arrives the
  optimizer runs once on the sum (or the sum becomes the value when there is
  no optimizer), then every push of the round (pushpull or not) and every held
  pull gets the new value: the worker keeps it for the pull that nearly always
  follows a push, which then costs no request. A worker's second push of a slot
  before the round completes waits for the next round.
* ``PUSH`` in **async** mode (``F_ASYNC``): applied at once; an optimizer is
  required; no answer unless it fails, or it asks for the values (``F_PULL``).
* ``PULL``: answered at once from the value, or held until the round
  completes when the same worker has pushed into the current round.
* ``SET_OPTIMIZER`` (JSON spec), ``GET_STATES``/``SET_STATES``, ``STOP``.
* ``STEPS``: where this worker's rank is (a replacement asks, see below).

**Repeated pushes** (:mod:`trainer.kv.recovery`). A worker's ``REGISTER`` to
the server names its rank, and rounds count ranks, not connections. Each
slot counts the pushes it took per rank; a push with ``F_STEP`` whose step
the slot already has from that rank is a repeat: never summed or applied
again, only answered with the value of its round (held until that round
completes, when it is the current one). A replacement worker pushes again the
step its lost predecessor had half pushed, and the job still makes exactly one
update per round. Answers to a lost worker's connection go nowhere (the send
fails, quietly); a round it had joined completes with the others' pushes.

Values are sent without a copy: a value is always a received ZeroMQ frame
(rank 0's init, or the first push of a round that the others were added to),
and sending a received frame again only shares its reference-counted buffer
(no copy, and none of pyzmq's zero-copy bookkeeping). In sync mode that is
safe because a value is only changed when a round completes, and a round
cannot complete before every worker has pushed again, which each does after it
has received its previous answer (a worker that pushes twice without waiting
never reads the first answer). Async answers are copies, taken as they are sent.
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
from . import recovery as R
from .errors import KVAbortedByScheduler, KVAbortError, KVTimeoutError, relay_cause
from .node import SchedulerSession
from .optim import OptimizerError, Updater, create_optimizer
from .transport import CLEAN_LINGER_MS, Hub, Verbose, bulk_context, node_address

logger = logging.getLogger(__name__)

_NP_DTYPES = {code: np.dtype(name) for code, (name, _) in P.DTYPES.items()}
_PUSH, _PULL = 0, 1


def who(peer: P.Peer) -> Any:
    """Whom a push counts for: the worker rank its ``REGISTER`` named, else the connection."""
    info = peer.info
    return info if type(info) is int else peer.rid


class Slot:
    """One stored array (a key, or one part of a split key) and its sync round."""

    __slots__ = ("value", "frame", "code", "count", "merged", "merged_frame", "pushed", "pending",
                 "backlog", "taken")

    def __init__(self, frame: zmq.Frame, code: int) -> None:
        self.frame = frame
        self.value = np.frombuffer(frame.buffer, _NP_DTYPES[code])
        self.code = code
        self.count = self.value.size
        self.merged: np.ndarray | None = None
        self.merged_frame: zmq.Frame | None = None
        #: who (:func:`who`) has pushed into the current round
        self.pushed: set[Any] = set()
        #: who -> pushes taken from it (the step its next push has)
        self.taken: dict[Any, int] = {}
        #: (answer, item) of every push and pull that gets this round's value
        self.pending: list[tuple[Answer, int]] = []
        #: requests of the next round: (kind, answer, item, data frame)
        self.backlog: list[tuple[int, Answer, int, Any]] = []

    def queued(self, whom: Any) -> bool:
        """True when a request of this worker waits for the slot's next round."""
        return any(who(a.peer) == whom for _, a, _, _ in self.backlog)


class Answer:
    """The answer to one request: filled item by item, sent when the last is done.

    Args:
        shard: the shard that sends it.
        peer, msg: the request.
        wanted: send the values (False: a plain async push, answered only on error).
        snapshot: copy the values as they are sent (async: others change them in place).
    """

    __slots__ = ("shard", "peer", "msg", "values", "left", "error", "wanted", "snapshot")

    def __init__(self, shard: Shard, peer: P.Peer, msg: P.Message, wanted: bool = True,
                 snapshot: bool = False) -> None:
        self.shard = shard
        self.peer = peer
        self.msg = msg
        n = len(msg.items or ())
        self.values: list[Any] = [None] * n
        self.left = n
        self.error: str | None = None
        self.wanted = wanted
        self.snapshot = snapshot

    def set(self, i: int, value: Any) -> None:
        self.values[i] = value
        self.left -= 1
        if not self.left:
            self.shard._answer(self)

    def fail(self, i: int, text: str) -> None:
        self.error = self.error or text
        self.left -= 1
        if not self.left:
            self.shard._answer(self)


class Shard:
    """The data plane of a server, free of I/O: slots, sync rounds and the optimizer.

    :meth:`handle` takes a verified request and answers through ``send`` (the
    server passes :meth:`Hub.send <trainer.kv.transport.Hub.send>`; a test can
    pass a recorder), so the round logic is testable on its own.

    Args:
        num_workers: workers per sync round.
        mac_payload: MAC the tensor payloads of replies.
        send: ``send(peer, cmd, key, part, req, status=, dtype=, count=, flags=, payload=,
            copy=)``.
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
        #: updates made (a sync round completed, an async push applied), per slot summed
        self.updates = 0
        #: pushes ignored as repeats of a step already taken (:mod:`trainer.kv.recovery`)
        self.repeats = 0

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
        elif cmd == P.STEPS:
            self._steps(peer, msg)
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

    def _answer(self, a: Answer) -> None:
        msg = a.msg
        if a.error is not None:
            self._error(a.peer, msg, a.error)
            return
        if not a.wanted:
            return
        # The answer's index is the request's: the same items, in the same order. Shared
        # buffers (received frames), or for a snapshot arrays that ZeroMQ copies now.
        self.send(a.peer, P.VALUES, msg.key, msg.part, msg.req, count=len(a.values),
                  payload=[msg.frames[0], *a.values], copy=a.snapshot)

    def _slot(self, a: Answer, i: int, key: int, part: int, count: int, code: int) -> Slot | None:
        slot = self.slots.get((key, part))
        if slot is None:
            a.fail(i, f"key {key} (part {part}) was never initialised on this server: every "
                   "worker must call init with the same keys in the same order")
        elif (code and code != slot.code) or (count and count != slot.count):
            spec = P.DTYPES.get(code, ("?", 0))[0]
            a.fail(i, f"key {key} (part {part}) has {count} elements of {spec} here, but init "
                   f"gave {slot.count} of {P.DTYPES[slot.code][0]}: workers disagree on shapes "
                   "or key order")
            return None
        return slot

    # --- data plane ------------------------------------------------------------------------
    def _init(self, peer: P.Peer, msg: P.Message) -> None:
        a = Answer(self, peer, msg, wanted=False)
        for i, ((key, part, _, code), frame) in enumerate(zip(msg.items or (), msg.data)):
            slot = self.slots.get((key, part))
            if slot is not None and (slot.pushed or slot.backlog):
                a.fail(i, f"key {key} was initialised again during a push round")
            else:
                self.slots[(key, part)] = Slot(frame, code)
                a.set(i, None)
        if a.error is None:
            self._ack(peer, msg)

    def _push(self, peer: P.Peer, msg: P.Message) -> None:
        asynchronous = bool(msg.flags & P.F_ASYNC)
        a = Answer(self, peer, msg, wanted=not asynchronous or bool(msg.flags & P.F_PULL),
                   snapshot=asynchronous)
        if asynchronous and self.updater is None:
            for i in range(a.left):
                a.fail(i, "dist_async needs an optimizer on the servers: call "
                       "kv.set_optimizer(...) before the first push")
            return
        for i, ((key, part, count, code), frame) in enumerate(zip(msg.items or (), msg.data)):
            slot = self._slot(a, i, key, part, count, code)
            if slot is None:
                continue
            if asynchronous:
                self._push_async(a, i, key, part, slot, frame)
            else:
                self._push_sync(a, i, key, part, slot, frame)

    def _repeat(self, a: Answer, slot: Slot, whom: Any) -> int:
        """:func:`trainer.kv.recovery.push_kind` of a push (NEW without ``F_STEP``)."""
        msg = a.msg
        if not msg.flags & P.F_STEP:
            return R.NEW
        kind = R.push_kind(msg.status, slot.taken.get(whom, 0), whom in slot.pushed)
        if kind != R.NEW:
            self.repeats += 1
        return kind

    def _push_sync(self, a: Answer, i: int, key: int, part: int, slot: Slot, frame: Any) -> None:
        whom = who(a.peer)
        kind = self._repeat(a, slot, whom)
        if kind == R.REPEAT_IN_ROUND:
            slot.pending.append((a, i))  # already summed: the round's value is its answer
            return
        if kind == R.REPEAT_DONE:
            a.set(i, slot.frame)
            return
        if whom in slot.pushed or slot.queued(whom):  # its next round (keep its order)
            slot.backlog.append((_PUSH, a, i, frame))
            return
        slot.pushed.add(whom)
        slot.taken[whom] = slot.taken.get(whom, 0) + 1
        grad = np.frombuffer(frame.buffer, _NP_DTYPES[slot.code])
        if slot.merged is None:
            slot.merged = grad
            slot.merged_frame = frame
        else:
            slot.merged += grad
        # Every push is answered with the round's value: a pull nearly always
        # follows, and this spares it a request and a round trip.
        slot.pending.append((a, i))
        if len(slot.pushed) >= self.num_workers:
            self._complete(key, part, slot)

    def _push_async(self, a: Answer, i: int, key: int, part: int, slot: Slot, frame: Any) -> None:
        if slot.pushed:
            a.fail(i, "a dist_async push arrived during a dist_sync round: every worker must "
                   "create the same kvstore type")
            return
        whom = who(a.peer)
        if self._repeat(a, slot, whom) != R.NEW:  # applied already: only answered
            a.set(i, slot.value)
            return
        grad = np.frombuffer(frame.buffer, _NP_DTYPES[slot.code])
        try:
            self.updater((key, part), slot.value, grad)  # type: ignore[misc]
        except (TypeError, ValueError) as e:
            a.fail(i, f"the optimizer failed on key {key}: {e}")
            return
        slot.taken[whom] = slot.taken.get(whom, 0) + 1
        self.updates += 1
        a.set(i, slot.value)

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
        if failed is None:
            self.updates += 1
        pending = slot.pending
        slot.pending = []
        if failed is not None:
            logger.warning("%s %s", self.who, failed)
            for a, i in pending:
                a.fail(i, failed)
        else:
            value = slot.frame
            for a, i in pending:
                a.set(i, value)
        # the next round's requests, failed round or not: nobody waits forever
        if slot.backlog:
            backlog = slot.backlog
            slot.backlog = []
            for kind, a, i, data in backlog:
                if kind == _PUSH:
                    self._push_sync(a, i, key, part, slot, data)
                else:
                    self._pull_item(a, i, slot)

    def _pull(self, peer: P.Peer, msg: P.Message) -> None:
        asynchronous = bool(msg.flags & P.F_ASYNC)
        a = Answer(self, peer, msg, snapshot=asynchronous)
        for i, (key, part, count, code) in enumerate(msg.items or ()):
            slot = self._slot(a, i, key, part, count, code)
            if slot is not None:
                if asynchronous:
                    a.set(i, slot.value)
                else:
                    self._pull_item(a, i, slot)

    def _pull_item(self, a: Answer, i: int, slot: Slot) -> None:
        whom = who(a.peer)
        if slot.queued(whom):  # after this worker's queued push
            slot.backlog.append((_PULL, a, i, None))
        elif whom in slot.pushed:
            slot.pending.append((a, i))
        else:
            a.set(i, slot.frame)

    def _steps(self, peer: P.Peer, msg: P.Message) -> None:
        """Where the asking worker's rank is: the fewest pushes taken from it on any slot that
        was pushed at all (``null`` when none was); see :mod:`trainer.kv.recovery`."""
        whom = who(peer)
        if type(whom) is not int:
            self._error(peer, msg, "STEPS from a worker that has not registered its rank")
            return
        steps = [slot.taken.get(whom, 0) for slot in self.slots.values() if slot.taken]
        self.send(peer, P.REPLY, msg.key, msg.part, msg.req,
                  payload=[P.dumps({"step": min(steps) if steps else None})])

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


def _key_id(slot_key: Any) -> int:
    """The key id of a ``(key id, part)`` state key: ``wd_mult`` is keyed by key id
    (the worker translates its keys, see :func:`trainer.kv.client.wd_mult_to_ids`)."""
    return slot_key[0]


class Server:
    """The server role. :meth:`run` returns once the job is done and raises on failure.

    Args:
        env: the process's contract.
        secret: the job's HMAC key.
    """

    def __init__(self, env: ClusterEnv, secret: bytes) -> None:
        self.env = env
        self.v = Verbose(env.verbose, "S[?]")
        self.ctx = bulk_context()
        self.hub = Hub(self.ctx, secret, env.mac_payload, self.v)
        self.sched = SchedulerSession(self.ctx, env, secret, self.v)
        self.shard = Shard(env.num_workers, env.mac_payload, self.hub.send, self.v.who)
        self.rank = -1
        self.stopping = False

    def _hello(self, peer: P.Peer, msg: P.Message) -> None:
        """A worker's ``REGISTER``: its name for log lines, and its rank, which its pushes
        count for (a replacement takes its predecessor's place in every round)."""
        try:
            info = msg.json()
            rank = int(info["rank"])
            if not 0 <= rank < self.env.num_workers:
                raise ValueError(rank)
            peer.label = f"worker {rank} (pid {int(info['pid'])} on {info['host']})"
        except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError):
            self.hub.drops.drop("malformed", peer.label)
            return
        peer.info = rank

    def _stop(self, peer: P.Peer, msg: P.Message) -> None:
        self.hub.send(peer, P.REPLY, msg.key, msg.part, msg.req)
        if not self.stopping:
            self.stopping = True
            self.v("is stopping after %d updates (%d repeated pushes ignored)",
                   self.shard.updates, self.shard.repeats)
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
            reason = str(msg.json().get("reason") or "no reason given")
            relay_cause(reason)
            raise KVAbortedByScheduler(f"the scheduler aborted the job: {reason}")
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
            hub = self.hub
            # While it connects, the server keeps its own gate and connection bounds going.
            gate = [s for s in hub.sockets() if s is not hub.sock]
            self.sched.connect(started + env.start_timeout, "server", host, port,
                               service=hub.service, also=gate)
            poller = zmq.Poller()
            hub_sock, sched_sock = hub.sock, self.sched.sock
            for sock in hub.sockets():
                poller.register(sock, zmq.POLLIN)
            poller.register(sched_sock, zmq.POLLIN)
            if self.sched.monitor is not None:
                poller.register(self.sched.monitor, zmq.POLLIN)
            monitor = self.sched.monitor
            next_tick = 0.0
            while True:
                events = poller.poll(max(0.0, min(next_tick, hub.next_sweep)
                                         - time.monotonic()) * 1000)
                due = False
                if len(events) > 1 or (events and events[0][0] is not hub_sock) or (
                        time.monotonic() >= hub.next_sweep):
                    hub.service()
                for sock, _ in events:
                    if sock is hub_sock:
                        for peer, msg in self.hub.receive(ready=True):
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
                        self.sched.blame(reason)
                        raise KVAbortError(reason)
                    if self.rank < 0 and now - started > env.start_timeout + 5:
                        reason = (f"{self.sched.name} sent no address book within "
                                  f"{env.start_timeout:g} s ({pc.START_TIMEOUT})")
                        self.sched.blame(reason)
                        raise KVTimeoutError(reason)
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
        self._report_drops()
        stats = self.hub.stats()
        self.hub.close(CLEAN_LINGER_MS)
        self.sched.close(CLEAN_LINGER_MS)
        self.v("is stopped (%s)", stats)

    def _report_drops(self) -> None:
        drops = P.DropCounter()
        drops.counts = dict(self.hub.drops.counts)
        for k, n in self.sched.link.drops.counts.items():
            drops.counts[k] = drops.counts.get(k, 0) + n
        if drops.total:
            logger.warning("%s refused or dropped %d connections or messages (%s)", self.v.who,
                           drops.total, drops.summary())


def run(env: ClusterEnv, secret: bytes) -> None:
    """Run the server role of this process (see :class:`Server`)."""
    Server(env, secret).run()
