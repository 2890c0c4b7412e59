"""The worker's side of the parameter server: numpy arrays in, numpy arrays out.

:class:`KVClient` is what ``trainer.kvstore`` builds its ``dist_*`` stores on.
It keeps torch out: callers hand it flat, contiguous numpy arrays (views of
their tensors when possible) and get values copied into flat numpy
destinations.

Threads: the main thread owns the data plane (one authenticated DEALER per
server). A daemon control thread owns the connection to the scheduler: it
registers, sends heartbeats, and relays barriers, the final handshake, ready,
release, done and abort messages to and from the main thread over an inproc
pair socket, which the main thread polls together with its server sockets,
so a blocked push or pull sees an abort at once. If the main thread is busy
elsewhere when the job is aborted, the control thread ends the process (exit
status 1) after a short grace period: no worker outlives a failed job.

Messages: a call sends one tensor batch per server (several for more than
:data:`~trainer.kv.protocol.BATCH_BYTES` of data), planned once per list of
keys (:meth:`KVClient._plan`) and reused, so a training step costs a few
messages whatever the number of parameters.

Steps: the client counts its pushes per key part, and every push carries
that count (``F_STEP``), so a server ignores a step it already has from this
rank. A replacement worker (``READY`` with ``recovery``, see
:mod:`trainer.kv.recovery`) asks the servers where its rank was
(:attr:`KVClient.resume_step`), counts from there, and until its first push
skips the start's collectives: ``init`` sends no values and waits at no
barrier, ``set_optimizer`` and ``set_states`` send nothing (the servers hold
the job's weights and optimizer; the other workers are training, not waiting
at a barrier). Under dist_sync the others wait at their next step's pull
until it pushes.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

import pscontract as pc
from pscontract import ClusterEnv

from ..memory import keep_freed_memory
from . import protocol as P
from . import recovery as R
from .errors import (
    KVAbortedByScheduler,
    KVAbortError,
    KVAuthError,
    KVConfigError,
    KVStoreError,
    KVTimeoutError,
    relay_cause,
)
from .node import SchedulerSession
from .placement import Part, Placement
from .transport import (
    CLEAN_LINGER_MS,
    Link,
    Verbose,
    bulk_context,
    handshake_all,
    node_address,
    recv_frames,
)

logger = logging.getLogger(__name__)

#: Seconds the control thread waits for the main thread to act on an abort.
ABORT_GRACE = 1.0
#: Without pooled memory (:func:`trainer.memory.keep_freed_memory` refused: not glibc, or the
#: user tunes malloc), a plain push stages data frames from this size on in buffers of ours:
#: pyzmq's copy would take fresh pages from the kernel for every message, ten times the cost of
#: a copy into a buffer of ours. Smaller ones pyzmq copies.
_ZERO_COPY_MIN = 64 << 10
#: A server link closed without an abort from the scheduler: give up after this long.
LOST_LINK_GRACE = 3.0
#: Plans (messages per list of keys) kept per client.
_MAX_PLANS = 256

_ACK, _VALUE, _JSON, _STASH = 0, 1, 2, 3
_FIRST_ITEM = struct.Struct("<II")
_ERRORS: dict[str, type[KVStoreError]] = {
    cls.__name__: cls for cls in (KVAbortError, KVAbortedByScheduler, KVAuthError,
                                  KVTimeoutError, KVConfigError)}
_pipe_ids = itertools.count()
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # ints: enum arithmetic is slow


@dataclass
class KeyInfo:
    """Where a key lives: its wire id, dtype code, element count and parts."""

    id: int
    code: int
    count: int
    parts: list[Part]


class _Out:
    """One planned message to one server: its index and where each item comes from.

    ``items`` holds ``(position in the call's key list, lo, hi, whole, (key id, part))``.
    """

    __slots__ = ("server", "index", "items")

    def __init__(self, server: int, index: bytes, items: list[tuple[int, int, int, bool,
                                                                     tuple[int, int]]]) -> None:
        self.server = server
        self.index = index
        self.items = items


class _Batch:
    """Replies a call is waiting for."""

    __slots__ = ("left", "results", "error")

    def __init__(self) -> None:
        self.left = 0
        self.results: list[P.Message] = []
        self.error: str | None = None


def dtype_code(dtype: np.dtype) -> int:
    """The wire code of a numpy dtype, or KVConfigError for one we do not carry."""
    code = P.DTYPE_CODES.get(np.dtype(dtype).str)
    if code is None:
        raise KVConfigError(f"dtype {np.dtype(dtype)} cannot go through the kvstore; use float32, "
                            "float64, float16 or an integer type")
    return code


def wd_mult_to_ids(spec: dict[str, Any], keys: dict[Hashable, KeyInfo]) -> dict[str, Any]:
    """``spec`` with ``wd_mult`` keyed by the servers' key ids instead of the user's keys.

    A server only knows key ids (the order of ``init``); ``wd_mult`` names the
    user's keys as strings. Raises KVConfigError for a key not initialised yet.
    """
    mult = spec.get("wd_mult") or {}
    if not mult:
        return spec
    ids: dict[str, list[int]] = {}
    for key, info in keys.items():
        ids.setdefault(str(key), []).append(info.id)
    out: dict[str, Any] = {}
    for name, factor in mult.items():
        found = ids.get(str(name))
        if found is None:
            raise KVConfigError(f"wd_mult names key {name!r}, which is not initialised: call "
                                "kv.init for every key before kv.set_optimizer")
        for i in found:
            out[str(i)] = factor
    return {**spec, "wd_mult": out}


def wd_mult_to_keys(spec: dict[str, Any], keys: dict[Hashable, KeyInfo]) -> dict[str, Any]:
    """The inverse of :func:`wd_mult_to_ids`: ``wd_mult`` keyed by the user's keys again."""
    mult = spec.get("wd_mult") or {}
    if not mult:
        return spec
    names = {str(info.id): str(key) for key, info in keys.items()}
    return {**spec, "wd_mult": {names[i]: f for i, f in mult.items() if i in names}}


class _Control(threading.Thread):
    """The control thread: scheduler session, heartbeats, relays (see the module docstring)."""

    def __init__(self, client: KVClient, endpoint: str) -> None:
        super().__init__(name="kv-control", daemon=True)
        self.c = client
        self.pipe = client.ctx.socket(zmq.PAIR)
        self.pipe.setsockopt(zmq.LINGER, 0)
        self.pipe.connect(endpoint)
        self.sched = SchedulerSession(client.ctx, client.env, client.secret, client.v)
        self.done = False
        self.fail_sent = False

    def _to_main(self, kind: bytes, data: bytes = b"") -> None:
        try:
            self.pipe.send_multipart([kind, data])
        except zmq.ZMQError:
            pass

    def run(self) -> None:
        env = self.c.env
        try:
            self.sched.connect(self.c.started + env.start_timeout, "worker", self.c.host)
            self._loop()
        except KVStoreError as e:
            self._abort(str(e), type(e).__name__)
        except zmq.ZMQError as e:
            if e.errno != zmq.ETERM:
                self._abort(f"control connection failed: {e}")
        finally:
            # Linger after a FAIL too: closing at once would drop it unsent, and the
            # scheduler would report a disconnection instead of the worker's error.
            self.sched.close(CLEAN_LINGER_MS if self.c.finished or self.fail_sent else 0)
            self.pipe.close(0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sched.sock, zmq.POLLIN)
        poller.register(self.pipe, zmq.POLLIN)
        if self.sched.monitor is not None:
            poller.register(self.sched.monitor, zmq.POLLIN)
        link = self.sched.link
        monitor = self.sched.monitor
        next_tick = 0.0
        while True:
            events = dict(poller.poll(max(0.0, next_tick - time.monotonic()) * 1000))
            if self.pipe in events:
                while self.pipe.poll(0):
                    kind, data = self.pipe.recv_multipart()
                    if kind == b"barrier":
                        link.send(P.BARRIER, key=int(data))
                    elif kind == b"finalize":
                        link.send(P.FINALIZE)
                    elif kind == b"fail":
                        link.send_json(P.FAIL, {"reason": data.decode()})
                        self.fail_sent = True
                        self._to_main(b"failed")
                    elif kind == b"stop":
                        return
            if self.sched.sock in events:
                self._from_scheduler()
            now = time.monotonic()
            if not self.done and (monitor in events or now >= next_tick):
                reason = self.sched.tick(now)
                if reason:
                    # A DONE or ABORT may have arrived just before the connection closed.
                    self._from_scheduler()
                    if not self.done:
                        self.sched.blame(reason)
                        raise KVAbortError(reason)
                next_tick = self.sched.next_due(now)
            elif self.done:
                self.sched.link.peer_closed()  # the scheduler leaving is expected now
                next_tick = now + 0.5

    def _from_scheduler(self) -> None:
        for msg in self.sched.receive():
            if msg.cmd == P.READY:
                self._to_main(b"ready", bytes(msg.frames[0].buffer))
            elif msg.cmd == P.RELEASE:
                self._to_main(b"release", str(msg.key).encode())
            elif msg.cmd == P.DONE:
                self.done = True
                self._to_main(b"done")
            elif msg.cmd == P.ABORT:
                try:
                    reason = msg.json().get("reason")
                except P.ProtocolError:
                    reason = None
                reason = reason or "no reason given"
                relay_cause(reason)
                raise KVAbortedByScheduler(f"the scheduler aborted the job: {reason}")

    def _abort(self, reason: str, kind: str = "KVAbortError") -> None:
        self._to_main(b"abort", f"{kind}:{reason}".encode())
        if self.c.finished:
            return
        # The main thread raises KVAbortError at its next kvstore call, or at once
        # if it is waiting on one. If it is busy elsewhere, do not let it run on.
        deadline = time.monotonic() + ABORT_GRACE
        while time.monotonic() < deadline:
            try:
                if self.pipe.poll(50) and self.pipe.recv_multipart()[0] == b"stop":
                    return
            except zmq.ZMQError:
                return
        logger.error("%s aborting: %s", self.c.v.who, reason)
        logging.shutdown()
        os._exit(1)


class KVClient:
    """A worker's connection to the scheduler and the servers.

    Args:
        env: the process's contract (role worker).
        secret: the job's HMAC key (:func:`trainer.kv.transport.check_dist_env`).
        asynchronous: ``dist_async``: servers apply each push at once.

    Raises:
        KVConfigError: the contract is unusable (no servers, bad addresses).
        KVAuthError, KVTimeoutError, KVAbortError: start-up failed.
    """

    #: a replacement of a lost worker (READY said ``recovery``); see the module docstring
    recovery = False
    #: on a replacement, the step where its lost predecessor was (from the servers); else None
    resume_step: int | None = None
    _rejoining = False
    _announce = False
    _copy_sends = False
    _step0 = 0

    def __init__(self, env: ClusterEnv, secret: bytes, asynchronous: bool = False) -> None:
        if env.num_servers < 1:
            raise KVConfigError(f"a dist kvstore needs at least one server ({pc.NUM_SERVER}=0): "
                                "start the job with -s 1 or more")
        if env.num_workers < 1:
            raise KVConfigError(f"{pc.NUM_WORKER} must be at least 1")
        self.env = env
        self.secret = secret
        self.asynchronous = asynchronous
        #: set_optimizer (or set_states with a spec) has run: dist_async needs it
        self.has_optimizer = False
        self._flags = P.F_ASYNC if asynchronous else 0
        self.started = time.monotonic()
        self.finished = False
        self.closed = False
        self.aborted: str | None = None
        self.v = Verbose(env.verbose, "W[?]")
        self.host = node_address(env)
        self.ctx = bulk_context()
        #: freed memory is pooled: a plain push lets pyzmq copy its data (see :meth:`push`)
        self._copy_sends = keep_freed_memory()
        endpoint = f"inproc://kv-control-{os.getpid()}-{next(_pipe_ids)}"
        self._pipe = self.ctx.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)
        self._pipe.bind(endpoint)
        self._released: set[int] = set()
        self._done = False
        self._failed_sent = False
        self._control = _Control(self, endpoint)
        self._control.start()
        self.links: list[Link] = []
        try:
            self._start()
        except BaseException:
            self._shutdown(0)
            raise

    def _start(self) -> None:
        env = self.env
        deadline = self.started + env.start_timeout + 5
        ready = None
        while ready is None:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = (f"no address book from the scheduler at {env.root_uri}:{env.root_port} "
                          f"within {env.start_timeout:g} s ({pc.START_TIMEOUT}): is it running "
                          "and reachable?")
                self._control.sched.blame(reason)
                raise KVTimeoutError(reason)
            if self._pipe.poll(min(left, 0.5) * 1000):
                kind, data = self._pipe.recv_multipart()
                if kind == b"abort":
                    self._raise_abort(data)
                if kind == b"ready":
                    ready = P.load_json(data)
        self.rank = int(ready["rank"])
        self.num_workers = int(ready["num_workers"])
        self.num_servers = int(ready["num_servers"])
        #: a replacement of a lost worker, joining a job under way
        self.recovery = ready.get("recovery") is True
        #: until the first push: skip the start's collectives (see the module docstring)
        self._rejoining = self.recovery
        self.v.who = f"W[{self.rank}]"
        for r, (host, port) in enumerate(ready["servers"]):
            self.links.append(Link(self.ctx, host, int(port), self.secret,
                                   f"server {r} at {host}:{port}", f"S[{r}]",
                                   env.mac_payload, self.v))
        handshake_all(self.links, deadline)
        for link in self.links:
            link.send_json(P.REGISTER, {"rank": self.rank, "pid": os.getpid(), "host": self.host})
        self.v("is connected to others")
        self._poller = zmq.Poller()
        self._poller.register(self._pipe, zmq.POLLIN)
        self._by_sock = {}
        for link in self.links:
            self._poller.register(link.sock, zmq.POLLIN)
            self._by_sock[link.sock] = link
        self._pending: dict[int, tuple[int, _Batch | None, Any]] = {}
        self._req = 0
        self._deferred_error: str | None = None
        self._lost_since: float | None = None
        # dist_sync: the server answers every push with the value of its round.
        # (key id, part) -> the request id of our latest push there, and its value
        # once it arrived; the pull that usually follows takes it from here
        # instead of asking again.
        self._latest: dict[tuple[int, int], int] = {}
        self._stash: dict[tuple[int, int], Any] = {}
        # dist_async: server -> the smallest (elements, key id, part, dtype code) this
        # worker pushed there since its last barrier (plain async pushes get no reply).
        self._unconfirmed: dict[int, tuple[int, int, int, int]] = {}
        self.keys: dict[Hashable, KeyInfo] = {}
        self.placement = Placement(self.num_servers, env.bigarray_bound)
        self._plans: dict[tuple[Hashable, ...], list[_Out]] = {}
        self._staging: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        #: (key id, part) -> the step of our next push there (the pushes made so far)
        self._steps: dict[tuple[int, int], int] = {}
        if self.recovery:
            self.resume_step = self._ask_steps()
            logger.warning("%s replaces a lost worker: rank %d was at step %d", self.v.who,
                           self.rank, self.resume_step)
        self._step0 = self.resume_step or 0
        #: a replacement says once when the answer to its first push came: training again
        self._announce = self.recovery

    def _ask_steps(self) -> int:
        """Where this rank was: every server's STEPS answer, the smallest (:mod:`.recovery`)."""
        batch = self._all_servers(P.STEPS, kind=_JSON)
        answers: list[int | None] = []
        for msg in batch.results:
            step = msg.json().get("step")
            answers.append(step if type(step) is int and step >= 0 else None)
        return R.resume_step(answers)

    # --- receiving ------------------------------------------------------------------------
    def _on_pipe(self) -> None:
        while self._pipe.poll(0):
            kind, data = self._pipe.recv_multipart()
            if kind == b"release":
                self._released.add(int(data))
            elif kind == b"done":
                self._done = True
            elif kind == b"failed":
                self._failed_sent = True
            elif kind == b"abort":
                self._raise_abort(data)

    def _raise_abort(self, data: bytes) -> None:
        kind, _, reason = data.decode().partition(":")
        self.aborted = reason
        raise _ERRORS.get(kind, KVAbortError)(reason)

    def _poll(self, timeout_ms: float) -> None:
        pending = self._pending
        events = self._poller.poll(timeout_ms)
        if not events:
            self._check_links()
        for sock, _ in events:
            if sock is self._pipe:
                self._on_pipe()
                continue
            link = self._by_sock[sock]
            # EVENTS instead of catching zmq.Again: an exception costs more than a message
            while sock.getsockopt(_EVENTS) & _POLLIN:
                frames = recv_frames(sock)
                msg = link.receive(frames)
                if msg is None:
                    continue
                entry = pending.pop(msg.req, None)
                if entry is None:
                    if msg.status != P.ST_OK:  # a plain push failed (pushes get no ack)
                        self._deferred_error = self._deferred_error or f"{link.name}: {msg.text()}"
                    else:
                        link.drops.drop("unexpected", link.name)
                    continue
                kind, batch, targets = entry
                if kind == _STASH:
                    # The values (or the error, as text) wait for the pull that follows.
                    latest, stash, req = self._latest, self._stash, msg.req
                    if msg.status != P.ST_OK or msg.cmd != P.VALUES:
                        got: Sequence[Any] = [f"{link.name}: {msg.text() or 'a bad reply'}"] * len(targets)
                    else:
                        got = msg.data
                    for slot, value in zip(targets, got):
                        if latest.get(slot) == req:
                            stash[slot] = value
                    if msg.status != P.ST_OK and not any(latest.get(t) == req for t in targets):
                        self._deferred_error = self._deferred_error or f"{link.name}: {msg.text()}"
                    continue
                if msg.status != P.ST_OK:
                    text = f"{link.name}: {msg.text()}"
                    if batch is None:
                        self._deferred_error = self._deferred_error or text
                    else:
                        batch.error = batch.error or text
                elif kind == _VALUE:
                    text = self._copy_values(link, msg, targets)
                    if text is not None and batch is not None:
                        batch.error = batch.error or text
                elif kind == _JSON and batch is not None:
                    batch.results.append(msg)
                if batch is not None:
                    batch.left -= 1

    @staticmethod
    def _copy_values(link: Link, msg: P.Message, dests: Sequence[np.ndarray]) -> str | None:
        """Copy a VALUES answer into ``dests``; the reason when it does not fit them."""
        items = msg.items
        if msg.cmd != P.VALUES or items is None or len(items) != len(dests):
            return f"{link.name} sent a reply that does not answer the request"
        for (_, _, count, code), frame, dest in zip(items, msg.data, dests):
            if count != dest.size or P.DTYPES[code][0] != dest.dtype.str:
                return f"{link.name} sent {count} elements for a {dest.size}-element pull"
            np.copyto(dest, np.frombuffer(frame.buffer, dest.dtype))
        return None

    def _check_links(self) -> None:
        """Raise when a server link closed and no abort explains it within a grace period
        (the scheduler names a dead server to everyone; this catches anything else)."""
        lost = [link for link in self.links if link.peer_closed()]
        if not lost:
            return
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = now
        elif now - self._lost_since > LOST_LINK_GRACE:
            self.aborted = f"lost the connection to {lost[0].name}"
            raise KVAbortError(self.aborted)

    def _check(self) -> None:
        if self.aborted:
            raise KVAbortError(self.aborted)
        if self.closed:
            raise KVStoreError("the kvstore is closed")

    def _wait(self, batch: _Batch) -> None:
        while batch.left > 0:
            self._poll(500)
        self._raise_errors(batch)

    def _raise_errors(self, batch: _Batch | None = None) -> None:
        text = (batch.error if batch is not None else None) or self._deferred_error
        if text:
            if batch is None or not batch.error:
                self._deferred_error = None
            raise KVStoreError(text)

    def _send(self, link: Link, cmd: int, kind: int | None, batch: _Batch | None,
              targets: Any = None, count: int = 0, flags: int = 0,
              payload: Sequence[Any] = (), step: int = 0, copy: bool = False) -> int:
        """Send a request; ``kind`` None means no reply is expected (a plain push).
        ``copy``: ZeroMQ takes copies of the frames now (else it reads them as it sends).
        Returns the request id."""
        self._req = req = (self._req + 1) & 0xFFFFFFFF
        if kind is not None:
            self._pending[req] = (kind, batch, targets)
            if batch is not None:
                batch.left += 1
        key = part = 0
        if cmd in P.BATCH_COMMANDS and count:  # the first item, for PS_VERBOSE=2 lines
            key, part = _FIRST_ITEM.unpack_from(payload[0])
        link.send(cmd, key, part, req, step, 0, count, flags, payload, copy=copy)
        return req

    def _stage(self, slot: tuple[int, int], view: np.ndarray) -> np.ndarray:
        """A copy of ``view`` in a buffer of ours, sent without a further copy.

        One buffer per (key, part), reused once the request that last carried it has
        been answered (the server had all of it then); else a new one (always, for a
        plain dist_async push, which is never answered).
        """
        if self.asynchronous:  # a plain async push is never answered: never known sent
            return view.copy()
        entry = self._staging.get(slot)
        if (entry is not None and entry[1] not in self._pending
                and entry[0].shape == view.shape and entry[0].dtype == view.dtype):
            buf = entry[0]
            np.copyto(buf, view)
        else:
            buf = view.copy()
        self._staging[slot] = (buf, self._req + 1)  # the id of the request about to go
        return buf

    # --- planning -----------------------------------------------------------------------------
    def _plan(self, keys: Sequence[Hashable]) -> list[_Out]:
        """The messages for a call on ``keys``: per server, its parts of those keys in order,
        cut into messages of about BATCH_BYTES (built once per list of keys)."""
        k = tuple(keys)
        plan = self._plans.get(k)
        if plan is not None:
            return plan
        per_server: list[list[tuple[int, Part, KeyInfo]]] = [[] for _ in self.links]
        for pos, key in enumerate(k):
            info = self.keys.get(key)
            if info is None:
                raise KVConfigError(f"key {key!r} is not initialised: call kv.init({key!r}, "
                                    "value) first, on every worker")
            for part in info.parts:
                per_server[part.server].append((pos, part, info))
        plan = []
        for server, entries in enumerate(per_server):
            items: list[tuple[int, int, int, bool, tuple[int, int]]] = []
            index: list[tuple[int, int, int, int]] = []
            size = 0
            for pos, part, info in entries:
                n = part.hi - part.lo
                items.append((pos, part.lo, part.hi, n == info.count, (info.id, part.index)))
                index.append((info.id, part.index, n, info.code))
                size += n * P.DTYPES[info.code][1]
                if size >= P.BATCH_BYTES:
                    plan.append(_Out(server, P.pack_index(index), items))
                    items, index, size = [], [], 0
            if items:
                plan.append(_Out(server, P.pack_index(index), items))
        if len(self._plans) < _MAX_PLANS:
            self._plans[k] = plan
        return plan

    def _check_arrays(self, keys: Sequence[Hashable], arrays: Sequence[np.ndarray]) -> None:
        keys_info = self.keys
        for key, arr in zip(keys, arrays):
            info = keys_info.get(key)
            if info is None:
                raise KVConfigError(f"key {key!r} is not initialised: call kv.init({key!r}, "
                                    "value) first, on every worker")
            if arr.size != info.count:
                raise KVConfigError(f"key {key!r} holds {info.count} elements, got {arr.size}")
            if P.DTYPE_CODES.get(arr.dtype.str) != info.code:
                raise KVConfigError(f"key {key!r} holds {P.DTYPES[info.code][0]}, got {arr.dtype}")

    # --- the API -------------------------------------------------------------------------------
    def init(self, keys: Sequence[Hashable], arrays: Sequence[np.ndarray]) -> None:
        """Register keys (same order on every worker); rank 0's arrays become the values."""
        self._check()
        new = []
        seen: set[Hashable] = set()
        for key, arr in zip(keys, arrays):
            if key in self.keys or key in seen:
                raise KVConfigError(f"key {key!r} was already initialised; init each key once")
            seen.add(key)
            new.append((key, arr, dtype_code(arr.dtype)))  # every check before any change
        parts = self.placement.assign([(a.size, a.itemsize) for _, a, _ in new])
        for (key, arr, code), p in zip(new, parts):
            self.keys[key] = KeyInfo(len(self.keys), code, arr.size, p)
        if self._rejoining:  # the servers hold the job's values; nobody waits at a barrier
            return
        if self.rank == 0 and new:
            batch = _Batch()
            arrays = [arr for _, arr, _ in new]
            for out in self._plan([key for key, _, _ in new]):
                payload: list[Any] = [out.index]
                for pos, lo, hi, whole, _ in out.items:
                    payload.append(arrays[pos] if whole else arrays[pos][lo:hi])
                self._send(self.links[out.server], P.INIT, _ACK, batch,
                           count=len(out.items), payload=payload)
            self._wait(batch)
        self.barrier()

    def push(self, keys: Sequence[Hashable], arrays: Sequence[np.ndarray],
             dests: Sequence[np.ndarray] | None = None, owned: bool = False) -> None:
        """Push flat arrays; with ``dests``, also receive the updated values (pushpull).

        dist_sync: the server answers each push with the value of its round,
        which the next pull of that key uses (see :meth:`pull`); errors are
        raised by the next call that waits. dist_async: a plain push gets no
        reply unless it fails. The caller may change the arrays as soon as this
        returns: a plain push copies them (unless ``owned`` says they are scratch
        buffers of the caller's, left alone until the next call).
        """
        self._check()
        if self.asynchronous and not self.has_optimizer:
            # The servers would refuse every push, and a plain push's refusal only
            # shows at a later call: say it here, at the push that is wrong.
            raise KVConfigError("dist_async needs an optimizer on the servers: call "
                                "kv.set_optimizer(...) on every worker before the first push")
        self._check_arrays(keys, arrays)
        plan = self._plan(keys)
        self._rejoining = False
        batch = _Batch() if dests is not None else None
        flags = self._flags | (P.F_PULL if dests is not None else 0)
        if dests is not None:
            kind: int | None = _VALUE
        else:
            kind = None if self.asynchronous else _STASH
        latest, stash = self._latest, self._stash
        links = self.links
        steps, step0 = self._steps, self._step0
        # A pushpull waits for its answer, and the server answers once it has all the
        # data: the caller's arrays can go as they are. A plain push returns at once, and
        # the caller may change its arrays then: ZeroMQ takes a copy of each frame as it is
        # sent (one copy, as into a buffer of ours, but without pyzmq's zero-copy
        # bookkeeping: a hand-off to its collector thread per frame of 128 KB or more,
        # about 5% of a worker's CPU at 1 MB and 16 MB). Without pooled memory that copy would fault
        # in fresh pages every time: big frames go through buffers of ours instead.
        stage = kind != _VALUE and not owned
        copying = stage and self._copy_sends
        stage = stage and not copying
        for out in plan:
            payload: list[Any] = [out.index]
            targets: list[Any] = []
            for pos, lo, hi, whole, slot in out.items:
                arr = arrays[pos]
                view = arr if whole else arr[lo:hi]
                if stage and view.nbytes >= _ZERO_COPY_MIN:
                    view = self._stage(slot, view)
                payload.append(view)
                if kind == _VALUE:
                    d = dests[pos]  # type: ignore[index]
                    targets.append(d if whole else d[lo:hi])
                    latest.pop(slot, None)  # this request's answer is the newest
                    stash.pop(slot, None)
                elif kind == _STASH:
                    targets.append(slot)
            # The step of every item of the message, when they agree (a training loop pushes
            # each key once a step); the server then ignores a step it has from this rank.
            step = steps.get(out.items[0][4], step0)
            same = True
            for item in out.items:
                slot = item[4]
                taken = steps.get(slot, step0)
                same = same and taken == step
                steps[slot] = taken + 1
            req = self._send(links[out.server], P.PUSH, kind, batch, targets,
                             count=len(out.items), flags=flags | (P.F_STEP if same else 0),
                             payload=payload, step=step & 0xFFFFFFFF, copy=copying)
            if kind == _STASH:
                for slot in targets:
                    latest[slot] = req
                    stash.pop(slot, None)
            elif kind is None:  # plain dist_async pushes: remember one to confirm them
                for pos, lo, hi, _, (key_id, part) in out.items:
                    mark = (hi - lo, key_id, part, self.keys[keys[pos]].code)
                    old = self._unconfirmed.get(out.server)
                    if old is None or mark < old:
                        self._unconfirmed[out.server] = mark
        if batch is not None:
            self._wait(batch)
            if self._announce:
                self._training_again()
        else:
            self._raise_errors()

    def _training_again(self) -> None:
        """A replacement's first push was answered (its step counted): one line, once."""
        self._announce = False
        logger.warning("%s is training again: the answer to its first push came %.2f s after "
                       "it started", self.v.who, time.monotonic() - self.started)

    def pull(self, keys: Sequence[Hashable], dests: Sequence[np.ndarray]) -> None:
        """Copy the current values into flat ``dests`` (after this worker's own pushes).

        In dist_sync, a key this worker has pushed since its last pull is
        answered by the server when that push's round completes, without a
        request: the pull waits for that answer.
        """
        self._check()
        self._check_arrays(keys, dests)
        plan = self._plan(keys)
        batch = _Batch()
        latest, stash = self._latest, self._stash
        kept: list[tuple[tuple[int, int], np.ndarray]] = []
        for out in plan:
            index: list[tuple[int, int, int, int]] | None = None
            targets = []
            for n, (pos, lo, hi, whole, slot) in enumerate(out.items):
                d = dests[pos]
                view = d if whole else d[lo:hi]
                if slot in latest:
                    kept.append((slot, view))
                    if index is None:  # not every item is asked for: a smaller index
                        index = [tuple(x) for x in P.ITEM.iter_unpack(out.index[:n * P.ITEM.size])]
                    continue
                targets.append(view)
                if index is not None:
                    index.append(P.ITEM.unpack_from(out.index, n * P.ITEM.size))
            if targets:
                packed = out.index if index is None else P.pack_index(index)
                self._send(self.links[out.server], P.PULL, _VALUE, batch, targets,
                           count=len(targets), flags=self._flags, payload=[packed])
        # Copy each answer as soon as it is here, while ZeroMQ receives the next ones (a
        # 16 MB key comes in 4 messages: the copy of the first overlaps the others' transfer).
        while kept:
            waiting = []
            for slot, view in kept:
                value = stash.pop(slot, None)
                if value is None:
                    waiting.append((slot, view))
                    continue
                del latest[slot]
                if isinstance(value, str):
                    batch.error = batch.error or value
                else:
                    np.copyto(view, np.frombuffer(value.buffer, view.dtype))
            kept = waiting
            if kept:
                self._poll(500)
        self._wait(batch)
        if self._announce and self._steps:
            self._training_again()

    def barrier(self, group: int = P.GROUP_WORKERS) -> None:
        """Block until every member of ``group`` has reached its barrier.

        dist_async: this worker's pushes have been applied by then, so a pull
        after the barrier sees every worker's pushes from before it.
        """
        self._check()
        self._confirm_pushes()
        self._released.discard(group)
        self._pipe.send_multipart([b"barrier", str(group).encode()])
        while group not in self._released:
            self._poll(500)
        self._released.discard(group)

    def _confirm_pushes(self) -> None:
        """Wait until the servers have applied our plain dist_async pushes.

        They get no reply, and the barrier travels through the scheduler, so
        another worker's pull could overtake them. A server serves a connection
        in order: the answer to a pull of the smallest part we pushed there
        comes after those pushes were applied.
        """
        if not self._unconfirmed:
            return
        batch = _Batch()
        for server, (count, key_id, part, code) in sorted(self._unconfirmed.items()):
            scratch = np.empty(count, P.DTYPES[code][0])
            self._send(self.links[server], P.PULL, _VALUE, batch, [scratch], count=1,
                       flags=self._flags, payload=[P.pack_index([(key_id, part, count, code)])])
        self._unconfirmed.clear()
        self._wait(batch)

    def _all_servers(self, cmd: int, payloads: Sequence[Sequence[Any]] | None = None,
                     kind: int = _ACK) -> _Batch:
        batch = _Batch()
        for i, link in enumerate(self.links):
            self._send(link, cmd, kind, batch, payload=payloads[i] if payloads else ())
        self._wait(batch)
        return batch

    def set_optimizer(self, spec: dict[str, Any]) -> None:
        """Rank 0 installs the optimizer (a JSON spec) on every server; all workers sync."""
        self._check()
        body = P.dumps(wd_mult_to_ids(spec, self.keys))  # on every rank: the same error
        if self._rejoining:  # the servers have the job's optimizer (and its states)
            self.has_optimizer = True
            return
        if self.rank == 0:
            self._all_servers(P.SET_OPTIMIZER, [[body]] * len(self.links))
        self.barrier()
        self.has_optimizer = True

    def get_states(self) -> tuple[dict[str, Any] | None, dict[Hashable, tuple[int, dict[str, np.ndarray]]]]:
        """The optimizer spec and ``{key: (count, {state: flat array})}`` from every server."""
        self._check()
        batch = self._all_servers(P.GET_STATES, kind=_JSON)
        by_part: dict[tuple[int, int], tuple[int, dict[str, np.ndarray]]] = {}
        spec = None
        for msg in batch.results:
            meta = msg.json()
            if spec is None and meta.get("optimizer") is not None:
                spec = wd_mult_to_keys(meta["optimizer"], self.keys)
            frames = list(msg.frames[1:])
            for entry in meta["slots"]:
                arrays = {}
                for name in entry["names"]:
                    arrays[name] = frames.pop(0)
                by_part[(int(entry["key"]), int(entry["part"]))] = (int(entry["count"]), arrays)
        out: dict[Hashable, tuple[int, dict[str, np.ndarray]]] = {}
        for key, info in self.keys.items():
            got = [by_part.get((info.id, p.index)) for p in info.parts]
            if any(g is None for g in got):
                continue
            count = max(g[0] for g in got)  # type: ignore[index]
            dtype = np.dtype(P.DTYPES[info.code][0])
            arrays = {}
            for name in got[0][1]:  # type: ignore[index]
                full = np.empty(info.count, dtype)
                for p, g in zip(info.parts, got):
                    full[p.lo:p.hi] = np.frombuffer(g[1][name].buffer, dtype)  # type: ignore[index]
                arrays[name] = full
            out[key] = (count, arrays)
        return spec, out

    def set_states(self, spec: dict[str, Any] | None,
                   states: dict[Hashable, tuple[int, dict[str, np.ndarray]]]) -> None:
        """Rank 0 restores optimizer states on the servers; all workers sync."""
        self._check()
        if spec is not None:
            spec = wd_mult_to_ids(spec, self.keys)
        if self._rejoining:  # the servers hold the job's states: restoring them would go back
            self.has_optimizer = self.has_optimizer or spec is not None
            return
        if self.rank == 0:
            metas: list[dict[str, Any]] = [{"optimizer": spec, "slots": []} for _ in self.links]
            frames: list[list[Any]] = [[] for _ in self.links]
            for key, (count, arrays) in states.items():
                info = self.keys.get(key)
                if info is None:
                    raise KVConfigError(f"optimizer state for key {key!r}, which is not "
                                        "initialised: call kv.init first")
                names = sorted(arrays)
                for part in info.parts:
                    metas[part.server]["slots"].append(
                        {"key": info.id, "part": part.index, "count": int(count), "names": names})
                    for n in names:
                        a = np.ascontiguousarray(arrays[n]).reshape(-1)
                        if a.size != info.count:
                            raise KVConfigError(f"state {n!r} of key {key!r} has {a.size} "
                                                f"elements, expected {info.count}")
                        frames[part.server].append(
                            a[part.lo:part.hi].astype(P.DTYPES[info.code][0], copy=False))
            self._all_servers(P.SET_STATES, [[P.dumps(m), *f] for m, f in zip(metas, frames)])
        self.barrier()
        if spec is not None:
            self.has_optimizer = True

    # --- the end -----------------------------------------------------------------------------
    def close(self) -> None:
        """The end of the job: wait for our pushes, barrier, rank 0 stops the servers,
        then the final handshake with the scheduler."""
        if self.closed:
            return
        try:
            self._check()
            # wait for what we asked for; answers to plain pushes nobody pulled do not matter
            while any(kind != _STASH for kind, _, _ in self._pending.values()):
                self._poll(500)
            self._raise_errors()
            self.barrier()
            if self.rank == 0:
                self._all_servers(P.STOP)
            self.v("is stopping")
            self._pipe.send_multipart([b"finalize", b""])
            while not self._done:
                self._poll(500)
            self.finished = True
            self.v("is stopped")
            self._shutdown(CLEAN_LINGER_MS)
        except BaseException:
            self._shutdown(0)
            raise

    def fail(self, reason: str) -> None:
        """Tell the scheduler this worker failed (so every node stops at once), then shut down."""
        if self.closed:
            return
        if not self.aborted:
            try:
                self._pipe.send_multipart([b"fail", reason.encode()])
                deadline = time.monotonic() + 1.0
                while not self._failed_sent and time.monotonic() < deadline:
                    if self._pipe.poll(50):
                        self._on_pipe()
            except (KVAbortError, zmq.ZMQError):
                pass
        self._shutdown(0)

    def _shutdown(self, linger_ms: int) -> None:
        self.closed = True
        try:
            self._pipe.send_multipart([b"stop", b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._control.join(timeout=5)
        for link in self.links:
            link.close(linger_ms)
        self._pipe.close(0)
        if not self._control.is_alive():
            self.ctx.term()
        drops = sum(link.drops.total for link in self.links)
        if drops:
            logger.warning("%s dropped %d invalid messages", self.v.who, drops)
