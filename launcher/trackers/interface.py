"""The tracker interface (:class:`Tracker`), the supervisor's view of one (:class:`TrackerHandle`),
and which Python runs a tracker program. See :mod:`launcher.trackers`.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import ClassVar, Optional

import pscontract as pc

from ..node.procgroup import resolve_program
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import ProcessHandle
from ..runtime.output import Console, ProcOutput
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan, ProcSpec

#: A tracker that failed counts as the job's failure only if no process failed within this long:
#: a worker that dies makes the tracker notice it first, and the worker's own code is the better
#: report.
FAILURE_GRACE = 1.0

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?\Z")


class Tracker:
    """One job's tracker (see the module docstring). Subclasses: :mod:`.service`.

    Attributes:
        kind: the ``--tracker`` value.
        label: how output and messages name it (``rabit tracker``).
        address, port: where it serves, once started.
        pid: its process, when it runs in one.
        peers: the addresses its workers connect from (``local``: any of this machine's), set
            before :meth:`start` where the launcher knows them; None: unknown (a batch system
            places the workers). A tracker that can refuses connections from others.
    """

    kind: ClassVar[str] = ""
    label: ClassVar[str] = ""
    #: whether :meth:`restart` serves the job's next attempt (``--max-restarts``) in the same
    #: tracker; otherwise each attempt has a tracker of its own (:func:`~launcher.trackers.create`)
    restarts: ClassVar[bool] = False

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        self.spec = spec
        self.console = console
        self.watchdog = watchdog
        self.output: ProcOutput = console.proc(self.name, self.label, str(Role.TRACKER))
        self.address = ""
        self.port = 0
        self.pid: Optional[int] = None
        self.peers: Optional[tuple[str, ...]] = None

    @property
    def name(self) -> str:
        """Its log file's stem and its name in the summary: ``rabit-tracker``."""
        return self.label.replace(" ", "-")

    def start(self, address: str) -> int:
        """Serve on ``address``, on the first free port of ``--port-range``; return the port.

        Raises:
            LaunchError: it cannot start (one line: what and how to fix it).
        """
        raise NotImplementedError

    def restart(self, address: str) -> int:
        """Serve the job's next attempt on ``address``, on a new port of ``--port-range``: afresh,
        nothing of the last attempt reaches it (its state and its port are gone); return the port.
        Only where :attr:`restarts`; the last attempt's workers have all ended.

        Raises:
            LaunchError: as :meth:`start`.
        """
        raise NotImplementedError

    def variables(self) -> dict[str, str]:
        """What every worker gets to find it (its address and port, under the contract's names)."""
        if self.kind == "torch":
            return {pc.MASTER_ADDR: self.address, pc.MASTER_PORT: str(self.port)}
        return {pc.TRACKER_URI: self.address, pc.TRACKER_PORT: str(self.port)}

    def failure(self) -> Optional[str]:
        """None while the tracker is well (or done); once it has failed, one line saying why."""
        return None

    def close(self) -> None:
        """The job is over (every worker has ended; with :attr:`restarts`, the job's last attempt,
        else this tracker's): stop serving, release everything, and say what the tracker saw.
        Idempotent; never blocks for more than a few seconds."""

    @classmethod
    def describe(cls, spec: JobSpec, plan: Plan) -> list[str]:
        """The dry run's lines about this tracker (pure)."""
        return []


def python_for(spec: JobSpec) -> str:
    """The tracker Python: ``--tracker-python``, else the command's interpreter when the command
    is a Python (``python``, ``python3.11``, ``.venv/bin/python``), else ``python3``."""
    if spec.tracker_python:
        return spec.tracker_python
    program = spec.command[0]
    return program if _PYTHON.match(os.path.basename(program)) else "python3"


def resolve_python(spec: JobSpec) -> Optional[str]:
    """:func:`python_for` as a path on this machine (through the launcher's ``PATH``, relative to
    the working directory), or None when there is none."""
    python = python_for(spec)
    environ = spec.environ_dict()
    found = resolve_program(python, {pc.PATH: environ.get(pc.PATH, os.defpath)}, spec.workdir)
    if "/" not in found:
        found = shutil.which(found, path=environ.get(pc.PATH, os.defpath)) or ""
    elif spec.workdir and not os.path.isabs(found):
        found = os.path.join(spec.workdir, found)
    return found if found and os.access(found, os.X_OK) and os.path.isfile(found) else None


class TrackerHandle(ProcessHandle):
    """A started tracker as the supervisor watches it: like a process that never ends on its own
    but may fail (:meth:`poll` turns non-zero, exit code 1, :attr:`failure` says why)."""

    def __init__(self, tracker: Tracker) -> None:
        proc = ProcSpec(Role.TRACKER, 0, None, None, (tracker.kind,))
        super().__init__(proc, tracker.output, "localhost")
        self.tracker = tracker
        self.pid = tracker.pid
        self._failed_at: Optional[float] = None

    @property
    def name(self) -> str:
        return self.tracker.name

    @property
    def label(self) -> str:
        return self.tracker.label

    def _poll(self) -> Optional[int]:
        why = self.tracker.failure()
        if why is None:
            return None
        now = time.monotonic()
        if self._failed_at is None:
            self._failed_at = now
        if now - self._failed_at < FAILURE_GRACE:
            return None
        self.failure = why
        return 1

    def terminate(self) -> None:
        """A tracker is stopped by :meth:`close`, after the workers (they may still need it)."""

    def kill(self) -> None:
        """See :meth:`terminate`."""

    def close(self) -> None:
        self.tracker.close()

    def describe(self) -> str:
        where = f"on {self.host}" + (f", pid {self.pid}" if self.pid else "")
        return f"the {self.label} ({where})"
