"""--launcher ray beyond the conformance suite (which runs every scenario on the Ray test cluster,
tests/integration/contract): a placement Ray cannot make is one line and leaves nothing, ``--ray-spread``
puts each process on a node of its own, every job's placement group is removed, ``pslaunch doctor
--launcher ray`` holds the job against the cluster's free resources, a node lost mid-job (its raylet
killed) ends the job naming that node and leaving nothing, and the trainer (dist_sync) runs on
it as on sge and yarn. (DDP and XGBoost on Ray: tests/integration/test_collective_jobs.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import ray_testbed
from support import trainer as H
from support.clusters import RayCluster
from support.helpers import REPO, pslaunch_argv, read_probes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.ray]


@pytest.fixture
def cluster(ray_cluster, tmp_path: Path):
    out = tmp_path / "probes"
    out.mkdir()
    c = RayCluster(out, ray_cluster)
    yield c
    c.close()


def nothing_left(c: RayCluster) -> None:
    wait_for(lambda: not c.leftovers() and not c.tb.live_placement_groups(), 30, interval=0.5,  # type: ignore[attr-defined]
             what="no process, actor or placement group of the job")


@pytest.mark.timeout(120)
def test_a_placement_ray_cannot_make_is_one_line_and_leaves_nothing(cluster: RayCluster) -> None:
    # 4 workers of 2 CPUs and a server of 1: 9 CPUs on a cluster of 3 nodes with 2 each
    t0 = time.monotonic()
    r = cluster.run("-n", "4", "-s", "1", "--worker-cores", "2", "--start-timeout", "5",
                    *cluster.probe("--sleep", "60"))
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert errors == ["pslaunch: error: Ray could not place the job within --start-timeout 5s: it needs 1 bundle of "
                      "{CPU: 1} + 4 bundles of {CPU: 2}; the cluster has 3 nodes with 2 CPUs free each (6 in all)"], \
        r.stderr
    assert "Traceback" not in r.stderr and took < 60
    assert not list(cluster.out.glob("*.json")) or sorted(read_probes(cluster.out)) == ["scheduler"]
    nothing_left(cluster)


@pytest.mark.timeout(120)
def test_ray_spread_puts_each_process_on_its_own_node_and_a_fourth_cannot_be_placed(cluster: RayCluster) -> None:
    r = cluster.run("-n", "3", "-s", "0", "--tracker", "torch", "--ray-spread", *cluster.probe())
    assert r.returncode == 0, r.stderr
    probes = read_probes(cluster.out)
    nodes = {cluster.node_of(probes[f"worker-{i}"]).name for i in range(3)}  # type: ignore[attr-defined]
    assert nodes == {"r0", "r1", "r2"}, probes
    for i in range(3):
        rec = probes[f"worker-{i}"]
        assert rec["env"]["DMLC_NODE_HOST"] == cluster.node_host(f"worker-{i}", rec)
    nothing_left(cluster)
    r = cluster.run("-n", "4", "-s", "0", "--ray-spread", "--start-timeout", "3", *cluster.probe())
    assert r.returncode == 1 and "4 bundles of {CPU: 1}, each on its own node (--ray-spread)" in r.stderr, r.stderr
    nothing_left(cluster)


@pytest.mark.timeout(120)
def test_after_a_failed_job_no_actor_and_no_placement_group_is_left(cluster: RayCluster) -> None:
    # a job whose processes leave setsid'd grandchildren, and whose worker 1 fails
    r = cluster.run("-n", "3", "-s", "1", "--kill-grace", "1",
                    *cluster.probe("--listen", "--sleep", "60", "--child", "--escape", "--fail", "worker-1:5:2"))
    assert r.returncode == 5, r.stderr
    assert "worker 1" in next(x for x in r.stderr.splitlines() if " first" in x)
    nothing_left(cluster)


@pytest.mark.timeout(300)
def test_a_lost_node_ends_the_job_naming_the_node_and_leaves_nothing(cluster: RayCluster) -> None:
    # one worker per node; then r2's raylet is killed (the node is lost: Ray's workers there end with it)
    tb = cluster.tb
    lost = tb.nodes[2]  # type: ignore[attr-defined]
    proc = cluster.start("-n", "3", "-s", "0", "--ray-spread", "--kill-grace", "1", *cluster.probe("--sleep", "240"))
    try:
        wait_for(lambda: len(list(cluster.out.glob("worker-*.json"))) == 3, 120, interval=0.5,
                 what="3 workers running")
        probes = read_probes(cluster.out)
        (victim,) = [n for n, rec in probes.items() if cluster.node_of(rec).name == lost.name]  # type: ignore
        raylets = [p for p in tb.pids(lost) if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]  # type: ignore
        assert len(raylets) == 1, raylets
        os.kill(raylets[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)  # (liveness only: about 5 s here)
        assert proc.returncode not in (0, None), err
        first = next(x for x in err.splitlines() if " first" in x)
        # as slurm says of a node it lost: exit code 1, the node named (not "its Ray actor died")
        assert proc.returncode == 1, err
        assert first.startswith(f"pslaunch: error: worker {victim.split('-')[1]} ") and f" on {lost.name}" in first \
            and f"Ray lost its node {lost.addr}: its raylet at {lost.addr}:" in first \
            and "ActorUnavailableError" not in first and "actor died" not in first, err
        assert f"pslaunch: error: Ray lost node {lost.addr} " in err, err
        # Ray's error to the drivers is one warning line, without the dead raylet's last 20 log lines
        assert "Traceback" not in err and "] (raylet) " not in out + err, out + err
        wait_for(lambda: not cluster.leftovers(), 30, interval=0.5, what="no process of the job on any node")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ray_testbed.start()  # the lost node back (the whole cluster restarts: about 20 s)


def _kill_raylet(cluster: RayCluster, node: object) -> None:
    raylets = [p for p in cluster.tb.pids(node) if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]  # type: ignore
    assert len(raylets) == 1, raylets
    os.kill(raylets[0], signal.SIGKILL)


@pytest.mark.timeout(400)
def test_a_job_restarts_on_the_nodes_left_after_a_node_is_lost(cluster: RayCluster) -> None:
    # 2 workers on 2 nodes (--ray-spread); the raylet of a worker node that is not the head is killed:
    # attempt 1 gets a new placement group on the 2 nodes left and ends 0
    proc = cluster.start("-n", "2", "-s", "0", "--ray-spread", "--kill-grace", "1", "--max-restarts", "1",
                         "--restart-delay", "0", "--start-timeout", "180",
                         *cluster.probe("--sleep", "240", "--sleep-on-attempts", "0"))
    try:
        wait_for(lambda: len(list((cluster.out / "history").glob("worker-*.0.json"))) == 2, 120, interval=0.5,
                 what="2 workers running")
        probes = read_probes(cluster.out)
        used = [cluster.node_of(probes[f"worker-{i}"]) for i in range(2)]
        lost = next(n for n in used if not n.head)  # type: ignore[attr-defined]
        _kill_raylet(cluster, lost)
        out, err = proc.communicate(timeout=300)  # (liveness only)
        assert proc.returncode == 0, err
        assert re.search(rf"error: worker \d \(Ray actor of bundle \d on {lost.name}, pid \d+; Ray lost its node "
                         rf"{re.escape(lost.addr)}: its raylet", err), err  # type: ignore[attr-defined]
        assert re.search(rf"attempt 1/2 failed: worker \d on {lost.name} \(pid \d+\) exited with code 1; restarting "
                         r"every process", err), err  # type: ignore[attr-defined]
        assert "(after 1 restart)" in err and "Traceback" not in err, err
        again = {f.stem.split(".")[0]: json.loads(f.read_text()) for f in (cluster.out / "history").glob("*.1.json")}
        assert sorted(again) == ["worker-0", "worker-1"], sorted(again)
        assert all(cluster.node_of(rec).name != lost.name for rec in again.values()), again  # type: ignore
        wait_for(lambda: not cluster.leftovers(), 30, interval=0.5, what="no process of the job on any node")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ray_testbed.start()  # the lost node back (the whole cluster restarts: about 20 s)


@pytest.mark.timeout(400)
def test_a_worker_on_a_lost_node_is_replaced_in_place_on_a_node_left(cluster: RayCluster, tmp_path: Path) -> None:
    # --restart-scope process, each process on its own node; a worker node's raylet is killed: the
    # worker there is replaced by a new actor in a one-bundle placement group on a node left, while
    # the scheduler, the server and the other worker run on; the job ends 0 in its first attempt
    summary = tmp_path / "summary.json"
    proc = cluster.start("-n", "2", "-s", "1", "--ray-spread", "--kill-grace", "1", "--max-restarts", "1",
                         "--restart-scope", "process", "--start-timeout", "180", "--summary-json", str(summary),
                         *cluster.probe("--listen", "--sleep", "30"))
    try:
        wait_for(lambda: len(list((cluster.out / "history").glob("*.0.json"))) == 4, 120, interval=0.5,
                 what="the scheduler, the server and 2 workers running")
        probes = read_probes(cluster.out)
        victim = next(f"worker-{i}" for i in range(2) if not cluster.node_of(probes[f"worker-{i}"]).head)  # type: ignore
        lost = cluster.node_of(probes[victim])
        _kill_raylet(cluster, lost)
        out, err = proc.communicate(timeout=300)  # (liveness only: about 45 s here)
        assert proc.returncode == 0, err
        assert f"pslaunch: error: Ray lost node {lost.addr} " in err, err  # type: ignore[attr-defined]
        assert re.search(rf"{victim.replace('-', ' ')} on {lost.name} \(pid \d+\) exited with code 1; replacing it in "  # type: ignore
                         r"place \(restart 1/1\)", err), err
        doc = json.loads(summary.read_text())
        assert [(a["attempt"], a["reason"]) for a in doc["attempts"]] == [(0, "success")], doc["attempts"]
        (rep,) = doc["replacements"]
        new = json.loads((cluster.out / "history" / f"{victim}~1.0.json").read_text())
        assert rep["process"] == victim and cluster.node_of(new).name != lost.name, (rep, new)  # type: ignore
        assert "Traceback" not in err
        wait_for(lambda: not cluster.leftovers() and not cluster.tb.live_placement_groups(), 60,  # type: ignore
                 interval=0.5, what="no process or placement group of the job")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ray_testbed.start()  # the lost node back (the whole cluster restarts: about 20 s)


@pytest.mark.timeout(180)
def test_the_job_secret_is_in_no_ray_log_and_no_ray_state(cluster: RayCluster) -> None:
    # the task document (the secret inside) goes to each actor as an argument of its method call:
    # Ray must neither log nor keep it (its session directories, its GCS tables)
    r = cluster.run("-n", "2", "-s", "1", *cluster.probe("--sleep", "1"))
    assert r.returncode == 0, r.stderr
    secrets = {rec["env"]["PSLAUNCH_SECRET"] for rec in read_probes(cluster.out).values()}
    (secret,) = secrets
    assert len(secret) >= 32
    needles = [secret.encode(), secret[:16].encode(), secret[-16:].encode()]  # (and halves: the document is chunked)
    found = []
    for path in Path(ray_testbed.TEMP).rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                found += [str(path) for n in needles if n in data]
        except OSError:
            continue
    assert not found, found
    state = cluster.tb.state_dump()  # type: ignore[attr-defined]
    assert "pslaunch-" in state and not any(n.decode() in state for n in needles)
    assert not any(n.decode() in r.stdout + r.stderr for n in needles)


@pytest.mark.timeout(120)
def test_a_launcher_that_is_not_on_a_node_of_the_cluster_is_one_line(cluster: RayCluster) -> None:
    # the launcher in this machine's own namespace, not a node's: Ray would place the actors, which
    # could never reach the driver (they waited out --start-timeout)
    t0 = time.monotonic()
    r = subprocess.run(pslaunch_argv("--launcher", "ray", "--ray-address", cluster.tb.address,  # type: ignore
                                     "--host-ip", cluster.tb.bridge, "-n", "1", "-s", "0",  # type: ignore
                                     "--env", f"PSLAUNCH_TEST_MARK={cluster.mark}", "true"),
                       capture_output=True, text=True, timeout=100, cwd=REPO)
    errors = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    assert errors[0].startswith(f"pslaunch: error: this machine is not a node of the Ray cluster at "
                                f"{cluster.tb.address}: ") and "run pslaunch on a node of the cluster" in errors[0] \
        and "ray://" in errors[0], errors  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 60 and "Traceback" not in r.stderr
    nothing_left(cluster)


def doctor(c: RayCluster, *args: str) -> subprocess.CompletedProcess:
    argv = [*c.tb.launcher_prefix(), *pslaunch_argv("doctor", "--launcher", "ray", "--ray-address",  # type: ignore
                                                     c.tb.address, "--host-ip", c.tb.head.addr, *args)]  # type: ignore
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.timeout(120)
def test_doctor_lists_the_nodes_and_holds_the_job_against_their_free_resources(cluster: RayCluster) -> None:
    r = doctor(cluster, "-n", "4", "-s", "2", "python", "train.py")
    assert r.returncode == 0, r.stdout + r.stderr
    for n in cluster.tb.nodes:  # type: ignore[attr-defined]
        assert f"node {n.addr}" in r.stdout and "CPU 2/2 free" in r.stdout
    assert "6 bundles ({CPU: 1}, PACK) fit the free resources now" in r.stdout
    r = doctor(cluster, "-n", "4", "--worker-cores", "2", "python", "train.py")
    assert r.returncode == 1
    assert "job fits: it needs 4 bundles of {CPU: 2}; the cluster has 3 nodes with 2 CPUs free each (6 in all)" \
        in r.stdout, r.stdout


# --- the trainer --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dist_sync_on_ray(cluster: RayCluster) -> None:
    data = H.mnist_dir()
    t0 = time.monotonic()
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--env", "OMP_NUM_THREADS=1", *H.train_argv(
        "--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1", "--num-examples", "640",
        "--batch-size", "64", "--disp-batches", "0", "--seed", "3", data_dir=data), timeout=280)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 4 processes exited 0" in r.stderr
    s0, s1 = H.summaries(r.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # one set of weights on the servers
    nothing_left(cluster)
    print(f"\nray timing: train_mnist dist_sync -n 2 -s 1, 1 epoch of 640 examples: {took:.1f}s")
