"""Runs XGBoost's own tracker for the launcher, in a process of its own.

Usage (with a Python that has xgboost; the launcher never imports it)::

    python xgboost_child.py [--tracker xgboost|rabit] --n-workers N --host-ip ADDR
                            [--port-range LOW-HIGH] [--sortby host|task] [--timeout SECONDS]
                            [--header-timeout SECONDS] [--allow-hosts ADDR,...] [--task-ids N]

``--tracker xgboost`` (the default) starts XGBoost 2.1+'s ``xgboost.tracker.RabitTracker``;
``--tracker rabit`` starts dmlc's rabit tracker, which XGBoost 2.0 and older ship in the same
module, in pure Python (see *rabit* below). Either listens on ``ADDR`` and the first port of
the range it can bind, then writes JSON lines on its stdout, one object each:

* ``{"event": "listening", "env": {...}, "xgboost": VERSION, "pid": PID}`` once it listens;
  ``env`` holds ``DMLC_TRACKER_URI`` and ``DMLC_TRACKER_PORT``, what the workers need to find it.
  With ``--tracker xgboost`` it also has ``worker_args``: ``tracker.worker_args()``, what a worker
  passes to ``xgboost.collective.CommunicatorContext(**worker_args)`` (``dmlc_tracker_uri``,
  ``dmlc_tracker_port``). XGBoost 2.1+ reads no variable itself: a script builds the arguments
  from them, with the port as an int and the task id as a str (XGBoost rejects other types)::

      args = {"dmlc_tracker_uri": os.environ["DMLC_TRACKER_URI"],
              "dmlc_tracker_port": int(os.environ["DMLC_TRACKER_PORT"]),
              "dmlc_task_id": os.environ["DMLC_TASK_ID"]}
      with xgboost.collective.CommunicatorContext(**args):
          rank = xgboost.collective.get_rank()  # shard the data by this
* ``{"event": "done"}`` when every worker has finished (exit code 0), or
  ``{"event": "failed", "error": "..."}`` (exit code 1; 2 when it could not start: no xgboost
  or an xgboost of the other protocol (``--tracker xgboost``), no free port).

Nothing else goes to stdout: the file descriptor is moved aside before xgboost is imported,
and whatever xgboost or (2.1+) the workers' ``communicator_print`` messages write goes to
stderr, for the launcher to label.

Stdin is the launcher's leash: when it reaches end of file (the launcher closed the pipe, or
died) the program exits at once with code 0 (``{"event": "stopped"}``), whatever the tracker
is doing. The launcher must therefore give it a pipe and keep the write end open while the
job runs.

With ``--tracker xgboost``, ranks follow the tracker's sort: by host address, then by task id
compared as *strings* (``"10"`` sorts before ``"2"``); ``--sortby task`` sorts by task id only.
From 10 workers on a host, ranks are therefore not ``DMLC_TASK_ID``: shard the data by
``xgboost.collective.get_rank()``.

rabit
-----
XGBoost 2.0's ``xgboost/tracker.py`` is "a variant of dmlc-core/dmlc_tracker/tracker.py": the
tracker launch.py ran for ``-s 0``, standard library only. It is loaded from its file, as a
module of this program's own, without importing xgboost (whose library and numpy it does not
use, and which take most of a second to import), and run with these changes:

* ranks: workers whose ``DMLC_TASK_ID`` is a number come first, in its order, so that
  ``rank == DMLC_TASK_ID`` when the launcher numbers them ``0..N-1`` (dmlc sorts by host
  address, then arrival); the others follow by host;
* every connection's header (the magic number, rank, world size, task id, command) is read by
  a front door (:class:`_FrontDoor`) on a thread of its own, as launch.py's tracker did, and
  dmlc's serial loop gets only connections whose whole header has come: one that does not
  speak the protocol, ends early or has not sent its header within ``--header-timeout``
  seconds (30) is dropped and holds up nobody (dmlc's tracker would stop, or wait for it, or
  spin on a closed socket); task ids and commands are at most :data:`MAX_TASK_ID` bytes,
  print messages :data:`MAX_STRING`;
* strangers (rabit has no secret; dmlc's tracker took any connection and its word): with
  ``--allow-hosts`` (the launcher gives the job's hosts where it knows them) a connection from
  another address is dropped before a byte is read; with ``--task-ids N`` (the launcher numbers
  ``DMLC_TASK_ID`` ``0..N-1``) a header with another task id is dropped, and a ``start`` must ask
  for its rank (-1); a ``start`` claims its task id at the door: a second claim is dropped
  (``{"event": "dropped", "claimed": TASK_ID, ...}``, which the launcher shows as a warning)
  while the first claim's connection is open or its rank given; so is a world size other than
  N (the worker fails without its links, and the note says what to fix). A claim whose
  connection closes before its rank is forgotten, and the next claim of that task id takes its
  place: dmlc's loop (``accept_workers``) is written again for this, since it would give a rank
  to the closed one (and fail the job on it). A ``recover`` must give the rank its task id has,
  a ``shutdown`` a rank whose links are set up. What remains: a program on a job's host that
  claims a task id before its worker does holds it (it cannot be told from the worker without a
  secret); the worker is then refused, with that note, and fails at once instead of hanging;
* its connections send at once (``TCP_NODELAY``): dmlc sends each int of its replies by itself,
  and Nagle's algorithm held most of them for the worker's delayed ACK (a 4-worker job joined
  0.3 s later);
* the job cannot go on (``failed``) when a worker speaks XGBoost 2.1+'s protocol (the error
  says to use ``--tracker xgboost``), or closes its connection while it sets up its links (it
  died);
* it says what happens, in more events:

  * ``{"event": "asked", "task_id": "0", "host": "10.0.0.2"}``: a worker asked for a rank;
  * ``{"event": "joined", "seconds": S, "ranks": [[rank, task_id, host], ...]}``: every
    worker has its rank and links, ``S`` seconds after the tracker started;
  * ``{"event": "print", "text": "..."}``: a worker's ``print`` message (rabit's
    ``communicator_print``: rank 0's evaluation log);
  * ``{"event": "log", "level": "INFO", "text": "..."}``: the tracker's ``logging`` records;
  * ``{"event": "dropped", "error": "..."}``: a connection was dropped, and why.

The stand-in
------------
``--tracker rabit`` with a Python that cannot run dmlc's tracker (no xgboost at all, XGBoost 2.1+,
or an XGBoost whose tracker this program does not know) does not fail at once: many ``-s 0``
jobs are "N workers, no servers" whose programs never talk to the tracker (a shell script, a
probe), and launch.py's tracker simply listened for them. So a stand-in of a few lines holds the
tracker's port (``{"event": "listening", ..., "xgboost": "3.0.2" or null, "stand_in": "why it
cannot run the tracker, and what to do"}``) until the launcher closes stdin (``stopped``, exit
code 0), and says why a rabit job cannot go on when a worker asks it for a rank. Its front door
is the tracker's: a connection whose first 4 bytes are rabit's magic number (dmlc's
``MAGIC_NUM``, 0xff99 as a 32-bit int in the machine's byte order, the first thing every rabit
worker, XGBoost 2.1+'s too, sends and then waits to see echoed) is a worker once its header has
come (XGBoost 2.1+ sends a length and a JSON object instead). The stand-in then emits ``failed``:
the line says what to install or which ``--tracker-python`` to give, or, for a 2.1+ worker, to
use ``--tracker xgboost``. It keeps that worker's connection open and exits (code 1) only when
stdin closes: a worker whose tracker went away fails at once, and its failure would be the job's
report instead of this line. Any other connection is ``dropped``, as the tracker drops it.

Standard library and xgboost only; nothing from the launcher is imported.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import json
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

#: the longest string (task id, command, print message) a rabit worker may send
MAX_STRING = 4 << 20
#: the longest task id or command in a worker's header (launch.py's tracker took 1 KiB): longer is not a worker's
MAX_TASK_ID = 1024
_COMMANDS = ("start", "recover", "print", "shutdown")


def _emit(stream, **obj) -> None:
    try:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _first_line(e: BaseException) -> str:
    """XGBoost errors carry a stack trace; keep the lines that say what went wrong."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("Stack trace", "[bt]"))]
    return " ".join(keep)[:500] or type(e).__name__


def _parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise SystemExit(f"bad --port-range {text!r}: expected LOW-HIGH") from None
    if not 0 <= low <= high <= 65535:
        raise SystemExit(f"bad --port-range {text!r}: need 0 <= LOW <= HIGH <= 65535")
    return low, high


def _on_first_free_port(low: int, high: int, start: Callable[[int], Any],
                        in_use: Callable[[Exception], bool]) -> tuple[Any, int, Exception | None]:
    """``start(port)`` on the ports of ``low..high`` from the lowest up until it does not fail
    with a port in use (``in_use(error)``): ``(what it returned, the port, None)``, else
    ``(None, the last port tried, its error)`` (``(None, 0, None)`` for an empty range).

    The launcher's rule for a port range (``pscontract.first_free_port``), written again here:
    XGBoost's trackers take a port number, not a socket that the launcher could bind for them (as
    it does for the torch store), and this program imports nothing of pslaunch.
    """
    port, error = 0, None
    for port in range(low, high + 1):
        try:
            return start(port), port, None
        except Exception as e:
            error = e
            if not in_use(e):
                break
    return None, port, error


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tracker", choices=["xgboost", "rabit"], default="xgboost",
                    help="xgboost: XGBoost 2.1+'s tracker; rabit: dmlc's, as XGBoost 2.0 and older ship it")
    ap.add_argument("--n-workers", type=int, required=True)
    ap.add_argument("--host-ip", required=True)
    ap.add_argument("--port-range", default="0", help="LOW-HIGH (default 0: any free port)")
    ap.add_argument("--sortby", choices=["host", "task"], default="host")
    ap.add_argument("--timeout", type=int, default=0,
                    help="XGBoost's own limit on start-up and shut-down, seconds (0: none; xgboost)")
    ap.add_argument("--header-timeout", type=float, default=30.0,
                    help="seconds a new connection has to send its whole request (rabit)")
    ap.add_argument("--allow-hosts", default=None, metavar="ADDR,...",
                    help="the addresses the workers connect from ('local': any of this machine's); others are "
                         "dropped unread (rabit; default: any)")
    ap.add_argument("--task-ids", type=int, default=None, metavar="N",
                    help="the workers' task ids are 0..N-1; a connection that gives another is dropped (rabit)")
    a = ap.parse_args(argv)
    low, high = _parse_range(a.port_range)

    # our JSON lines get the real stdout; everything else that writes to fd 1 gets stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if a.tracker == "rabit":
        rules = _DoorRules(a.header_timeout, _Peers.parse(a.allow_hosts), a.task_ids, a.n_workers)
        return _rabit(out, a.n_workers, a.host_ip, low, high, rules)

    try:
        import xgboost
        from xgboost.tracker import RabitTracker
    except ImportError as e:
        _emit(out, event="failed", error=f"cannot import xgboost with {sys.executable}: {e}; "
                                         "install xgboost>=2.1 there or choose another --tracker-python")
        return 2
    version = xgboost.__version__
    if _major_minor(version) < (2, 1):
        _emit(out, event="failed", error=f"xgboost {version} at {sys.executable} predates the new tracker "
                                         "(2.1): use --tracker rabit for it")
        return 2

    tracker, _, error = _on_first_free_port(
        low, high, lambda port: RabitTracker(n_workers=a.n_workers, host_ip=a.host_ip, port=port, sortby=a.sortby,
                                             timeout=a.timeout),
        lambda e: "in use" in _first_line(e))  # (an XGBoostError; its text names the cause)
    if tracker is None:
        last = "empty port range" if error is None else _first_line(error)
        _emit(out, event="failed", error=f"cannot start XGBoost's tracker on {a.host_ip} port {low}-{high}: "
                                         f"{last}")
        return 2
    tracker.start()
    args = tracker.worker_args()
    _emit(out, event="listening", worker_args=args, xgboost=version, pid=os.getpid(),
          env={"DMLC_TRACKER_URI": str(args["dmlc_tracker_uri"]),
               "DMLC_TRACKER_PORT": str(args["dmlc_tracker_port"])})
    return _serve(out, tracker.wait_for)


def _serve(out, wait, linger: bool = False) -> int:
    """Run ``wait()`` (the tracker, until every worker is done) beside the stdin leash; exit. With
    ``linger``, a failure is said at once but the program exits only when the leash ends."""
    result: dict = {}
    finished = threading.Event()
    leash_ended = threading.Event()

    def run() -> None:
        try:
            wait()
            result["ok"] = True
        except Exception as e:
            result["error"] = _first_line(e)
        finished.set()

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        leash_ended.set()
        result.setdefault("stopped", True)
        finished.set()

    threading.Thread(target=run, name="xgb-tracker-wait", daemon=True).start()
    threading.Thread(target=watch_stdin, name="xgb-tracker-stdin", daemon=True).start()
    finished.wait()
    if result.get("ok"):
        _emit(out, event="done")
        code = 0
    elif "error" in result:
        _emit(out, event="failed", error=result["error"])
        code = 1
        if linger:
            leash_ended.wait()
    else:
        _emit(out, event="stopped")
        code = 0
    sys.stderr.flush()
    # os._exit: the tracker's C++ threads and destructor may block, or raise at exit
    os._exit(code)


# --- rabit: dmlc's tracker from XGBoost 2.0 and older ------------------------------------------------


def _rabit(out, n_workers: int, host: str, low: int, high: int, rules: _DoorRules) -> int:
    install = ("install xgboost 2.0 or older there (pip install 'xgboost<2.1') or give --tracker-python a Python "
               "that has it")
    spec = importlib.util.find_spec("xgboost")
    if spec is None or not spec.submodule_search_locations:
        return _stand_in(out, host, low, high, rules, None, f"{sys.executable} has no XGBoost: {install}")
    package = spec.submodule_search_locations[0]
    try:  # where xgboost reads its own version (core._py_version)
        with open(os.path.join(package, "VERSION"), encoding="ascii") as f:
            version = f.read().strip()
    except OSError:
        import xgboost

        version = xgboost.__version__
    if _major_minor(version) >= (2, 1):
        return _stand_in(out, host, low, high, rules, version,
                         f"xgboost {version} at {sys.executable} has only XGBoost 2.1+'s tracker: {install}")
    path = os.path.join(package, "tracker.py")
    try:
        file_spec = importlib.util.spec_from_file_location("dmlc_tracker", path)
        if file_spec is None or file_spec.loader is None:  # (not for a .py file)
            raise ImportError(f"no loader for {path}")
        dmlc = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(dmlc)
        tracker_class = _adapt(dmlc, out, n_workers, rules)
    except Exception as e:  # (an XGBoost older than this program knows: no WorkerEntry, ...)
        return _stand_in(out, host, low, high, rules, version,
                         f"xgboost {version} at {sys.executable} has no rabit tracker this program can run ({path}: "
                         f"{_first_line(e)}): install xgboost 2.0 there (pip install 'xgboost==2.0.*')")

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _emit(out, event="log", level=record.levelname, text=record.getMessage())

    logging.getLogger().addHandler(Forward(logging.DEBUG))
    logging.getLogger().setLevel(logging.DEBUG)

    tracker = _listen(out, host, low, high, lambda port: tracker_class(host, n_workers, port=port))
    if tracker is None:
        return 2
    _emit(out, event="listening", xgboost=version, pid=os.getpid(),
          env={"DMLC_TRACKER_URI": host, "DMLC_TRACKER_PORT": str(tracker.port)})
    return _serve(out, lambda: tracker.accept_workers(n_workers))


def _listen(out, host: str, low: int, high: int, start: Callable[[int], Any]) -> Any:
    """``start(port)`` (a rabit tracker or the stand-in's socket) on the first free port of the
    range, or None once a ``failed`` event has said why not."""
    def in_use(e: Exception) -> bool:
        return isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EACCES)

    listening, port, error = _on_first_free_port(low, high, start, in_use)
    if listening is None:
        _emit(out, event="failed", error=f"no free port in {low}-{high} on {host}: widen --port-range"
              if error is None or in_use(error) else
              f"cannot listen on {host}:{port}: {getattr(error, 'strerror', None) or error}; give an address of "
              "this host")
    return listening


class _Fatal(Exception):
    """The job cannot go on (not a stray connection to drop)."""


class _Claimed(ValueError):
    """A connection that claims a task id cannot have it (another one claimed it first, or it
    expects another world size): dropped, with a note, since it may be the job's worker."""


def _other_world(task_id: str, world: int, n_workers: int) -> str:
    return (f"task id {task_id} expects a world of {world} workers but this job has {n_workers}: if it is the job's "
            "worker, remove rabit_world_size or make it match -n")


_SECOND_CLAIM = ("a second claim is refused (rabit has no secret: if this is the job's worker, another program on a "
                 "job host connected to the tracker as this task first)")


def _adapt(dmlc, out, n_workers: int, rules: _DoorRules) -> type:
    """dmlc's ``RabitTracker`` with the changes of the module docstring (*rabit*): subclasses of
    its classes, put in its module's namespace (a module of this program's own) where its
    ``accept_workers`` finds them."""
    for name in ("accept_workers", "_sort_pending"):  # (AttributeError: an XGBoost this program does not know)
        getattr(dmlc.RabitTracker, name)

    class Socket(dmlc.ExSocket):
        def __init__(self, sock) -> None:
            super().__init__(sock)
            self.echo_sent = isinstance(sock, _Greeted)  # (the front door has echoed the magic number)

        def sendint(self, value: int) -> None:
            if self.echo_sent:  # (WorkerEntry's first send is that echo)
                self.echo_sent = False
                if value == dmlc.MAGIC_NUM:
                    return
            super().sendint(value)

        def recvall(self, nbytes: int) -> bytes:
            if not 0 <= nbytes <= MAX_STRING:
                raise ValueError(f"a string of {nbytes} bytes")
            return _recv_exactly(self.sock, nbytes)

    class Entry(dmlc.WorkerEntry):
        assigned = False  # its rank has been given out

        def __init__(self, sock, addr) -> None:
            while True:  # until a connection makes a request that the tracker can serve
                try:
                    super().__init__(sock, addr)  # (from the front door: its header is here already)
                    self._check()
                    break
                except _Fatal:
                    raise
                except Exception as e:
                    if sock.new_protocol:
                        raise _new_protocol(addr) from None
                    _emit(out, event="dropped", error=f"a connection from {addr[0]}: {_first_line(e)}",
                          **({"claimed": self.task_id} if isinstance(e, _Claimed) else {}))
                    sock.close()
                sock, addr = Tracker.listener.accept()
            if self.cmd in ("start", "recover"):
                sock.settimeout(None)  # it waits for the others, then for its peers
                _emit(out, event="asked", task_id=self.task_id, host=self.host)

        def _check(self) -> None:
            """Raise for a request that dmlc's tracker would stop on (an assert) or hang for, or
            that claims a task id that another connection holds (:class:`_Claimed`)."""
            if self.cmd not in _COMMANDS:
                raise ValueError(f"unknown command {self.cmd[:32]!r}")
            if self.cmd == "print":
                return
            first = Tracker.claims.get(self.task_id) if self.task_id != "NULL" else None
            if self.cmd == "shutdown":
                if self.rank not in Tracker.joined or self.rank in Tracker.shut_down:
                    raise ValueError(f"a shutdown for rank {self.rank}, which has no links or has shut down")
                if first is not None and first.rank != self.rank:
                    raise ValueError(f"a shutdown for rank {self.rank} from task id {self.task_id}, whose rank is "
                                     f"{first.rank}")
                Tracker.shut_down.add(self.rank)
                return
            lowest = (-1 if self.cmd == "start" else 0)
            highest = -1 if self.cmd == "start" and rules.task_ids is not None else n_workers - 1
            if not lowest <= self.rank <= highest:  # (the job's workers start as -1: rank = task id)
                raise ValueError(f"{self.cmd} for rank {self.rank}")
            if self.cmd == "recover":  # (a worker of the job whose links broke: it has its rank)
                if (first is None and rules.task_ids is not None) or (
                        first is not None and (not first.assigned or first.rank != self.rank)):
                    raise ValueError(f"a recover as rank {self.rank} from task id {self.task_id}, which does not "
                                     "have that rank")
            elif first is not None:  # a second start for this task id: the first claim holds...
                if first.assigned:
                    raise _Claimed(f"task id {self.task_id} has rank {first.rank} already (a connection from "
                                   f"{first.host} claimed it first): {_SECOND_CLAIM}")
                if first.sock.sock.is_open():
                    raise _Claimed(f"task id {self.task_id} was claimed first by a connection from {first.host}, "
                                   f"which waits for its rank: {_SECOND_CLAIM}")
                Tracker.forget(first)  # (...unless it closed while it waited: this one takes its place)
            if self.world_size not in (-1, n_workers):  # (a stranger's, or a worker's that will fail without links)
                raise _Claimed(_other_world(self.task_id, self.world_size, n_workers))
            if self.task_id != "NULL":
                Tracker.claims[self.task_id] = self

        def print(self, use_logger: bool) -> None:
            try:
                text = self.sock.recvall(self.sock.recvint()).decode("utf-8", "replace")
                _emit(out, event="print", text=text.strip())
            except (OSError, EOFError, ValueError) as e:
                _emit(out, event="dropped", error=f"a print from {self.host}: {_first_line(e)}")

        def assign_rank(self, rank, *args):
            self.assigned = self.sock.sock.assigned = True
            try:
                done = super().assign_rank(rank, *args)
            except (OSError, EOFError, ValueError, AssertionError) as e:
                raise _Fatal(f"the worker with task id {self.task_id} ({self.host}) failed in its link set-up as "
                             f"rank {rank}: {_first_line(e)} (did it die?)") from None
            Tracker.joined[rank] = (rank, self.task_id, self.host)
            if len(Tracker.joined) == n_workers and not Tracker.said_joined:
                Tracker.said_joined = True
                _emit(out, event="joined", seconds=round(time.monotonic() - Tracker.started, 3),
                      ranks=sorted(Tracker.joined.values()))
            return done

    class Tracker(dmlc.RabitTracker):
        listener: _FrontDoor  # its socket's front door: a dropped connection's entry accepts the next one
        sock: Any  # (dmlc's listening socket, then the front door)
        started = 0.0
        joined: dict = {}  # rank -> (rank, task id, host), once its links are set up
        claims: dict = {}  # task id -> the entry that claimed it first (waiting for its rank, or given it)
        pending: list = []  # the entries that wait for their ranks
        shut_down: set = set()
        said_joined = False

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            door = _FrontDoor(self.sock, out, rules)
            Tracker.listener = door
            self.sock = door  # (what its accept_workers accepts from)
            Tracker.started = time.monotonic()

        def _sort_pending(self, pending: list) -> list:
            def key(s) -> tuple:  # (task ids in number order, then the rest by host)
                numeric = s.task_id.isascii() and s.task_id.isdigit()
                return (0, int(s.task_id), "") if numeric else (1, 0, s.host)

            return sorted(pending, key=key)

        @staticmethod
        def forget(entry) -> None:
            """A claim whose connection closed before its rank came: out of the pending ones."""
            _emit(out, event="dropped", error=f"a connection from {entry.host}: it asked for a rank as task id "
                                              f"{entry.task_id}, then closed before it had one")
            entry.sock.sock.close()
            task_id = entry.task_id
            if Tracker.claims.get(task_id) is entry:
                del Tracker.claims[task_id]
            if entry in Tracker.pending:
                Tracker.pending.remove(entry)

        def accept_workers(self, n_workers: int) -> None:
            """dmlc's loop (``RabitTracker.accept_workers``) for a world of ``n_workers`` (the entries
            refuse any other), written again so that a pending entry whose connection has closed
            leaves the batch instead of being given a rank: dmlc's would fail the job on it, or give
            it the rank of a worker that comes later."""
            shutdown: dict = {}
            wait_conn: dict = {}  # rank -> its entry, while others still have to connect to it
            job_map: dict = {}  # task id -> rank
            todo = list(range(n_workers))
            tree_map, parent_map, ring_map = self.get_link_map(n_workers)
            while len(shutdown) != n_workers:
                fd, s_addr = self.sock.accept()
                s = dmlc.WorkerEntry(fd, s_addr)
                if s.cmd == "print":
                    s.print(self._use_logger)
                    continue
                if s.cmd == "shutdown":
                    shutdown[s.rank] = s
                    logging.debug("Received %s signal from %d", s.cmd, s.rank)
                    continue
                rank = s.decide_rank(job_map)
                if rank != -1:  # (a recover: the rank it had)
                    s.assign_rank(rank, wait_conn, tree_map, parent_map, ring_map)
                    logging.debug("Received %s signal from %d", s.cmd, s.rank)
                    if s.wait_accept > 0:
                        wait_conn[rank] = s
                    continue
                if not todo:  # (only without task ids: a task id's second start is refused before)
                    _emit(out, event="dropped", error=f"a connection from {s.host}: it asked for a rank as task id "
                                                      f"{s.task_id[:32]!r} after every rank was given")
                    s.sock.sock.close()
                    continue
                Tracker.pending.append(s)
                for entry in list(Tracker.pending):
                    if len(Tracker.pending) == len(todo) and not entry.sock.sock.is_open():
                        Tracker.forget(entry)
                if len(Tracker.pending) == len(todo):
                    for entry in self._sort_pending(Tracker.pending):
                        rank = todo.pop(0)
                        if entry.task_id != "NULL":
                            job_map[entry.task_id] = rank
                        entry.assign_rank(rank, wait_conn, tree_map, parent_map, ring_map)
                        if entry.wait_accept > 0:
                            wait_conn[rank] = entry
                        logging.debug("Received %s signal from %s; assign rank %d", entry.cmd, entry.host, entry.rank)
                    Tracker.pending = []
                    logging.info("@tracker All of %d nodes getting started", n_workers)
            logging.info("@tracker All nodes finishes job")

    dmlc.ExSocket, dmlc.WorkerEntry = Socket, Entry
    return Tracker


# --- the stand-in: no xgboost at all (see *The stand-in* in the module docstring) ---------------------

#: what a rabit worker sends first and waits to see echoed: dmlc's ``MAGIC_NUM`` as ``ExSocket.sendint`` sends it
RABIT_MAGIC = struct.pack("@i", 0xFF99)


def _stand_in(out, host: str, low: int, high: int, rules: _DoorRules, version: str | None,
              cannot: str) -> int:
    """Hold the tracker's port for a job whose tracker Python cannot run dmlc's tracker
    (``cannot`` says why, and what to do, to the first XGBoost 2.0 worker that asks)."""
    def listen(port: int) -> socket.socket:
        return socket.create_server((host, port), family=socket.getaddrinfo(host, None)[0][0], backlog=256)

    listener = _listen(out, host, low, high, listen)
    if listener is None:
        return 2
    door = _FrontDoor(listener, out, rules)
    held = []  # the first worker that asks: its connection stays open until the program exits

    def wait() -> None:
        sock, addr = door.accept()
        held.append(sock)
        if sock.new_protocol:
            raise _new_protocol(addr)
        raise _Fatal(f"the worker at {addr[0]} asked for its rank, but {cannot}")

    _emit(out, event="listening", xgboost=version, stand_in=cannot, pid=os.getpid(),
          env={"DMLC_TRACKER_URI": host, "DMLC_TRACKER_PORT": str(listener.getsockname()[1])})
    return _serve(out, wait, linger=True)


# --- the front door: every connection's header read on its own thread ---------------------------------

#: connections whose headers are being read at once; more are dropped until one is done
MAX_GREETING = 256


def _opens_json(head: bytes) -> bool:
    """Whether a header (the magic number, then what follows) is XGBoost 2.1+'s: where 2.0 sends the
    world size, 2.1+ has begun a JSON object."""
    return head[8:10] == b'{"'


def _new_protocol(addr: Any) -> _Fatal:
    return _Fatal(f"the worker at {addr[0]} speaks XGBoost 2.1+'s tracker protocol, which this rabit tracker "
                  "does not: run the job with --tracker xgboost")


class _Greeted:
    """A worker's connection whose header (``head``: the magic number, rank, world size, task id
    and command, or up to a 2.1+ worker's JSON) the front door has read: ``recv`` gives those bytes
    again first, so that dmlc's ``WorkerEntry`` reads them as it would from the socket."""

    def __init__(self, sock: socket.socket, head: bytes, task_id: str = "", command: str = "") -> None:
        self.sock, self.head, self._unread = sock, head, head
        self.rank, self.world_size = struct.unpack("@ii", head[4:12])
        self.task_id, self.command = task_id, command
        self.assigned = False  # (its entry has been given a rank)
        self.peer = ""  # (the address it came from, once it has claimed a task id)

    @property
    def new_protocol(self) -> bool:
        """An XGBoost 2.1+ worker (its header is a length, then a JSON object)."""
        return _opens_json(self.head)

    def is_open(self) -> bool:
        """Whether the peer has not closed the connection (nothing is read)."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def recv(self, nbytes: int) -> bytes:
        if self._unread:
            data, self._unread = self._unread[:nbytes], self._unread[nbytes:]
            return data
        return self.sock.recv(nbytes)

    def __getattr__(self, name: str) -> Any:  # sendall, settimeout, close, ...
        return getattr(self.sock, name)


#: in ``--allow-hosts``: any address of this machine
THIS_MACHINE = "local"


class _Peers:
    """The addresses the job's workers connect from (``--allow-hosts``): IP addresses, and
    ``local``, any address of this machine (one that a socket can bind)."""

    def __init__(self, addresses: set, local: bool) -> None:
        self.addresses, self.local = addresses, local
        self._mine: dict = {}  # address -> whether it is this machine's (bounded below)

    @classmethod
    def parse(cls, text: str | None) -> _Peers | None:
        if text is None:
            return None
        names = {x.strip() for x in text.split(",") if x.strip()}
        try:
            return cls({ipaddress.ip_address(x) for x in names - {THIS_MACHINE}}, THIS_MACHINE in names)
        except ValueError as e:
            raise SystemExit(f"bad --allow-hosts {text!r}: {e}") from None

    def __contains__(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)
        address = mapped or address
        if address in self.addresses:
            return True
        return self.local and (address.is_loopback or self._is_mine(address))

    def _is_mine(self, address: Any) -> bool:
        if address not in self._mine:
            family = socket.AF_INET if address.version == 4 else socket.AF_INET6
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.bind((str(address), 0))
                mine = True
            except OSError:
                mine = False
            if len(self._mine) >= 4096:
                self._mine.clear()
            self._mine[address] = mine
        return self._mine[address]

    def __str__(self) -> str:
        return ", ".join(sorted(map(str, self.addresses)) + (["this machine"] if self.local else []))


class _DoorRules:
    """What the front door lets in: ``header_timeout`` seconds for a header; with ``peers``, only
    connections from those addresses; with ``task_ids`` (N), only task ids ``0..N-1``."""

    def __init__(self, header_timeout: float, peers: _Peers | None = None, task_ids: int | None = None,
                 n_workers: int | None = None) -> None:
        self.header_timeout, self.peers, self.task_ids, self.n_workers = header_timeout, peers, task_ids, n_workers

    def check_task_id(self, task_id: bytes) -> None:
        if self.task_ids is None:
            return
        text = task_id.decode("ascii", "replace")
        if not (text.isascii() and text.isdigit() and str(int(text)) == text and int(text) < self.task_ids):
            raise ValueError(f"task id {text[:32]!r} is not one of this job's (0 to {self.task_ids - 1})")


class _FrontDoor:
    """The tracker's listening socket as dmlc's serial accept loop sees it: each connection is
    greeted on a thread of its own (the magic number read and echoed, then the rest of its header
    read within the rules' ``header_timeout`` seconds in all), so that a silent or slow peer holds
    up nobody; :meth:`accept` returns the connections whose whole header has come, as
    :class:`_Greeted`. What is not a rabit worker of this job (another address than the rules'
    peers, a task id not the job's) is ``dropped`` (with why) and closed."""

    def __init__(self, listener: socket.socket, out, rules: _DoorRules) -> None:
        self.listener, self.out, self.rules = listener, out, rules
        self.claims: dict[str, _Greeted] = {}  # task id -> the connection that asked for a rank as it first
        self.claims_lock = threading.Lock()
        self.ready: queue.Queue = queue.Queue()
        self.greeting = threading.BoundedSemaphore(MAX_GREETING)
        threading.Thread(target=self._accept, name="rabit-front-door", daemon=True).start()

    def accept(self) -> tuple[_Greeted, Any]:
        return self.ready.get()

    def close(self) -> None:
        self.listener.close()

    def __getattr__(self, name: str) -> Any:  # getsockname, ...
        return getattr(self.listener, name)

    def _drop(self, addr: Any, why: str) -> None:
        _emit(self.out, event="dropped", error=f"a connection from {addr[0]}: {why}")

    def _accept(self) -> None:
        peers = self.rules.peers
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                if self.listener.fileno() < 0:  # (closed: the tracker is done)
                    return
                time.sleep(0.1)  # (out of descriptors, say: a moment later there may be some)
                continue
            if peers is not None and addr[0] not in peers:
                self._drop(addr, f"not one of the job's hosts ({peers}); nothing read")
                sock.close()
                continue
            if not self.greeting.acquire(blocking=False):
                self._drop(addr, f"{MAX_GREETING} other connections are still sending their headers")
                sock.close()
                continue
            try:
                threading.Thread(target=self._greet, args=(sock, addr), daemon=True).start()
            except RuntimeError as e:  # (can't start new thread)
                self.greeting.release()
                self._drop(addr, str(e))
                sock.close()

    def _greet(self, sock: socket.socket, addr: Any) -> None:
        greeted = None
        try:
            greeted = self._read_header(sock, addr)
            self._claim(greeted, addr)
        except Exception as e:  # (not a rabit worker: dmlc's tracker would stop or hang on it)
            claimed = {"claimed": greeted.task_id} if greeted is not None and isinstance(e, _Claimed) else {}
            _emit(self.out, event="dropped", error=f"a connection from {addr[0]}: {_first_line(e)}", **claimed)
            sock.close()
            return
        finally:
            self.greeting.release()
        self.ready.put((greeted, addr))

    def _claim(self, greeted: _Greeted, addr: Any) -> None:
        """A ``start`` claims its task id here, where it is read: while the first claim's
        connection is open or its entry has a rank, a second is refused, even while the
        tracker's loop waits on the first (a claim that never answers)."""
        if greeted.command != "start" or greeted.task_id in ("", "NULL"):
            return
        world = self.rules.n_workers
        if world is not None and greeted.world_size not in (-1, world):  # (before it claims anything)
            raise _Claimed(_other_world(greeted.task_id, greeted.world_size, world))
        with self.claims_lock:
            first = self.claims.get(greeted.task_id)
            if first is not None and first.assigned:
                raise _Claimed(f"task id {greeted.task_id} has its rank already (a connection from {first.peer} "
                               f"claimed it first): {_SECOND_CLAIM}")
            if first is not None and first.is_open():
                raise _Claimed(f"task id {greeted.task_id} was claimed first by a connection from {first.peer}, "
                               f"which waits for its rank: {_SECOND_CLAIM}")
            greeted.peer = addr[0]
            self.claims[greeted.task_id] = greeted

    def _read_header(self, sock: socket.socket, addr: Any) -> _Greeted:
        # (dmlc sends each int by itself: without TCP_NODELAY, Nagle's algorithm holds most of them
        # until the worker's delayed ACK, 40 ms each on Linux)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + self.rules.header_timeout
        head = _recv_exactly(sock, 4, deadline)
        if head != RABIT_MAGIC:
            raise ValueError(f"invalid magic number={struct.unpack('@i', head)[0]} from {addr[0]}")
        sock.sendall(RABIT_MAGIC)
        head += _recv_exactly(sock, 8, deadline)  # rank and world size
        if _opens_json(head):  # (the entry names it)
            return _Greeted(sock, head)
        words = []
        for what in ("task id", "command"):  # each a length, then that many bytes
            raw = _recv_exactly(sock, 4, deadline)
            (length,) = struct.unpack("@i", raw)
            if not 0 <= length <= MAX_TASK_ID:
                raise ValueError(f"a string of {length} bytes in its header")
            text = _recv_exactly(sock, length, deadline)
            if what == "task id":
                self.rules.check_task_id(text)
            head += raw + text
            words.append(text.decode("utf-8", "replace"))  # (as dmlc's recvstr decodes, but never raising)
        sock.settimeout(None)
        return _Greeted(sock, head, *words)


def _recv_exactly(sock: Any, nbytes: int, deadline: float | None = None) -> bytes:
    """``nbytes`` bytes from ``sock`` (a socket or a :class:`_Greeted`), by ``deadline`` (a
    ``time.monotonic()``) if given, else within the socket's own timeout."""
    data = b""
    while len(data) < nbytes:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(min(nbytes - len(data), 1 << 16))
        if not chunk:
            raise EOFError("the connection closed")
        data += chunk
    return data


if __name__ == "__main__":
    sys.exit(main())
