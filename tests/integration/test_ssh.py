# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""The ssh backend on the namespace testbed (tests/support/testbed.py): real sshd, real hosts' namespaces.

Every host is a network namespace with its own sshd, a private /tmp and a
private sync root; processes there are counted with ``ip netns pids``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.helpers import REPO, pslaunch_argv, read_probes, run_pslaunch, wait_for, wait_probes
from support.testbed import Testbed, TestHost

pytestmark = [pytest.mark.integration, pytest.mark.ssh]

PY = sys.executable
CONTRACT = ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
            "PSLAUNCH_SECRET", "PS_START_TIMEOUT", "PSLAUNCH_JOB_ID")
NETGUARD = ("--env", "PSLAUNCH_NETGUARD_LOG")  # the network guard in every remote Python child too


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def out(shared_out: Path) -> Path:
    """A results directory every host can write (probes' --out)."""
    return shared_out


def probe(out: Path, *args: str) -> list[str]:
    return [PY, str(REPO / "tests" / "bin" / "probe.py"), "--out", str(out), *args]


def hostfile(testbed: Testbed, tmp_path: Path, n: int = 3, fmt: str = "{addr_a}") -> str:
    return str(testbed.write_hostfile(tmp_path / f"hosts{n}", testbed.hosts[:n], fmt))


def run_ssh(testbed: Testbed, *args: str, env: dict | None = None, timeout: float = 90,
            cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    return run_pslaunch("--launcher", "ssh", *NETGUARD, *args, env=env or testbed.env(), timeout=timeout, cwd=cwd)


def start_ssh(testbed: Testbed, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(pslaunch_argv("--launcher", "ssh", *NETGUARD, *args), cwd=REPO, env=env or testbed.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def leftovers(testbed: Testbed, hosts: list[TestHost] | None = None) -> dict[str, list[int]]:
    return {h.name: pids for h in (hosts or testbed.hosts) if (pids := testbed.job_pids(h))}


def assert_no_leftovers(testbed: Testbed, timeout: float = 10.0, hosts: list[TestHost] | None = None) -> float:
    """Wait until no job process is left in any namespace; returns how long that took."""
    t0 = time.monotonic()
    try:
        wait_for(lambda: not leftovers(testbed, hosts), timeout, interval=0.1, what="0 leftovers")
    except AssertionError:
        left = leftovers(testbed, hosts)
        desc = {k: testbed.describe_pids(v) for k, v in left.items()}
        raise AssertionError(f"leftover processes after {timeout}s: {desc}") from None
    return time.monotonic() - t0


def one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("pslaunch: error: "), lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def _clean_hosts(testbed: Testbed):
    """Every test starts and ends with no job process on any host."""
    assert_no_leftovers(testbed, timeout=15)
    yield
    assert_no_leftovers(testbed, timeout=15)


# --- environment, quoting, placement --------------------------------------------------------


@pytest.mark.timeout(90)
def test_env_contract_per_role_and_placement(testbed: Testbed, out: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PS_VERBOSE", "1")
    monkeypatch.setenv("UNRELATED_VAR", "stays on the launching host")
    monkeypatch.setenv("DMLC_NODE_HOST", "1.2.3.4")  # overridden by the launcher
    hosts = hostfile(testbed, tmp_path, 3)
    r = run_ssh(testbed, "-n", "3", "-s", "2", "-H", hosts, "--env", "FOO=bar baz", "--env-server",
                "OMP_NUM_THREADS:3", "--env-worker", "WHO=worker", "--kill-grace", "1",
                *probe(out, "--print", "héllo ✓"), env=testbed.env())
    assert r.returncode == 0, r.stderr
    probes = read_probes(out)
    assert sorted(probes) == ["scheduler", "server-0", "server-1", "worker-0", "worker-1", "worker-2"]
    h = testbed.hosts
    where = {"server-0": h[0], "server-1": h[1], "worker-0": h[2], "worker-1": h[0], "worker-2": h[1]}
    sched = probes["scheduler"]["env"]
    assert sched["DMLC_PS_ROOT_URI"] == testbed.root_a  # this host's address toward the hosts
    assert probes["scheduler"]["netns"] == os.readlink("/proc/self/ns/net")
    for name, rec in probes.items():
        env = rec["env"]
        role = name.split("-")[0]
        for key in CONTRACT:
            if key != "DMLC_ROLE":
                assert env[key] == sched[key], (name, key)
        assert env["DMLC_ROLE"] == role and env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
        assert env["PS_VERBOSE"] == "1" and env["FOO"] == "bar baz"
        if role == "scheduler":
            continue
        host = where[name]
        assert testbed.host_of(rec["netns"]) == host, name  # it really ran in that host's namespace
        assert rec["pgid"] == rec["pid"] == rec["sid"]
        assert rec["cwd"] == str(REPO)
        rank = int(name.split("-")[1])
        assert env["DMLC_TASK_ID"] == str(rank if role == "worker" else 3 + rank)
        assert env["DMLC_JOB_CLUSTER"] == "ssh"
        assert env["DMLC_NODE_HOST"] == host.addr_a
        assert env["PSLAUNCH_LOCAL_PROCS"] == ("1" if host is h[2] else "2")
        assert "UNRELATED_VAR" not in env  # only the forwarded allow-list crosses
        if role == "server":
            assert env["OMP_NUM_THREADS"] == "3" and "WHO" not in env
        else:
            assert env["WHO"] == "worker" and env["OMP_NUM_THREADS"] == "1"
        assert f"[{role} {rank} @ {host.addr_a}] héllo ✓" in r.stdout.splitlines()
    assert "the launcher sets DMLC_NODE_HOST itself" in r.stderr
    assert "all 6 processes exited 0" in r.stderr


@pytest.mark.timeout(90)
def test_hostfile_gpus_slices_and_only_over_ssh(testbed: Testbed, out: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h = testbed.hosts
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{h[0].addr_a} gpus=1,3,5,7\n{h[1].addr_a}\n")
    logs = tmp_path / "logs"
    r = run_ssh(testbed, "-n", "4", "-s", "1", "-H", str(hosts), "--gpus-per-process", "2", "--only", "worker:1",
                "--log-dir", str(logs), "--kill-grace", "1", *probe(out, "--print", "hello"))
    assert r.returncode == 0, r.stderr
    probes = read_probes(out)
    # server 0 on h0; workers 0, 2 on h1 (no gpus=: counted from 0); workers 1, 3 on h0 (from its gpus=)
    where = {"server-0": h[0], "worker-0": h[1], "worker-1": h[0], "worker-2": h[1], "worker-3": h[0]}
    cuda = {"scheduler": None, "server-0": None, "worker-0": "0,1", "worker-1": "1,3", "worker-2": "2,3",
            "worker-3": "5,7"}
    for name, rec in probes.items():
        assert rec["env"].get("CUDA_VISIBLE_DEVICES") == cuda[name], name
        if name in where:
            assert testbed.host_of(rec["netns"]) == where[name], name
    assert r.stdout.splitlines() == [f"[worker 1 @ {h[0].addr_a}] hello"]
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "server-0.log", "worker-0.log",
                                                      "worker-1.log", "worker-2.log", "worker-3.log"]
    assert all(p.read_text() == "hello\n" for p in logs.iterdir())


@pytest.mark.timeout(90)
def test_hostile_arguments_arrive_intact_and_nothing_runs(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    marker = f"/tmp/pslaunch-pwned-{uuid.uuid4().hex[:6]}"
    hostile = ["a b", "'", '"', "$HOME", ";", "$(id)", "`id`", "*", "\\", "", "--", "-n", "3", "ünï",
               f"$(touch {marker})", f"; touch {marker}", f"' ; touch {marker} ; '", "\n"]
    r = run_ssh(testbed, "-n", "2", "-s", "0", "-H", hostfile(testbed, tmp_path, 2), *probe(out, "--", *hostile))
    assert r.returncode == 0, r.stderr
    for rec in read_probes(out).values():
        assert rec["rest"][-len(hostile):] == hostile
    assert not os.path.exists(marker)
    for h in testbed.hosts:
        assert testbed.run(h, ["test", "-e", marker]).returncode == 1, h.name


@pytest.mark.timeout(90)
def test_secret_and_env_never_on_a_command_line(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    p = start_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 2), "--kill-grace", "1",
                  "--env", "MY_TOKEN=tok-3141592653", *probe(out, "--listen", "--sleep", "30"))
    try:
        probes = wait_probes(out, 4, alive=True)
        secret = probes["scheduler"]["env"]["PSLAUNCH_SECRET"]
        checked = 0
        for h in testbed.hosts[:2]:
            for pid in testbed.pids(h):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                checked += 1
                assert secret not in cmd and "tok-3141592653" not in cmd and "DMLC_ROLE" not in cmd, cmd
        assert checked >= 4
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 143, err
    assert "tok-3141592653" not in err and secret not in err


@pytest.mark.timeout(90)
def test_many_processes_on_a_host_whose_sshd_allows_one_session(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    # host 3: MaxSessions 1. The wrapper takes that session, and everything goes through it: the
    # interface lookup, the sync, the processes and the teardown's signals (one frame, 12 groups).
    limited = testbed.hosts[3]
    hosts = str(testbed.write_hostfile(tmp_path / "hosts", [limited]))
    src = _project(tmp_path)
    dst = f"{testbed.sync_root}/limited-{uuid.uuid4().hex[:6]}"
    env = testbed.env(DMLC_INTERFACE=testbed.subnet_b)
    r = run_ssh(testbed, "-n", "12", "-s", "1", "-H", hosts, "--kill-grace", "1", "--sync-dst-dir", dst,
                "--log-level", "DEBUG", *probe(out, "--listen", "--sleep", "60", "--fail", "worker-5:4:2"),
                env=env, cwd=src)
    assert r.returncode == 4, r.stderr
    assert "sshd refused another session" not in r.stderr  # one session was enough
    assert f"{limited.addr_a}: TERM to 12 processes" in r.stderr
    probes = read_probes(out)
    assert len(probes) == 14
    assert all(p["env"]["DMLC_NODE_HOST"] == limited.addr_b for n, p in probes.items() if n != "scheduler")
    assert "exited with code 4 first" in r.stderr


# --- DMLC_INTERFACE per host ------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("given", ["environment", "--env"])
def test_dmlc_interface_cidr_selects_the_second_subnet_everywhere(testbed: Testbed, out: Path,
                                                                  tmp_path: Path, given: str) -> None:
    env = testbed.env(DMLC_INTERFACE=testbed.subnet_b) if given == "environment" else testbed.env()
    extra = ("--env", f"DMLC_INTERFACE={testbed.subnet_b}") if given == "--env" else ()
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 3), "--kill-grace", "1",
                *extra, *probe(out, "--listen"), env=env)
    assert r.returncode == 0, r.stderr
    probes = read_probes(out)
    assert probes["scheduler"]["env"]["DMLC_PS_ROOT_URI"] == testbed.root_b
    for name, rec in probes.items():
        if name == "scheduler":
            continue
        host = testbed.host_of(rec["netns"])
        assert host is not None
        # the hosts' interfaces on subnet B have different names (data0, ib0, bond0)
        assert rec["env"]["DMLC_NODE_HOST"] == host.addr_b, (name, host.iface_b)
        assert rec["env"]["DMLC_INTERFACE"] == testbed.subnet_b


@pytest.mark.timeout(90)
def test_dmlc_interface_name_missing_on_some_hosts_fails_before_start(testbed: Testbed, out: Path,
                                                                      tmp_path: Path) -> None:
    h = testbed.hosts
    env = testbed.env(DMLC_INTERFACE=h[0].iface_b)  # data0: only host 0 has it
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 3), *probe(out), env=env)
    assert r.returncode == 2, r.stderr
    line = one_line_error(r)
    assert line.startswith(f"pslaunch: error: {h[1].addr_a}: DMLC_INTERFACE={h[0].iface_b} matches no interface")
    assert f"{h[1].iface_a} {h[1].addr_a}/24" in line and f"{h[1].iface_b} {h[1].addr_b}/24" in line
    assert "(1 more host failed too)" in line
    assert time.monotonic() - t0 < 20
    assert read_probes(out) == {}  # nothing started, the scheduler neither


@pytest.mark.timeout(90)
def test_dmlc_interface_lo_with_ssh_hosts_is_refused_at_once(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    # lo, the one name every host has, puts the tracker on this host's loopback: no other host reaches
    # it, so each process would wait --start-timeout for nothing. One line, before any connection.
    env = testbed.env(DMLC_INTERFACE="lo")
    for args in (("-s", "0"), ("--tracker", "torch"), ("-s", "1")):
        t0 = time.monotonic()
        r = run_ssh(testbed, "-n", "2", *args, "-H", hostfile(testbed, tmp_path, 2), *probe(out), env=env)
        assert r.returncode == 2, r.stderr
        line = one_line_error(r)
        assert re.fullmatch(r"pslaunch: error: DMLC_INTERFACE=lo puts the (rabit tracker \(DMLC_TRACKER_URI\)|torch "
                            r"store \(MASTER_ADDR\)|scheduler \(DMLC_PS_ROOT_URI\)) on 127\.0\.0\.1, a loopback "
                            rf"address, which processes on {re.escape(testbed.hosts[0].addr_a)} \(and 1 more host\) "
                            r"cannot reach: set DMLC_INTERFACE to a network the hosts share .*", line), line
        assert time.monotonic() - t0 < 10
        assert read_probes(out) == {}  # nothing started


# --- orphans ------------------------------------------------------------------------------------------


def _running_job(testbed: Testbed, out: Path, tmp_path: Path, *extra: str, n: int = 3, hosts: int = 3,
                 probe_args: tuple[str, ...] = ("--listen", "--sleep", "60", "--child"),
                 ) -> tuple[subprocess.Popen, dict]:
    p = start_ssh(testbed, "-n", str(n), "-s", "1", "-H", hostfile(testbed, tmp_path, hosts), *extra,
                  *probe(out, *probe_args))
    try:
        probes = wait_probes(out, n + 2, alive=True)
        wait_for(lambda: all(len(testbed.job_pids(h)) >= 2 for h in testbed.hosts[:hosts]), 10,
                 what="children on every host")
    except BaseException:
        p.kill()
        p.communicate()
        raise
    return p, probes


@pytest.mark.timeout(90)
def test_failed_worker_on_another_host_stops_everything(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "3", "-s", "1", "-H", hostfile(testbed, tmp_path, 3), "--kill-grace", "1",
                "--summary-json", str(summary),
                *probe(out, "--listen", "--sleep", "60", "--child", "--fail", "worker-1:3:2.0"))
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 30
    b = testbed.hosts[2]  # worker 1 runs on host 2 (server 0, worker 0, worker 1 round-robin)
    assert f"worker 1 @ {b.addr_a} (on {b.addr_a}, pid" in r.stderr and "exited with code 3 first" in r.stderr
    assert "worker-1 failing with code 3" in r.stderr
    took = assert_no_leftovers(testbed, timeout=10)
    print(f"orphans after a failed worker: 0 (gone {took:.1f}s after the launcher exited)")
    doc = json.loads(summary.read_text())
    procs = {p["name"]: p for p in doc["processes"]}
    assert doc["first_failure"] == "worker-1" and procs["worker-1"]["host"] == b.addr_a
    for name in ("server-0", "worker-0", "worker-2"):
        assert procs[name]["stopped_by_launcher"] and procs[name]["signal"] == "SIGTERM", procs[name]
    assert procs["worker-1"]["pid"] == read_probes(out)["worker-1"]["pid"]


@pytest.mark.timeout(90)
def test_link_down_on_one_host_fails_the_job_and_leaves_nothing(testbed: Testbed, out: Path,
                                                                tmp_path: Path) -> None:
    keepalive = 1.0  # lost after 4 silent intervals: 4 s (shorter flakes on a loaded 2-core machine)
    p, probes = _running_job(testbed, out, tmp_path, "--kill-grace", "1", "--ssh-keepalive", str(keepalive),
                             n=2)
    down = testbed.hosts[1]  # worker 0
    others = [h for h in testbed.hosts[:3] if h is not down]
    try:
        t0 = time.monotonic()
        testbed.link(down, up=False)
        _, err = p.communicate(timeout=30)
        failed_after = time.monotonic() - t0
        assert p.returncode == 255, err
        assert f"host {down.addr_a} is lost: no reply to keep-alives" in err
        assert f"worker 0 @ {down.addr_a} (on {down.addr_a}, pid" in err and "host lost" in err
        assert failed_after < 15, failed_after
        took_others = assert_no_leftovers(testbed, timeout=10, hosts=others)
        # the downed host's wrapper notices on its own: 4 keep-alive intervals plus --kill-grace
        took_down = assert_no_leftovers(testbed, timeout=10, hosts=[down])
        print(f"link down: job failed after {failed_after:.1f}s; orphans 0 on the other hosts ({took_others:.1f}s), "
              f"0 on the downed host ({time.monotonic() - t0:.1f}s after the link went down)")
        assert took_down >= 0
    finally:
        testbed.link(down, up=True)


@pytest.mark.timeout(120)
def test_a_worker_on_a_host_whose_link_goes_down_is_replaced_on_another(testbed: Testbed, out: Path,
                                                                       tmp_path: Path) -> None:
    """--restart-scope process (issue 34): worker 1's host drops off the network; once it is lost
    (4 silent keep-alives), worker 1 is replaced on a connected host, with that host's
    DMLC_NODE_HOST, while the scheduler, the server and worker 0 run on; the job exits 0, and the
    downed host's wrapper stops the lost worker there by itself."""
    summary = tmp_path / "summary.json"
    p, probes = _running_job(testbed, out, tmp_path, "--kill-grace", "1", "--ssh-keepalive", "1", "--max-restarts",
                             "1", "--restart-scope", "process", "--summary-json", str(summary), n=2,
                             probe_args=("--listen", "--sleep", "14", "--child"))
    down = testbed.hosts[2]  # worker 1 (the server is on host 0, worker 0 on host 1)
    assert probes["worker-1"]["netns"] == testbed.netns_link(down), probes["worker-1"]
    try:
        testbed.link(down, up=False)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert re.search(rf"worker 1 on {re.escape(down.addr_a)} \(pid \d+\) exited with code 255(: .*)?; replacing "
                         r"it in place \(restart 1/1\)", err), err
        assert f"{down.addr_a} is lost" in err and "replacement runs on" in err, err
        doc = json.loads(summary.read_text())
        (rep,) = doc["replacements"]
        assert rep["host"] == down.addr_a and rep["new_host"] != down.addr_a, rep
        new = json.loads(next((out / "history").glob("worker-1~1.*.json")).read_text())
        assert new["netns"] != testbed.netns_link(down) and new["env"]["PSLAUNCH_REPLACEMENT"] == "1"
        assert new["env"]["DMLC_NODE_HOST"] == rep["new_host"] != probes["worker-1"]["env"]["DMLC_NODE_HOST"]
        procs = {(q["name"], q["pid"]): q for q in doc["processes"]}
        for name in ("server-0", "worker-0"):
            assert procs[(name, probes[name]["pid"])]["exit_code"] == 0, name
        assert_no_leftovers(testbed, timeout=15, hosts=[down])  # (the wrapper there stopped its worker itself)
    finally:
        testbed.link(down, up=True)


# --- refusals ---------------------------------------------------------------------------------------------


def _home(testbed: Testbed, tmp_path: Path, known_hosts: str = "") -> Path:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(testbed.key, home / ".ssh" / "id_ed25519")
    (home / ".ssh" / "id_ed25519").chmod(0o600)
    (home / ".ssh" / "known_hosts").write_text(known_hosts)
    return home


@pytest.mark.timeout(90)
def test_unknown_host_key_is_refused_then_accepted_on_request(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    home = _home(testbed, tmp_path)
    env = testbed.env(HOME=str(home))
    hosts = hostfile(testbed, tmp_path, 2)
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "1", "-s", "1", "-H", hosts, "--ssh-connect-timeout", "5", *probe(out), env=env)
    assert time.monotonic() - t0 < 5 + 5
    assert r.returncode == 1, r.stderr
    line = one_line_error(r)
    h0 = testbed.hosts[0]
    assert f"host key of {h0.addr_a} is not known: ED25519 SHA256:" in line
    assert f"ssh-keyscan -t ed25519 {h0.addr_a} >> {home}/.ssh/known_hosts" in line
    assert "--accept-new-host-keys" in line and "(1 more host failed: " in line
    assert read_probes(out) == {}
    r = run_ssh(testbed, "-n", "1", "-s", "1", "-H", hosts, "--accept-new-host-keys", *probe(out), env=env)
    assert r.returncode == 0, r.stderr
    assert "added the new ED25519 host key" in r.stderr
    known = (home / ".ssh" / "known_hosts").read_text()
    assert h0.addr_a in known and testbed.hosts[1].addr_a in known
    r = run_ssh(testbed, "-n", "1", "-s", "1", "-H", hosts, *probe(out), env=env)  # now known: strict is fine
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(90)
def test_changed_host_key_is_always_refused(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    h0, h1 = testbed.hosts[:2]
    real = testbed.known_hosts.read_text().splitlines()
    wrong = [line.replace(f"{h1.addr_a},{h1.addr_b}", f"{h0.addr_a},{h0.addr_b}") for line in real
             if line.startswith(f"{h1.addr_a},")]
    home = _home(testbed, tmp_path, "\n".join(wrong) + "\n")
    for extra in ((), ("--accept-new-host-keys",)):
        r = run_ssh(testbed, "-n", "1", "-s", "0", "-H", hostfile(testbed, tmp_path, 1), *extra, *probe(out),
                    env=testbed.env(HOME=str(home)))
        assert r.returncode == 1, r.stderr
        line = one_line_error(r)
        assert f"the host key of {h0.addr_a} has CHANGED" in line and "man-in-the-middle" in line
        assert f"ssh-keygen -R '{h0.addr_a}' -f {home}/.ssh/known_hosts" in line
    assert read_probes(out) == {}


@pytest.mark.timeout(90)
def test_wrong_user_is_refused(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    hosts = hostfile(testbed, tmp_path, 1, fmt="nosuchuser@{addr_a}")
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "1", "-s", "0", "-H", hosts, "--ssh-connect-timeout", "5", *probe(out))
    assert time.monotonic() - t0 < 10
    assert r.returncode == 1, r.stderr
    line = one_line_error(r)
    assert f"ssh authentication as nosuchuser on {testbed.hosts[0].addr_a}:22 failed" in line
    assert "--ssh-user" in line


@pytest.mark.timeout(90)
def test_unreachable_host_fails_within_the_connect_timeout(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    dead = f"10.200.{testbed.number}.99"
    (tmp_path / "hosts").write_text(f"{testbed.hosts[0].addr_a}\n{dead}\n")
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "2", "-s", "0", "-H", str(tmp_path / "hosts"), "--ssh-connect-timeout", "2",
                *probe(out))
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    line = one_line_error(r)
    assert line.startswith(f"pslaunch: error: {dead}: cannot reach {dead}:22")
    assert elapsed < 2 + 5, elapsed
    assert read_probes(out) == {}


@pytest.mark.timeout(90)
def test_refused_port_is_retried_then_reported(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(f"{testbed.hosts[0].addr_a}:2222\n")
    t0 = time.monotonic()
    r = run_ssh(testbed, "-n", "1", "-s", "0", "-H", str(tmp_path / "hosts"), "--ssh-connect-timeout", "3",
                *probe(out))
    assert time.monotonic() - t0 < 3 + 5
    assert r.returncode == 1, r.stderr
    line = one_line_error(r)
    assert f"connection to {testbed.hosts[0].addr_a}:2222 refused: is sshd running there" in line


# --- configuration ---------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_ssh_config_host_patterns_under_a_home_override(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    home = tmp_path / "cfghome"
    (home / ".ssh").mkdir(parents=True)
    key = tmp_path / "keys" / "mykey"
    key.parent.mkdir()
    shutil.copy(testbed.key, key)
    key.chmod(0o600)
    lines = ["Host node-*", "    User root", f"    IdentityFile {key}", f"    UserKnownHostsFile {testbed.known_hosts}",
             "    Port 22", ""]
    for h in testbed.hosts[:2]:
        lines += [f"Host node-{h.index}", f"    HostName {h.addr_a}", ""]
    (home / ".ssh" / "config").write_text("\n".join(lines))
    (tmp_path / "hosts").write_text("node-0\nnode-1\n")
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", str(tmp_path / "hosts"), *probe(out, "--print", "hi"),
                env=testbed.env(HOME=str(home)))
    assert r.returncode == 0, r.stderr
    probes = read_probes(out)
    assert probes["server-0"]["env"]["DMLC_NODE_HOST"] == testbed.hosts[0].addr_a  # an IP, never the alias
    assert probes["worker-0"]["env"]["DMLC_NODE_HOST"] == testbed.hosts[1].addr_a
    assert "[worker 0 @ node-1] hi" in r.stdout


def _start_agent(tmp_path: Path) -> dict[str, str]:
    r = subprocess.run(["ssh-agent", "-s", "-a", str(tmp_path / "agent.sock")], capture_output=True, text=True,
                       check=True)
    env = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", r.stdout))
    return env


@pytest.mark.timeout(90)
def test_protected_key_needs_an_agent(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    home = tmp_path / "emptyhome"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(testbed.known_hosts, home / ".ssh" / "known_hosts")
    hosts = hostfile(testbed, tmp_path, 1)
    args = ("-n", "1", "-s", "0", "-H", hosts, "--ssh-key", str(testbed.protected_key), *probe(out))
    r = run_ssh(testbed, *args, env=testbed.env(HOME=str(home)))
    assert r.returncode == 1, r.stderr
    line = one_line_error(r)
    assert f"the key {testbed.protected_key} needs a passphrase and no ssh-agent holds it" in line
    assert f"ssh-add {testbed.protected_key}" in line
    agent = _start_agent(tmp_path)
    try:
        askpass = tmp_path / "askpass.sh"
        askpass.write_text(f"#!/bin/sh\necho '{testbed.passphrase}'\n")
        askpass.chmod(0o700)
        subprocess.run(["ssh-add", str(testbed.protected_key)], env={**os.environ, **agent, "SSH_ASKPASS": str(askpass),
                       "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}, stdin=subprocess.DEVNULL,
                       capture_output=True, check=True, timeout=20)
        env = testbed.env(HOME=str(home), SSH_AUTH_SOCK=agent["SSH_AUTH_SOCK"])
        r = run_ssh(testbed, *args, env=env)  # the agent holds the protected key
        assert r.returncode == 0, r.stderr
        r = run_ssh(testbed, "-n", "1", "-s", "0", "-H", hosts, *probe(out), env=env)  # agent only, no key file
        assert r.returncode == 0, r.stderr
    finally:
        os.kill(int(agent["SSH_AGENT_PID"]), signal.SIGTERM)


# --- sync ---------------------------------------------------------------------------------------------------


def _project(tmp_path: Path) -> Path:
    src = tmp_path / "project"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "__pycache__").mkdir()
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.py").write_text("print('b')\n")
    (src / "big.bin").write_bytes(os.urandom(200_000))
    (src / ".git" / "config").write_text("[core]\n")
    (src / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (src / "skip.log").write_text("log\n")
    (src / "run.sh").write_text("#!/bin/sh\npwd\nls -A\n")
    (src / "run.sh").chmod(0o755)
    return src


def _remote_files(testbed: Testbed, host: TestHost, dst: str) -> set[str]:
    r = testbed.run(host, ["find", dst, "-mindepth", "1"])
    return {line[len(dst) + 1:] for line in r.stdout.splitlines()}


@pytest.mark.timeout(120)
def test_sync_dst_dir(testbed: Testbed, tmp_path: Path) -> None:
    src = _project(tmp_path)
    dst = f"{testbed.sync_root}/job-{uuid.uuid4().hex[:6]}"
    hosts = testbed.hosts[:2]
    hf = hostfile(testbed, tmp_path, 2)
    env = testbed.env()
    env["PATH"] = str(tmp_path / "no-tools")  # no rsync and no ssh here: the wrapper's channel does it
    args = ("-n", "2", "-s", "0", "-H", hf, "--sync-dst-dir", dst, "--sync-exclude", "*.log")
    r = run_ssh(testbed, *args, "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    want = {"a.txt", "sub", "sub/b.py", "big.bin", "run.sh"}
    for h in hosts:
        assert _remote_files(testbed, h, dst) == want, h.name
        assert f"synced {src} to {h.addr_a}:{dst}: 4 files" in r.stderr
    assert f"[worker 0 @ {hosts[0].addr_a}] {dst}" in r.stdout  # the remote working directory
    assert not Path(dst).exists() or not any(Path(dst).iterdir())  # it went to the hosts, not here
    # unchanged: nothing is sent
    r = run_ssh(testbed, *args, "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    for h in hosts:
        assert f"synced {src} to {h.addr_a}:{dst}: 0 files" in r.stderr
    # the sync was each wrapper's first request, so its time includes the wrapper's start; after
    # the interface lookup (DMLC_INTERFACE) the wrapper has answered once already and it does not
    def started(r) -> list[bool]:
        return [x.endswith("(with the wrapper's start there)")
                for x in r.stderr.splitlines() if f"synced {src} to " in x]

    assert started(r) == [True, True], r.stderr
    r = run_ssh(testbed, *args, "./run.sh", env={**env, "DMLC_INTERFACE": testbed.subnet_b}, cwd=src)
    assert r.returncode == 0, r.stderr
    assert started(r) == [False, False], r.stderr
    # a changed file, a removed file and a remote-only file, without and with --sync-delete
    (src / "a.txt").write_text("alpha, longer now\n")
    (src / "sub" / "b.py").unlink()
    testbed.run(hosts[0], ["sh", "-c", f"echo x > {dst}/extra.txt && mkdir -p {dst}/.git && touch {dst}/.git/keep"],
                check=True)
    r = run_ssh(testbed, *args, "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    assert f"synced {src} to {hosts[0].addr_a}:{dst}: 1 file," in r.stderr
    assert {"extra.txt", "sub/b.py"} <= _remote_files(testbed, hosts[0], dst)
    r = run_ssh(testbed, *args, "--sync-delete", "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    files = _remote_files(testbed, hosts[0], dst)
    assert "extra.txt" not in files and "sub/b.py" not in files and "sub" in files
    assert ".git/keep" in files  # excluded: protected from deletion
    assert testbed.run(hosts[0], ["cat", f"{dst}/a.txt"]).stdout == "alpha, longer now\n"


@pytest.mark.timeout(120)
@pytest.mark.timeout(120)
def test_a_restart_does_not_sync_an_unchanged_tree_again(testbed: Testbed, tmp_path: Path) -> None:
    src = _project(tmp_path)
    (src / "run.sh").write_text('#!/bin/sh\necho "attempt $PSLAUNCH_ATTEMPT in $(pwd)"\n'
                                '[ "$PSLAUNCH_ATTEMPT" = 0 ] && [ "$DMLC_TASK_ID" = 1 ] && exit 3\nexit 0\n')
    dst = f"{testbed.sync_root}/restart-{uuid.uuid4().hex[:6]}"
    hosts = testbed.hosts[:2]
    r = run_ssh(testbed, "-n", "2", "-s", "0", "-H", hostfile(testbed, tmp_path, 2), "--sync-dst-dir", dst,
                "--max-restarts", "1", "--restart-delay", "0", "./run.sh", env=testbed.env(), cwd=src)
    assert r.returncode == 0, r.stderr
    synced = [x for x in r.stderr.splitlines() if f"synced {src} to " in x]
    assert len(synced) == 4, r.stderr  # each host, each attempt
    for h in hosts:
        first, again = [x for x in synced if f" to {h.addr_a}:{dst}: " in x]
        assert ": 5 files" in first and ": 0 files, 0 B sent" in again, (first, again)
    assert r.stdout.count(f"attempt 1 in {dst}") == 2, r.stdout


def test_sync_of_a_tree_whose_file_list_is_longer_than_an_output_frame(testbed: Testbed, tmp_path: Path) -> None:
    """30,000 new files: the host's answer lists them all (over 1 MiB, more than a process's output
    frame may be) and it arrives (it was dropped, and the sync waited 600 s for it)."""
    src = tmp_path / "many"
    for d in range(30):
        (src / f"directory-{d:02d}").mkdir(parents=True)
        for i in range(1000):
            (src / f"directory-{d:02d}" / f"a-file-with-a-longish-name-{i:04d}.txt").write_bytes(b"x")
    dst = f"{testbed.sync_root}/many-{uuid.uuid4().hex[:6]}"
    host = testbed.hosts[0]
    r = run_ssh(testbed, "-n", "1", "-s", "0", "-H", host.addr_a, "--sync-dst-dir", dst, "true",
                env=testbed.env(), cwd=src)
    assert r.returncode == 0, r.stderr
    assert f"synced {src} to {host.addr_a}:{dst}: 30000 files" in r.stderr, r.stderr
    assert testbed.run(host, ["sh", "-c", f"find {dst} -type f | wc -l"]).stdout.strip() == "30000"


@pytest.mark.timeout(120)
def test_a_frame_a_busy_host_takes_slowly_is_sent_whole(testbed: Testbed, monkeypatch) -> None:
    """The wrapper channel polls with a 0.5 s timeout; a frame larger than ssh's window, sent while
    the host reads nothing for 2 s (a busy machine), is waited for (paramiko's ``sendall`` gave up
    there with an empty message: "the connection to pslaunch's remote wrapper failed: ")."""
    import socket as socketmod

    from launcher.spec.job import Host
    from launcher.transport.options import SSHOptions
    from launcher.transport.ssh import connect_all, resolve_targets, send_patiently

    monkeypatch.setenv("HOME", str(testbed.home))
    opts = SSHOptions()
    target = resolve_targets([Host(testbed.hosts[0].addr_a)], opts)[0]
    session = next(iter(connect_all([target], opts).values()))
    data = os.urandom(8 << 20)  # (4 ssh windows of paramiko's 2 MiB)
    try:
        def slow_reader():
            chan = session.open_channel()
            chan.settimeout(0.5)
            chan.exec_command("sleep 2; wc -c")
            return chan

        chan = slow_reader()
        with pytest.raises(socketmod.timeout):  # what the backend did: the test can fail
            chan.sendall(data)
        chan.close()
        chan = slow_reader()
        started = time.monotonic()
        send_patiently(chan, data, stall_limit=30.0)
        chan.shutdown_write()
        chan.settimeout(30)
        assert chan.makefile("rb").read().strip() == str(len(data)).encode()
        assert time.monotonic() - started > 1.5  # (it did wait for the host)
        chan.close()
        stalled = slow_reader()  # a host that takes nothing: the stall limit ends the wait
        with pytest.raises(EOFError, match=r"took no data for \d+s"):
            send_patiently(stalled, data, stall_limit=1.0)
        stalled.close()
    finally:
        session.close()


def _git_project(tmp_path: Path) -> Path:
    """A git work tree with what a job must not ship: a virtual environment, ignored build output."""
    src = tmp_path / "gitproj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "train.py").write_text("print('train')\n")
    (src / ".gitignore").write_text("build/\n*.log\n")
    (src / "build").mkdir()
    (src / "build" / "out.bin").write_bytes(os.urandom(1000))
    (src / "debug.log").write_text("log\n")
    (src / "venv" / "lib").mkdir(parents=True)  # not in .gitignore: found by its pyvenv.cfg
    (src / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (src / "venv" / "lib" / "big.so").write_bytes(os.urandom(1000))
    (src / "run.sh").write_text("#!/bin/sh\nls -A\n")
    (src / "run.sh").chmod(0o755)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", ".gitignore", "pkg", "run.sh"], check=True)
    return src


@pytest.mark.timeout(120)
def test_sync_honours_gitignore_and_skips_virtual_environments(testbed: Testbed, tmp_path: Path) -> None:
    src = _git_project(tmp_path)
    dst = f"{testbed.sync_root}/git-{uuid.uuid4().hex[:6]}"
    env = testbed.env()
    host = testbed.hosts[0]
    args = ("-n", "1", "-s", "0", "-H", host.addr_a, "--sync-dst-dir", dst)
    r = run_ssh(testbed, *args, "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    assert _remote_files(testbed, host, dst) == {".gitignore", "pkg", "pkg/train.py", "run.sh"}
    assert f"synced {src} to {host.addr_a}:{dst}: 3 files" in r.stderr
    # --sync-no-gitignore: the ignored files go too, the virtual environment still does not
    # (and the skipped paths are protected from --sync-delete, as excluded ones are)
    r = run_ssh(testbed, *args, "--sync-no-gitignore", "--sync-delete", "./run.sh", env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    assert _remote_files(testbed, host, dst) == {".gitignore", "pkg", "pkg/train.py", "run.sh", "build",
                                                 "build/out.bin", "debug.log"}


@pytest.mark.timeout(120)
def test_the_dry_run_shows_the_hosts_and_the_sync_as_the_job_resolves_them(testbed: Testbed, tmp_path: Path) -> None:
    """The dry run resolves the hosts through ~/.ssh/config as the job does and shows what the sync
    sends; a large tree is a warning with its largest directories."""
    src = _git_project(tmp_path)
    with open(src / "pkg" / "weights.bin", "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB to the walk, nothing on disk
    dst = f"{testbed.sync_root}/dry-{uuid.uuid4().hex[:6]}"
    hosts = [h.alias for h in testbed.hosts[:2]]  # names that only ~/.ssh/config resolves
    args = ("-n", "2", "-s", "0", "-H", ",".join(hosts), "--sync-dst-dir", dst, "--sync-exclude", "weights.bin")
    dry = run_ssh(testbed, *args, "--dry-run", "./run.sh", cwd=src)
    assert dry.returncode == 0, dry.stderr
    for alias, h in zip(hosts, testbed.hosts[:2]):
        assert f"  {alias}: root@{h.addr_a}:22, cwd {dst}:" in dry.stdout, dry.stdout
    assert "skipped by .gitignore: build/, debug.log" in dry.stdout and "virtual environments: venv/" in dry.stdout
    r = run_ssh(testbed, *args, "./run.sh", cwd=src)
    assert r.returncode == 0, r.stderr
    for h in testbed.hosts[:2]:
        assert _remote_files(testbed, h, dst) == {".gitignore", "pkg", "pkg/train.py", "run.sh"}
    # without the exclude, the sparse file makes it large: a warning, in the dry run and before a sync
    big = run_ssh(testbed, *args[:-2], "--dry-run", "./run.sh", cwd=src)
    warning = next(x for x in big.stdout.splitlines() if "warning: --sync-dst-dir will copy" in x)
    assert "300.0 MiB in 4 files" in warning and "to each of 2 hosts; largest: pkg/ 300.0 MiB" in warning
    print(warning.strip())


@pytest.mark.timeout(90)
def test_sync_failure_on_one_host_stops_the_launch(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    src = _project(tmp_path)
    dst = f"{testbed.sync_root}/job-fail-{uuid.uuid4().hex[:6]}"
    bad = testbed.hosts[1]
    # a file where the target directory goes
    testbed.run(bad, ["sh", "-c", f"mkdir -p {testbed.sync_root} && touch {dst}"], check=True)
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 2), "--sync-dst-dir", dst,
                *probe(out), cwd=src)
    assert r.returncode == 1, r.stderr
    line = [x for x in r.stderr.splitlines() if "error" in x]
    assert len(line) == 1, r.stderr
    assert line[0].startswith(f"pslaunch: error: sync to {bad.addr_a}:{dst} failed: "), line[0]
    assert "the destination is not a directory" in line[0], line[0]
    assert read_probes(out) == {}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("planted", ["link", "theirs"])
def test_sync_refuses_a_destination_another_user_planted(testbed: Testbed, out: Path, tmp_path: Path,
                                                         planted: str) -> None:
    """Issue 30: a link planted at the destination by another user (uid 65534) made --sync-delete
    delete the files of its target and write there, rc 0. Now one line, nothing deleted, nothing
    started; the same for a destination directory another user made."""
    src = _project(tmp_path)
    base = f"{testbed.sync_root}/planted-{uuid.uuid4().hex[:6]}"
    dst, victim = f"{base}/job", f"{base}/victim"
    plant = (f"ln -s {victim} {dst} && chown -h 65534 {dst}" if planted == "link" else
             f"mkdir {dst} && chown 65534 {dst} && chmod 777 {dst}")
    bad = testbed.hosts[1]
    testbed.run(bad, ["sh", "-c", f"mkdir -p {victim} && chmod 700 {victim} && touch {victim}/a {victim}/b "
                                  f"{victim}/c && {plant}"], check=True)
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 2), "--sync-dst-dir", dst,
                "--sync-delete", *probe(out), cwd=src)
    assert r.returncode == 1, r.stderr
    line = [x for x in r.stderr.splitlines() if "error" in x]
    assert len(line) == 1, r.stderr
    why = "is a symbolic link" if planted == "link" else "is owned by uid 65534, not by you"
    assert line[0].startswith(f"pslaunch: error: sync to {bad.addr_a}:{dst} failed: the destination {why}"), line[0]
    assert "choose a directory of your own" in line[0]
    assert testbed.run(bad, ["ls", "-A", victim]).stdout.split() == ["a", "b", "c"]
    assert read_probes(out) == {}


# --- real clients ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.mxnet
@pytest.mark.parametrize("scheduler", ["command", "builtin"])
def test_mxnet_dist_sync_over_ssh(testbed: Testbed, mxnet: str, tmp_path: Path, scheduler: str) -> None:
    # (builtin: pslaunch's scheduler, here, registers nodes on three other hosts and connects to each)
    r = run_ssh(testbed, "-n", "2", "-s", "1", "-H", hostfile(testbed, tmp_path, 3), "--kill-grace", "1",
                "--timeout", "150", "--env", "PS_VERBOSE=1", "--scheduler", scheduler,
                mxnet, str(REPO / "tests" / "bin" / "mxnet_dist_sync.py"), timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    pulled = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(pulled) == 2, r.stdout
    h = testbed.hosts
    for line in pulled:
        assert line.startswith((f"[worker 0 @ {h[1].addr_a}]", f"[worker 1 @ {h[2].addr_a}]"))
        assert "expected 3.0" in line
    text = r.stdout + r.stderr
    for label in ("scheduler", f"server 0 @ {h[0].addr_a}", f"worker 0 @ {h[1].addr_a}", f"worker 1 @ {h[2].addr_a}"):
        said = "assign rank=" if label == "scheduler" and scheduler == "builtin" else "van.cc"
        assert any(x.startswith(f"[{label}]") and said in x for x in text.splitlines()), label


@pytest.mark.timeout(180)
@pytest.mark.mxnet
def test_mxnet_binds_the_dmlc_interface_subnet(testbed: Testbed, mxnet: str, out: Path, tmp_path: Path) -> None:
    """Real ps-lite on 3 hosts with DMLC_INTERFACE=<subnet B CIDR>: ``ss`` in every namespace shows
    the job's listening sockets on subnet B only, although the interface names differ."""
    env = testbed.env(DMLC_INTERFACE=testbed.subnet_b)
    p = start_ssh(testbed, "-n", "2", "-s", "2", "-H", hostfile(testbed, tmp_path, 3), "--kill-grace", "1",
                  "--timeout", "150", "--env", f"HOLD_DIR={out}", mxnet, str(REPO / "tests" / "bin" / "mxnet_hold.py"),
                  env=env)
    try:
        wait_for(lambda: len(list(out.glob("ready-*"))) == 2, 120, what="both MXNet workers to be ready")
        _assert_listeners_on_subnet_b(testbed, testbed.hosts[:3])
        (out / "release").touch()
        stdout, err = p.communicate(timeout=60)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, stdout + err


def _assert_listeners_on_subnet_b(testbed: Testbed, hosts: list[TestHost]) -> None:
    net = ipaddress.ip_network(testbed.subnet_b)
    for h in hosts:
        found = testbed.listeners(h)
        assert found, f"no listening socket on {h.name}"
        for addr, port, name in found:
            assert addr not in ("0.0.0.0", "*", "::") and ipaddress.ip_address(addr) in net, (h.name, addr, port, name)
    # and the scheduler here, on this host's subnet B address
    local = subprocess.run(["ss", "-H", "-ltn"], capture_output=True, text=True).stdout
    assert f"{testbed.root_b}:" in local


TRAINER = REPO / "scripts" / "train_mnist.py"


def _need_trainer() -> None:
    if not TRAINER.exists():
        pytest.skip("scripts/train_mnist.py has not landed on this branch yet (issue 4)")


@pytest.mark.timeout(300)
def test_seed_usage_line_trains_mnist_over_ssh(testbed: Testbed, tmp_path: Path) -> None:
    """``pslaunch -n 2 -s 2 --launcher ssh -H hosts --sync-dst-dir DIR python scripts/train_mnist.py
    --network lenet --kv-store dist_sync``: the code reaches the hosts by sync, PS_VERBOSE=1 output
    comes from every node, and the trainer's sockets are on the DMLC_INTERFACE subnet."""
    _need_trainer()
    dst = f"{testbed.sync_root}/mnist-{uuid.uuid4().hex[:6]}"
    venv_bin = str(Path(PY).parent)
    env = testbed.env(PS_VERBOSE="1", DMLC_INTERFACE=testbed.subnet_b)
    env["PYTHONPATH"] = str(REPO / "tests" / "netguard")  # not the repo: the hosts import the synced copy
    args = ["-n", "2", "-s", "2", "-H", hostfile(testbed, tmp_path, 3), "--sync-dst-dir", dst, "--kill-grace", "1",
            "--timeout", "240", "--env", f"PATH={venv_bin}:/usr/bin:/bin",
            "python", "scripts/train_mnist.py", "--network", "lenet", "--kv-store", "dist_sync",
            "--num-epochs", "1", "--num-examples", "2000"]
    p = start_ssh(testbed, *args, env=env)
    seen: dict[str, set] = {}
    try:
        while p.poll() is None:
            for h in testbed.hosts[:3]:
                for addr, _, _ in testbed.listeners(h):
                    seen.setdefault(h.name, set()).add(addr)
            time.sleep(0.5)
        stdout, err = p.communicate(timeout=60)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, stdout[-3000:] + err[-3000:]
    text = (stdout + err).splitlines()
    h = testbed.hosts
    labels = ["scheduler", f"server 0 @ {h[0].addr_a}", f"server 1 @ {h[1].addr_a}", f"worker 0 @ {h[2].addr_a}",
              f"worker 1 @ {h[0].addr_a}"]
    # PS_VERBOSE=1 reached every node: each prints its ps-lite style lifecycle lines
    for label in labels:
        marker = "is connected to others" if label.startswith("worker") else "Bind to role="
        assert any(x.startswith(f"[{label}]") and marker in x for x in text), (label, marker)
    net = ipaddress.ip_network(testbed.subnet_b)
    assert seen, "no listening socket seen on any host while the trainer ran"
    for host, addrs in seen.items():
        assert all(ipaddress.ip_address(a) in net for a in addrs), (host, addrs)
    for hh in h[:3]:
        assert "scripts/train_mnist.py" in "\n".join(_remote_files(testbed, hh, dst))


@pytest.mark.timeout(60)
def test_ctrl_c_while_connecting_stops_at_once(testbed: Testbed, out: Path, tmp_path: Path) -> None:
    dead = f"10.200.{testbed.number}.98"  # no host there: connecting waits for the timeout
    (tmp_path / "hosts").write_text(f"{testbed.hosts[0].addr_a}\n{dead}\n")
    p = start_ssh(testbed, "-n", "2", "-s", "1", "-H", str(tmp_path / "hosts"), "--ssh-connect-timeout", "30",
                  *probe(out))
    time.sleep(2.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 130, err
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in err
    assert read_probes(out) == {}


# --- pslaunch doctor ----------------------------------------------------------------------------------------


def run_doctor(testbed: Testbed, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_pslaunch("doctor", *args, env=env or testbed.env(), timeout=90)


@pytest.mark.timeout(120)
def test_doctor_all_hosts_ready(testbed: Testbed, tmp_path: Path) -> None:
    hosts = hostfile(testbed, tmp_path, 3)
    r = run_doctor(testbed, "-H", hosts, "--env", f"DMLC_INTERFACE={testbed.subnet_b}", "--check-import", "trainer",
                   PY, str(REPO / "tests" / "bin" / "probe.py"), "--out", "x")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["HOST", "SSH", "PYTHON3", "CWD", "PROGRAM", "IMPORTS", "INTERFACE", "PORT", "REACH"]
    here = ".".join(map(str, sys.version_info[:3]))
    for h in testbed.hosts[:3]:
        row = next(x for x in lines if x.startswith(h.addr_a + " "))
        assert "FAIL" not in row
        assert f"ok {h.iface_b} {h.addr_b}" in row and "ok trainer" in row and f"ok {PY} python {here}" in row
    assert f"3 of 3 hosts ready; scheduler address {testbed.root_b}:" in r.stdout
    print(r.stdout)


@pytest.mark.timeout(180)
def test_doctor_passes_the_hosts_a_job_just_ran_on(testbed: Testbed, tmp_path: Path, out: Path) -> None:
    """The issue's case: a job runs fine on two hosts from a directory that holds no pslaunch, and
    doctor, given the same options and command, finds both hosts ready (the bundled packages are
    not required there; ``--check-import trainer`` is the way to ask for them)."""
    src = tmp_path / "job"
    src.mkdir()
    shutil.copy(REPO / "tests" / "bin" / "probe.py", src / "probe.py")
    dst = f"{testbed.sync_root}/doctor-job-{uuid.uuid4().hex[:6]}"
    hosts = ",".join(h.addr_a for h in testbed.hosts[:2])
    env = testbed.env()
    env["PYTHONPATH"] = str(REPO / "tests" / "netguard")  # the network guard, but not pslaunch's packages
    job = ("-H", hosts, "--sync-dst-dir", dst, "--env", f"DMLC_INTERFACE={testbed.subnet_b}")
    command = ("python3", "probe.py", "--out", str(out))
    r = run_ssh(testbed, "-n", "2", "-s", "0", *job, *command, env=env, cwd=src)
    assert r.returncode == 0, r.stderr
    d = run_pslaunch("doctor", *job, *command, env=env, cwd=src, timeout=90)
    assert d.returncode == 0, d.stdout + d.stderr
    assert "2 of 2 hosts ready" in d.stdout and "FAIL" not in d.stdout
    assert d.stdout.count("ok python3 python 3.") == 2, d.stdout
    print(f"$ pslaunch doctor {' '.join(job + command)}\n{d.stdout}")
    # asked for, the trainer is checked, and it is not there
    d = run_pslaunch("doctor", *job, "--check-import", "trainer", *command, env=env, cwd=src, timeout=90)
    assert d.returncode == 1 and "0 of 2 hosts ready" in d.stdout, d.stdout
    assert "imports: import trainer in" in d.stdout and "No module named 'trainer'" in d.stdout
    # a program the hosts do not have: 127, as the job would exit
    d = run_pslaunch("doctor", *job, "no-such-program-xyz", env=env, cwd=src, timeout=90)
    assert d.returncode == 1 and "FAIL no-such-program-xyz not found" in d.stdout, d.stdout


@pytest.mark.timeout(180)
def test_doctor_counts_what_the_sync_sends_as_there(testbed: Testbed, tmp_path: Path) -> None:
    """Before the first --sync-dst-dir the hosts have neither the job's directory nor its files:
    a script and a program that the sync sends count as there, so hosts that are fine are ready
    (the doctor given the job's whole command line); what the sync leaves out still fails, as the
    job would."""
    src = tmp_path / "job"
    (src / "bin").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "bin" / "probe.py", src / "probe.py")
    (src / "bin" / "run.sh").write_text('#!/bin/sh\nexec python3 probe.py "$@"\n')
    (src / "bin" / "run.sh").chmod(0o755)
    dst = f"{testbed.sync_root}/doctor-sync-{uuid.uuid4().hex[:6]}"
    hosts = ",".join(h.addr_a for h in testbed.hosts[:2])
    job = ("-n", "2", "-s", "0", "--tracker", "torch", "--kill-grace", "1", "-H", hosts, "--sync-dst-dir", dst,
           "--env", f"DMLC_INTERFACE={testbed.subnet_b}")
    for command, cell in ((("python3", "probe.py", "--out", "x"), "ok python3 python 3."),
                          (("./bin/run.sh", "--out", "x"), "ok ./bin/run.sh")):
        d = run_pslaunch("doctor", *job, *command, env=testbed.env(), cwd=src, timeout=90)
        assert d.returncode == 0, d.stdout + d.stderr
        assert "2 of 2 hosts ready" in d.stdout and "FAIL" not in d.stdout, d.stdout
        assert d.stdout.count(cell) == 2 and d.stdout.count("ok (synced)") == 2, d.stdout
        print(f"$ pslaunch doctor {' '.join(job + command)}\n{d.stdout}")
    for h in testbed.hosts[:2]:  # (the doctor sent nothing)
        assert testbed.run(h, ["test", "-e", dst]).returncode != 0
    d = run_pslaunch("doctor", *job, "--sync-exclude", "bin", "./bin/run.sh", env=testbed.env(), cwd=src, timeout=90)
    assert d.returncode == 1 and "0 of 2 hosts ready" in d.stdout, d.stdout + d.stderr
    assert d.stdout.count("FAIL ./bin/run.sh not found") == 2, d.stdout


@pytest.mark.timeout(120)
def test_doctor_reports_every_problem_and_fails(testbed: Testbed, tmp_path: Path) -> None:
    dead = f"10.200.{testbed.number}.97"
    (tmp_path / "hosts").write_text(f"{testbed.hosts[0].addr_a}\n{testbed.hosts[1].addr_a}\nnosuchuser@"
                                    f"{testbed.hosts[2].addr_a}\n{dead}\n")
    empty = testbed.sync_root / "doctor-empty"
    for h in testbed.hosts[:2]:
        testbed.run(h, ["mkdir", "-p", str(empty)], check=True)
    r = run_doctor(testbed, "-H", str(tmp_path / "hosts"), "--ssh-connect-timeout", "3", "--sync-dst-dir", str(empty),
                   "--env", "PYTHONPATH=/nonexistent", "--env", f"DMLC_INTERFACE={testbed.hosts[0].iface_b}",
                   "--host-ip", "127.0.0.1", "--check-import", "launcher", PY, "train.py")
    assert r.returncode == 1, r.stdout + r.stderr
    problems = r.stdout.split("problems:\n", 1)[1].split("information:\n", 1)[0].splitlines()
    h0, h1, h2 = testbed.hosts[:3]
    expect = [
        f"{h0.addr_a}: program: train.py: no such file in {empty}",
        f"{h0.addr_a}: reach: cannot connect to the launching host at 127.0.0.1:",
        f"{h1.addr_a}: interface: DMLC_INTERFACE={h0.iface_b} matches no interface",
        f"{h2.addr_a}: ssh: ssh authentication as nosuchuser on {h2.addr_a}:22 failed",
        f"{dead}: ssh: cannot reach {dead}:22: no answer within 3s",
    ]
    for e in expect:
        assert any(p.strip().startswith(e) for p in problems), (e, problems)
    assert "0 of 4 hosts ready" in r.stdout
