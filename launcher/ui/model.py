"""The live job page's model: :class:`JobView`, what the supervisor knows of a running job, kept
for the page's server (``launcher.ui.server``) and the static report (``launcher.ui.report``).

The supervisor feeds it from its own thread (:meth:`JobView.plan`, :meth:`~JobView.sync`,
:meth:`~JobView.set_state`, :meth:`~JobView.set_failure`, :meth:`~JobView.finish`); the console
taps every line of every process into :meth:`~JobView.add_line` from the output threads. Viewers
read :meth:`~JobView.snapshot` (the JSON dict of the UI contract) and the *event log*: every change
is one event with a global id (``snapshot``, ``lines``, ``procs``, ``job``, ``points``,
``failure``), encoded once as a server-sent-events message, so that a viewer that reconnects with
``Last-Event-ID`` gets every message after it (:meth:`~JobView.events_after`), or a fresh snapshot
when the ring no longer holds them. Nobody waits on a viewer: the lock is held only to copy.

Memory is bounded whatever the job prints (the bound, for 256 processes printing 50,000 lines
each, is measured in docs/performance.md "The job page" and by ``tests/unit/test_ui_model.py``):

* a line is cut to :data:`MAX_LINE` characters;
* each process keeps its last :data:`LOG_LINES` lines, and at most ``LOG_BUDGET / processes``
  bytes of them (at least :data:`LOG_MIN_BYTES`): 256 processes keep about 16 MiB of lines;
* each worker's throughput series keeps at most :data:`SERIES_POINTS` points in two arrays of
  doubles: when it is full, every other point goes and the gap between kept points doubles;
* the event ring keeps at most :data:`EVENT_BYTES` bytes of encoded messages
  (and :data:`MAX_EVENTS` events); lines not yet sent wait in one batch of at most
  :data:`BATCH_LINES` lines and :data:`BATCH_CHARS` characters. While nobody watches, lines are
  not encoded at all (a viewer that comes back gets a snapshot): the job pays for the page only
  while someone looks.
"""

from __future__ import annotations

import array
import collections
import json
import threading
import time
from typing import Any, Iterable, Optional, Sequence

from ..run.progress import parse_line
from ..runtime.handle import signal_name

#: characters of a line kept (a longer line is cut, and says how much was cut)
MAX_LINE = 2000
#: lines kept per process (the page's log pane and the report)
LOG_LINES = 1000
#: bytes of lines kept for all processes together (each gets its share, at least LOG_MIN_BYTES)
LOG_BUDGET = 16 * 1024 * 1024
LOG_MIN_BYTES = 64 * 1024
#: what one kept line costs besides its characters (the tuple, its time, the str header, the deque's slot)
LINE_COST = 150
#: points kept per worker's throughput series
SERIES_POINTS = 512
#: the event ring's bounds (encoded bytes, events)
EVENT_BYTES = 8 * 1024 * 1024
MAX_EVENTS = 4096
#: lines (and characters) gathered into one ``lines`` event at most (more make another event)
BATCH_LINES = 2000
BATCH_CHARS = 256 * 1024
#: how often the rows are compared with the handles (s): a state change is on the page well within 0.5 s
SYNC_INTERVAL = 0.1
#: rows whose line-derived fields (last line, speed, count) changed are sent at most this often (s)
ROW_INTERVAL = 1.0
#: CPU and RSS are sampled at most this often (s), and less often for big jobs (USAGE_PER_SECOND handles a second)
USAGE_INTERVAL = 1.0
USAGE_PER_SECOND = 128
#: a viewer gone this long stops the encoding of lines (s)
IDLE_AFTER = 5.0

ROLE_ORDER = {"scheduler": 0, "server": 1, "worker": 2}
FINAL = ("succeeded", "failed", "stopped")


class Row:
    """One process's row (the contract's ``processes`` item) and its kept lines."""

    __slots__ = ("name", "role", "rank", "label", "host", "pid", "state", "exit_code", "signal", "cpu", "rss",
                 "last_line", "speed", "epoch", "batch", "lines", "log", "ring", "ring_bytes", "started",
                 "dirty", "sent_at", "series_t", "series_v", "gap", "latest")

    def __init__(self, name: str, role: str, rank: int, label: str, host: str) -> None:
        self.name, self.role, self.rank, self.label, self.host = name, role, rank, label, host
        self.pid: Optional[int] = None
        self.state = "starting"
        self.exit_code: Optional[int] = None
        self.signal: Optional[str] = None
        self.cpu: Optional[float] = None
        self.rss: Optional[int] = None
        self.last_line = ""
        self.speed: Optional[float] = None
        self.epoch: Optional[int] = None
        self.batch: Optional[int] = None
        self.lines = 0
        self.log: Optional[str] = None
        self.ring: collections.deque[tuple[float, str, str]] = collections.deque()
        self.ring_bytes = 0
        self.started = False
        self.dirty = False  # line-derived fields changed since the row was last sent
        self.sent_at = 0.0
        self.series_t = array.array("d")
        self.series_v = array.array("d")
        self.gap = 0.0  # the least time between two kept points (doubles when the series is halved)
        self.latest: Any = None  # the parser's last result (validation lines refer to it)

    def to_dict(self) -> dict:
        return {"name": self.name, "role": self.role, "rank": self.rank, "label": self.label, "host": self.host,
                "pid": self.pid, "state": self.state, "exit_code": self.exit_code, "signal": self.signal,
                "cpu": self.cpu, "rss": self.rss, "last_line": self.last_line, "speed": self.speed,
                "epoch": self.epoch, "batch": self.batch, "lines": self.lines, "log": self.log}

    def order(self) -> tuple[int, int, str]:
        return ROLE_ORDER.get(self.role, 3), self.rank, self.name

    def log_lines(self) -> list[list]:
        """The kept lines as ``[seq, t, "o"|"e", text]`` (seq counts from 1 per process)."""
        first = self.lines - len(self.ring) + 1
        return [[first + i, t, kind, text] for i, (t, kind, text) in enumerate(self.ring)]


def cut(line: str) -> str:
    """``line`` cut to :data:`MAX_LINE` characters, saying how many went (a bound on memory)."""
    if len(line) <= MAX_LINE:
        return line
    return f"{line[:MAX_LINE]}… ({len(line) - MAX_LINE:,} more characters)"


def hosts_note(hosts: Any) -> str:
    """What an attempt did with its hosts (``--summary-json``'s ``attempts[].hosts``), in a line:
    who was left out and why, which spare took whose place, who came back, and the workers when
    the job went on smaller; "" when it ran on the job's hosts."""
    if not isinstance(hosts, dict):
        return ""
    parts = [f"{e.get('host')} left out ({e.get('reason')}; {float(e.get('cooldown') or 0):.0f}s)"
             for e in hosts.get("excluded") or () if isinstance(e, dict)]
    parts += [f"spare {s.get('spare')} for {s.get('replaces')}" for s in hosts.get("spares") or ()
              if isinstance(s, dict)]
    parts += [f"{h} back" for h in hosts.get("back") or ()]
    if hosts.get("dropped"):
        parts.append(f"{hosts.get('workers')} workers ({', '.join(map(str, hosts['dropped']))} out, no spare)")
    return "; ".join(parts)


class JobView:
    """The thread-safe model of one running job (see the module docstring).

    ``clock`` has ``time()`` (tests pass their own); ``logs``: whether ``--log-dir`` files exist
    (each row then names its file).
    """

    def __init__(self, command: Sequence[str], tracker: str, backend: str, max_restarts: int = 0,
                 start: Optional[float] = None, logs: bool = False, clock: Any = time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.job: dict[str, Any] = {
            "id": None, "command": " ".join(command), "tracker": tracker, "backend": backend, "state": "starting",
            "attempt": 0, "max_restarts": max_restarts, "start": clock.time() if start is None else start,
            "elapsed": 0.0, "end": None, "exit_code": None, "logs": logs, "attempts": []}
        self.rows: dict[str, Row] = {}
        self.failure: Optional[dict] = None
        self._events: collections.deque[tuple[int, bytes]] = collections.deque()
        self._event_bytes = 0
        self._next_id = 1
        self._lost_upto = 0  # a viewer that saw less than this id cannot resume (it gets a snapshot)
        self._pending: list[list] = []  # lines not yet in an event
        self._pending_chars = 0
        self._points: list[list] = []  # throughput points not yet in an event
        self._synced = self._sampled = 0.0
        self._usage_from = 0  # the next handle to sample (a big job's samples go round)
        self._viewers = 0
        self._watched_at = -IDLE_AFTER  # (monotonic) when a viewer last asked
        #: set by the page's server once it listens: ``http://127.0.0.1:PORT/`` (no token)
        self.address: Optional[str] = None

    # -- the supervisor's side ------------------------------------------------------------------

    def plan(self, job_id: str, procs: Iterable[Any], attempt: int) -> None:
        """A new attempt's plan: every process gets its row (``starting``) before any starts.
        ``procs`` are ``ProcSpec``s (name, role, rank, label, host)."""
        with self._lock:
            self.job["id"] = job_id
            self.job["attempt"] = attempt
            self.job["state"] = "starting"
            for p in procs:
                host = p.host.name if p.host is not None else "localhost"
                row = self.rows.get(p.name)
                if row is None:
                    label = p.label.partition(" @ ")[0]  # (the host has its own column)
                    row = self.rows[p.name] = Row(p.name, str(p.role), p.rank, label, host)
                    if self.job["logs"]:
                        row.log = f"{p.name}.log"
                else:  # (a restart: the same name, a new process; its kept lines stay)
                    row.pid, row.exit_code, row.signal, row.state = None, None, None, "starting"
                    row.cpu = row.rss = None
                    row.started = False
            self.rows = dict(sorted(self.rows.items(), key=lambda kv: kv[1].order()))
            self._emit_locked("job", self._job_locked())
            self._emit_locked("procs", {"procs": [r.to_dict() for r in self.rows.values()]})

    def set_state(self, state: str) -> None:
        """The job's state (``running``, ``restarting``, ...): sent at once."""
        with self._lock:
            if self.job["state"] == state:
                return
            self.job["state"] = state
            self._emit_locked("job", self._job_locked())

    def set_attempts(self, attempts: Sequence[dict]) -> None:
        """Every attempt so far (``AttemptRecord.to_dict()``s) for the header's attempts panel."""
        with self._lock:
            self.job["attempts"] = [{"attempt": a.get("attempt"), "start": a.get("start_time"),
                                     "end": a.get("end_time"), "reason": a.get("reason"),
                                     "exit_code": a.get("exit_code"), "cause": a.get("cause"),
                                     "hosts": hosts_note(a.get("hosts"))} for a in attempts]
            self._emit_locked("job", self._job_locked())

    def set_failure(self, name: Optional[str], headline: str, lines: Sequence[str]) -> None:
        """The first failure as the supervisor names it (its failure report's first line), and
        the last lines of that process."""
        failure = {"name": name, "headline": headline, "lines": [cut(line) for line in lines]}
        with self._lock:
            if failure == self.failure:
                return
            self.failure = failure
            self._emit_locked("failure", failure)

    def sync(self, handles: Sequence[Any], stopped: Iterable[str] = (), force: bool = False) -> None:
        """Compare the rows with the handles (pid, exit code, the launcher's stops) and send what
        changed; every :data:`SYNC_INTERVAL` at most (``force``: now). Cheap enough to call on
        every look of the supervisor's loop; CPU and RSS are sampled here too (:meth:`_sample`)."""
        now = self.clock.time()
        if not force and now - self._synced < SYNC_INTERVAL:
            return
        self._synced = now
        usage = self._sample(handles, now)
        stopped = set(stopped)
        changed = []
        with self._lock:
            watched = self._watched_locked()  # (unwatched, a row's new last line waits for the next snapshot)
            for h in handles:
                row = self.rows.get(h.name)
                if row is None:
                    continue
                if self._update_locked(row, h, h.name in stopped, usage.get(h.name)) or \
                        watched and row.dirty and now - row.sent_at >= ROW_INTERVAL:
                    changed.append(row)
            if any(r.started for r in self.rows.values()) and self.job["state"] == "starting":
                self.job["state"] = "running"
                self._emit_locked("job", self._job_locked())
            self._flush_locked(now)
            if changed:
                for row in changed:
                    row.dirty, row.sent_at = False, now
                self._emit_locked("procs", {"procs": [r.to_dict() for r in changed]})

    def _update_locked(self, row: Row, h: Any, stopped: bool, usage: Optional[tuple]) -> bool:
        """Bring ``row`` up to its handle; whether anything a viewer sees changed."""
        code = h.exit_code
        state = "running" if code is None else "stopped" if stopped else "succeeded" if code == 0 else "failed"
        cpu, rss = usage if usage is not None else (row.cpu, row.rss)
        rss = rss or row.rss  # (0 bytes: a process leaving, its memory already given back; the last RSS stays)
        if code is not None:
            cpu = None  # (an ended process uses no CPU; its last RSS stays)
        if (h.pid, state, code, h.host, cpu, rss) == (row.pid, row.state, row.exit_code, row.host, row.cpu, row.rss):
            return False
        row.pid, row.state, row.exit_code, row.host, row.cpu, row.rss = h.pid, state, code, str(h.host), cpu, rss
        row.signal = signal_name(code)
        row.started = True
        return True

    def _sample(self, handles: Sequence[Any], now: float) -> dict[str, tuple]:
        """``{name: (cpu %, rss)}`` from ``handle.usage()`` where a handle has it (each backend's
        own way), every :data:`USAGE_INTERVAL` at most, and for a big job a share of the handles
        each time (:data:`USAGE_PER_SECOND`), so that sampling never costs the job a core."""
        if now - self._sampled < USAGE_INTERVAL or not handles:
            return {}
        self._sampled = now
        out = {}
        n = min(len(handles), USAGE_PER_SECOND)
        start = self._usage_from % len(handles)
        for i in range(n):
            h = handles[(start + i) % len(handles)]
            usage = getattr(h, "usage", None)
            if usage is None or h.exit_code is not None:
                continue
            try:
                got = usage()
            except Exception:  # (a sample is a nicety: never the end of the supervisor)
                got = None
            if got is not None:
                out[h.name] = (round(float(got[0]), 1), int(got[1]))
        self._usage_from = start + n
        return out

    def finish(self, reason: str, exit_code: Optional[int], handles: Sequence[Any] = (),
               stopped: Iterable[str] = ()) -> None:
        """The job has ended for ``reason`` (the supervisor's: ``success``, ``failure``, ``signal``,
        ``timeout``) with ``exit_code``."""
        state = job_state(reason)
        self.sync(handles, stopped, force=True)
        now = self.clock.time()
        with self._lock:
            for row in self.rows.values():
                if row.state in ("starting", "running"):
                    row.state = "stopped"  # (the job is over: whatever did not end by itself was ended)
            self.job.update(state=state, exit_code=exit_code, end=now)
            self._flush_locked(now)
            self._emit_locked("procs", {"procs": [r.to_dict() for r in self.rows.values()]})
            self._emit_locked("job", self._job_locked())

    # -- lines (the console's tap; any thread) ---------------------------------------------------

    def add_line(self, name: str, line: str, err: bool) -> None:
        """One line of process ``name`` (already redacted and printable): kept in its ring, parsed
        for Speedometer's throughput, and batched for the viewers."""
        line = cut(line)
        now = self.clock.time()
        with self._lock:
            row = self.rows.get(name)
            if row is None:
                return  # (not a process of the job: a tracker's own lines)
            t = round(now - self.job["start"], 3)
            kind = "e" if err else "o"
            row.lines += 1
            row.ring.append((t, kind, line))
            row.ring_bytes += len(line) + LINE_COST
            budget = max(LOG_MIN_BYTES, LOG_BUDGET // max(1, len(self.rows)))
            while len(row.ring) > LOG_LINES or row.ring_bytes > budget and len(row.ring) > 1:
                row.ring_bytes -= len(row.ring.popleft()[2]) + LINE_COST
            row.last_line = line
            row.dirty = True
            if "Speed" in line or "Validation" in line:
                self._speed_locked(row, line, t)
            if self._watched_locked():
                self._pending.append([name, row.lines, t, kind, line])
                self._pending_chars += len(line)
                if len(self._pending) >= BATCH_LINES or self._pending_chars >= BATCH_CHARS:
                    self._flush_locked(now)
            else:
                self._unwatched_locked(now)

    def _unwatched_locked(self, now: float) -> None:
        """A line while nobody watches: no event holds it, so the id it would have had marks a gap
        (a viewer that saw less gets a snapshot, which has the line); once per unwatched stretch."""
        if self._pending:
            self._flush_locked(now)
        if self._lost_upto != self._next_id - 1:
            self._lost_upto = self._next_id
            self._next_id += 1

    def _speed_locked(self, row: Row, line: str, t: float) -> None:
        """A Speedometer line (``launcher.run.progress.parse_line``, the progress line's parser):
        the row's speed, epoch, batch, and a point of its throughput series."""
        found = parse_line(line, row.latest)
        if found is None:
            return
        row.latest = found
        row.epoch, row.batch = found.epoch, found.batch
        if found.speed is None or "Speed" not in line:  # (a validation line repeats the last speed)
            return
        row.speed = found.speed
        ts, vs = row.series_t, row.series_v
        if ts and t - ts[-1] < row.gap:
            return
        if len(ts) >= SERIES_POINTS:  # full: keep every other point, and twice the gap from now on
            ts = row.series_t = array.array("d", ts[::2])
            vs = row.series_v = array.array("d", vs[::2])
            row.gap = max(row.gap * 2, (ts[-1] - ts[0]) / len(ts) if len(ts) > 1 else 0.0)
        ts.append(t)
        vs.append(found.speed)
        self._points.append([row.name, t, found.speed])

    # -- the viewers' side ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The whole job as the UI contract's JSON dict (what ``/api/state`` and the report show)."""
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict:
        return {"job": self._job_locked(),
                "processes": [r.to_dict() for r in self.rows.values()],
                "throughput": {r.name: [[t, v] for t, v in zip(r.series_t, r.series_v)]
                               for r in self.rows.values() if r.series_t},
                "failure": self.failure,
                "logs": {r.name: r.log_lines() for r in self.rows.values()}}

    def snapshot_message(self) -> tuple[int, bytes]:
        """The snapshot as one SSE message, with the id of the last event it holds (a viewer
        goes on from there)."""
        with self._lock:
            self._viewed_locked()
            self._flush_locked(self.clock.time())
            last = self._next_id - 1
            doc = self._snapshot_locked()
        return last, message(last, "snapshot", doc)

    def events_after(self, last: int) -> Optional[list[tuple[int, bytes]]]:
        """Every message after id ``last`` (``[]``: none yet), or None when some of them are no
        longer held (the viewer needs a snapshot)."""
        with self._lock:
            self._viewed_locked()
            self._flush_locked(self.clock.time())
            if last < self._lost_upto or self._events and last < self._events[0][0] - 1:
                return None
            if last >= self._next_id:
                return None  # (an id from another job, or the future)
            if not self._events or last >= self._events[-1][0]:
                return []
            return [e for e in self._events if e[0] > last]

    def wait(self, last: int, timeout: float) -> None:
        """Until an event after ``last`` is sent or ``timeout`` passes (lines wake no one: a viewer
        asks again within its timeout, which batches them)."""
        with self._changed:
            if self._next_id - 1 <= last:
                self._changed.wait(timeout)

    def viewer(self, delta: int) -> None:
        """A viewer connected (+1) or left (-1); lines are encoded only while one is there."""
        with self._lock:
            self._viewers += delta
            self._viewed_locked()

    def _viewed_locked(self) -> None:
        self._watched_at = time.monotonic()

    def _watched_locked(self) -> bool:
        return self._viewers > 0 or time.monotonic() - self._watched_at < IDLE_AFTER

    # -- events -----------------------------------------------------------------------------------

    def _job_locked(self) -> dict:
        job = dict(self.job)
        end = job["end"] if job["end"] is not None else self.clock.time()
        job["elapsed"] = round(max(0.0, end - job["start"]), 3)
        job["attempts"] = list(job["attempts"])
        return job

    def _flush_locked(self, now: float) -> None:
        """Lines and points gathered so far become one event each."""
        if self._pending:
            lines, self._pending, self._pending_chars = self._pending, [], 0
            self._emit_locked("lines", {"lines": lines})
        if self._points:
            points, self._points = self._points, []
            self._emit_locked("points", {"points": points})

    def _emit_locked(self, kind: str, data: Any) -> None:
        """Append one event to the ring (dropping the oldest past its bounds) and wake the viewers."""
        if kind not in ("lines", "points") and self._pending:
            self._flush_locked(0.0)  # (lines first: a state change never overtakes what led to it)
        event_id = self._next_id
        self._next_id += 1
        data_bytes = message(event_id, kind, data)
        self._events.append((event_id, data_bytes))
        self._event_bytes += len(data_bytes)
        while len(self._events) > MAX_EVENTS or self._event_bytes > EVENT_BYTES and len(self._events) > 1:
            self._event_bytes -= len(self._events.popleft()[1])
        self._changed.notify_all()

    def memory(self) -> int:
        """Bytes the kept lines, series and events take, estimated as the bounds count them."""
        with self._lock:
            rows = sum(r.ring_bytes + 2 * 8 * len(r.series_t) for r in self.rows.values())
            return rows + self._event_bytes


def message(event_id: int, kind: str, data: Any) -> bytes:
    """One server-sent-events message: ``id``, ``event`` and the data as one line of JSON."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event_id}\nevent: {kind}\ndata: {text}\n\n".encode("utf-8", "replace")


def job_state(reason: str) -> str:
    """The supervisor's reason for the end of a job (``success``, ``failure``, ``signal``,
    ``timeout``) as the page's job state."""
    return {"success": "succeeded", "signal": "stopped"}.get(reason, "failed")

