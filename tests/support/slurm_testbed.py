"""The Slurm test cluster that ``scripts/setup-slurm.sh`` starts, as seen by the tests.

The script writes a JSON description (path in ``$PSLAUNCH_SLURM_TESTBED``, which
``eval "$(scripts/setup-slurm.sh)"`` exports; default :data:`DEFAULT_JSON`)::

    {"conf": "/etc/slurm/slurm.conf", "partition": "debug",
     "controller": {"addr_a": "10.202.1.1", "addr_b": "10.202.2.1", "bridge_a": ..., "bridge_b": ...},
     "subnet_a": "10.202.1.0/24", "subnet_b": "10.202.2.0/24", "cpus": 4,
     "script": "/path/to/scripts/setup-slurm.sh",
     "nodes": [{"name": "sn0", "netns": "psslurm-sn0", "addr_a": "10.202.1.10", "iface_a": "eth0",
                "addr_b": "10.202.2.10", "iface_b": "data0", "log": ..., "pidfile": ...}, ...]}

:func:`load` reads it into a :class:`SlurmCluster`; :func:`problem` says in one line
why the cluster cannot be used (or None); the ``slurm`` fixture skips a test then
(a failure under ``CI=true``: see tests/suite_rules.py). Node ``sN`` runs its slurmd
in network namespace ``psslurm-sN``: every process of a job step on that node is in
that namespace, which is how :meth:`SlurmCluster.job_pids` finds a job's leftovers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from launcher.node import procgroup

DEFAULT_JSON = Path("/var/lib/pslaunch-slurm/testbed.json")
#: the daemons of a node; anything else in its namespace belongs to a job
DAEMONS = ("slurmd", "slurmstepd")


class SlurmTestbedError(RuntimeError):
    """The Slurm test cluster is missing or does not answer."""


def _run(argv: Sequence[str], timeout: float = 30, check: bool = True, **kw: object) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                       **kw)  # type: ignore[call-overload]
    if check and r.returncode != 0:
        raise SlurmTestbedError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    name: str
    netns: str
    addr_a: str
    iface_a: str
    addr_b: str
    iface_b: str
    log: str
    pidfile: str


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster. See the module docstring."""

    conf: str
    partition: str
    controller_a: str
    controller_b: str
    subnet_a: str
    subnet_b: str
    cpus: int
    script: str
    nodes: tuple[SlurmNode, ...]

    def node(self, name: str) -> SlurmNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    # -- Slurm's view ------------------------------------------------------------------

    def node_states(self) -> dict[str, str]:
        """``{"sn0": "idle", ...}`` from ``sinfo -N`` (compact states: idle, alloc, mix, down*, ...)."""
        out = _run(["sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def jobs(self, name: Optional[str] = None) -> list[str]:
        """Ids of the jobs that ``squeue`` shows (pending, running or completing), or only those named ``name``."""
        argv = ["squeue", "-h", "-o", "%i"] + (["-n", name] if name else [])
        return _run(argv).stdout.split()

    def job_state(self, job: str) -> str:
        """``squeue``'s state of ``job`` (RUNNING, COMPLETING...), or "" when squeue no longer shows it."""
        r = _run(["squeue", "-h", "-j", job, "-o", "%T"], check=False)
        return r.stdout.strip()

    def salloc(self, nodes: int, name: str, *extra: str) -> str:
        """``salloc --no-shell``: the new allocation's job id."""
        r = _run(["salloc", "--no-shell", f"-N{nodes}", "-J", name, "-p", self.partition, *extra], timeout=60)
        for word in r.stderr.replace("\n", " ").split():
            if word.isdigit():
                return word
        raise SlurmTestbedError(f"salloc printed no job id: {r.stderr.strip()}")

    def scancel(self, *ids: str) -> None:
        if ids:
            _run(["scancel", *ids], check=False)

    # -- the nodes as Linux sees them ----------------------------------------------------

    def netns_link(self, node: SlurmNode) -> str:
        """``net:[INODE]``, as ``readlink /proc/PID/ns/net`` shows it for a process on ``node``."""
        return f"net:[{os.stat(f'/run/netns/{node.netns}').st_ino}]"

    def node_of(self, netns_link: str) -> Optional[SlurmNode]:
        for n in self.nodes:
            if self.netns_link(n) == netns_link:
                return n
        return None

    def pids(self, node: SlurmNode) -> list[int]:
        """Every live process in ``node``'s network namespace, daemons included."""
        r = _run(["ip", "netns", "pids", node.netns], check=False)
        return [int(p) for p in r.stdout.split() if _alive(int(p))]

    def job_pids(self, node: SlurmNode, job: Optional[str] = None) -> list[int]:
        """Processes on ``node`` other than slurmd and slurmstepd; only ``job``'s (by SLURM_JOB_ID) if given."""
        out = []
        for pid in self.pids(node):
            if _comm(pid) in DAEMONS:
                continue
            if job is not None and _environ(pid).get("SLURM_JOB_ID") != job:
                continue
            out.append(pid)
        return out

    def step_daemons(self, node: SlurmNode, job: str) -> list[int]:
        """``job``'s slurmstepd processes on ``node`` (their title is ``slurmstepd: [JOB.STEP]``)."""
        return [pid for pid in self.pids(node)
                if _comm(pid) == "slurmstepd" and f"[{job}.".encode() in _cmdline(pid)]

    def stop_slurmd(self, node: SlurmNode) -> None:
        """Stop ``node``'s slurmd only (SIGTERM); the job steps it started keep running."""
        _run(["bash", self.script, "node-stop", node.name], timeout=60)

    def start_slurmd(self, node: SlurmNode) -> None:
        """Start ``node``'s slurmd again and wait until the node is idle."""
        _run(["bash", self.script, "node-start", node.name], timeout=120)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    st = procgroup.stat(pid)
    return st is not None and st.alive


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def load(path: Optional[os.PathLike | str] = None) -> SlurmCluster:
    """The cluster described by ``path`` (default ``$PSLAUNCH_SLURM_TESTBED`` or :data:`DEFAULT_JSON`)."""
    p = Path(path or os.environ.get("PSLAUNCH_SLURM_TESTBED") or DEFAULT_JSON)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SlurmTestbedError(f"cannot read {p} ({e}): start the cluster with scripts/setup-slurm.sh") from None
    nodes = tuple(SlurmNode(**n) for n in doc["nodes"])
    return SlurmCluster(conf=doc["conf"], partition=doc["partition"], controller_a=doc["controller"]["addr_a"],
                        controller_b=doc["controller"]["addr_b"], subnet_a=doc["subnet_a"],
                        subnet_b=doc["subnet_b"], cpus=int(doc["cpus"]), script=doc["script"], nodes=nodes)


def problem() -> Optional[str]:
    """Why the Slurm test cluster cannot be used here, in one line; None when it answers."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, /proc of every node)"
    for tool in ("srun", "salloc", "sinfo", "squeue", "scancel", "scontrol"):
        if shutil.which(tool) is None:
            return f"{tool} not found (scripts/setup-slurm.sh installs Slurm)"
    try:
        cluster = load()
        r = _run(["scontrol", "ping"], check=False, timeout=20)
        if "is UP" not in r.stdout:
            return f"slurmctld does not answer ({(r.stdout + r.stderr).strip()}): run scripts/setup-slurm.sh"
        states = cluster.node_states()
    except (SlurmTestbedError, subprocess.TimeoutExpired) as e:
        return str(e)
    missing = [n for n in cluster.names if n not in states]
    if missing:
        return f"sinfo does not list {', '.join(missing)}: run scripts/setup-slurm.sh"
    return None


try:  # pytest fixture (import it into a test module: ``from slurm_testbed import slurm``)
    import pytest

    @pytest.fixture(scope="session")
    def slurm() -> SlurmCluster:
        """The running Slurm test cluster; skipped (a failure under CI=true) when there is none."""
        why = problem()
        if why:
            pytest.skip(f"no Slurm test cluster: {why}")
        return load()
except ImportError:  # pragma: no cover
    pass
