"""The three trackers a collective job can have: rabit, xgboost and torch, each a child process run
with the tracker Python. See :mod:`launcher.trackers`.
"""

from __future__ import annotations

import array
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import LaunchError
from ..logs import printable
from ..node.procgroup import signal_group
from ..node.watchdog import Client as Watchdog
from ..runtime import ports
from ..runtime.output import PipePump, ProcOutput
from ..runtime.spawn import spawn
from ..spec import env as jobenv
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan
from .interface import Tracker, python_for, resolve_python

log = logging.getLogger("launcher.trackers")

# After closing a child's leash (its stdin), how long it may take to exit before SIGTERM: it exits at once when
# it reads the end of file, but not while it still imports torch or xgboost (the job may have ended
# first), and SIGTERM is harmless to it then.
STOP_WAIT = 0.2
KILL_WAIT = 2.0  # after SIGTERM, before SIGKILL
#: the events of a tracker program that say where it stands (kept); the others are news (passed on)
LIFECYCLE = ("listening", "done", "failed", "stopped")
DROPS_NOTED = 5  # dropped connections that the rabit tracker's log names; the rest are counted


def _line(value: Any) -> str:
    """A tracker program's text as one line for the console: no line breaks, control characters
    shown visibly (a task id or an error may come from the network; :func:`launcher.logs.printable`)."""
    return printable(str(value).replace("\n", " "))


# --- a tracker in a child process ----------------------------------------------------------------


class _Child:
    """A tracker program run with the tracker Python: its own session and process group, known to
    the watchdog; stdin its leash, one end of a Unix socket pair (its end of file: exit at once;
    :meth:`send`: a request with a socket); stdout JSON event lines; stderr labelled."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Optional[str], output: ProcOutput,
                 watchdog: Optional[Watchdog], pass_fds: Sequence[int] = (),
                 on_event: Optional[Callable[[dict], None]] = None) -> None:
        self.output = output
        self.watchdog = watchdog
        self.on_event = on_event  # every event, on the pump's thread; only LIFECYCLE ones are kept
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._buf = b""
        self._eof = False
        self.stopping = False
        self.leash, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            child = spawn(argv, env, cwd, stdin=theirs.fileno(), pass_fds=pass_fds, watchdog=watchdog)
        except BaseException:
            self.leash.close()
            raise
        finally:
            theirs.close()  # (the child's now: when it dies, the leash ends for us too)
        self.popen, self.pid = child.popen, child.pid
        self.pump = PipePump()
        assert child.stderr is not None
        self.pump.add(child.stderr, output.stderr.feed, output.stderr.close)
        self.pump.add(child.stdout, self._feed, self._close)

    def _feed(self, data: bytes) -> None:
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                self.output.stdout.feed(line + b"\n")
                continue
            if self.on_event is not None:
                self.on_event(event)
            if event.get("event") not in LIFECYCLE:
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()

    def _close(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def event(self, *names: str) -> Optional[dict]:
        """The first event named one of ``names`` so far, or None."""
        with self._cond:
            return next((e for e in self.events if e.get("event") in names), None)

    def last(self, name: str) -> Optional[dict]:
        """The last event named ``name`` so far, or None."""
        with self._cond:
            return next((e for e in reversed(self.events) if e.get("event") == name), None)

    def send(self, request: dict, fd: int) -> bool:
        """Send ``request`` (one JSON line) and the descriptor ``fd`` (``SCM_RIGHTS``: the child gets
        its own copy) over the leash; False when the child is gone."""
        data = (json.dumps(request) + "\n").encode()
        try:
            sent = self.leash.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            if sent < len(data):  # (a line this short goes whole into an empty socket buffer; the rest, if not)
                self.leash.sendall(data[sent:])
        except OSError:
            return False
        return True

    def wait_event(self, names: Sequence[str], timeout: float) -> Optional[dict]:
        """Wait for an event named one of ``names``; None when the program ended or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((e for e in self.events if e.get("event") in names), None)
                left = deadline - time.monotonic()
                if found is not None or self._eof or left <= 0:
                    return found
                self._cond.wait(min(left, 0.1))

    def exit_code(self) -> Optional[int]:
        code = self.popen.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def stderr_tail(self) -> str:
        lines = [x for x in self.output.lines() if x.strip()]
        return lines[-1].strip() if lines else ""

    def stop(self) -> None:
        """Close the leash; SIGTERM, then SIGKILL, whatever does not exit in time. Idempotent."""
        self.stopping = True
        self.leash.close()
        for sig, wait in ((None, STOP_WAIT), (signal.SIGTERM, KILL_WAIT), (signal.SIGKILL, KILL_WAIT)):
            if sig is not None:
                signal_group(self.pid, sig)
            try:
                self.popen.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        signal_group(self.pid, signal.SIGKILL)  # whatever it started goes with it
        self.pump.stop()
        self.output.close()
        if self.watchdog is not None:
            self.watchdog.forget(self.pid)


class _ChildService(Tracker):
    """A tracker that is a program run with the tracker Python (see :class:`_Child`)."""

    program = ""
    needs = ""  # what the tracker Python must have, for messages

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.child: Optional[_Child] = None
        self._closed = False

    def _python(self) -> str:
        python = resolve_python(self.spec)
        if python is None:
            raise self._no_python()
        return python

    def _no_python(self) -> LaunchError:
        return LaunchError(f"--tracker {self.kind} runs its {self.label} on this machine with "
                           f"{python_for(self.spec)}, which is not here: give --tracker-python PYTHON "
                           f"(one with {self.needs})")

    def _env(self) -> dict[str, str]:
        env = self.spec.environ_dict()
        env.update(dict(self.spec.env))  # (--env: what the job's processes get, a test's mark among them)
        return jobenv.launcher_defaults(env)

    def _spawn(self, args: Sequence[str], pass_fds: Sequence[int] = (),
               on_event: Optional[Callable[[dict], None]] = None) -> _Child:
        argv = [*node.tracker_command(self.program, self._python()), *args]
        self.child = _Child(argv, self._env(), self.spec.workdir, self.output, self.watchdog, pass_fds, on_event)
        self.pid = self.child.pid
        return self.child

    def _failed(self, child: _Child) -> Optional[str]:
        event = child.event("failed")
        if event is not None:
            return _line(event.get("error") or "failed")
        code = child.exit_code()
        if code is not None and not child.stopping and child.event("done") is None:
            tail = child.stderr_tail()
            return f"exited with code {code}" + (f": {tail}" if tail else "")
        return None

    def failure(self) -> Optional[str]:
        return None if self.child is None else self._failed(self.child)

    def close(self) -> None:
        if self.child is None or self._closed:
            return
        self._closed = True
        self.child.stop()


# --- rabit and xgboost: XGBoost's own trackers -----------------------------------------------------


class _XGBoostTracker(_ChildService):
    """A tracker of the tracker Python's xgboost, run by :mod:`.xgboost_child`; the workers start once
    it listens (the job never starts when it cannot: no xgboost, the other protocol, no free port)."""

    program = "xgboost_child"

    @classmethod
    def _args(cls, spec: JobSpec, address: str, peers: Optional[Sequence[str]] = None) -> list[str]:
        """The program's arguments (the xgboost tracker's are the default)."""
        lo, hi = spec.port_range
        args = ["--n-workers", str(spec.num_workers), "--host-ip", address, "--port-range", f"{lo}-{hi}"]
        if cls.kind != "rabit":
            return args
        # (the launcher numbers its workers' DMLC_TASK_ID 0..N-1, and knows where they run, if not a batch system)
        return ["--tracker", "rabit", *args, "--task-ids", str(spec.num_workers),
                *(("--allow-hosts", ",".join(peers)) if peers is not None else ())]

    about = ""  # the dry run's words: which tracker
    ranks = ""  # and how the workers get their ranks

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lo, hi = spec.port_range
        argv = [*node.tracker_command(cls.program, python_for(spec)), *cls._args(spec, plan.root_uri)]
        return [f"tracker: {cls.about}, a child process on this machine: {' '.join(argv)}; it takes the first free "
                f"port of {lo}-{hi} (shown as {plan.root_port}); {cls.ranks}"]

    def start(self, address: str) -> int:
        child = self._spawn(self._args(self.spec, address, self.peers), on_event=self._event)
        timeout = max(self.spec.start_timeout, 1.0)
        event = child.wait_event(("listening", "failed"), timeout)
        if event is None or event.get("event") == "failed":
            why = self._failed(child) or (f"did not listen within --start-timeout {timeout:g}s" if event is None
                                          else "failed")
            raise LaunchError(f"the {self.label} cannot start: {why}")
        try:
            self.port = int(event["env"][pc.TRACKER_PORT])
        except (KeyError, TypeError, ValueError):
            raise LaunchError(f"the {self.label} said it listens but gave no port: {event}") from None
        self.address = address
        self._listening(event)
        return self.port

    def _listening(self, event: dict) -> None:
        """It listens (``event``: :mod:`.xgboost_child`'s ``listening``)."""

    def _event(self, event: dict) -> None:
        """An event of the program (on the pump's thread)."""


class RabitService(_XGBoostTracker):
    """dmlc's rabit tracker as XGBoost 2.0 and older ship it (``xgboost_child.py --tracker rabit``):
    launch.py's tracker for ``-s 0``. The workers' rabit ``print`` messages are its output, as
    launch.py's tracker printed them: ``[rabit tracker] [7]\ttrain-logloss:...``."""

    kind = "rabit"
    label = "rabit tracker"
    needs = "xgboost 2.0 or older"
    about = "rabit (dmlc's protocol, XGBoost up to 2.0), XGBoost's own"
    ranks = "rank = DMLC_TASK_ID; the workers' rabit print messages appear as [rabit tracker]"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0  # workers that asked for a rank
        self.joined: Optional[dict] = None  # the "joined" event: every worker has its rank and links
        self.prints = 0
        self.dropped = 0  # connections it dropped (not rabit, or broken)
        self.stand_in = False  # the program's stand-in holds the port (its Python cannot run the tracker)

    def _python(self) -> str:
        """The tracker Python; where it is not here and no ``--tracker-python`` was given, the
        launcher's own (most likely without XGBoost: the stand-in). A job of N workers that never
        talk to the tracker then runs on a machine without ``python3`` on PATH, as it did under
        launch.py's tracker, and one whose worker asks for a rank is told what to give."""
        python = resolve_python(self.spec)
        if python is not None:
            return python
        if self.spec.tracker_python:
            raise self._no_python()
        log.debug("rabit tracker: %s is not here; the launcher's Python (%s) runs it", python_for(self.spec),
                  sys.executable)
        return sys.executable

    def _listening(self, event: dict) -> None:
        if event.get("stand_in"):
            self.stand_in = True
            log.debug("rabit tracker: %s; a stand-in (pid %s) holds %s:%d and ends the job with that if a worker "
                      "asks it for a rank", _line(event["stand_in"]), self.pid, self.address, self.port)
            return
        log.debug("rabit tracker: XGBoost %s's tracker (pid %s) listens on %s:%d for %d workers, task ids 0 to %d, "
                  "from %s", event.get("xgboost", "?"), self.pid, self.address, self.port, self.spec.num_workers,
                  self.spec.num_workers - 1, "any address" if self.peers is None else ", ".join(self.peers))

    def _event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "print":
            self.prints += 1
            text = str(event.get("text", ""))  # (from the network: its output shows control characters visibly)
            self.output.stdout.feed(text.encode("utf-8", "replace") + b"\n")
        elif kind == "asked":
            self.asked += 1
        elif kind == "joined":
            self.joined = event
            ranks = event.get("ranks") or []
            table = _line(", ".join(f"rank {r} = task {t} on {h}" for r, t, h in ranks)) if len(ranks) <= 16 else ""
            log.debug("rabit tracker: all %d workers joined in %.2f s%s", len(ranks), float(event.get("seconds", 0)),
                      f": {table}" if table else "")
        elif kind == "dropped":
            self.dropped += 1
            if self.dropped <= DROPS_NOTED:
                # (a second claim of a task id is news: the job's own worker may be the one refused)
                log.log(logging.WARNING if "claimed" in event else logging.INFO, "rabit tracker: dropped %s",
                        _line(event.get("error")))
            elif self.dropped == DROPS_NOTED + 1:
                log.info("rabit tracker: more connections dropped; counting them without a note")
        elif kind == "log":
            log.debug("rabit tracker: %s", _line(event.get("text")))
        elif kind == "failed" and self.port and not self.stand_in:
            # (the failure report says it first, where a worker failed of it: report.job_type_hint)
            log.debug("rabit tracker: %s", _line(event.get("error")))

    def close(self) -> None:
        if self.child is None or self._closed:
            return
        super().close()
        if not self.port:  # it never listened: its error is the job's
            return
        n = self.spec.num_workers
        if self.joined is not None:
            log.info("rabit tracker: all %d workers joined %.2f s after it started", n, float(self.joined["seconds"]))
        if self.asked == 0 and n > 1 and self.child.event("failed") is None:
            log.warning("rabit tracker: no worker asked it for a rank; if they are rabit programs (XGBoost up to "
                        "2.0) each trained alone: start rabit in the program (xgboost.collective.init() or "
                        "CommunicatorContext()); for XGBoost 2.1+ use --tracker xgboost, for torch --tracker torch")
        else:
            log.debug("rabit tracker: %d of %d workers asked for a rank, %d joined; %d print messages, %d dropped "
                      "connections", self.asked, n, len(self.joined["ranks"]) if self.joined else 0, self.prints,
                      self.dropped)



class XGBoostService(_XGBoostTracker):
    """XGBoost 2.1+'s ``xgboost.tracker.RabitTracker`` (:mod:`.xgboost_child`)."""

    kind = "xgboost"
    label = "xgboost tracker"
    needs = "xgboost 2.1 or later"
    about = "xgboost (XGBoost 2.1+'s own)"
    ranks = "ranks follow its order (by host, then task id as a string), not DMLC_TASK_ID, from 10 workers on"

    def _listening(self, event: dict) -> None:
        log.info("xgboost tracker: XGBoost %s's tracker (pid %s) listens on %s:%d", event.get("xgboost", "?"),
                 self.pid, self.address, self.port)



# --- torch: a TCPStore for torch.distributed's env:// -------------------------------------------------


class TorchService(_ChildService):
    """The job's rendezvous store, hosted by :mod:`.torch_store` on a socket bound here first; one
    program for the whole job, a fresh store in it for each attempt (:meth:`restart`)."""

    kind = "torch"
    label = "torch store"
    program = "torch_store"
    needs = "torch"
    restarts = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._noted = -1  # the last attempt whose store was said to serve
        self.attempt = self.spec.first_attempt  # (PSLAUNCH_ATTEMPT) the attempt its store serves

    def _bind(self, address: str) -> socket.socket:
        """A listening socket on ``address`` and the first free port of ``--port-range`` above the
        last attempt's, else the first one (each attempt on a port of its own while the range
        lasts; the store that serves holds its port, so the next attempt's always differs)."""
        lo, hi = self.spec.port_range
        try:
            try:
                sock = ports.bind_in_range(address, lo, hi, after=self.port)
            except ports.NoFreePort:
                sock = ports.bind_in_range(address, lo, hi)
        except ports.NoFreePort as e:
            raise e.for_user("the torch store") from None
        except ports.BindError as e:
            raise LaunchError(f"cannot listen on {address}:{e.port} for the torch store: {e.strerror}; "
                              "give an address of this host (DMLC_INTERFACE or --host-ip)") from None
        try:
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
        return sock

    def start(self, address: str) -> int:
        sock = self._bind(address)
        try:
            port = sock.getsockname()[1]
            self._spawn(["--listen-fd", str(sock.fileno()), "--host", address, "--port", str(port),
                         "--attempt", str(self.attempt)], pass_fds=(sock.fileno(),))
        finally:
            sock.close()  # the child holds it now; until its store accepts, connections wait in the backlog
        self.address, self.port = address, port
        log.debug("torch store: pid %d starts on %s:%d (the workers start meanwhile)", self.pid, address, port)
        return port

    def restart(self, address: str) -> int:
        """The next attempt's store, in the same program: attempt k's store closes there and a new,
        empty one serves on a port bound here as for the first, sent over the leash. A program that
        ended or failed in between is replaced by a new one (:meth:`start`)."""
        self.attempt += 1
        child = self.child
        if child is None or child.exit_code() is not None or self._failed(child) is not None:
            self._replace("it " + (self._failed(child) or "ended") if child is not None else "none runs")
            return self.start(address)
        sock = self._bind(address)
        try:
            port = sock.getsockname()[1]
            sent = child.send({"attempt": self.attempt, "host": address, "port": port}, sock.fileno())
        finally:
            sock.close()  # (the child has its own copy, or is gone)
        if not sent:
            self._replace("its leash is closed")
            return self.start(address)
        self.address, self.port = address, port
        self.output.mark(self.console.log_banner)
        log.debug("torch store: pid %d serves attempt %d on %s:%d, a new store (the last attempt's is closed)",
                  self.pid, self.attempt, address, port)
        return port

    def _replace(self, why: str) -> None:
        """Stop the program (it ended, failed or cannot be told): the next :meth:`start` runs a new one."""
        log.info("torch store: starting a new one for attempt %d (pid %s: %s)", self.attempt, self.pid, _line(why))
        if self.child is not None:
            self.child.stop()
        self.child, self.pid, self.port = None, None, 0
        self.output = self.console.proc(self.name, self.label, str(Role.TRACKER))  # (the last one's is closed)

    def failure(self) -> Optional[str]:
        child = self.child
        if child is not None and self._noted != self.attempt:
            event = child.last("listening")
            if event is not None and event.get("attempt", self.attempt) == self.attempt:
                self._noted = self.attempt
                log.info("torch store: serving on %s:%d (torch %s, pid %d, ready %.2f s after %s)",
                         self.address, self.port, event.get("torch", "?"), child.pid, float(event.get("seconds") or 0),
                         "it started" if child.event("listening") is event else "the restart")
        return super().failure()

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lo, hi = spec.port_range
        python = python_for(spec)
        return [f"tracker: torch, a torch.distributed TCPStore on {plan.root_uri}, port: the first free one of "
                f"{lo}-{hi} (shown as {plan.root_port}), bound by the launcher and served by "
                f"{' '.join(node.tracker_command(cls.program, python))} (torch from {python}); every rank connects "
                "to it (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun's workers connect to their agent's store"] + (
            ["RANK, ROLE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE: "
             "sent to each task once every task has said which host it runs on (the batch system places them), "
             "numbered host by host"]
            if any(p.awaits_placement for p in plan.procs) else [])
