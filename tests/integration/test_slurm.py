"""``--launcher slurm`` on the Slurm test cluster (scripts/setup-slurm.sh; CI starts it itself).

The conformance suite (``contract/test_backend_contract.py``) runs every common scenario on
slurm inside and outside an allocation; these are the Slurm-specific ones: placement and
labels, the secret kept out of Slurm's records and of every command line, DMLC_INTERFACE as
a name and as a prefix that differ per node, records that reach the launcher through srun
when an agent cannot connect, the allocation pslaunch makes (its shape, its time limit,
``squeue`` empty afterwards, a request still pending after --start-timeout, Ctrl-C and kill
-9 while it is pending), a node lost mid-job, a job launched from an ``sbatch`` script, the
trainer's accuracy, and ``pslaunch doctor --launcher slurm``. Every test cancels what it
started and checks with ``squeue`` that its jobs are gone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from support import trainer as H
from support.clusters import MARK
from support.clusters import SlurmCluster as Probes
from support.helpers import REPO, pslaunch_argv, read_probes, run_pslaunch, wait_for, wait_probes
from support.slurm_testbed import SlurmCluster, slurm  # noqa: F401  (slurm is a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


@pytest.fixture
def job(tmp_path: Path, slurm: SlurmCluster):  # noqa: F811
    """A probe cluster (outside an allocation, named after the test); its jobs are cancelled afterwards."""
    c = Probes(tmp_path / "probes")
    c.out.mkdir()
    yield c
    c.close()
    assert not c.leftovers(), c.leftovers()


def wait_gone(slurm: SlurmCluster, name: str, timeout: float = 30.0) -> None:  # noqa: F811
    wait_for(lambda: not slurm.jobs(name), timeout, interval=0.2, what=f"squeue to drop the jobs named {name}")


def allocation_of(probes: dict) -> str:
    (job,) = {rec["env"]["SLURM_JOB_ID"] for rec in probes.values() if "SLURM_JOB_ID" in rec["env"]}
    return job


# --- placement, labels, the secret --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_placement_labels_and_the_allocation_pslaunch_makes(job: Probes, slurm: SlurmCluster) -> None:  # noqa: F811
    p = job.start("-n", "3", "-s", "2", "--kill-grace", "1", "--timeout", "600", "--worker-memory", "300m",
                  *job.probe("--listen", "--print", "hello", "--sleep", "60"))
    try:
        probes = wait_probes(job.out, 6, timeout=60, alive=True)
        alloc = allocation_of(probes)
        shown = subprocess.run(["scontrol", "show", "job", "-dd", alloc], capture_output=True, text=True).stdout
        steps = subprocess.run(["scontrol", "show", "step", "-dd", alloc], capture_output=True, text=True).stdout
        queue = subprocess.run(["squeue", "-o", "%all"], capture_output=True, text=True).stdout
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in os.listdir("/proc") if pid.isdigit()
                    and Path(f"/proc/{pid}/cmdline").exists()}
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    secret = probes["scheduler"]["env"]["PSLAUNCH_SECRET"]
    # the secret is in no Slurm record and on no command line (srun's, the wrappers', the tasks')
    for text in (shown, steps, queue, out, err):
        assert secret not in text
    assert not [pid for pid, cmd in cmdlines.items() if secret.encode() in cmd]
    # the allocation: S+N tasks over the 4 nodes, the larger role's memory, a limit from --timeout
    assert f"JobName={job.name}" in shown and "NumNodes=4" in shown and "NumTasks=5" in shown, shown
    assert "TimeLimit=00:12:00" in shown and "MinMemoryCPU=300M" in shown, shown
    # servers first, round-robin over the allocation's nodes, and the labels name the node
    # (the fifth goes where Slurm allocated a second task: a node takes no more than that)
    where = {name: job.node_of(rec).name for name, rec in probes.items() if name != "scheduler"}  # type: ignore[attr-defined]
    nodes = [n.name for n in slurm.nodes]
    assert [where[n] for n in ("server-0", "server-1", "worker-0", "worker-1")] == nodes, where
    for name, node in where.items():
        role, rank = name.split("-")
        assert f"[{role} {rank} @ {node}] hello" in out, out
        assert probes[name]["env"]["PSLAUNCH_LOCAL_PROCS"] == str(list(where.values()).count(node)), name
    assert probes["scheduler"]["netns"] == os.readlink("/proc/self/ns/net")  # the scheduler: here
    assert "placement: server 0 @ " in err
    wait_gone(slurm, job.name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iface, nodes", [("ib", ["sn1", "sn3"]), ("ib0", ["sn1"])], ids=["prefix", "name"])
def test_interface_name_or_prefix_resolves_on_each_node(job: Probes, slurm: SlurmCluster, iface: str,  # noqa: F811
                                                        nodes: list[str]) -> None:
    # the nodes' data interfaces are data0, ib0, bond0, ib1: "ib" selects ib0 on sn1 and ib1 on sn3; this
    # host has neither, so the scheduler listens on --host-ip (a login node whose interfaces differ)
    r = run_pslaunch("--launcher", "slurm", "--jobname", job.name, "--env", f"{MARK}={job.mark}",
                     "--env", f"DMLC_INTERFACE={iface}", "--host-ip", slurm.controller_b,
                     "--slurm-args", f"--nodelist={','.join(nodes)}", "-n", str(len(nodes)), "-s", "1",
                     "--kill-grace", "1", *job.probe("--listen"), timeout=100)
    assert r.returncode == 0, r.stderr
    probes = read_probes(job.out)
    assert probes["scheduler"]["env"]["DMLC_PS_ROOT_URI"] == slurm.controller_b
    for name, rec in probes.items():
        if name == "scheduler":
            continue
        node = job.node_of(rec)
        assert node.name in nodes and rec["env"]["DMLC_NODE_HOST"] == node.addr_b, (name, node)  # type: ignore
    wait_gone(slurm, job.name)


@pytest.mark.timeout(120)
def test_records_reach_the_launcher_through_srun_when_the_agents_cannot_connect(job: Probes,
                                                                              slurm: SlurmCluster) -> None:  # noqa: F811
    # -s 0 and --host-ip 127.0.0.1: the hub listens on this host's loopback, which no node reaches;
    # each agent writes its records to its stdout instead, and srun relays them
    r = job.run("-n", "3", "-s", "0", "--host-ip", "127.0.0.1", "--slurm-nodes", "3", "--kill-grace", "2",
                *job.probe("--print", "line one", "--fail", "worker-1:3:1.0", "--sleep", "60", "--child"),
                timeout=100)
    assert r.returncode == 3, r.stderr
    assert re.search(r"error: worker 1 \(Slurm step \d+\.\d+ task 1 on sn\d, pid \d+\) exited with code 3 first",
                     r.stderr), r.stderr
    for rank in range(3):
        assert re.search(rf"^\[worker {rank} @ sn\d\] line one$", r.stdout, re.M), r.stdout
    assert "worker-1 failing with code 3" in r.stderr
    wait_gone(slurm, job.name)


# --- the allocation pslaunch makes --------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_a_job_from_outside_an_allocation_leaves_squeue_empty(job: Probes, slurm: SlurmCluster,  # noqa: F811
                                                             outcome: str) -> None:
    fail = ("--fail", "worker-0:4:0.5", "--sleep", "60") if outcome == "failure" else ()
    r = job.run("-n", "2", "-s", "1", "--kill-grace", "1", *job.probe("--listen", *fail), timeout=100)
    assert r.returncode == (4 if fail else 0), r.stderr
    alloc = allocation_of(read_probes(job.out))
    assert re.search(rf"Slurm granted allocation {alloc}: ", r.stderr), r.stderr
    # released before pslaunch exits: squeue no longer lists it at all, not even COMPLETING
    assert slurm.jobs(job.name) == [] and slurm.job_state(alloc) == "", slurm.job_state(alloc)


@pytest.mark.timeout(90)
def test_an_allocation_still_pending_after_start_timeout_fails_the_launch(job: Probes,
                                                                        slurm: SlurmCluster) -> None:  # noqa: F811
    t0 = time.monotonic()
    r = job.run("-n", "1", "-s", "1", "--start-timeout", "3", "--slurm-args", "--begin=now+600",
                *job.probe("--listen"), timeout=60)
    assert r.returncode == 1, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert len(line) == 1 and "has not granted the allocation" in line[0] and "--start-timeout 3s" in line[0], r.stderr
    assert "PENDING" in line[0] and "BeginTime" in line[0], line
    assert time.monotonic() - t0 < 30
    assert read_probes(job.out) == {}  # not even the scheduler started
    wait_gone(slurm, job.name, timeout=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_pending_request_is_withdrawn_when_the_launcher_stops(job: Probes, slurm: SlurmCluster,  # noqa: F811
                                                               sig: int) -> None:
    p = job.start("-n", "1", "-s", "1", "--start-timeout", "300", "--slurm-args", "--begin=now+600",
                  *job.probe("--listen"))
    wait_for(lambda: slurm.jobs(job.name), 30, interval=0.2, what="the pending request")
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    wait_gone(slurm, job.name, timeout=15)


@pytest.mark.timeout(60)
def test_an_impossible_request_is_one_line(job: Probes) -> None:
    # 3 tasks of 3 CPUs on 2 nodes of 4 CPUs: Slurm refuses at once (a shape that can never fit)
    r = run_pslaunch("--launcher", "slurm", "--jobname", job.name, "--env", f"DMLC_INTERFACE={job.tb.subnet_a}",
                     "-n", "3", "-s", "0", "--worker-cores", "3", "--slurm-nodes", "2", *job.probe(), timeout=50)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("pslaunch: error: Slurm refused the allocation"), r.stderr
    assert "--cpus-per-task=3" in lines[0] and "Requested node configuration is not available" in lines[0], lines


# --- a lost node -------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_node_whose_slurmd_stops_fails_the_job_naming_it(job: Probes, slurm: SlurmCluster) -> None:  # noqa: F811
    p = job.start("-n", "3", "-s", "1", "--kill-grace", "1", *job.probe("--listen", "--sleep", "120"))
    probes = wait_probes(job.out, 5, timeout=60, alive=True)
    victim = job.node_of(probes["worker-1"])
    t0 = time.monotonic()
    slurm.stop_slurmd(victim)  # type: ignore[arg-type]
    try:
        _, err = p.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        bring_back(slurm, victim.name)  # type: ignore[attr-defined]
    assert p.returncode == 1, err
    errors = [x for x in err.splitlines() if x.startswith("pslaunch: error:")]
    assert f"Slurm declared node {victim.name} failed" in errors[0], err  # type: ignore[attr-defined]
    assert re.search(rf"error: worker 1 \(Slurm step \S+ task 1 on {victim.name}\b[^;]*; Slurm lost its node "  # type: ignore
                     rf"{victim.name} \(NODE_FAIL.*\) exited with code 1 first", err), err  # type: ignore[attr-defined]
    print(f"\nslurm: slurmd of {victim.name} stopped -> launcher exited after {took:.1f}s "  # type: ignore
          "(Slurm needs ~15 s to declare a node down here)")
    wait_gone(slurm, job.name)
    # the process on the lost node ran on after Slurm gave up on it; its agent stopped it
    wait_for(lambda: not job.marked_pids(), 20, interval=0.2, what="the processes on the lost node to stop")


@pytest.mark.timeout(300)
def test_a_job_restarts_on_the_nodes_left_after_slurm_loses_one(job: Probes, slurm: SlurmCluster) -> None:  # noqa: F811
    # a lost node is its processes' reason to fail, not a start failure (which no restart helps):
    # with --max-restarts the next attempt is a new allocation, on the nodes Slurm still has
    p = job.start("-n", "2", "-s", "1", "--kill-grace", "1", "--max-restarts", "1", "--restart-delay", "0",
                  *job.probe("--listen", "--sleep", "120", "--sleep-on-attempts", "0"))
    probes = wait_probes(job.out, 4, timeout=60, alive=True)
    victim = job.node_of(probes["worker-1"])
    slurm.stop_slurmd(victim)  # type: ignore[arg-type]
    try:
        _, err = p.communicate(timeout=180)  # (liveness only: Slurm takes about 15 s to declare it down)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        bring_back(slurm, victim.name)  # type: ignore[attr-defined]
    assert p.returncode == 0, err
    assert re.search(rf"attempt 1/2 failed: worker 1 on {victim.name} \(pid \d+\) exited with code 1; restarting "  # type: ignore
                     r"every process", err), err
    assert "(after 1 restart)" in err and "Traceback" not in err, err
    again = {f.stem.split(".")[0]: json.loads(f.read_text()) for f in (job.out / "history").glob("*.1.json")}
    assert sorted(again) == ["scheduler", "server-0", "worker-0", "worker-1"], sorted(again)
    assert all(job.node_of(rec).name != victim.name for n, rec in again.items() if n != "scheduler"), again  # type: ignore
    wait_gone(slurm, job.name)
    wait_for(lambda: not job.marked_pids(), 20, interval=0.2, what="the processes on the lost node to stop")


def bring_back(slurm: SlurmCluster, name: str) -> None:  # noqa: F811
    """Start the node's slurmd again; wait until Slurm sees it answer. (node-start also waits until
    the node is idle, 60 s at most: other jobs on the shared cluster may keep it busy longer.)"""
    r = subprocess.run(["bash", slurm.script, "node-start", name], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PSLAUNCH_SLURM_WAIT": "15"})
    print(f"node-start {name}: {r.stderr.strip().splitlines()[-1:] if r.returncode else 'idle'}")
    wait_for(lambda: (lambda s: bool(s) and "*" not in s and not s.startswith(("down", "unk")))(
        slurm.node_states().get(name, "")), 60, interval=0.5, what=f"{name} to answer again")


# --- from an sbatch script --------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_a_job_launched_from_an_sbatch_script(job: Probes, slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    # the batch script runs on the allocation's first node, which then also runs the scheduler
    log = tmp_path / "batch.out"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec " + shlex.join(
        pslaunch_argv("--launcher", "slurm", "--env", f"{MARK}={job.mark}", "--env",
                      f"DMLC_INTERFACE={slurm.subnet_a}", "-n", "2", "-s", "1", "--kill-grace", "1",
                      *job.probe("--listen", "--print", "in batch"))) + "\n")
    r = subprocess.run(["sbatch", "--parsable", "--wait", "--no-requeue", "-N", "3", "-J", job.name,
                        "-o", str(log), "-D", str(REPO), str(script)], capture_output=True, text=True, timeout=120)
    text = log.read_text() if log.exists() else ""
    assert r.returncode == 0, r.stderr + text
    assert "all 4 processes exited 0" in text, text
    probes = read_probes(job.out)
    batch_node = job.node_of(probes["scheduler"])  # the scheduler ran on the batch host
    assert probes["scheduler"]["env"]["DMLC_PS_ROOT_URI"] == batch_node.addr_a  # type: ignore[attr-defined]
    alloc = r.stdout.strip().split(";")[0]
    for name in ("server-0", "worker-0", "worker-1"):
        rec = probes[name]
        assert rec["env"]["SLURM_JOB_ID"] == alloc and rec["env"]["DMLC_NODE_HOST"] == job.node_of(rec).addr_a
        role, rank = name.split("-")
        assert f"[{role} {rank} @ {job.node_of(rec).name}] in batch" in text  # type: ignore[attr-defined]
    wait_gone(slurm, job.name)


def job_field(alloc: str, field: str) -> str:
    """``FIELD=value`` of ``scontrol show job`` (it keeps an ended job for MinJobAge, 120 s here)."""
    shown = subprocess.run(["scontrol", "show", "job", alloc], capture_output=True, text=True, timeout=20).stdout
    found = re.search(rf"\b{field}=(\S*)", shown)
    return found.group(1) if found else ""


def batch_script(path: Path, job: Probes, slurm: SlurmCluster, *args: str) -> Path:  # noqa: F811
    """A batch script at ``path`` that execs pslaunch on the allocation (``--launcher slurm``, the
    job's mark, the testbed's network) with ``args``."""
    path.write_text("#!/bin/sh\nexec " + shlex.join(
        pslaunch_argv("--launcher", "slurm", "--env", f"{MARK}={job.mark}", "--env",
                      f"DMLC_INTERFACE={slurm.subnet_a}", *args)) + "\n")
    return path


@pytest.mark.timeout(240)
def test_a_requeued_batch_job_goes_on_counting_attempts(job: Probes, slurm: SlurmCluster,  # noqa: F811
                                                        tmp_path: Path) -> None:
    # issue 31: when Slurm requeues a job (sbatch --requeue, then scontrol requeue, as after a node
    # failure or a preemption), it ends the batch script and runs it again with SLURM_RESTART_COUNT=1;
    # the pslaunch of the second run starts at attempt 1, so that a program resumes as after a restart
    log = tmp_path / "batch.out"
    script = batch_script(tmp_path / "job.sh", job, slurm, "-n", "2", "-s", "1", "--kill-grace", "1",
                          "--max-restarts", "1", *job.probe("--listen", "--sleep", "60", "--sleep-on-attempts", "0"))
    r = subprocess.run(["sbatch", "--parsable", "--requeue", "-N", "2", "-J", job.name, "-o", str(log),
                        "--open-mode=append", "-D", str(REPO), str(script)],
                       capture_output=True, text=True, timeout=60, check=True)
    alloc = r.stdout.strip().split(";")[0]
    try:
        first = wait_probes(job.out, 4, timeout=60, alive=True)
        assert {name: rec["env"]["PSLAUNCH_ATTEMPT"] for name, rec in first.items()} == dict.fromkeys(first, "0")
        assert not {rec["env"].get("SLURM_RESTART_COUNT", "0") for rec in first.values()} - {"0"}, first
        nodes = subprocess.run(["squeue", "-h", "-j", alloc, "-o", "%N"], capture_output=True, text=True,
                               timeout=20, check=True).stdout.strip()
        t0 = time.monotonic()
        subprocess.run(["scontrol", "requeue", alloc], check=True, timeout=20)
        wait_for(lambda: slurm.job_state(alloc) == "PENDING", 30, interval=0.1, what="the job requeued")
        t1 = time.monotonic()
        # the first run ended: nothing of it is left on the nodes
        wait_for(lambda: not job.marked_pids(), 20, interval=0.1, what="the first run's processes to end")
        t2 = time.monotonic()
        assert job_field(alloc, "Reason") == "BeginTime", job_field(alloc, "Reason")
        # Slurm holds a requeued job 121 s (BeginTime: the job credential's lifetime, 120 s, and 1), and a
        # job started at once on the nodes it left fails ("Job credential revoked"): start it now on others
        subprocess.run(["scontrol", "update", f"jobid={alloc}", f"ExcNodeList={nodes}", "StartTime=now"],
                       check=True, timeout=20)
        wait_gone(slurm, job.name, timeout=120)
        t3 = time.monotonic()
    finally:
        slurm.scancel(alloc)
    text = log.read_text()
    assert job_field(alloc, "JobState") == "COMPLETED" and job_field(alloc, "Restarts") == "1", text
    # pslaunch, the first run's batch shell, got Slurm's SIGTERM and stopped every process; the second ran to its end
    assert "stopped by SIGTERM after" in text and "every process was terminated" in text, text
    assert text.count("all 4 processes exited 0") == 1, text
    second = read_probes(job.out)
    first_nodes = {job.node_of(rec).name for rec in first.values()}  # type: ignore[attr-defined]
    assert set(second) == set(first), second
    for name, rec in second.items():
        env = rec["env"]
        assert env["SLURM_JOB_ID"] == alloc and env["SLURM_RESTART_COUNT"] == "1", (name, env)
        assert (env["PSLAUNCH_ATTEMPT"], env["DMLC_NUM_ATTEMPT"], env["PSLAUNCH_MAX_RESTARTS"]) == ("1", "1", "1"), \
            (name, env)
        assert rec["previous_alive"] == [] and rec["pid"] != first[name]["pid"], (name, rec)
        assert job.node_of(rec).name not in first_nodes, (name, first_nodes)  # type: ignore[attr-defined]
    print(f"\nslurm requeue: squeue PENDING {t1 - t0:.1f}s after scontrol requeue, the first run's processes "
          f"gone after {t2 - t0:.1f}s, the second run ended {t3 - t2:.1f}s after StartTime=now")


# --- a batch system's notice (SIGUSR1, SIGUSR2) ------------------------------------------------------


def notices(out: Path) -> dict[str, list[tuple[str, int]]]:
    """What each probe recorded with ``--notices``: its name -> ``[(signal, pid), ...]``."""
    return {f.name[:-len(".notices")]: [(w[0], int(w[1])) for w in map(str.split, f.read_text().splitlines())]
            for f in out.glob("*.notices")}


def steps_of(alloc: str) -> list[str]:
    r = subprocess.run(["squeue", "-h", "-s", "-j", alloc, "-o", "%i"], capture_output=True, text=True, timeout=20)
    return sorted(x for x in r.stdout.split() if re.fullmatch(rf"{alloc}\.\d+", x))


@pytest.mark.timeout(120)
def test_a_step_signal_reaches_each_task_once_and_the_job_goes_on(job: Probes, slurm: SlurmCluster) -> None:  # noqa: F811
    # what srun --signal=USR1@T does at T seconds before the step's limit (slurmstepd signals every
    # process of the step); the task wrapper must neither die of it nor pass on a second one
    p = job.start("-n", "2", "-s", "1", *job.probe("--listen", "--sleep", "12", "--notices"))
    try:
        probes = wait_probes(job.out, 4, timeout=60, alive=True)
        steps = steps_of(allocation_of(probes))
        assert len(steps) == 2, steps  # the servers' step, the workers' step
        for step in steps:  # (scancel may say "Invalid job id" for a node of the allocation outside the
            # step, here 22.05 for a one-node step of a two-node allocation, and still signal the step)
            subprocess.run(["scancel", "--signal=USR1", step], capture_output=True, timeout=20)
        want = {n: [("USR1", rec["pid"])] for n, rec in probes.items() if n != "scheduler"}
        wait_for(lambda: notices(job.out) == want, 10, interval=0.1, what="SIGUSR1 in every task")
    finally:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert notices(job.out) == want  # once each


@pytest.mark.timeout(150)
def test_a_batch_shell_signal_reaches_every_process_once(job: Probes, slurm: SlurmCluster,  # noqa: F811
                                                          tmp_path: Path) -> None:
    # sbatch --signal=B:USR1@T signals the batch shell, which here is pslaunch (exec); scancel
    # --batch is the same signal now
    log = tmp_path / "batch.out"
    script = batch_script(tmp_path / "job.sh", job, slurm, "-n", "2", "-s", "1", "--kill-grace", "1",
                          *job.probe("--listen", "--sleep", "12", "--notices"))
    r = subprocess.run(["sbatch", "--parsable", "--no-requeue", "-N", "3", "-J", job.name, "-o", str(log),
                        "-D", str(REPO), str(script)], capture_output=True, text=True, timeout=60, check=True)
    alloc = r.stdout.strip().split(";")[0]
    probes = wait_probes(job.out, 4, timeout=60, alive=True)
    subprocess.run(["scancel", "--batch", "--signal=USR1", alloc], check=True, timeout=20)
    want = {n: [("USR1", rec["pid"])] for n, rec in probes.items()}
    wait_for(lambda: notices(job.out) == want, 10, interval=0.1, what="SIGUSR1 in every process")
    wait_gone(slurm, job.name, timeout=60)
    text = log.read_text()
    assert "SIGUSR1 received: passing it on to every process" in text, text
    assert "all 4 processes exited 0" in text, text
    assert notices(job.out) == want


# --- the trainer ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dist_sync_on_slurm_reaches_its_local_accuracy(job: Probes, slurm: SlurmCluster) -> None:  # noqa: F811
    data = H.mnist_dir()
    args = ("--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1", "--num-examples", "3200",
            "--batch-size", "64", "--disp-batches", "0", "--seed", "3")
    t0 = time.monotonic()
    local = H.run_launched(*args, data_dir=data)
    t1 = time.monotonic()
    r = subprocess.run(pslaunch_argv("-n", "2", "-s", "1", *job.argv(), *H.train_argv(*args, data_dir=data)),
                       capture_output=True, text=True, timeout=240, env=H.child_env(), cwd=REPO)
    t2 = time.monotonic()
    assert local.returncode == 0, local.stderr[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 4 processes exited 0" in r.stderr
    (l0, _), (s0, s1) = H.summaries(local.stdout), H.summaries(r.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == l0["batches_per_epoch"] == 25
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # one set of weights on the server
    assert l0["validation_accuracy"] > 0.85
    assert abs(s0["validation_accuracy"] - l0["validation_accuracy"]) <= 0.01, (s0, l0)
    assert re.search(r"^\[worker 0 @ sn\d\] .*Validation-accuracy=", r.stderr, re.M)
    wait_gone(slurm, job.name)
    print(f"\nslurm trainer: dist_sync -n 2 -s 1, 1 epoch of 3200 examples: local {l0['validation_accuracy']:.4f} "
          f"in {t1 - t0:.1f}s, slurm {s0['validation_accuracy']:.4f} in {t2 - t1:.1f}s")


# --- doctor -----------------------------------------------------------------------------------------


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(pslaunch_argv("doctor", "--launcher", "slurm", *args), capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def problems(r: subprocess.CompletedProcess) -> list[str]:
    text = r.stdout.split("problem", 1)[1] if "problem" in r.stdout else ""
    return [x.strip() for x in text.splitlines()[1:] if x.strip()]


@pytest.mark.timeout(60)
def test_doctor_passes_on_a_working_cluster(slurm: SlurmCluster) -> None:  # noqa: F811
    r = doctor("--env", f"DMLC_INTERFACE={slurm.subnet_a}")
    assert r.returncode == 0, r.stdout
    assert "everything a job needs is here" in r.stdout
    for check in ("commands", "munge", "controller", "partition", "free nodes", "address"):
        assert re.search(rf"^  {check} +ok ", r.stdout, re.M), r.stdout


@pytest.mark.timeout(60)
def test_doctor_names_what_is_missing_one_line_each(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    # no srun: nothing of Slurm's on PATH
    r = doctor("--host-ip", slurm.controller_a, env={**os.environ, "PATH": str(tmp_path)})
    assert r.returncode == 1 and len(problems(r)) == 1, r.stdout
    assert problems(r)[0].startswith("commands: srun, scontrol") and "not found on PATH" in problems(r)[0]
    # no munge: a configuration whose munge socket is not there
    conf = tmp_path / "slurm.conf"
    conf.write_text(Path(slurm.conf).read_text().replace("socket=/run/munge/munge.socket.2",
                                                         f"socket={tmp_path}/munge.socket"))
    r = doctor("--host-ip", slurm.controller_a, env={**os.environ, "SLURM_CONF": str(conf)})
    assert r.returncode == 1, r.stdout
    assert problems(r)[0].startswith(f"munge: no munge socket at {tmp_path}/munge.socket"), r.stdout
    assert any(p.startswith("controller: scontrol ping") for p in problems(r)), r.stdout
    # no partition
    r = doctor("--host-ip", slurm.controller_a, "--queue", "nosuch")
    assert r.returncode == 1 and problems(r) == [f"partition: no partition 'nosuch' (sinfo lists "
                                                  f"{slurm.partition}); give another with --queue"], r.stdout
    # no scheduler address
    r = doctor()
    assert r.returncode == 1 and len(problems(r)) == 1 and problems(r)[0].startswith("address: "), r.stdout


@pytest.mark.timeout(90)
def test_doctor_says_when_no_node_is_free(slurm: SlurmCluster) -> None:  # noqa: F811
    name = f"pslt-{uuid.uuid4().hex[:8]}"
    slurm.salloc(len(slurm.nodes), name, "--exclusive")  # every node, whole
    try:
        r = doctor("--host-ip", slurm.controller_a)
    finally:
        slurm.scancel(*slurm.jobs(name))
    assert r.returncode == 1, r.stdout
    assert problems(r) == [f"free nodes: no free nodes in partition {slurm.partition} (0 of {len(slurm.nodes)} idle "
                           f"or mixed); the job would wait in the queue (squeue -p {slurm.partition})"], r.stdout
    wait_gone(slurm, name)
