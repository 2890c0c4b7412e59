# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""Real collective programs under ``--tracker``: XGBoost 2.0 (rabit), XGBoost 3.0 (its own tracker) and
PyTorch DDP (torch), each checked against one process trained on all the data.

* XGBoost 2.0.3 under plain ``pslaunch -n 2 -s 0`` (local, ray and k8s): one job of world size 2 (rabit reads the
  variables itself), the same model on both workers, equal to one process on all the data;
* XGBoost 3.0 under ``--tracker xgboost`` (local, ray and k8s): predictions identical to one process on all the data;
* a torch job restarted twice (``--max-restarts``): one store program, a fresh store on a new port
  in each attempt, holding no key of an attempt before;
* DDP (gloo, float64) under ``--tracker torch`` on local, over ssh on the testbed (2 hosts,
  ``DMLC_INTERFACE`` as a CIDR, and without it: each host's interface of the address ssh reached),
  under mpi (Open MPI, MPICH), sge, yarn, slurm, ray and k8s: the parameters of
  every rank equal those of one process trained on the ranks' batches together.

Workers are tests/bin/xgb_worker.py and tests/bin/ddp_worker.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.clusters import make_cluster
from support.helpers import BIN, run_pslaunch, xgboost_python
from support.testbed import Testbed

pytestmark = pytest.mark.integration

DDP = str(BIN / "ddp_worker.py")
XGB = str(BIN / "xgb_worker.py")
DEADLINE = 240  # liveness only


def xgb(version: str) -> str:
    python = xgboost_python(version)
    if python is None:
        pytest.skip(f"the XGBoost {version} venv is missing (run scripts/deps/70-xgboost.sh)")
    return python


def results(out: Path) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("*.json"))}


def solo_xgb(python: str, out: Path) -> dict:
    r = subprocess.run([python, XGB, "--api", "solo", "--out", str(out), "--name", "solo"], capture_output=True,
                       text=True, timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "solo.json").read_text())


# --- XGBoost ---------------------------------------------------------------------------------------------


@pytest.mark.xgboost
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["local", pytest.param("ray", marks=pytest.mark.ray),
                                  pytest.param("k8s", marks=pytest.mark.k8s)])
def test_xgboost20_under_plain_s0_is_one_job(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    python = xgb("2.0")
    out = tmp_path / "out"
    cluster = make_cluster(kind, tmp_path, request)
    try:
        r = cluster.run("-n", "2", "-s", "0", "--kill-grace", "2", python, XGB, "--api", "env", "--out", str(out),
                        timeout=DEADLINE)
    finally:
        cluster.close()
    assert r.returncode == 0, r.stdout + r.stderr
    res = results(out)
    assert sorted(res) == ["task-0", "task-1"]
    assert [(res[k]["rank"], res[k]["world"]) for k in sorted(res)] == [(0, 2), (1, 2)]  # not "rank 0 of 1"
    assert {r["xgboost"] for r in res.values()} == {"2.0.3"}
    assert res["task-0"]["model_sha256"] == res["task-1"]["model_sha256"]
    assert res["task-0"]["predictions"] == res["task-1"]["predictions"]
    assert {r["train_rows"] for r in res.values()} == {300}  # each trained on its half...
    assert solo_xgb(python, tmp_path)["predictions"] == res["task-0"]["predictions"]  # ...one model of all
    # rabit's print messages come out labelled, as launch.py's tracker printed them
    assert "[rabit tracker] xgb_worker task 1: rank 1 of 2" in r.stdout
    assert "[rabit tracker] [7]\ttrain-logloss:" in r.stdout
    assert "rabit tracker: all 2 workers joined" in r.stderr


@pytest.mark.ssh
@pytest.mark.xgboost
@pytest.mark.timeout(300)
@pytest.mark.parametrize("network", ["a", "b"])
def test_xgboost20_over_ssh_the_rabit_tracker_takes_its_hosts(testbed: Testbed, tmp_path: Path, shared_out: Path,
                                                                network: str) -> None:
    # (issue 30, item 7: the tracker takes connections only from the job's hosts; here they come from
    # the addresses ssh reached them on (a), or from the data network that DMLC_INTERFACE names (b))
    python = xgb("2.0")
    out = shared_out
    hosts = testbed.write_hostfile(tmp_path / "hosts", testbed.hosts[:2], "{addr_a} slots=1")
    iface = ["--env", f"DMLC_INTERFACE={testbed.subnet_b}"] if network == "b" else []
    r = run_pslaunch("--launcher", "ssh", "-H", str(hosts), "-n", "2", "-s", "0", "--kill-grace", "2",
                     "--log-level", "debug", *iface, python, XGB, "--api", "env", "--out", str(out),
                     env=testbed.env(), timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    res = results(out)
    assert [(res[k]["rank"], res[k]["world"]) for k in sorted(res)] == [(0, 2), (1, 2)]
    assert res["task-0"]["predictions"] == res["task-1"]["predictions"] == solo_xgb(python, tmp_path)["predictions"]
    assert "rabit tracker: dropped" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "rabit tracker: XGBoost 2.0.3's tracker" in x]
    peers = line.partition(", from ")[2].split(", ")
    for host in testbed.hosts[:2]:
        assert (host.addr_b if network == "b" else host.addr_a) in peers, line
    assert "127.0.0.1" not in peers


@pytest.mark.xgboost
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["local", pytest.param("ray", marks=pytest.mark.ray),
                                  pytest.param("k8s", marks=pytest.mark.k8s)])
def test_xgboost3_under_tracker_xgboost_matches_one_process(kind: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    python = xgb("3.0")
    out = tmp_path / "out"
    cluster = make_cluster(kind, tmp_path, request)
    try:
        r = cluster.run("-n", "3", "--tracker", "xgboost", "--kill-grace", "2", python, XGB, "--api", "args",
                        "--out", str(out), timeout=DEADLINE)
    finally:
        cluster.close()
    assert r.returncode == 0, r.stdout + r.stderr
    res = results(out)
    assert sorted(res) == ["task-0", "task-1", "task-2"]
    assert sorted(x["rank"] for x in res.values()) == [0, 1, 2] and {x["world"] for x in res.values()} == {3}
    assert {x["xgboost"][:4] for x in res.values()} == {"3.0."}
    assert len({x["predictions"] for x in res.values()}) == 1
    assert solo_xgb(python, tmp_path)["predictions"] == res["task-0"]["predictions"]
    assert "xgboost tracker: XGBoost 3.0" in r.stderr
    assert "[xgboost tracker]" in r.stdout + r.stderr  # its log and the workers' prints, labelled


# --- PyTorch DDP ---------------------------------------------------------------------------------------------


def ddp_argv(out: Path, *args: str) -> list[str]:
    return [sys.executable, DDP, "--out", str(out), *args]


def check_ddp(out: Path, n: int, tmp_path: Path) -> dict[str, dict]:
    """Every rank's parameters equal one process's on the same data, and the ranks are 0..n-1."""
    res = results(out)
    assert sorted(res) == [f"task-{i}" for i in range(n)], sorted(res)
    assert sorted(x["rank"] for x in res.values()) == list(range(n))
    assert {x["world"] for x in res.values()} == {n}
    solo_out = tmp_path / "solo"
    r = subprocess.run(ddp_argv(solo_out, "--solo", str(n), "--name", "solo"), capture_output=True, text=True,
                       timeout=DEADLINE)
    assert r.returncode == 0, r.stderr
    solo = json.loads((solo_out / "solo.json").read_text())["params"]
    for name, x in res.items():
        worst = max(abs(a - b) for p, q in zip(x["params"], solo) for a, b in zip(p, q))
        assert worst < 1e-12, (name, worst)  # float64; only the order of additions differs
        assert x["params"] != [[0.0] * len(p) for p in solo]
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", [
    "local",
    pytest.param("mpi-openmpi", marks=pytest.mark.mpi),
    pytest.param("mpi-mpich", marks=pytest.mark.mpi),
    pytest.param("sge", marks=pytest.mark.sge),
    pytest.param("yarn", marks=pytest.mark.yarn),
    pytest.param("slurm", marks=pytest.mark.slurm),  # 4 nodes, DMLC_INTERFACE as a CIDR
    pytest.param("ray", marks=pytest.mark.ray),  # 3 nodes, each actor's node address
    pytest.param("k8s", marks=pytest.mark.k8s),  # a Pod per rank, each with its own address and hostname
])
def test_ddp_under_tracker_torch_matches_one_process(kind: str, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    cluster = make_cluster(kind, tmp_path, request)
    try:
        r = cluster.run("-n", "3", "--tracker", "torch", "--kill-grace", "2", *ddp_argv(cluster.out),
                        timeout=DEADLINE)
        assert r.returncode == 0, r.stdout + r.stderr
        res = check_ddp(cluster.out, 3, tmp_path)
        hosts: dict[str, list[dict]] = {}
        for x in sorted(res.values(), key=lambda x: x["rank"]):
            assert x["env"]["RANK"] == str(x["rank"])
            hosts.setdefault(x["host"], []).append(x["env"])
        for group, members in enumerate(hosts.values()):  # host by host: cuda:LOCAL_RANK would be right
            assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in members] \
                == [(str(i), str(len(members)), str(group), str(len(hosts))) for i in range(len(members))]
        assert "torch store: serving on" in r.stderr
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_a_restarted_torch_job_keeps_one_store_program_with_a_fresh_store_per_attempt(tmp_path: Path) -> None:
    # attempts 0 and 1: the last rank exits 3 after every rank set its key; attempt 2 ends well
    out = tmp_path / "out"
    r = run_pslaunch("-n", "2", "--tracker", "torch", "--kill-grace", "2", "--max-restarts", "2",
                     "--restart-delay", "0", "--log-level", "debug", *ddp_argv(out, "--store-check"),
                     timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(after 2 restarts)" in r.stderr
    res = results(out)
    assert sorted(res) == [f"task-{t}-attempt-{a}" for t in range(2) for a in range(3)], sorted(res)
    for x in res.values():
        assert x["this"] == 2, x  # every rank's key of its own attempt: the check can see keys
        assert x["earlier"] == [], x  # and none of an attempt before
    ports = {a: {res[f"task-{t}-attempt-{a}"]["env"]["MASTER_PORT"] for t in range(2)} for a in range(3)}
    assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 3, ports
    # one store program, started once: each later attempt got a new store in it
    started = re.findall(r"torch store: pid (\d+) starts on 127\.0\.0\.1:(\d+)", r.stderr)
    served = re.findall(r"torch store: pid (\d+) serves attempt (\d+) on 127\.0\.0\.1:(\d+), a new store",
                        r.stderr)
    assert len(started) == 1 and [a for _, a, _ in served] == ["1", "2"], r.stderr
    assert {pid for pid, _, _ in served} == {started[0][0]}
    assert [started[0][1]] + [port for _, _, port in served] == [ports[a].pop() for a in range(3)]


@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_ddp_over_ssh_on_two_hosts_with_a_cidr(testbed: Testbed, tmp_path: Path, shared_out: Path) -> None:
    out = shared_out
    hosts = testbed.write_hostfile(tmp_path / "hosts", testbed.hosts[:2], "{addr_a} slots=2")
    # the data network (subnet B), whose interface has another name on each host
    r = run_pslaunch("--launcher", "ssh", "-H", str(hosts), "-n", "4", "--tracker", "torch", "--kill-grace", "2",
                     "--env", "PSLAUNCH_NETGUARD_LOG", "--env", f"DMLC_INTERFACE={testbed.subnet_b}",
                     *ddp_argv(out), env=testbed.env(), timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    res = check_ddp(out, 4, tmp_path)
    by_rank = {x["rank"]: x["env"] for x in res.values()}
    # ranks host by host: 0, 1 on the first host, 2, 3 on the second; cuda:LOCAL_RANK would be right
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for _, e in sorted(by_rank.items())] == \
        [("0", "0", "2"), ("0", "1", "2"), ("1", "0", "2"), ("1", "1", "2")]
    assert {e["MASTER_ADDR"] for e in by_rank.values()} == {testbed.root_b}
    first, second = testbed.hosts[0], testbed.hosts[1]
    assert [e["DMLC_NODE_HOST"] for _, e in sorted(by_rank.items())] == [first.addr_b] * 2 + [second.addr_b] * 2


@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_ddp_over_ssh_on_two_hosts_without_dmlc_interface(testbed: Testbed, tmp_path: Path, shared_out: Path) -> None:
    # no DMLC_INTERFACE: each host's gloo binds the interface of the address ssh reached it on (a name of
    # its own on each host); without that, gloo took what the host's name resolves to ("Connection
    # refused, remote=127.0.0.1")
    out = shared_out
    first, second = testbed.hosts[0], testbed.hosts[1]
    hosts = testbed.write_hostfile(tmp_path / "hosts", [first, second], "{addr_a} slots=2")
    r = run_pslaunch("--launcher", "ssh", "-H", str(hosts), "-n", "4", "--tracker", "torch", "--kill-grace", "2",
                     "--log-level", "info", "--env", "PSLAUNCH_NETGUARD_LOG", *ddp_argv(out),
                     env=testbed.env(), timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    res = check_ddp(out, 4, tmp_path)
    by_rank = {x["rank"]: x["env"] for x in res.values()}
    assert {e["MASTER_ADDR"] for e in by_rank.values()} == {testbed.root_a}  # the route to the hosts
    per_rank = [(e["DMLC_NODE_HOST"], e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"])
                for _, e in sorted(by_rank.items())]
    assert per_rank == [(h.addr_a, h.iface_a, "=" + h.iface_a) for h in (first, first, second, second)]
    for h in (first, second):  # where the values came from, once per host
        line = (f"pslaunch: {h.addr_a}: GLOO_SOCKET_IFNAME={h.iface_a}, NCCL_SOCKET_IFNAME=={h.iface_a} (the "
                f"interface of {h.addr_a}, the address the other hosts reach)")
        assert r.stderr.count(line) == 1, r.stderr


@pytest.mark.xgboost
@pytest.mark.timeout(300)
def test_xgboost3_ranks_follow_its_trackers_order_from_ten_workers(tmp_path: Path) -> None:
    # what the README warns about: XGBoost's tracker sorts task ids as strings ("10" before "2")
    python = xgb("3.0")
    out = tmp_path / "out"
    r = run_pslaunch("-n", "11", "--tracker", "xgboost", "--kill-grace", "2", python, XGB, "--api", "args",
                     "--only-rank", "--out", str(out), timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = {int(x["task_id"]): x["rank"] for x in results(out).values()}
    assert ranks == {0: 0, 1: 1, 10: 2, **{t: t + 1 for t in range(2, 10)}}
