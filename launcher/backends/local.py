"""The local backend: every process on this machine, as dmlc's ``--launcher local``.

Each process is a :class:`~launcher.runtime.local.LocalProcess`: argv passed as a list (no
shell), stdin from ``/dev/null``, its own session and process group, the launcher's whole
environment beneath the job's variables. ``DMLC_NODE_HOST`` is the scheduler's address, so
every node binds the same interface.
"""

from __future__ import annotations

from typing import Sequence

from ..runtime.handle import ProcessHandle, ProcGroup
from ..runtime.local import LocalProcess
from ..runtime.output import PipePump
from ..spec.plan import ProcSpec
from .base import Backend


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pump: PipePump | None = None

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
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
        return ProcGroup(handles)

    def close(self) -> None:
        if self.pump is not None:
            self.pump.stop()
            self.pump = None
