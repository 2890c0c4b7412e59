"""Processes that a node agent runs: the launcher's one reader of what agents say.

Every backend but the local one runs its servers and workers under a node agent
(``launcher.node.agent``), which reports each process in frames (``launcher.node.protocol``):
over an ssh channel (``launcher.backends.ssh``), over a connection to the job's hub
(:mod:`.hub`), or in-band on mpirun's or srun's output. Whatever carried them, the frames of a
process go to its :class:`RemoteProcess` (:meth:`RemoteProcess.frame`), which turns them into what
the supervisor sees: output, pid, start, failure, exit code and usage. A backend's handle subclasses it
and overrides the hooks it needs (:meth:`~RemoteProcess.on_start`, :meth:`~RemoteProcess.on_exit`,
:meth:`~RemoteProcess.on_failed`, :meth:`~RemoteProcess.on_here`, the channel's ends).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..node import protocol
from ..node.protocol import parse_exit, parse_json
from ..spec.plan import ProcSpec
from .handle import ProcessHandle, ProgramError
from .output import ProcOutput


class RemoteProcess(ProcessHandle):
    """A server or worker run by a node agent; ``ident`` is its process id in the frames."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, host: str, ident: int) -> None:
        super().__init__(proc, output, host)
        self.ident = ident
        #: the ``p`` frame: pid, host, boot id, pid namespace, and what the backend added
        self.info: dict[str, Any] = {}
        #: the exit code the agent reported (``x``, or ``f``'s code)
        self.reported: int | None = None
        self.failure_code = 1
        self.started = threading.Event()  # set by ``p`` or ``f``
        self.first_output: float | None = None  # (monotonic: scripts/bench_launch_ssh.py)
        #: its agent's connection to the hub: ``none``, ``open`` or ``closed``
        self.channel = "none"
        #: the last ``u``: (CPU percent, RSS bytes)
        self.last_usage: tuple[float, int] | None = None

    def frame(self, kind: bytes, payload: bytes) -> None:
        """One frame from the agent about this process (see ``launcher.node.protocol``)."""
        if kind == protocol.STDOUT or kind == protocol.STDERR:
            if self.first_output is None:
                self.first_output = time.monotonic()
            (self.output.stdout if kind == protocol.STDOUT else self.output.stderr).feed(payload)
        elif kind == protocol.STARTED:
            self.on_start(parse_json(payload))
        elif kind == protocol.EXIT:
            code, when = parse_exit(payload)
            if self.node_ended_at is None:
                self.node_ended_at = when  # (before the code: see ProcessHandle.poll)
            self.on_exit(code)
        elif kind == protocol.RECORD:
            if self.error is None:  # (in-band, it comes twice)
                self.error = ProgramError.from_doc(parse_json(payload))
        elif kind == protocol.FAILED:
            info = parse_json(payload)
            try:
                code = int(info.get("code") or 1)
            except (TypeError, ValueError):
                code = 1
            self.on_failed(str(info.get("error") or "could not start"), code, info)
        elif kind == protocol.HERE:
            self.on_here(parse_json(payload))
        elif kind == protocol.USAGE:
            value = protocol.parse_usage(payload)
            if value is not None:
                self.last_usage = value

    def usage(self) -> tuple[float, int] | None:
        """The last ``u`` its agent sent (sent only when the spec asks), until it ended."""
        return None if self.reported is not None or self.exit_code is not None else self.last_usage

    # -- the hooks -------------------------------------------------------------------------------

    def on_start(self, info: dict[str, Any]) -> None:
        """It runs (``p``)."""
        self.info = info
        pid = info.get("pid")
        if isinstance(pid, int):
            self.pid = pid
        self.started.set()

    def on_exit(self, code: int) -> None:
        """It exited with ``code`` (``x``; 128+N for signal N); the first report counts."""
        if self.reported is None:
            self.reported = code
            self.ended_at = self.now()

    def on_failed(self, error: str, code: int, info: dict[str, Any]) -> None:
        """It could not start (``f``): ``error`` is one line, ``code`` the shell's."""
        if self.reported is None:
            self.failure = error
            self.failure_code = code
            self.on_exit(code)
        self.started.set()

    def on_here(self, info: dict[str, Any]) -> None:
        """It awaits its placement (``h``): see ``launcher.backends.batch``."""

    def channel_opened(self) -> None:
        """Its agent's connection to the hub was accepted (before the agent hears so)."""
        self.channel = "open"

    def channel_closed(self) -> None:
        """Its agent's connection to the hub ended."""
        self.channel = "closed"

    def now(self) -> float:
        """When a frame arrived (the hook of tests that need a clock)."""
        return time.time()

    def _poll(self) -> int | None:
        return self.reported
