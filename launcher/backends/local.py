"""The local backend: every process on this machine, as dmlc's ``--launcher local``.

Each process is a :class:`~launcher.process.LocalProcess`: argv passed as a
list (no shell), stdin from ``/dev/null``, its own session and process group,
the launcher's whole environment beneath the job's variables. ``DMLC_NODE_HOST``
is the scheduler's address, so every node binds the same interface.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from ..output import PipePump
from ..plan import ProcSpec
from ..process import LocalProcess, ProcessHandle
from ..spec import Host
from .base import Backend


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pump: PipePump | None = None
        self.node_address: str | None = None

    def prepare(self) -> Mapping[Optional[Host], Optional[str]]:
        # The supervisor fills in the scheduler's address (see Supervisor._node_hosts).
        return {None: None}

    def start(self, procs: Sequence[ProcSpec]) -> list[ProcessHandle]:
        if self.pump is None:
            self.pump = PipePump()
        handles: list[ProcessHandle] = []
        try:
            for p in procs:
                out = self.console.proc(p.name, p.label, str(p.role))
                handles.append(LocalProcess(p, out, self.pump, self.watchdog, p.env, self.spec.workdir))
        except BaseException:
            for h in handles:  # nothing half-started stays behind
                h.kill()
            raise
        return handles

    def close(self) -> None:
        if self.pump is not None:
            self.pump.stop()
            self.pump = None
