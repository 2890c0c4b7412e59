"""``--launcher k8s`` on the test cluster (scripts/setup-k8s.sh: a real control plane, 3 nodes run
by scripts/k8s_node.py), as pslaunch's service account: a PS job's Pods run the probe and end 0
with labelled output; a failing worker stops every Pod and the launcher exits with its code; an
unschedulable job is one line in the scheduler's words; the bundled trainer trains under dist_sync;
and after every job no Pod, Service, ConfigMap or Secret of it is left. (DDP and XGBoost on k8s:
tests/integration/test_collective_jobs.py.)

The node program runs each Pod's command on this machine's filesystem (there are no images):
``--k8s-image`` is required by pslaunch and ignored by the test nodes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from support import trainer as T
from support.helpers import probe_argv, run_pslaunch, start_pslaunch, wait_for
from support.k8s_testbed import K8sCluster

from launcher.backends import k8s

pytestmark = [pytest.mark.integration, pytest.mark.k8s]

#: this machine's address on the Pods' bridge (psk8s): where the launcher's scheduler and hub listen
GATEWAY = "10.202.8.1"
DEADLINE = 120.0


def options(cluster: K8sCluster) -> list[str]:
    return ["--launcher", "k8s", "--k8s-namespace", cluster.namespace, "--k8s-image", "localhost/unused:test",
            "--host-ip", GATEWAY, "--start-timeout", "60"]


def launcher_env(cluster: K8sCluster) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}


def job_of(stderr: str) -> str:
    """The job's object name, from the launcher's "created N Pods ... (job NAME)" line."""
    m = re.search(r"created \d+ Pods in namespace \S+ \(job ([a-z0-9-]+)\)", stderr)
    assert m, stderr
    return m.group(1)


def left_of(cluster: K8sCluster, job: str) -> list[str]:
    """What of ``job`` the cluster still holds (as the admin: the Secrets too)."""
    core, ns, sel = cluster.core(admin=True), cluster.namespace, f"{k8s.LABEL_JOB}={job}"
    left = [f"pod/{p.metadata.name}" for p in core.list_namespaced_pod(ns, label_selector=sel).items]
    left += [f"service/{s.metadata.name}" for s in core.list_namespaced_service(ns, label_selector=sel).items]
    left += [f"configmap/{c.metadata.name}" for c in core.list_namespaced_config_map(ns, label_selector=sel).items]
    left += [f"secret/{s.metadata.name}" for s in core.list_namespaced_secret(ns, label_selector=sel).items]
    return left


def records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*-*.json")}


def test_a_ps_job_runs_in_pods_and_ends_0_with_labelled_output(k8s_cluster: K8sCluster, tmp_path: Path) -> None:
    out = tmp_path / "probes"
    out.mkdir()
    r = run_pslaunch(*options(k8s_cluster), "-n", "2", "-s", "1", *probe_argv(out, "--print", "hello"),
                     timeout=DEADLINE, env=launcher_env(k8s_cluster))
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stderr)
    for label in ("worker 0", "worker 1", "server 0"):
        assert f"[{label}] hello" in r.stdout, r.stdout + r.stderr
    recs = records(out)
    assert sorted(recs) == ["server-0", "worker-0", "worker-1"], sorted(recs)
    here = os.readlink("/proc/self/ns/net")
    for name, rec in recs.items():
        env = rec["env"]
        role = name.split("-")[0]
        # each in a Pod of its own: its hostname, its own network namespace and address on the bridge
        assert rec["host"] == name and rec["netns"] != here, rec
        assert env["DMLC_NODE_HOST"].startswith("10.202.8.") and env["DMLC_NODE_HOST"] != GATEWAY, env
        assert env["DMLC_ROLE"] == role and env["DMLC_PS_ROOT_URI"] == GATEWAY, env
        assert "PSLAUNCH_TASK" not in env  # the wrapper took the task document out
    # distinct task ids and addresses (each wrapper's index from its own Pod's rank label)
    assert len({rec["env"]["DMLC_TASK_ID"] for rec in recs.values()}) == 3
    assert len({rec["env"]["DMLC_NODE_HOST"] for rec in recs.values()}) == 3
    assert left_of(k8s_cluster, job) == []


def test_a_failing_worker_stops_every_pod_and_its_code_is_the_jobs(k8s_cluster: K8sCluster, tmp_path: Path) -> None:
    out = tmp_path / "probes"
    out.mkdir()
    delay = 3.0
    p = start_pslaunch(*options(k8s_cluster), "-n", "2", "-s", "1",
                       *probe_argv(out, "--sleep", "300", "--fail", f"worker-1:3:{delay}"),
                       env=launcher_env(k8s_cluster))
    try:
        core, ns = k8s_cluster.core(admin=True), k8s_cluster.namespace

        # while they run: the task document (the job's secret) is in the job's Secret, not in any Pod's spec
        def running() -> list:
            pods = core.list_namespaced_pod(ns, label_selector=k8s.LABEL_JOB).items
            return pods if len(pods) == 3 and all(x.status.phase == "Running" for x in pods) else []

        pods = wait_for(running, DEADLINE, interval=0.2, what="3 Running Pods of the job")
        for pod in pods:
            env = {e.name: e for e in pod.spec.containers[0].env}
            task = env[k8s.TASK_ENV]
            assert task.value is None and task.value_from.secret_key_ref.name.endswith("-task"), task
            assert pod.metadata.labels[k8s.LABEL_ATTEMPT] == "0"
            assert pod.metadata.owner_references[0].kind == "ConfigMap"
        stdout, stderr = p.communicate(timeout=DEADLINE)
        ended = time.time()
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 3, stdout + stderr
    assert "worker 1" in stderr and "exited with code 3" in stderr, stderr
    job = job_of(stderr)
    recs = records(out)
    failed_at = recs["worker-1"]["time"] + delay
    # every Pod was gone before the launcher exited (it waits for that), long before the others' 300 s
    took = ended - failed_at
    print(f"from worker 1's failure to the launcher's exit with every Pod gone: {took:.1f} s")
    assert took < 60, took
    assert left_of(k8s_cluster, job) == []


def test_an_unschedulable_job_is_one_line_with_the_schedulers_reason(k8s_cluster: K8sCluster,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "probes"
    out.mkdir()
    opts = [*options(k8s_cluster)[:-2], "--start-timeout", "5"]
    r = run_pslaunch(*opts, "-n", "2", "-s", "1", "--worker-cores", "64", *probe_argv(out),
                     timeout=DEADLINE, env=launcher_env(k8s_cluster))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert len(errors) == 1, r.stderr
    # the scheduler's own words: 64 CPUs fit none of the 3 nodes (8 each)
    assert re.search(r"2 of 3 Pods not running after --start-timeout 5s .*worker 0, worker 1: "
                     r"Unschedulable: 0/3 nodes are available: 3 Insufficient cpu", errors[0]), errors[0]
    assert left_of(k8s_cluster, job_of(r.stderr)) == []


def test_without_an_image_it_is_one_line(k8s_cluster: K8sCluster) -> None:
    r = run_pslaunch("--launcher", "k8s", "-n", "1", sys.executable, "-c", "pass", timeout=DEADLINE,
                     env=launcher_env(k8s_cluster))
    assert r.returncode != 0
    assert "--launcher k8s needs --k8s-image IMAGE" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_launcher_killed_with_sigkill_leaves_nothing(k8s_cluster: K8sCluster, tmp_path: Path) -> None:
    """Its reaper (a session of its own, reading the launcher's pipe) deletes the job's objects;
    the nodes then stop the Pods' processes."""
    import signal

    out = tmp_path / "probes"
    out.mkdir()
    p = start_pslaunch(*options(k8s_cluster), "-n", "2", "-s", "1", *probe_argv(out, "--sleep", "300"),
                       env=launcher_env(k8s_cluster))
    try:
        wait_for(lambda: len(records(out)) == 3, DEADLINE, interval=0.2, what="3 probes running")
        p.send_signal(signal.SIGKILL)
        _, stderr = p.communicate(timeout=DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    job = job_of(stderr)
    wait_for(lambda: left_of(k8s_cluster, job) == [], 60, interval=0.3, what=f"nothing of {job} left")
    pids = [rec["pid"] for rec in records(out).values()]
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 60, interval=0.3,
             what="the probes' processes gone")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dist_sync_on_k8s(k8s_cluster: K8sCluster) -> None:
    """The bundled trainer, dist_sync, its workers and server in Pods: one set of weights on the
    server, so both workers validate alike, and nothing of the job is left."""
    data = T.mnist_dir()
    r = run_pslaunch(*options(k8s_cluster), "-n", "2", "-s", "1", "--kill-grace", "1", "--env", "OMP_NUM_THREADS=1",
                     *T.train_argv("--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1",
                                   "--num-examples", "640", "--batch-size", "64", "--disp-batches", "0",
                                   "--seed", "3", data_dir=data),
                     env=launcher_env(k8s_cluster), timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 4 processes exited 0" in r.stderr
    s0, s1 = T.summaries(r.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]
    assert left_of(k8s_cluster, job_of(r.stderr)) == []
