"""The Slurm test cluster itself (scripts/setup-slurm.sh; CI starts it with scripts/deps/60-slurm.sh).

These tests prove that the cluster works as the slurm backend will need it: every
node idle, each task in its own node's network namespace with that node's
interfaces, the environment and working directory reaching the tasks (and the
secret staying out of slurmctld), allocations released, signal exit codes, no
process left on any node after a cancelled step, and a stopped slurmd failing the
job with a message that names the node. Every test cancels what it started, and
checks with ``squeue`` that its jobs are gone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from support.helpers import wait_for
from support.slurm_testbed import SlurmCluster, slurm  # noqa: F401  (slurm is a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

#: run as each task: records what the task sees into OUT/task-<SLURM_PROCID>.json, then
#: optionally spawns a child and a grandchild in its own session, and sleeps
TASK = r'''
import json, os, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
addrs = {}
for line in subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout.splitlines():
    f = line.split()
    addrs[f[1]] = f[3].split("/")[0]
me = {"env": {k: v for k, v in os.environ.items()}, "cwd": os.getcwd(), "pid": os.getpid(),
      "hostname": os.uname().nodename, "netns": os.readlink("/proc/self/ns/net"), "addrs": addrs,
      "argv": sys.argv}
if mode == "spawn":
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    me["children"] = [subprocess.Popen(sleeper).pid, subprocess.Popen(sleeper, start_new_session=True).pid]
path = os.path.join(out, f"task-{os.environ['SLURM_PROCID']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(me, f)
os.rename(path + ".tmp", path)
if mode in ("sleep", "spawn"):
    time.sleep(600)
'''


@pytest.fixture
def job(tmp_path: Path, slurm: SlurmCluster):  # noqa: F811
    """A unique job name and a directory for the tasks' records; cancels the name's jobs afterwards."""
    name = f"pslt-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "task.py"
    task.write_text(TASK)
    yield {"name": name, "out": out, "task": task, "dir": tmp_path}
    left = slurm.jobs(name)
    if left:  # never leave jobs behind, even when a test failed
        slurm.scancel(*left)
        wait_for(lambda: not slurm.jobs(name), 60, interval=0.25, what=f"jobs named {name} to go")


def records(out: Path, n: int, timeout: float = 30) -> list[dict]:
    wait_for(lambda: len(list(out.glob("task-*.json"))) >= n, timeout, interval=0.1, what=f"{n} task records")
    recs = [json.loads(p.read_text()) for p in sorted(out.glob("task-*.json"))]
    return sorted(recs, key=lambda r: int(r["env"]["SLURM_PROCID"]))


def srun(slurm: SlurmCluster, job: dict, *args: str, timeout: float = 60, env: dict | None = None,  # noqa: F811
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "-J", job["name"], "-p", slurm.partition, *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd or job["dir"], stdin=subprocess.DEVNULL)


def assert_no_jobs_left(slurm: SlurmCluster, name: str, timeout: float = 60) -> None:  # noqa: F811
    wait_for(lambda: not slurm.jobs(name), timeout, interval=0.25, what=f"squeue to drop the jobs named {name}")


def test_every_node_is_idle_in_the_default_partition(slurm: SlurmCluster) -> None:  # noqa: F811
    assert len(slurm.nodes) >= 2
    # idle once the previous test's jobs have completed
    wait_for(lambda: set(slurm.node_states().values()) == {"idle"}, 60, interval=0.25, what="every node idle")
    assert sorted(slurm.node_states()) == sorted(slurm.names)
    r = subprocess.run(["sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True, timeout=20, check=True)
    assert f"{slurm.partition}* up" in r.stdout.splitlines()  # '*': the default partition


def test_each_task_runs_in_its_own_nodes_namespace_with_env_and_cwd(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    n = len(slurm.nodes)
    env = dict(os.environ, PSLT_FORWARDED="forwarded value with spaces")
    r = srun(slurm, job, f"-N{n}", f"-n{n}", "--ntasks-per-node=1", sys.executable, str(job["task"]),
             str(job["out"]), "record", env=env)
    assert r.returncode == 0, r.stderr
    recs = records(job["out"], n)
    seen = set()
    for rec in recs:
        name = rec["env"]["SLURMD_NODENAME"]
        node = slurm.node(name)
        seen.add(name)
        # the process really ran in that node's network namespace, with that node's interfaces
        assert slurm.node_of(rec["netns"]) == node, (name, rec["netns"])
        assert rec["addrs"].get(node.iface_a) == node.addr_a, rec["addrs"]
        assert rec["addrs"].get(node.iface_b) == node.addr_b, rec["addrs"]
        assert set(rec["addrs"]) == {"lo", node.iface_a, node.iface_b}
        assert rec["hostname"] == name
        assert rec["cwd"] == str(job["dir"])  # the submit directory, seen through the shared file system
        assert rec["env"]["PSLT_FORWARDED"] == "forwarded value with spaces"
        # one task per node: node ids follow the step's node list (sn0, sn1, ...), local ids are 0
        assert rec["env"]["SLURM_NODEID"] == str(slurm.names.index(name))
        assert rec["env"]["SLURM_LOCALID"] == "0"
        assert rec["env"]["SLURM_STEP_NUM_NODES"] == str(n)
    assert seen == set(slurm.names)
    assert sorted(int(r["env"]["SLURM_PROCID"]) for r in recs) == list(range(n))
    # interface names differ between nodes: only the CIDR form of DMLC_INTERFACE fits all
    assert len({slurm.node(r["env"]["SLURMD_NODENAME"]).iface_a for r in recs}) == n
    assert_no_jobs_left(slurm, job["name"])


def test_tasks_reach_the_launching_host_on_both_subnets(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    """A scheduler on the launching host is reachable from every node, on either network."""
    got: list[tuple[str, str]] = []
    servers = []
    for addr in (slurm.controller_a, slurm.controller_b):
        s = socket.create_server((addr, 0))
        s.settimeout(30)
        servers.append(s)

    def accept(s: socket.socket) -> None:
        for _ in range(len(slurm.nodes)):
            try:
                c, peer = s.accept()
            except OSError:
                return
            with c:
                got.append((s.getsockname()[0], c.recv(64).decode()))

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    connect = ("import os, socket, sys\n"
               "for a in sys.argv[1:]:\n"
               "    h, p = a.rsplit(':', 1)\n"
               "    with socket.create_connection((h, int(p)), timeout=20) as c:\n"
               "        c.sendall(os.environ['SLURMD_NODENAME'].encode())\n")
    targets = [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in servers]
    n = len(slurm.nodes)
    try:
        r = srun(slurm, job, f"-N{n}", f"-n{n}", "--ntasks-per-node=1", sys.executable, "-c", connect, *targets)
        assert r.returncode == 0, r.stderr
        for t in threads:
            t.join(30)
    finally:
        for s in servers:
            s.close()
    for addr in (slurm.controller_a, slurm.controller_b):
        assert sorted(name for a, name in got if a == addr) == sorted(slurm.names), got


def test_secret_reaches_tasks_but_not_slurmctld(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    """The environment goes from srun to the nodes directly: ``scontrol show job/step`` never shows it."""
    secret = uuid.uuid4().hex
    env = dict(os.environ, PSLT_SECRET=secret)
    p = subprocess.Popen(["srun", "-J", job["name"], "-N2", "-n2", sys.executable, str(job["task"]),
                          str(job["out"]), "sleep"], env=env, cwd=job["dir"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        recs = records(job["out"], 2)
        assert all(r["env"]["PSLT_SECRET"] == secret for r in recs)
        assert all(secret not in " ".join(r["argv"]) for r in recs)
        (jid,) = slurm.jobs(job["name"])
        shown = ""
        for argv in (["scontrol", "show", "job", "-dd", jid], ["scontrol", "show", "step", "-dd", jid],
                     ["squeue", "-h", "-j", jid, "-o", "%all"], ["squeue", "-h", "-s", "-o", "%all"]):
            shown += subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout
        assert jid in shown and "PSLT_SECRET" not in shown and secret not in shown
    finally:
        slurm.scancel(*slurm.jobs(job["name"]))
        p.communicate(timeout=60)
    assert_no_jobs_left(slurm, job["name"])


def test_salloc_allocation_is_released_by_scancel(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    jid = slurm.salloc(2, job["name"])
    assert slurm.job_state(jid) == "RUNNING"
    # steps run in the allocation, from the launching host
    r = subprocess.run(["srun", f"--jobid={jid}", "-N2", "-n2", "hostname"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    nodes = subprocess.run(["scontrol", "show", "hostnames",
                            subprocess.run(["squeue", "-h", "-j", jid, "-o", "%N"], capture_output=True,
                                           text=True, timeout=20).stdout.strip()],
                           capture_output=True, text=True, timeout=20).stdout.split()
    assert sorted(r.stdout.split()) == sorted(nodes) and len(nodes) == 2
    slurm.scancel(jid)
    assert_no_jobs_left(slurm, job["name"])
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=20).stdout.strip() == ""


def test_task_killed_by_sigsegv(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    r = srun(slurm, job, "-N1", "-n1", "sh", "-c", "kill -SEGV $$")
    assert r.returncode == 128 + 11, (r.returncode, r.stderr)
    assert "task 0: Segmentation fault" in r.stderr
    # With --kill-on-bad-exit the other task gets SIGTERM, and srun exits with the LARGEST
    # status of its tasks: 143 (SIGTERM) beats 139 (SIGSEGV). The first failure is only
    # in srun's first "task N: ..." line.
    r = srun(slurm, job, "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable, "-c",
             "import os, signal, time\n"
             "if os.environ['SLURM_PROCID'] == '1':\n"
             "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGSEGV)\n"
             "time.sleep(600)\n", timeout=60)
    assert r.returncode == 128 + 15, (r.returncode, r.stderr)
    task_lines = [line for line in r.stderr.splitlines() if ": task " in line]
    assert task_lines[0].endswith("task 1: Segmentation fault"), r.stderr
    assert task_lines[1].endswith("task 0: Terminated"), r.stderr
    assert_no_jobs_left(slurm, job["name"])


def test_cancelled_step_leaves_no_process_on_any_node(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    n = len(slurm.nodes)
    jid = slurm.salloc(n, job["name"])
    p = subprocess.Popen(["srun", f"--jobid={jid}", f"-N{n}", f"-n{n}", "--ntasks-per-node=1",
                          sys.executable, str(job["task"]), str(job["out"]), "spawn"], cwd=job["dir"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        recs = records(job["out"], n)
        pids = {slurm.node(r["env"]["SLURMD_NODENAME"]).name: [r["pid"], *r["children"]] for r in recs}
        for rec in recs:  # the child and the new-session grandchild are on the task's node
            node = slurm.node(rec["env"]["SLURMD_NODENAME"])
            assert set(pids[node.name]) <= set(slurm.job_pids(node, jid)), (node.name, pids[node.name])
        steps = subprocess.run(["squeue", "-h", "-s", "-j", jid, "-o", "%i"], capture_output=True, text=True,
                               timeout=20).stdout.split()
        (step,) = [s for s in steps if not s.endswith(".extern")]
        subprocess.run(["scancel", step], timeout=20, check=True)
        p.communicate(timeout=60)  # srun ends (its exit code varies: 137, or 0 if a task outlives the kill)
        for node in slurm.nodes:
            wait_for(lambda node=node: not slurm.job_pids(node, jid), 30, interval=0.2,
                     what=f"no process of job {jid} on {node.name}")
        # the allocation outlives its cancelled step
        assert slurm.job_state(jid) == "RUNNING"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        slurm.scancel(jid)
    assert_no_jobs_left(slurm, job["name"])


@pytest.mark.slow
def test_stopped_slurmd_fails_the_job_naming_the_node(slurm: SlurmCluster, job: dict) -> None:  # noqa: F811
    """What the backend must turn into a fast failure: slurmctld marks the node DOWN
    (SlurmdTimeout plus failed pings, ~15 s here), srun prints "Node failure on <node>"
    (its exit code says nothing: 0 or 143), the job ends NODE_FAIL, and the task on the
    stopped node runs on until its slurmd is back."""
    victim = slurm.nodes[-1]
    jid = slurm.salloc(len(slurm.nodes), job["name"])
    n = len(slurm.nodes)
    p = subprocess.Popen(["srun", f"--jobid={jid}", f"-N{n}", f"-n{n}", "--ntasks-per-node=1",
                          sys.executable, str(job["task"]), str(job["out"]), "sleep"], cwd=job["dir"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    stopped = False
    try:
        recs = records(job["out"], n)
        orphan = next(r["pid"] for r in recs if r["env"]["SLURMD_NODENAME"] == victim.name)
        t0 = time.monotonic()
        slurm.stop_slurmd(victim)
        stopped = True
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
        assert f"Node failure on {victim.name}" in err, err
        wait_for(lambda: slurm.job_state(jid) == "", 60, interval=0.25, what=f"job {jid} to end")
        r = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True, timeout=20)
        assert "JobState=NODE_FAIL" in r.stdout, r.stdout
        assert slurm.node_states()[victim.name].startswith("down")
        # the stopped node's task outlives its slurmd (nobody there to kill it) ...
        assert orphan in slurm.job_pids(victim, jid)
        print(f"srun reported the failure of {victim.name} and exited {took:.1f}s after slurmd stopped")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        if stopped:
            slurm.start_slurmd(victim)  # waits until the node is idle again (ReturnToService=2)
    # ... until slurmd is back: slurmctld then has it killed
    wait_for(lambda: not slurm.job_pids(victim, jid), 60, interval=0.25, what=f"the orphan task on {victim.name}")
    wait_for(lambda: not slurm.step_daemons(victim, jid), 60, interval=0.25,
             what=f"job {jid}'s slurmstepd on {victim.name}")
    assert slurm.node_states()[victim.name] == "idle"
    assert_no_jobs_left(slurm, job["name"])
