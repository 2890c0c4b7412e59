"""The mpi backend's running job: one mpirun, its output demultiplexed into one handle per rank.

Each rank's wrapper (``launcher.node.mpirank``) reports its command's start, output and exit
code as frames (``launcher.node.protocol``): over its own connection to the job's hub, or, when
it cannot connect, in-band on mpirun's output. Both reach one :class:`MPIRank` per server and
worker, so the supervisor sees per-rank output, pids and exit codes, and names the first rank
that failed, as on every other backend. (mpirun's output is no channel for frames when it can be
avoided: Open MPI forwards each rank's output in chunks of its own size, and chunks of different
ranks interleave in the middle of lines.)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from ...node import protocol
from ...node.agent import machine
from ...node.procgroup import group_alive
from ...node.watchdog import Client as Watchdog
from ...node.watchdog import remove_matching
from ...runtime.handle import ProcessHandle, ProcGroup, group_members, normalize_exitcode
from ...runtime.hub import Hub
from ...runtime.output import ProcOutput
from ...runtime.remote import RemoteProcess
from ...spec.plan import ProcSpec

log = logging.getLogger(__name__)

# After mpirun exited, how long to wait for the rest of its output (the last frames).
OUTPUT_DRAIN_WAIT = 5.0
# After every rank exited 0, how long mpirun may take to exit before it is stopped.
MPIRUN_EXIT_WAIT = 30.0
# A longer run of bytes without a newline in mpirun's output cannot be a frame (those are short): cut there.
MAX_UNTERMINATED = 64 * 1024


class MPIRank(RemoteProcess):
    """One server or worker, a rank of the job's single mpirun.

    Its output, pid and exit code come from its wrapper's frames. A rank that
    reported 0 counts as finished once mpirun has exited too, so an all-zero
    job ends when mpirun does; a non-zero report counts at once (fail fast).
    """

    def __init__(self, proc: ProcSpec, output: ProcOutput, job: MPIJob, mpi_rank: int) -> None:
        super().__init__(proc, output, proc.host.name if proc.host is not None else "localhost", mpi_rank)
        self.job = job
        self.mpi_rank = mpi_rank
        self.local_pgid: Optional[int] = None
        self.note = ""
        #: when its wrapper's connection to the hub ended (the hub's clock)
        self.closed_at: Optional[float] = None

    @property
    def node(self) -> dict[str, Any]:
        """What the wrapper said of where the rank runs (its start, or its failure)."""
        return self.info

    def on_start(self, info: dict[str, Any]) -> None:
        """The wrapper's start frame: the command's pid, the node, its address."""
        super().on_start(info)
        log.debug("%s is MPI rank %d (rank from %s) on %s, pid %s, DMLC_NODE_HOST %s", self.label, self.mpi_rank,
                  info.get("source"), info.get("host"), self.pid, info.get("addr"))
        if self.pid is not None and self.job.is_this_machine(info):
            self.local_pgid = self.pid  # the wrapper started it as a group leader
            if self.job.watchdog is not None:
                self.job.watchdog.watch(self.local_pgid)

    def on_failed(self, error: str, code: int, info: dict[str, Any]) -> None:
        """The wrapper's failure frame: the command (or the wrapper) could not start."""
        if self.reported is None:
            self.info = {"host": info.get("host"), **self.info}
        super().on_failed(error, code, info)

    def now(self) -> float:
        return self.job.clock.time()  # (tests: when a frame arrived)

    def channel_closed(self) -> None:
        self.closed_at = self.now()
        if self.reported is None and self.job.mpirun_code() is None:
            # Its wrapper reports the command's end before it closes, and signals make it report:
            # the connection ended without a report while mpirun runs, so the wrapper was killed
            # (SIGKILL, the OOM killer). This rank failed first, whatever mpirun then does to the others.
            self.note = "its wrapper was killed: its connection to the launcher ended without an exit code"
            self.reported = 128 + signal.SIGKILL
            self.ended_at = self.now()
        super().channel_closed()
        for err, closed in self.job._mpirun_closed.items():
            if closed:
                (self.output.stderr if err else self.output.stdout).close()

    def _poll(self) -> Optional[int]:
        return self.job.rank_code(self)

    def _send(self, command: str) -> bool:
        return self.job.hub is not None and self.job.hub.send(self.mpi_rank, command)

    def terminate(self) -> None:
        if not self._send("TERM"):
            self.job.terminate()

    def kill(self) -> None:
        if not self._send("KILL"):
            self.job.kill()

    def dump_stacks(self) -> None:
        if not self._send("ABRT"):
            self.job.dump_stacks()

    def forward(self, signame: str) -> None:
        if not self._send(signame):
            self.job.forward(signame)

    def cleanup(self, groups: Optional[Mapping[int, list[int]]] = None) -> None:
        if self.local_pgid is None:
            return
        if group_members(self.local_pgid, groups) if groups is not None else group_alive(self.local_pgid):
            try:
                os.killpg(self.local_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.job.watchdog is not None and self.poll() is not None:
            self.job.watchdog.forget(self.local_pgid)

    def describe(self) -> str:
        where = self.node.get("host") or self.host
        text = f"{self.label} (MPI rank {self.mpi_rank} on {where}" + (f", pid {self.pid}" if self.pid else "")
        return text + (f"; {self.note})" if self.note else ")")


class MPIJob:
    """The one mpirun of a job: its process, its output demultiplexed per rank."""

    def __init__(self, ranks: Sequence[MPIRank], mpirun_out: ProcOutput, watchdog: Optional[Watchdog],
                 clock: Any = time) -> None:
        self.ranks = list(ranks)
        #: the ranks by MPI rank, their process id in the frames (the hub's)
        self.by_rank: dict[int, MPIRank] = dict(enumerate(self.ranks))
        self.hub: Optional[Hub] = None
        self.clock = clock  # (tests: when a frame arrived)
        self.out = mpirun_out
        self.watchdog = watchdog
        self.popen: Optional[subprocess.Popen] = None
        self.code: Optional[int] = None
        self._lock = threading.Lock()
        self._buffers = {False: b"", True: b""}
        self._signalled: set[str] = set()
        #: the signals (protocol names) this mpirun passes on to every rank (command.MPIRUN_FORWARDS)
        self.forwards: tuple[str, ...] = ("USR1",)
        self._machine = machine()  # (what each rank's agent reports of its own)
        self._all_done_at: Optional[float] = None
        self._lingered = False
        self._out_closed = threading.Event()
        self._mpirun_closed = {False: False, True: False}
        self._exited_at: Optional[float] = None
        #: glob patterns of Open MPI's session directory, removed once mpirun has exited (see stop)
        self.session_dirs: Sequence[str] = ()
        #: the MPI ranks whose frames came through mpirun's output although the job has a hub
        self.in_band: set[int] = set()

    def attach(self, ranks: Sequence[MPIRank]) -> None:
        """The rank handles, in MPI rank order (they need the job first, the job needs them)."""
        self.ranks = list(ranks)
        self.by_rank.update(enumerate(self.ranks))

    def is_this_machine(self, info: Mapping[str, Any]) -> bool:
        """A pid the rank reported is one of ours if it shares our kernel and pid namespace."""
        boot, pidns = self._machine.get("boot"), self._machine.get("pidns")
        return boot is not None and pidns is not None and info.get("boot") == boot and info.get("pidns") == pidns

    # -- mpirun's output --------------------------------------------------------------

    def feed(self, err: bool, data: bytes) -> None:
        """Bytes from mpirun's stdout (``err`` false) or stderr: in-band frames go to their rank."""
        with self._lock:
            data = self._buffers[err] + data
            *lines, rest = data.split(b"\n")
            if len(rest) > MAX_UNTERMINATED:  # not a frame (those are short): mpirun's own text
                lines.append(rest)
                rest = b""
            self._buffers[err] = rest
        for line in lines:
            self._line(err, line)

    def close(self, err: bool) -> None:
        """mpirun's stdout or stderr reached its end: flush, and close the ranks' streams
        (those of a rank still connected close when its connection does)."""
        with self._lock:
            rest, self._buffers[err] = self._buffers[err], b""
        if rest:
            self._line(err, rest)
        self._mpirun_closed[err] = True
        for r in self.ranks:
            if r.channel != "open":
                (r.output.stderr if err else r.output.stdout).close()
        (self.out.stderr if err else self.out.stdout).close()
        if not err:
            self._out_closed.set()

    def _line(self, err: bool, line: bytes) -> None:
        frame = protocol.unwrap(line)
        if frame is None or not 0 <= frame[1] < len(self.ranks):
            (self.out.stderr if err else self.out.stdout).feed(line + b"\n")
            return
        rank = self.ranks[frame[1]]
        if self.hub is not None and frame[1] not in self.in_band:
            self.in_band.add(frame[1])
            (log.debug if len(self.in_band) > 1 else log.warning)(
                "%s could not reach the launcher's hub at %s:%d (its wrapper says why): its output comes through "
                "mpirun's, where long lines of different ranks may be broken", rank.label, *self.hub.address)
        rank.frame(frame[0], frame[2])

    # -- status ------------------------------------------------------------------------

    def mpirun_code(self) -> Optional[int]:
        """mpirun's exit code (128+N for signal N) once it has exited."""
        if self.code is None and self.popen is not None:
            code = self.popen.poll()
            if code is not None:
                self.code = normalize_exitcode(code)
        return self.code

    def rank_code(self, r: MPIRank) -> Optional[int]:
        """A rank's exit code once it is known (see :class:`MPIRank`)."""
        if r.reported is not None and r.reported != 0:
            return r.reported
        code = self._finished()
        if code is None:
            if r.reported == 0 and self._mpirun_lingers():
                return 0  # every rank is done; close() stops mpirun
            return None
        if r.reported == 0:
            if code != 0 and r is self._blamed_for(code):
                r.note = f"every rank exited 0 but mpirun exited with code {code}"
                return code
            return 0
        if r.node:
            if code == 0:
                # Both families exit non-zero if any rank did: its exit frame was lost on the
                # way, and the command exited 0 (the wrapper exits with the command's code).
                log.debug("%s: no exit frame, but mpirun exited 0, so it exited 0", r.label)
                return 0
            r.note = "its wrapper ended without reporting"
            # Dated by its connection's end: when mpirun stops the other ranks at once (MPICH kills
            # them when one dies), the hub can see every connection end only after mpirun exited,
            # and the first to end is the rank that failed first.
            r.ended_at = r.ended_at or r.closed_at
            return 128 + signal.SIGKILL
        if not r.note:
            r.note = f"mpirun exited with code {code} before this rank started"
            # what mpirun said is this rank's story: put it in the failure report's tail
            r.output.tail.extend(self.out.lines())
        return code or 1

    def _finished(self) -> Optional[int]:
        """mpirun's exit code once it has exited *and* the ranks' frames are read (its
        stdout and every rank connection reached their end).

        mpirun can be seen to exit before the pump has read the last frames;
        a rank's exit frame must not be taken for missing.
        """
        code = self.mpirun_code()
        if code is None:
            return None
        if not self._out_closed.is_set() or any(r.channel == "open" for r in self.ranks):
            if self._exited_at is None:
                self._exited_at = time.monotonic()
            if time.monotonic() - self._exited_at < OUTPUT_DRAIN_WAIT:
                return None  # (a leftover holding the pipe open delays us this long at most)
        return code

    def _mpirun_lingers(self) -> bool:
        """True once every rank has exited 0 and mpirun has not followed within :data:`MPIRUN_EXIT_WAIT`."""
        if self._all_done_at is None:
            if not all(x.reported == 0 for x in self.ranks):
                return False
            self._all_done_at = time.monotonic()
        if time.monotonic() - self._all_done_at < MPIRUN_EXIT_WAIT:
            return False
        if not self._lingered:
            self._lingered = True
            log.warning("every rank exited 0 but mpirun (pid %d) did not exit within %gs; stopping it",
                        self.popen.pid if self.popen else 0, MPIRUN_EXIT_WAIT)
        return True

    def _blamed_for(self, code: int) -> Optional[MPIRank]:
        if all(r.reported == 0 for r in self.ranks):
            return self.ranks[0]
        return None

    # -- signals -----------------------------------------------------------------------

    def _signal_once(self, what: str, sig: int, group: bool = False) -> None:
        if self.popen is None or what in self._signalled or self.mpirun_code() is not None:
            return
        self._signalled.add(what)
        try:
            if group:
                os.killpg(self.popen.pid, sig)
            else:
                os.kill(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to mpirun: both families pass it to every rank, whose wrapper stops its command."""
        self._signal_once("term", signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to mpirun's group and to the commands of the ranks on this machine."""
        self._signal_once("kill", signal.SIGKILL, group=True)
        for r in self.ranks:
            if r.local_pgid is not None:
                try:
                    os.killpg(r.local_pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def dump_stacks(self) -> None:
        """SIGABRT to mpirun, where it forwards it to every rank, whose wrapper passes it on (faulthandler)."""
        if "ABRT" in self.forwards:
            self._signal_once("abrt", signal.SIGABRT)

    def forward(self, signame: str) -> None:
        """``USR1``/``USR2`` to mpirun, which passes it to every rank's wrapper, which passes it on;
        a signal this mpirun would die of is not sent (a warning says who missed it)."""
        if self.popen is None or self.mpirun_code() is not None:
            return
        if signame not in self.forwards:
            log.warning("SIG%s was not passed to the ranks that have no connection to the launcher: this "
                        "mpirun forwards only %s", signame, ", ".join(f"SIG{s}" for s in self.forwards))
            return
        try:
            os.kill(self.popen.pid, getattr(signal, f"SIG{signame}"))
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float) -> None:
        """The end of the job: make sure mpirun and its group are gone."""
        if self.popen is None:
            return
        deadline = time.monotonic() + timeout
        while self.mpirun_code() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if group_members(self.popen.pid):
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.mpirun_code() is None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.watchdog is not None:
            self.watchdog.forget(self.popen.pid)
        log.debug("mpirun (pid %d) exited with code %s", self.popen.pid, self.mpirun_code())
        if self.mpirun_code() is not None and self.session_dirs:
            # mpirun removes it on its way out, but not when a signal ends it first (SIGKILL, or
            # a SIGTERM before its handlers are set: a lost port race stops it at once)
            for d in remove_matching(self.session_dirs):
                log.debug("removed %s (mpirun exited with code %s)", d, self.mpirun_code())




class MPIGroup(ProcGroup):
    """The ranks of one mpirun: a signal to the group is one signal to mpirun, which forwards it."""

    def __init__(self, handles: Sequence[ProcessHandle], job: MPIJob) -> None:
        super().__init__(handles)
        self.job = job

    def terminate(self) -> None:
        self.job.terminate()

    def kill(self) -> None:
        self.job.kill()

    def dump_stacks(self) -> None:
        # each rank's agent, over its own connection; mpirun's SIGABRT for those not connected
        sent = [h._send("ABRT") for h in self.running() if isinstance(h, MPIRank)]
        if not all(sent):
            self.job.dump_stacks()

    def forward(self, signame: str) -> None:
        """Over each rank's connection when every running rank has one; else once to mpirun, which
        passes it to every rank (so that no rank gets it twice)."""
        ranks = [h for h in self.running() if isinstance(h, MPIRank)]
        hub = self.job.hub
        if hub is not None and all(hub.connected(r.mpi_rank) for r in ranks):
            for r in ranks:
                r._send(signame)
        else:
            self.job.forward(signame)
