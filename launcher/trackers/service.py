"""The three trackers a collective job can have: rabit (in the launcher), xgboost and torch
(each a child process run with the tracker Python). See :mod:`launcher.trackers`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import LaunchError
from ..node.procgroup import signal_group
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import spawn_guard
from ..runtime.output import PipePump, ProcOutput
from ..spec import env as jobenv
from ..spec.job import JobSpec
from ..spec.plan import Plan
from .interface import Tracker, python_for, resolve_python
from .rabit import RabitTracker, TrackerError

log = logging.getLogger("launcher.trackers")

# After closing a child's stdin, how long it may take to exit before SIGTERM: it exits at once when
# it reads the end of file, but not while it still imports torch or xgboost (the job may have ended
# first), and SIGTERM is harmless to it then.
STOP_WAIT = 0.2
KILL_WAIT = 2.0  # after SIGTERM, before SIGKILL


# --- rabit: in the launcher --------------------------------------------------------------------


class RabitService(Tracker):
    """dmlc's rabit tracker (:class:`~.rabit.RabitTracker`) in a thread of the launcher."""

    kind = "rabit"
    label = "rabit tracker"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker: Optional[RabitTracker] = None
        self._closed = False

    def start(self, address: str) -> int:
        try:
            self.tracker = RabitTracker(self.spec.num_workers, address, self.spec.port_range,
                                        on_print=self._print, on_log=self._note)
        except TrackerError as e:
            raise LaunchError(f"the rabit tracker cannot start: {e}") from None
        self.address, self.port = address, self.tracker.port
        self.tracker.start()
        return self.port

    def _print(self, rank: int, text: str) -> None:
        # rabit's print messages (XGBoost's evaluation log from rank 0), as dmlc's tracker shows them
        self.output.stdout.feed(text.encode("utf-8", "replace") + b"\n")

    def _note(self, text: str) -> None:
        if text.startswith(("listening on", "all ")) or "asked for ranks" in text:
            log.debug("rabit tracker: %s", text)
        else:
            log.info("rabit tracker: %s", text)

    def failure(self) -> Optional[str]:
        if self.tracker is None:
            return None
        st = self.tracker.status()
        return st.error if st.state == "failed" else None

    def close(self) -> None:
        if self.tracker is None or self._closed:
            return
        self._closed = True
        st = self.tracker.close()
        if st.started_s is not None:
            log.info("rabit tracker: all %d workers joined %.2f s after it started", st.n_workers, st.started_s)
        if st.asked == 0 and self.spec.num_workers > 1:
            log.warning("rabit tracker: no worker asked it for a rank; if they are rabit programs (XGBoost up to "
                        "2.0) each trained alone: start rabit in the program (xgboost.collective.init() or "
                        "CommunicatorContext()); for XGBoost 2.1+ use --tracker xgboost, for torch --tracker torch")
        else:
            log.debug("rabit tracker: %s", st.summary())
        self.output.close()

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lo, hi = spec.port_range
        return [f"tracker: rabit (dmlc's protocol, XGBoost up to 2.0), inside the launcher on {plan.root_uri}, port: "
                f"the first free one of {lo}-{hi} (shown as {plan.root_port}); the workers' rabit print messages "
                "appear as [rabit tracker]"]


# --- a tracker in a child process ----------------------------------------------------------------


class _Child:
    """A tracker program run with the tracker Python: its own session and process group, known to
    the watchdog; stdin a pipe that it treats as a leash; stdout JSON event lines; stderr labelled."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Optional[str], output: ProcOutput,
                 watchdog: Optional[Watchdog], pass_fds: Sequence[int] = ()) -> None:
        self.output = output
        self.watchdog = watchdog
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._buf = b""
        self._eof = False
        self.stopping = False
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with spawn_guard():
                self.popen = subprocess.Popen(list(argv), env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=out_w,
                                              stderr=err_w, start_new_session=True, close_fds=True,
                                              pass_fds=tuple(pass_fds))
                if watchdog is not None:
                    watchdog.watch(self.popen.pid)
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            raise LaunchError(f"cannot run {argv[0]}: {e.strerror or e}") from None
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pid = self.popen.pid
        self.pump = PipePump()
        self.pump.add(err_r, output.stderr.feed, output.stderr.close)
        self.pump.add(out_r, self._feed, self._close)

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
        try:
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        except OSError:
            pass
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
            raise LaunchError(f"--tracker {self.kind} runs its {self.label} on this machine with "
                              f"{python_for(self.spec)}, which is not here: give --tracker-python PYTHON "
                              f"(one with {self.needs})")
        return python

    def _env(self) -> dict[str, str]:
        env = self.spec.environ_dict()
        env.update(dict(self.spec.env))  # (--env: what the job's processes get, a test's mark among them)
        return jobenv.launcher_defaults(env)

    def _spawn(self, args: Sequence[str], pass_fds: Sequence[int] = ()) -> _Child:
        argv = [*node.tracker_command(self.program, self._python()), *args]
        self.child = _Child(argv, self._env(), self.spec.workdir, self.output, self.watchdog, pass_fds)
        self.pid = self.child.pid
        return self.child

    def _failed(self, child: _Child) -> Optional[str]:
        event = child.event("failed")
        if event is not None:
            return str(event.get("error") or "failed")
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


# --- xgboost: XGBoost 2.1+'s own tracker -------------------------------------------------------------


class XGBoostService(_ChildService):
    """``xgboost.tracker.RabitTracker`` from the tracker Python's xgboost (:mod:`.xgboost_child`)."""

    kind = "xgboost"
    label = "xgboost tracker"
    program = "xgboost_child"
    needs = "xgboost 2.1 or later"

    def start(self, address: str) -> int:
        lo, hi = self.spec.port_range
        child = self._spawn(["--n-workers", str(self.spec.num_workers), "--host-ip", address,
                             "--port-range", f"{lo}-{hi}"])
        timeout = max(self.spec.start_timeout, 1.0)
        event = child.wait_event(("listening", "failed"), timeout)
        if event is None or event.get("event") == "failed":
            why = self._failed(child) or (f"did not listen within --start-timeout {timeout:g}s" if event is None
                                          else "failed")
            raise LaunchError(f"the xgboost tracker cannot start: {why}")
        try:
            self.port = int(event["env"][pc.TRACKER_PORT])
        except (KeyError, TypeError, ValueError):
            raise LaunchError(f"the xgboost tracker said it listens but gave no port: {event}") from None
        self.address = address
        log.info("xgboost tracker: XGBoost %s's tracker (pid %d) listens on %s:%d", event.get("xgboost", "?"),
                 child.pid, address, self.port)
        return self.port

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lo, hi = spec.port_range
        argv = [*node.tracker_command(cls.program, python_for(spec)), "--n-workers", str(spec.num_workers),
                "--host-ip", plan.root_uri, "--port-range", f"{lo}-{hi}"]
        return [f"tracker: xgboost (XGBoost 2.1+'s own), a child process on this machine: {' '.join(argv)}; it takes "
                f"the first free port of {lo}-{hi} (shown as {plan.root_port}); ranks follow its order (by host, then "
                "task id as a string), not DMLC_TASK_ID, from 10 workers on"]


# --- torch: a TCPStore for torch.distributed's env:// -------------------------------------------------


def listen_first(address: str, lo: int, hi: int) -> socket.socket:
    """A socket listening on ``address`` and the first free port of ``lo..hi``.

    Raises:
        LaunchError: no free port in the range, or not an address of this host.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for port in range(lo, hi + 1):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise LaunchError(f"cannot listen on {address}:{port} for the torch store: {e.strerror or e}; "
                                  "give an address of this host (DMLC_INTERFACE or --host-ip)") from None
    raise LaunchError(f"no free port in --port-range {lo}-{hi} for the torch store; free one or give another range")


class TorchService(_ChildService):
    """The job's rendezvous store, hosted by :mod:`.torch_store` on a socket bound here first."""

    kind = "torch"
    label = "torch store"
    program = "torch_store"
    needs = "torch"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._noted = False

    def start(self, address: str) -> int:
        lo, hi = self.spec.port_range
        sock = listen_first(address, lo, hi)
        try:
            port = sock.getsockname()[1]
            self._spawn(["--listen-fd", str(sock.fileno()), "--host", address, "--port", str(port)],
                        pass_fds=(sock.fileno(),))
        finally:
            sock.close()  # the child holds it now; until its store accepts, connections wait in the backlog
        self.address, self.port = address, port
        log.debug("torch store: pid %d starts on %s:%d (the workers start meanwhile)", self.pid, address, port)
        return port

    def failure(self) -> Optional[str]:
        child = self.child
        if child is not None and not self._noted:
            event = child.event("listening")
            if event is not None:
                self._noted = True
                log.info("torch store: serving on %s:%d (torch %s, pid %d, ready %.2f s after it started)",
                         self.address, self.port, event.get("torch", "?"), child.pid, float(event.get("seconds") or 0))
        return super().failure()

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lo, hi = spec.port_range
        python = python_for(spec)
        return [f"tracker: torch, a torch.distributed TCPStore on {plan.root_uri}, port: the first free one of "
                f"{lo}-{hi} (shown as {plan.root_port}), bound by the launcher and served by "
                f"{' '.join(node.tracker_command(cls.program, python))} (torch from {python}); every rank connects "
                "to it (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun's workers connect to their agent's store"] + (
            ["RANK, ROLE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE: sent to each task once every "
             "task has said which host it runs on (the batch system places them), numbered host by host"]
            if any(p.awaits_placement for p in plan.procs) else [])
