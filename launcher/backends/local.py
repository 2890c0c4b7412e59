"""The local backend: every process on this machine, as dmlc's ``--launcher local``.

Each process is a :class:`~launcher.runtime.local.LocalProcess`: argv passed as a list (no
shell), stdin from ``/dev/null``, its own session and process group, the launcher's whole
environment beneath the job's variables. ``DMLC_NODE_HOST`` is the scheduler's address, so
every node binds the same interface.

A job must fit this machine: :meth:`LocalBackend.check_spec` refuses more processes than its
process and open-file limits allow (:mod:`launcher.runtime.limits`), in one line, before anything
starts.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError
from ..node.watchdog import Client as Watchdog
from ..runtime import limits
from ..runtime.handle import ProcessHandle, ProcGroup
from ..runtime.local import LocalProcess
from ..runtime.output import Console, PipePump
from ..spec.job import JobSpec
from ..spec.plan import ProcSpec
from .base import Backend


def local_processes(spec: JobSpec) -> int:
    """The processes a local job runs here: servers, workers and the scheduler."""
    return spec.num_procs + (1 if spec.has_scheduler else 0)


class LocalBackend(Backend):
    name = "local"
    can_replace = True
    node_address_from_launcher = True

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        super().__init__(spec, console, watchdog)
        self.pump: PipePump | None = None

    @classmethod
    def check_spec(cls, spec: JobSpec) -> None:
        super().check_spec(spec)
        need = local_processes(spec)
        cap = limits.local_capacity()
        if need > cap.processes:
            raise ConfigError(f"--launcher local: {need:,} processes (scheduler, {spec.num_servers:,} servers, "
                              f"{spec.num_workers:,} workers) do not fit this machine: {cap.limit} allows "
                              f"{cap.processes:,} more; lower -n/-s, raise the limit, or spread the job over "
                              "hosts (-H)")

    def check(self) -> None:
        limits.raise_open_files(local_processes(self.spec))

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
