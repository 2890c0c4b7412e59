"""One :class:`Cluster` per backend that can run here, for the backend conformance suite.

A cluster knows three things about its backend: the pslaunch options that select it (and the
environment the launcher needs), where the probes of a job write their records, and how to find
what a job left behind. Everything else is the same scenario on every backend
(``tests/integration/contract/test_backend_contract.py``).

What is left behind is found two ways, both independent of the code under test:

* every process whose environment holds this job's unique ``PSLAUNCH_TEST_MARK`` (every process a
  job starts inherits the job's variables, and so does whatever those processes start, however
  they detach): one pass over ``/proc``, which covers this machine and its network-namespace hosts;
* what the backend itself still holds: processes on the namespace hosts other than sshd (ssh),
  jobs of this job's name that Grid Engine still knows (sge), allocations of this job's name
  or steps of the test's allocation that ``squeue`` still lists, and processes on the Slurm
  nodes that carry the mark anywhere in their environment (a task wrapper holds it inside
  its task document) (slurm).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

import pytest

from support.helpers import (
    REPO,
    describe_pids,
    mpirun_path,
    pid_alive,
    pids_with_env,
    probe_argv,
    pslaunch_argv,
    run_pslaunch,
    start_pslaunch,
)

MARK = "PSLAUNCH_TEST_MARK"


class Cluster:
    """A backend ready to run jobs; one instance per test (its own probe directory and mark).

    Attributes:
        launcher: the ``--launcher`` value.
        out: where the probes of this test's jobs write their records.
        start_timeout: seconds a job may take until every process runs (batch queues are slower).
        timeout: a ``--timeout`` long enough for every process to have started first.
        graceful: the first SIGTERM reaches the processes, which may ignore it (False only
            where the backend can do nothing but kill).
    """

    launcher = ""
    start_timeout = 30.0
    timeout = 3.0
    graceful = True

    def __init__(self, out: Path) -> None:
        self.out = out
        self.mark = uuid.uuid4().hex

    # -- what a subclass tells -----------------------------------------------------------

    def options(self) -> list[str]:
        """pslaunch options that select and configure the backend."""
        return ["--launcher", self.launcher]

    def env(self) -> Optional[dict]:
        """The launcher's environment (None: the test's own)."""
        return None

    def node_host(self, name: str, rec: dict) -> str:
        """The ``DMLC_NODE_HOST`` the process ``name`` (``worker-0``) should have had."""
        return "127.0.0.1"

    def check_record(self, name: str, rec: dict) -> None:
        """Backend-specific checks of one probe record (where it ran, its own variables)."""

    def backend_leftovers(self) -> list[str]:
        """What the backend itself still holds for this test's jobs."""
        return []

    # -- the same for every backend ----------------------------------------------------------

    def probe(self, *args: str) -> list[str]:
        return probe_argv(self.out, *args)

    def argv(self, *args: str) -> list[str]:
        """The full pslaunch arguments: backend options, the test mark, then ``args``."""
        return [*self.options(), "--env", f"{MARK}={self.mark}", *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_pslaunch(*self.argv(*args), timeout=timeout, env=self.env())

    def start(self, *args: str) -> subprocess.Popen:
        return start_pslaunch(*self.argv(*args), env=self.env())

    def leftovers(self) -> list[str]:
        """Descriptions of everything of this test's jobs that still runs or is still queued."""
        pids = pids_with_env(MARK, self.mark)
        left = [describe_pids(pids)] if pids else []
        return left + self.backend_leftovers()

    def close(self) -> None:
        """Remove whatever a failed test left (after the assertions have run)."""
        for line in self.leftovers():
            print(f"cleaning up after the test: {line}")
        for pid in pids_with_env(MARK, self.mark):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


class LocalCluster(Cluster):
    launcher = "local"
    timeout = 2.0


class MPICluster(Cluster):
    """``--launcher mpi`` with every rank on this machine, for one mpirun family."""

    launcher = "mpi"

    def __init__(self, out: Path, impl: str) -> None:
        super().__init__(out)
        path = mpirun_path(impl)
        if path is None:
            pytest.skip(f"{impl}: mpirun not found (run scripts/deps/40-mpi.sh)")
        self.mpirun = path
        # the launcher's TMPDIR, where Open MPI keeps its session directory (short: it holds
        # unix sockets, whose paths are limited to 107 bytes)
        self.tmp = Path(tempfile.mkdtemp(prefix="pslt-"))

    def options(self) -> list[str]:
        return [*super().options(), "--mpirun", self.mpirun]

    def env(self) -> dict:
        return {**os.environ, "TMPDIR": str(self.tmp)}

    def backend_leftovers(self) -> list[str]:
        left = ["(it kept changing while it was read)"]
        for _ in range(10):
            try:  # (a directory may go while it is read: a node agent's watchdog removing it)
                left = sorted(str(p.relative_to(self.tmp)) for p in self.tmp.glob("*/*"))
                break
            except FileNotFoundError:
                continue
        return [f"mpirun's session directories in TMPDIR: {', '.join(left)}"] if left else []

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class SSHCluster(Cluster):
    """``--launcher ssh`` over the namespace testbed: 3 hosts, each its own sshd and network."""

    launcher = "ssh"

    def __init__(self, out: Path, testbed: object, hostfile: Path) -> None:
        super().__init__(out)
        self.tb = testbed
        self.hostfile = hostfile

    def options(self) -> list[str]:
        # the network guard travels to every remote Python child too
        return [*super().options(), "-H", str(self.hostfile), "--env", "PSLAUNCH_NETGUARD_LOG"]

    def env(self) -> dict:
        return self.tb.env()  # type: ignore[attr-defined]

    def host_of(self, rec: dict) -> object:
        host = self.tb.host_of(rec["netns"])  # type: ignore[attr-defined]
        assert host is not None, f"{rec['name']} ran in the launcher's namespace, not on a host"
        return host

    def node_host(self, name: str, rec: dict) -> str:
        return self.host_of(rec).addr_a  # type: ignore[attr-defined]

    def check_record(self, name: str, rec: dict) -> None:
        self.host_of(rec)

    def backend_leftovers(self) -> list[str]:
        tb = self.tb
        return [f"{h.name}: {tb.describe_pids(pids)}" for h in tb.hosts  # type: ignore[attr-defined]
                if (pids := tb.job_pids(h))]  # type: ignore[attr-defined]


class SGECluster(Cluster):
    """``--launcher sge`` on the one-node Grid Engine that CI starts (scripts/setup-sge.sh)."""

    launcher = "sge"
    start_timeout = 60.0
    timeout = 8.0

    def __init__(self, out: Path, logs: Path) -> None:
        super().__init__(out)
        problem = sge_problem()
        if problem:
            pytest.skip(f"no Grid Engine: {problem}")
        self.name = f"pslt-{self.mark[:8]}"
        self.logs = logs

    def options(self) -> list[str]:
        return [*super().options(), "--host-ip", "127.0.0.1", "--jobname", self.name, "--sge-log-dir",
                str(self.logs)]

    def check_record(self, name: str, rec: dict) -> None:
        assert rec["env"]["JOB_NAME"] == self.name  # it ran as a Grid Engine task of this job

    def backend_leftovers(self) -> list[str]:
        jobs = sge_jobs(self.name)
        return [f"Grid Engine jobs named {self.name}: {', '.join(jobs)}"] if jobs else []

    def close(self) -> None:
        jobs = sge_jobs(self.name)
        if jobs:
            subprocess.run(["qdel", *jobs], capture_output=True, timeout=20)
        super().close()


class YarnCluster(Cluster):
    """``--launcher yarn`` on the YARN testbed (scripts/setup-yarn.sh): the real skein client, driver
    and application master; containers are local processes."""

    launcher = "yarn"
    start_timeout = 90.0
    timeout = 20.0

    def __init__(self, out: Path, driver_env: dict[str, str]) -> None:
        super().__init__(out)
        self.driver_env = driver_env  # the session's global skein driver (support.yarn_testbed.skein_driver)
        self.name = f"pslt-{self.mark[:8]}"
        self.tmp = out / "launcher-tmp"  # the launcher's TMPDIR: where its staging directory goes
        self.tmp.mkdir(parents=True, exist_ok=True)

    def options(self) -> list[str]:
        return [*super().options(), "--host-ip", "127.0.0.1", "--jobname", self.name]

    def env(self) -> dict:
        return {**os.environ, **self.driver_env, "TMPDIR": str(self.tmp)}

    def check_record(self, name: str, rec: dict) -> None:
        assert rec["env"]["SKEIN_CONTAINER_ID"].startswith(name.split("-")[0] + "_")  # a skein container

    def backend_leftovers(self) -> list[str]:
        from support.yarn_testbed import apps_named

        apps = apps_named(self.name, self.driver_env)
        left = [f"YARN applications named {self.name} still running: {', '.join(apps)}"] if apps else []
        staged = sorted(p.name for p in self.tmp.glob("pslaunch-yarn-*"))
        return left + ([f"the launcher's staging directories (bundle, task file with the job's secret): "
                        f"{', '.join(staged)}"] if staged else [])


class SlurmCluster(Cluster):
    """``--launcher slurm`` on the Slurm test cluster (scripts/setup-slurm.sh), outside an
    allocation: pslaunch makes one (named after the test) over the 4 nodes and releases it."""

    launcher = "slurm"
    start_timeout = 60.0
    timeout = 8.0
    #: DMLC_INTERFACE as a CIDR: the nodes' interface names differ (eth0, ens1, ...)
    interface_key = "subnet_a"

    def __init__(self, out: Path) -> None:
        super().__init__(out)
        from support import slurm_testbed

        problem = slurm_testbed.problem()
        if problem:
            pytest.skip(f"no Slurm test cluster: {problem}")
        self.tb = slurm_testbed.load()
        self.name = f"pslt-{self.mark[:8]}"

    def options(self) -> list[str]:
        return [*super().options(), "--jobname", self.name, "--slurm-nodes", str(len(self.tb.nodes)),
                "--env", f"DMLC_INTERFACE={getattr(self.tb, self.interface_key)}"]

    def node_of(self, rec: dict) -> object:
        node = self.tb.node_of(rec["netns"])
        assert node is not None, f"{rec.get('name')} ran in the launcher's namespace, not on a Slurm node"
        return node

    def node_host(self, name: str, rec: dict) -> str:
        return self.node_of(rec).addr_a  # type: ignore[attr-defined]

    def check_record(self, name: str, rec: dict) -> None:
        node = self.node_of(rec)
        env = rec["env"]
        assert env["SLURMD_NODENAME"] == node.name and env["SLURM_STEP_ID"].isdigit(), env  # type: ignore[attr-defined]
        assert "PSLAUNCH_TASK" not in env  # the wrapper took the task document out

    def marked_pids(self) -> list[int]:
        """Processes on the nodes whose environment holds the mark anywhere (the wrappers too)."""
        from support.slurm_testbed import _alive

        needle = self.mark.encode()
        found = []
        for n in self.tb.nodes:
            for pid in self.tb.pids(n):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if needle in env and _alive(pid):
                    found.append(pid)
        return found

    def backend_leftovers(self) -> list[str]:
        left = []
        jobs = self.tb.jobs(self.name)
        if jobs:
            left.append(f"Slurm jobs named {self.name}: {', '.join(jobs)}")
        pids = self.marked_pids()
        if pids:
            left.append(f"on the Slurm nodes: {describe_pids(pids)}")
        return left

    def close(self) -> None:
        self.tb.scancel(*self.tb.jobs(self.name))
        super().close()


class SlurmAllocationCluster(SlurmCluster):
    """``--launcher slurm`` inside an allocation: ``salloc --no-shell -N4`` made by the test, and
    ``SLURM_JOB_ID`` in the launcher's environment (as under salloc or in an sbatch script)."""

    def __init__(self, out: Path) -> None:
        super().__init__(out)
        self.job = self.tb.salloc(len(self.tb.nodes), self.name)

    def options(self) -> list[str]:
        return ["--launcher", self.launcher, "--jobname", self.name, "--env",
                f"DMLC_INTERFACE={getattr(self.tb, self.interface_key)}"]

    def env(self) -> dict:
        return {**os.environ, "SLURM_JOB_ID": self.job}

    def check_record(self, name: str, rec: dict) -> None:
        super().check_record(name, rec)
        assert rec["env"]["SLURM_JOB_ID"] == self.job

    def steps(self) -> list[str]:
        r = subprocess.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i"], capture_output=True, text=True,
                           timeout=20)
        return r.stdout.split()

    def backend_leftovers(self) -> list[str]:
        left = []
        steps = self.steps()
        if steps:
            left.append(f"steps of allocation {self.job}: {', '.join(steps)}")
        pids = self.marked_pids()
        if pids:
            left.append(f"on the Slurm nodes: {describe_pids(pids)}")
        return left

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.tb.scancel(self.job)


class RayCluster(Cluster):
    """``--launcher ray`` on the Ray test cluster (scripts/setup-ray.sh; the ``ray_cluster`` fixture):
    a head and two workers, each in its own network namespace. The launcher is a driver on the head
    (it runs in the head's namespace); its hub and scheduler listen on the head's address
    (``--host-ip``), and each process's ``DMLC_NODE_HOST`` is its actor's node address, as Ray
    knows it (no ``DMLC_INTERFACE``)."""

    launcher = "ray"
    start_timeout = 90.0
    timeout = 12.0

    def __init__(self, out: Path, tb: object) -> None:
        super().__init__(out)
        self.tb = tb

    def options(self) -> list[str]:
        return [*super().options(), "--ray-address", self.tb.address,  # type: ignore[attr-defined]
                "--host-ip", self.tb.head.addr]  # type: ignore[attr-defined]

    def _argv(self, *args: str) -> list[str]:
        return [*self.tb.launcher_prefix(), *pslaunch_argv(*self.argv(*args))]  # type: ignore[attr-defined]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self._argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def start(self, *args: str) -> subprocess.Popen:
        # (ip netns exec execs the launcher: the Popen's pid is the launcher's, for the signal tests)
        return subprocess.Popen(self._argv(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def node_of(self, rec: dict) -> object:
        node = self.tb.node_of(rec["netns"])  # type: ignore[attr-defined]
        assert node is not None, f"{rec.get('name')} ran in the launcher's namespace, not on a Ray node"
        return node

    def node_host(self, name: str, rec: dict) -> str:
        return self.node_of(rec).addr  # type: ignore[attr-defined]

    def check_record(self, name: str, rec: dict) -> None:
        self.node_of(rec)
        env = rec["env"]
        # the wrapper took the task document and its own variables out
        assert "PSLAUNCH_TASK" not in env and "PSLAUNCH_RAY_INDEX" not in env and "PSLAUNCH_RAY_NODE_IP" not in env

    def marked_pids(self) -> list[int]:
        """Processes on the nodes whose environment holds the mark anywhere (the wrappers too)."""
        needle = self.mark.encode()
        found = []
        for n in self.tb.nodes:  # type: ignore[attr-defined]
            for pid in self.tb.pids(n):  # type: ignore[attr-defined]
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if needle in env:
                    found.append(pid)
        return [p for p in found if p in set(pids_alive(found))]

    def actor_pids(self) -> list[int]:
        """pslaunch's actors still alive on the nodes (Ray names their workers ``ray::PslaunchTask``)."""
        found = []
        for n in self.tb.nodes:  # type: ignore[attr-defined]
            for pid in self.tb.pids(n):  # type: ignore[attr-defined]
                try:
                    if Path(f"/proc/{pid}/comm").read_text().startswith("ray::PslaunchT"):
                        found.append(pid)
                except OSError:
                    continue
        return pids_alive(found)

    def backend_leftovers(self) -> list[str]:
        left = []
        pids = self.marked_pids()
        if pids:
            left.append(f"on the Ray nodes: {describe_pids(pids)}")
        actors = self.actor_pids()
        if actors:
            left.append(f"pslaunch's Ray actors: {describe_pids(actors)}")
        return left

    def close(self) -> None:
        super().close()
        for pid in self.marked_pids() + self.actor_pids():
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def pids_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if pid_alive(p)]


def sge_problem() -> Optional[str]:
    """Why no Grid Engine job can run here, or None."""
    for name in ("SGE_ROOT", "DRMAA_LIBRARY_PATH", "GLIBC_TUNABLES"):
        if not os.environ.get(name):
            return f"{name} is not set (eval \"$(scripts/setup-sge.sh env)\" after scripts/setup-sge.sh)"
    if not shutil.which("qstat"):
        return "qstat not found (scripts/setup-sge.sh installs Grid Engine)"
    r = subprocess.run(["qstat"], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"qstat fails: {r.stderr.strip()} (start Grid Engine with scripts/setup-sge.sh)"
    return None


def sge_jobs(name: str) -> list[str]:
    """Numbers of the jobs named ``name`` that Grid Engine still knows (queued, running, deleting)."""
    r = subprocess.run(["qstat", "-u", "*", "-xml"], capture_output=True, text=True, timeout=20, check=True)
    root = ET.fromstring(r.stdout)
    return sorted({j.findtext("JB_job_number") or "" for j in root.iter("job_list")
                   if j.findtext("JB_name") == name})


class KubeCluster(Cluster):
    """``--launcher k8s`` on the Kubernetes test cluster (scripts/setup-k8s.sh: a real control plane,
    3 nodes run by scripts/k8s_node.py), as pslaunch's service account. The Pods' processes run on
    this machine (in network namespaces of their own), so the mark finds them; the cluster's own
    leftovers are objects labelled ``pslaunch.io/job`` in the namespace (the k8s tests run one at
    a time)."""

    launcher = "k8s"
    start_timeout = 60.0
    timeout = 5.0
    #: this machine's address on the Pods' bridge: where the scheduler and the hub listen
    gateway = "10.202.8.1"

    def __init__(self, out: Path, kube: object) -> None:
        super().__init__(out)
        self.kube = kube

    def options(self) -> list[str]:
        return [*super().options(), "--k8s-namespace", self.kube.namespace,  # type: ignore[attr-defined]
                "--k8s-image", "localhost/unused:test", "--host-ip", self.gateway]

    def env(self) -> dict:
        return {**os.environ, "KUBECONFIG": str(self.kube.kubeconfig)}  # type: ignore[attr-defined]

    def node_host(self, name: str, rec: dict) -> str:
        addr = rec["env"].get("DMLC_NODE_HOST", "")
        # a Pod's own address on the bridge (not this machine's): the test node's podCIDRs
        return addr if addr.startswith("10.202.8.") and addr != self.gateway else f"<a Pod address, not {addr!r}>"

    def check_record(self, name: str, rec: dict) -> None:
        assert rec["netns"] != os.readlink("/proc/self/ns/net"), f"{name} ran in the launcher's namespace"
        assert "PSLAUNCH_TASK" not in rec["env"]

    def backend_leftovers(self) -> list[str]:
        core = self.kube.core(admin=True)  # type: ignore[attr-defined]
        ns, sel = self.kube.namespace, "pslaunch.io/job"  # type: ignore[attr-defined]
        left = [f"pod/{x.metadata.name}" for x in core.list_namespaced_pod(ns, label_selector=sel).items]
        left += [f"service/{x.metadata.name}" for x in core.list_namespaced_service(ns, label_selector=sel).items]
        left += [f"configmap/{x.metadata.name}" for x in core.list_namespaced_config_map(ns, label_selector=sel).items]
        left += [f"secret/{x.metadata.name}" for x in core.list_namespaced_secret(ns, label_selector=sel).items]
        return left

    def close(self) -> None:
        super().close()
        for what in self.backend_leftovers():
            kind, name = what.split("/", 1)
            core = self.kube.core(admin=True)  # type: ignore[attr-defined]
            try:
                getattr(core, f"delete_namespaced_{ {'configmap': 'config_map'}.get(kind, kind)}")(
                    name, self.kube.namespace)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass


#: The clusters of the conformance suite: id -> pytest marks.
CLUSTERS = {
    "local": (),
    "ssh": (pytest.mark.ssh,),
    "mpi-openmpi": (pytest.mark.mpi,),
    "mpi-mpich": (pytest.mark.mpi,),
    "sge": (pytest.mark.sge,),
    "yarn": (pytest.mark.yarn,),
    "slurm": (pytest.mark.slurm,),
    "slurm-alloc": (pytest.mark.slurm,),
    "ray": (pytest.mark.ray,),
    "k8s": (pytest.mark.k8s,),
}


def make_cluster(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Cluster:
    """Build the cluster ``kind`` for one test (the testbed fixture only when it is needed)."""
    if kind == "local":
        out = tmp_path / "probes"
        out.mkdir()
        return LocalCluster(out)
    if kind.startswith("mpi-"):
        out = tmp_path / "probes"
        out.mkdir()
        return MPICluster(out, kind.split("-", 1)[1])
    if kind == "ssh":
        tb = request.getfixturevalue("testbed")
        out = tb.shared / uuid.uuid4().hex[:10]
        out.mkdir(mode=0o777)
        request.addfinalizer(lambda: shutil.rmtree(out, ignore_errors=True))
        hostfile = tb.write_hostfile(tmp_path / "hosts", tb.hosts[:3])
        return SSHCluster(out, tb, hostfile)
    if kind == "sge":
        out = tmp_path / "probes"
        out.mkdir()
        return SGECluster(out, tmp_path / "logs")
    if kind == "yarn":
        out = tmp_path / "probes"
        out.mkdir()
        return YarnCluster(out, request.getfixturevalue("skein_driver"))
    if kind in ("slurm", "slurm-alloc"):
        out = tmp_path / "probes"
        out.mkdir()
        return SlurmCluster(out) if kind == "slurm" else SlurmAllocationCluster(out)
    if kind == "ray":
        out = tmp_path / "probes"
        out.mkdir()
        return RayCluster(out, request.getfixturevalue("ray_cluster"))
    if kind == "k8s":
        out = tmp_path / "probes"
        out.mkdir()
        return KubeCluster(out, request.getfixturevalue("k8s_cluster"))
    raise ValueError(f"unknown cluster {kind!r}")


__all__ = ["CLUSTERS", "Cluster", "KubeCluster", "MARK", "RayCluster", "SlurmAllocationCluster", "SlurmCluster",
           "make_cluster", "sge_jobs", "sge_problem"]
