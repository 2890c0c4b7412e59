"""The mpi backend: one ``mpirun`` starts every server and worker through a rank wrapper.

The scheduler runs on the launching host, as on every backend. The S + N servers and workers
are the ranks of a single ``mpirun`` (Open MPI or MPICH/Hydra, told apart by ``mpirun
--version``). Each rank runs the rank wrapper (``launcher.node.mpirank``), which finds its MPI
rank in the table built here (:func:`.command.rank_table`), takes that rank's role, task id and
environment, and runs the user command; the command need not be an MPI program.

* :mod:`.command`: finding mpirun, placement, the rank table, the command line (pure);
* :mod:`.job`: the running mpirun, one handle per rank (:class:`~.job.MPIJob`);
* the rank wrappers report to the job's hub (``launcher.runtime.hub``), on the scheduler's
  address and a free port of ``--port-range``.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import pscontract as pc
from pscontract import netif

from ...errors import BackendUnavailableError, ConfigError, LaunchError
from ...node import mpi_wire
from ...node.watchdog import Client as Watchdog
from ...runtime.handle import ProcGroup
from ...runtime.hub import Hub, stop_all
from ...runtime.output import Console, PipePump
from ...runtime.ports import bind_beside
from ...runtime.spawn import spawn, spawn_guard
from ...spec.job import JobSpec
from ...spec.plan import Plan, ProcSpec
from ..base import Backend, BackendOption
from .command import (
    HOSTFILE_PLACEHOLDER,
    MPIRUN_FORWARDS,
    MPIImpl,
    MPIInfo,
    RankLayout,
    check_hosts,
    mpi_interface,
    mpirun_command,
    openmpi_session_dirs,
    probe_mpirun,
    rank_layout,
)
from .job import MPIGroup, MPIJob, MPIRank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MPIOptions:
    """``--mpirun`` and ``--mpirun-args``."""

    mpirun: str = "mpirun"
    extra_args: tuple[str, ...] = ()


class MPIBackend(Backend):
    """``--launcher mpi``: servers and workers as the ranks of one mpirun."""

    name = "mpi"
    remote = True  # ranks get the job's variables, not the launcher's whole environment
    uses_hostfile = True
    Options = MPIOptions
    options = (
        BackendOption(("--mpirun",), "mpirun", "the mpirun to use (Open MPI or MPICH).", default="mpirun",
                      metavar="PATH", show_default=True),
        BackendOption(("--mpirun-args",), "extra_args", "extra mpirun options, one shell-quoted string "
                      "(e.g. \"--mca plm_rsh_args '-p 2222'\").", metavar="ARGS"),
    )

    @classmethod
    def make_options(cls, values: Mapping[str, object]) -> MPIOptions:
        text = values.get("mpirun_args")
        try:
            extra = tuple(shlex.split(str(text or "")))
        except ValueError as e:
            raise ConfigError(f"--mpirun-args {text!r}: {e}") from None
        return MPIOptions(mpirun=str(values.get("mpirun") or "mpirun"), extra_args=extra)

    @classmethod
    def check_spec(cls, spec: JobSpec) -> None:
        # --sync-dst-dir is not refused but ignored, with a warning (as dmlc's mpi launcher did);
        # hostfile lines mpirun cannot express are refused by check()
        super().check_spec(replace(spec, sync_dst_dir=None))

    @classmethod
    def all_here(cls, spec: JobSpec) -> bool:
        return not spec.hosts

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        super().__init__(spec, console, watchdog)
        self.opts: MPIOptions = spec.options or MPIOptions()
        self.info: Optional[MPIInfo] = None
        self.job: Optional[MPIJob] = None
        self.pump: Optional[PipePump] = None
        self.hub: Optional[Hub] = None
        self.tmpdir: Optional[str] = None

    def check(self) -> None:
        check_hosts(self.spec.hosts)
        if self.spec.sync_dst_dir:
            log.warning("--sync-dst-dir is ignored by --launcher mpi (as by dmlc's): mpirun runs the command "
                        "at the same path on every host; copy it there first, or use --launcher ssh")
        self.info = probe_mpirun(self.opts.mpirun)
        log.debug("mpirun: %s (%s) at %s", self.info.impl.label, self.info.version, self.info.path)
        # a DMLC_INTERFACE that mpirun cannot be told about fails before anything starts
        mpi_interface(self.info.impl, self.spec.interface, netif.interfaces())

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
        if self.info is None:
            self.check()
        assert self.info is not None
        spec = self.spec
        layout = rank_layout(procs)
        job = MPIJob([], self.console.proc("mpirun", "mpirun", "mpirun"), self.watchdog)
        job.forwards = MPIRUN_FORWARDS[self.info.impl]
        if self.pump is None:
            self.pump = PipePump()
        self.hub = job.hub = self._listen(job, procs, layout)
        argv, env, hostfile_text = mpirun_command(spec, self.info, procs, layout,
                                                  hub=self.hub.address if self.hub else None)
        if hostfile_text is not None:
            self.tmpdir = tempfile.mkdtemp(prefix="pslaunch-mpi-")
            if self.watchdog is not None:
                self.watchdog.on_abandon(["rm", "-rf", "--", self.tmpdir])
            path = os.path.join(self.tmpdir, "hostfile")
            with open(path, "w", encoding="utf-8") as f:
                f.write(hostfile_text)
            argv = [path if a == HOSTFILE_PLACEHOLDER else a for a in argv]
        log.debug("mpirun command: %s", shlex.join(argv))
        ranks = [MPIRank(procs[i], self.console.proc(procs[i].name, procs[i].label, str(procs[i].role)), job, r)
                 for r, i in enumerate(layout.order)]
        job.attach(ranks)
        self.job = job
        with spawn_guard():  # (the session directories are known to the watchdog before a Ctrl-C)
            child = spawn(argv, env, spec.workdir, watchdog=self.watchdog)
            job.popen = child.popen
            if self.info.impl is MPIImpl.OPENMPI:
                job.session_dirs = openmpi_session_dirs(child.pid, env, os.getuid())
                if self.watchdog is not None:  # (killed, mpirun leaves it behind)
                    for pattern in job.session_dirs:
                        self.watchdog.remove_after_kill(pattern)
        assert child.stderr is not None
        self.pump.add(child.stdout, lambda data: job.feed(False, data), lambda: job.close(False))
        self.pump.add(child.stderr, lambda data: job.feed(True, data), lambda: job.close(True))
        log.info("mpirun (%s, pid %d) starts %d ranks%s", self.info.impl.label, job.popen.pid, len(ranks),
                 f" on {len(layout.hosts)} host{'s' if len(layout.hosts) != 1 else ''}" if layout.hosts else "")
        by_proc = {i: ranks[r] for r, i in enumerate(layout.order)}
        return MPIGroup([by_proc[i] for i in range(len(procs))], job)

    def _listen(self, job: MPIJob, procs: Sequence[ProcSpec], layout: RankLayout) -> Optional[Hub]:
        """The hub the rank wrappers connect to: on the scheduler's address (which every host
        reaches; loopback when all ranks run here), in ``--port-range`` if a port is free there."""
        env = procs[0].env
        secret = env.get(pc.SECRET, "")
        service = pc.service_endpoint(env)  # the scheduler's or the tracker's
        root = service[0] if service else ""
        if not secret or (layout.hosts and not root):
            return None
        lo, hi = self.spec.port_range
        try:
            address = netif.resolve_ipv4(root) if layout.hosts else "127.0.0.1"
            assert self.pump is not None
            hub = Hub(self.pump, secret, bind_beside(address, lo, hi, (service[1] if service else 0) or lo),
                      range(len(procs)), job.by_rank)
        except (OSError, netif.NetifError) as e:
            log.warning("cannot listen for the ranks' output on %s (%s); it goes through mpirun's output, "
                        "where long lines of different ranks may mix", root or "127.0.0.1", e)
            return None
        log.debug("the rank wrappers connect to %s:%d", *hub.address)
        return hub

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        """The mpirun command line(s), Open MPI's hostfile and the rank table; no job is started."""
        # With hosts, each wrapper works DMLC_NODE_HOST out on its node (the plan shows a guess).
        procs = [replace(p, env={k: v for k, v in p.env.items() if k != pc.NODE_HOST})
                 if p.host is not None else p for p in plan.procs]
        if not procs:
            return []
        lines: list[str] = []
        try:
            infos = [probe_mpirun((spec.options or MPIOptions()).mpirun)]
            lines.append(f"mpi: {infos[0].impl.label} ({infos[0].version}) at {infos[0].path}")
        except BackendUnavailableError as e:
            lines.append(f"mpi: {e}; showing the command for both Open MPI and MPICH")
            mpirun = (spec.options or MPIOptions()).mpirun
            infos = [MPIInfo(mpirun, MPIImpl.OPENMPI, ""), MPIInfo(mpirun, MPIImpl.MPICH, "")]
        layout = rank_layout(procs)
        for info in infos:
            try:
                argv, _env, hostfile_text = mpirun_command(spec, info, procs, layout, resolve=False)
            except (ConfigError, LaunchError) as e:
                lines.append(f"{info.impl.label}: {e}")
                continue
            lines.append(f"mpirun command ({info.impl.label}): the variables all ranks share go by name (values "
                         f"from the environment above), the role's and rank's in {mpi_wire.TABLE}:")
            lines.append("  " + shlex.join(argv))
            if hostfile_text is not None:
                lines.append(f"{HOSTFILE_PLACEHOLDER} (one line per MPI rank, --map-by seq):")
                lines.extend(f"  {h}" for h in hostfile_text.splitlines())
        lines.append("MPI ranks:")
        for r, i in enumerate(layout.order):
            p = procs[i]
            lines.append(f"  rank {r}: {p.label} (task id {p.task_id})")
        lo, hi = spec.port_range
        where = (pc.service_endpoint(procs[0].env) or ("?", 0))[0] if layout.hosts else "127.0.0.1"
        lines.append(f"rank wrappers: each connects back to {where}, on a free port of {lo}-{hi} after the "
                     "scheduler's (authenticated with the job secret), for its records and the launcher's commands")
        return lines

    def close(self) -> None:
        if self.job is not None:
            self.job.stop(timeout=5.0)
        stop_all(self.hub, self.pump)
        self.hub = self.pump = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


