"""The backend interface: how servers and workers get started somewhere.

A backend is one module under ``launcher/backends/`` with one :class:`Backend`
subclass. The supervisor drives it in this order::

    with backend:                       # __enter__/close(): sessions, connections
        node_hosts = backend.prepare()  # connect, sync, resolve each node's address
        ...                             # the supervisor starts the scheduler locally
        handles = backend.start(plan.procs)
        ...                             # poll / terminate / kill the handles

Everything a backend needs comes from the frozen :class:`~launcher.spec.JobSpec`
and the :class:`~launcher.plan.Plan`; builders of commands and job templates are
pure functions in the backend's module, so golden tests can check them.
"""

from __future__ import annotations

from typing import ClassVar, Mapping, Optional, Sequence

from ..output import Console
from ..plan import Plan, ProcSpec
from ..process import ProcessHandle, Watchdog
from ..spec import Host, JobSpec


class Backend:
    """Base class of every backend.

    Class attributes:
        name: the ``--launcher`` value.
        remote: processes run on other machines (labels get ``@ host``, and the
            launcher's environment is not inherited wholesale).
        needs_scheduler_address: the nodes are unknown before the job runs
            (sge, yarn), so ``DMLC_INTERFACE`` or ``--host-ip`` must say which
            of the launching host's addresses they can reach.
    """

    name: ClassVar[str] = ""
    remote: ClassVar[bool] = False
    needs_scheduler_address: ClassVar[bool] = False

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        self.spec = spec
        self.console = console
        self.watchdog = watchdog

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        """Extra lines for ``--dry-run`` (commands, job templates); pure, no dependencies needed."""
        return []

    def check(self) -> None:
        """Fail fast (``BackendUnavailableError``) when a dependency is missing; no side effects."""

    def prepare(self) -> Mapping[Optional[Host], Optional[str]]:
        """Get ready to start: connect, sync, and work out each host's ``DMLC_NODE_HOST``.

        Returns the address per host (key ``None`` for this machine). A ``None``
        value means the backend's wrapper resolves it on the node itself.
        """
        return {None: None}

    def start(self, procs: Sequence[ProcSpec]) -> list[ProcessHandle]:
        """Start the servers and workers (servers first) and return one handle each.

        On an exception the supervisor terminates the handles it already
        holds; a backend must clean up whatever else it half-started itself.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release sessions and connections. Idempotent."""
