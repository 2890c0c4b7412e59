"""The Ray test cluster that ``scripts/setup-ray.sh`` starts, as seen by the tests.

The script writes a JSON description (path in ``$PSLAUNCH_RAY_TESTBED``, default
:data:`DEFAULT_JSON`)::

    {"address": "10.202.5.10:6379", "subnet": "10.202.5.0/24", "bridge": "10.202.5.1", "cpus": 2,
     "python": ".../.venv/bin/python", "script": ".../scripts/setup-ray.sh",
     "nodes": [{"name": "r0", "netns": "psray-r0", "addr": "10.202.5.10", "head": true}, ...]}

Node ``rN`` runs its raylet (and ``r0`` the GCS) in network namespace ``psray-rN``: every
process of a job on that node is in that namespace, which is how a test tells where a process
ran. A driver must run where a raylet runs, so the launcher runs in the head's namespace
(:meth:`RayCluster.launcher_prefix`), as a driver on a real head node does.

The ``ray_cluster`` fixture (session scope) starts the cluster when it does not run, and stops
it at the end of the session if it started it (the cluster costs about 1 GiB of memory: see
docs/ray.md); a cluster that ran before the session is left running. Without ``ray`` in the
test interpreter, or without root, the fixture skips the test (a failure under ``CI=true``: see
tests/suite_rules.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import pytest

DEFAULT_JSON = Path("/var/lib/pslaunch-ray/testbed.json")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup-ray.sh"
#: every node's Ray temp dir (sessions, logs, spilled objects): setup-ray.sh's --temp-dir
TEMP = Path("/tmp/ray-pslaunch")
#: Ray's own processes on a node; anything else in a node's namespace belongs to a job
#: (a job's actors are ray::<class> workers; the idle pool is ray::IDLE)
DAEMONS = ("gcs_server", "raylet", "ray::DashboardA", "ray::RuntimeEnv", "ray::IDLE")


class RayTestbedError(RuntimeError):
    """The Ray test cluster is missing or does not answer."""


@dataclasses.dataclass(frozen=True)
class RayNode:
    name: str
    netns: str
    addr: str
    head: bool


@dataclasses.dataclass(frozen=True)
class RayCluster:
    """A running test cluster. See the module docstring."""

    address: str
    subnet: str
    bridge: str
    cpus: int
    python: str
    nodes: tuple[RayNode, ...]

    @property
    def head(self) -> RayNode:
        return next(n for n in self.nodes if n.head)

    def launcher_prefix(self) -> list[str]:
        """What runs a command as a driver on the head node: in the head's network namespace."""
        return ["ip", "netns", "exec", self.head.netns]

    def netns_link(self, node: RayNode) -> str:
        """``net:[INODE]``, as ``readlink /proc/PID/ns/net`` shows it for a process on ``node``."""
        return f"net:[{os.stat(f'/run/netns/{node.netns}').st_ino}]"

    def node_of(self, netns_link: str) -> Optional[RayNode]:
        """The node whose namespace is ``netns_link``, or None (the launcher's own namespace)."""
        for n in self.nodes:
            if self.netns_link(n) == netns_link:
                return n
        return None

    def pids(self, node: RayNode) -> list[int]:
        """Every process in ``node``'s namespace."""
        r = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True, timeout=20)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def live_placement_groups(self) -> list[str]:
        """The names of pslaunch's placement groups that Ray has not removed (asked by a driver
        on the head, as Ray's own ``placement_group_table()`` shows them)."""
        code = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='error');"
                "print(json.dumps([v['name'] for v in ray.util.placement_group_table().values() "
                "if v['state'] != 'REMOVED' and v['name'].startswith('pslaunch-')]))")
        r = subprocess.run([*self.launcher_prefix(), self.python, "-c", code, self.address], capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0:
            raise RayTestbedError(f"placement_group_table() failed: {r.stderr.strip()[-1000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def state_dump(self) -> str:
        """What the cluster's GCS keeps of jobs, actors, placement groups and nodes, as text (asked
        by a driver on the head; the state API's task events need the dashboard, which the test
        cluster does not run)."""
        code = ("import sys, ray; from ray._private import state as s;"
                "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='error');"
                "print(repr(s.jobs())); print(repr(s.actors())); print(repr(s.state.placement_group_table()));"
                "print(repr(ray.nodes()))")
        r = subprocess.run([*self.launcher_prefix(), self.python, "-c", code, self.address], capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0:
            raise RayTestbedError(f"the GCS's tables: {r.stderr.strip()[-1000:]}")
        return r.stdout

    def job_pids(self, node: RayNode) -> list[int]:
        """The processes on ``node`` that are not Ray's own (a job's actors, agents, commands) and
        not the launcher (a driver in the head's namespace is a ``python`` running ``launcher``)."""
        out = []
        for pid in self.pids(node):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if comm in DAEMONS or comm.startswith("ray::IDLE") or "ray/_private" in cmdline \
                    or "ray/autoscaler" in cmdline or "ray/dashboard" in cmdline or "ray.scripts" in cmdline:
                continue
            out.append(pid)
        return out


def load(path: Optional[Path] = None) -> RayCluster:
    """The cluster as ``scripts/setup-ray.sh`` described it."""
    path = path or Path(os.environ.get("PSLAUNCH_RAY_TESTBED") or DEFAULT_JSON)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RayTestbedError(f"cannot read {path}: {e} (run scripts/setup-ray.sh)") from None
    nodes = tuple(RayNode(**n) for n in doc["nodes"])
    return RayCluster(doc["address"], doc["subnet"], doc["bridge"], int(doc["cpus"]), doc["python"], nodes)


def problem() -> Optional[str]:
    """Why no Ray test cluster can run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed in this interpreter (pip install '.[ray]': scripts/deps/65-ray.sh)"
    if os.geteuid() != 0:
        return "the Ray test cluster needs root (network namespaces)"
    return None


def start() -> bool:
    """Start the cluster unless it runs; True if this call started (some of) it."""
    before = _running()
    r = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RayTestbedError(f"scripts/setup-ray.sh start failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return not before


def stop() -> None:
    subprocess.run([str(SCRIPT), "stop"], capture_output=True, text=True, timeout=300)


def _running() -> bool:
    r = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and "alive nodes: 3" in r.stdout


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """The Ray test cluster, started for this session if it did not run (and then stopped after it)."""
    why = problem()
    if why:
        pytest.skip(f"no Ray test cluster: {why}")
    started = start()
    try:
        yield load()
    finally:
        if started:
            stop()
