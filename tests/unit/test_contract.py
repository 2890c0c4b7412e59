"""The environment contract (pscontract) and the launcher's policy around it (launcher.spec.env)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.helpers import REPO

import pscontract as pc
from launcher.spec import env as jobenv
from pscontract import ClusterEnv, ClusterEnvError


@pytest.mark.parametrize("name", ["PSLAUNCH_SECRET", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "DB_PASSWORD",
                                  "FTP_PASSWD", "GOOGLE_APPLICATION_CREDENTIALS", "API_KEY", "my_key"])
def test_secret_names(name: str) -> None:
    assert jobenv.is_secret(name)


@pytest.mark.parametrize("name", ["PS_VERBOSE", "DMLC_ROLE", "KEYBOARD", "HOME", "MONKEY"])
def test_not_secret(name: str) -> None:
    assert not jobenv.is_secret(name)


def test_redact() -> None:
    env = {"AWS_SECRET_ACCESS_KEY": "abcd1234", "PS_VERBOSE": "1"}
    assert jobenv.redact(env) == {"AWS_SECRET_ACCESS_KEY": "<redacted>", "PS_VERBOSE": "1"}
    assert jobenv.redact_text("key is abcd1234!", env) == "key is <redacted>!"


def test_forwarded_allow_list() -> None:
    environ = {"PS_VERBOSE": "1", "PS_X": "2", "DMLC_INTERFACE": "eth0", "DMLC_ROLE": "worker", "OMP_A": "1",
               "KMP_B": "1", "MXNET_C": "1", "AWS_D": "1", "PYTHONPATH": "/p", "LD_LIBRARY_PATH": "/l",
               "CUDA_VISIBLE_DEVICES": "1", "HOME": "/h", "PATH": "/bin", "DMLC_SUBMIT_CLUSTER": "ssh"}
    got = jobenv.forwarded(environ, extra_names=["HOME"])
    assert set(got) == {"PS_VERBOSE", "PS_X", "DMLC_INTERFACE", "OMP_A", "KMP_B", "MXNET_C", "AWS_D",
                        "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "HOME"}


def test_names_that_are_not_variable_names_are_never_forwarded() -> None:
    """``env 'PS_A$(touch x)=1' pslaunch ...``: such a name must not reach YARN's launch script
    (export NAME="VALUE") or MPICH's comma-separated -genvlist."""
    environ = {"PS_A$(touch x)": "1", "DMLC_B;id": "1", "OMP_C,D": "1", "PS_OK": "1", "MXNET_E F": "1"}
    assert jobenv.forwarded(environ, extra_names=["X-Y"]) == {"PS_OK": "1"}


def contract_env(**kw):
    base = dict(root_uri="127.0.0.1", root_port=9091, num_workers=2, num_servers=1, secret="s" * 64,
                start_timeout=30, job_id="j", task_id=1, cluster="local", node_host="127.0.0.1", local_procs=3)
    base.update(kw)
    return pc.contract("worker", **base)


def test_round_trip_contract_to_cluster_env() -> None:
    env = contract_env()
    env.update({"PS_HEARTBEAT_INTERVAL": "2", "PS_PORT_RANGE": "10000-10100", "PS_VERBOSE": "1"})
    c = ClusterEnv.from_environ(env)
    assert (c.role, c.root_uri, c.root_port, c.num_workers, c.num_servers, c.task_id) == \
        ("worker", "127.0.0.1", 9091, 2, 1, 1)
    assert (c.node_host, c.secret, c.cluster, c.start_timeout, c.local_procs) == \
        ("127.0.0.1", "s" * 64, "local", 30.0, 3)
    assert (c.heartbeat_interval, c.heartbeat_timeout, c.port_range, c.verbose) == (2.0, 10.0, (10000, 10100), 1)


def test_cluster_env_missing_role_means_worker() -> None:
    env = contract_env()
    del env["DMLC_ROLE"]
    assert ClusterEnv.from_environ(env).role == "worker"


@pytest.mark.parametrize("change, message", [
    ({"DMLC_PS_ROOT_URI": None}, "DMLC_PS_ROOT_URI is not set"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER='two' is not an integer"),
    ({"DMLC_ROLE": "boss"}, "DMLC_ROLE='boss' is not one of"),
    ({"PS_START_TIMEOUT": "soon"}, "PS_START_TIMEOUT='soon' is not a number"),
    ({"PS_PORT_RANGE": "10-5"}, "PS_PORT_RANGE: bad port range"),
    ({"PS_HEARTBEAT_TIMEOUT": "1"}, "PS_HEARTBEAT_TIMEOUT=1 must be longer than PS_HEARTBEAT_INTERVAL=1"),
    ({"PS_HEARTBEAT_INTERVAL": "5", "PS_HEARTBEAT_TIMEOUT": "2"}, "must be longer than PS_HEARTBEAT_INTERVAL=5"),
    ({"PS_HEARTBEAT_INTERVAL": "-1"}, "PS_HEARTBEAT_INTERVAL='-1' must be a finite number of seconds"),
    ({"PS_HEARTBEAT_TIMEOUT": "nan"}, "PS_HEARTBEAT_TIMEOUT='nan' must be a finite number"),
    ({"PS_HEARTBEAT_TIMEOUT": "inf"}, "PS_HEARTBEAT_TIMEOUT='inf' must be a finite number"),
])
def test_cluster_env_errors(change, message) -> None:
    env = contract_env()
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ClusterEnvError, match=message):
        ClusterEnv.from_environ(env)


@pytest.mark.parametrize("change, expected", [
    ({}, (1.0, 10.0)),
    ({"PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "3"}, (0.5, 3.0)),
    ({"PS_HEARTBEAT_INTERVAL": "0", "PS_HEARTBEAT_TIMEOUT": "0.1"}, (0.0, 0.1)),  # heartbeats off
    ({"PS_HEARTBEAT_INTERVAL": "2", "PS_HEARTBEAT_TIMEOUT": "0"}, (2.0, 0.0)),  # the check off
])
def test_heartbeat_settings(change, expected) -> None:
    env = {**contract_env(), **change}
    c = ClusterEnv.from_environ(env)
    assert (c.heartbeat_interval, c.heartbeat_timeout) == expected


def test_compose_reports_only_real_conflicts() -> None:
    c = contract_env()
    out = jobenv.compose(c, inherited={"DMLC_ROLE": "worker", "HOME": "/h"}, cli_env={"DMLC_TASK_ID": "7"})
    assert out.overridden == ("DMLC_TASK_ID",)
    assert out.env["DMLC_TASK_ID"] == "1" and out.env["HOME"] == "/h"


def test_cluster_env_repr_hides_the_secret() -> None:
    from pscontract import ClusterEnv

    env = ClusterEnv(role="worker", root_uri="127.0.0.1", root_port=9, num_workers=1,
                     num_servers=1, secret="5e" * 32)
    assert "5e5e" not in repr(env) and env.secret == "5e" * 32


def test_importing_the_contract_pulls_in_nothing_else_of_pslaunch() -> None:
    """The trainer and the node programs import it: it must not bring click, yaml, paramiko or the launcher."""
    code = ("import sys; import pscontract, pscontract.netif; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('launcher', 'trainer', 'click', 'yaml', 'paramiko', 'pscontract')))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['pscontract', 'pscontract.netif']"


# --- the collective trackers ---------------------------------------------------------------------------


def test_rabit_contract_key_by_key() -> None:
    env = pc.rabit_contract(tracker_uri="10.0.0.1", tracker_port=9091, task_id=1, num_workers=2, cluster="ssh",
                            secret="s" * 64, job_id="j", start_timeout=60, node_host="10.0.0.7", local_procs=1)
    assert env == {"DMLC_TRACKER_URI": "10.0.0.1", "DMLC_TRACKER_PORT": "9091", "DMLC_ROLE": "worker",
                   "DMLC_TASK_ID": "1", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "0", "DMLC_JOB_CLUSTER": "ssh",
                   "DMLC_NODE_HOST": "10.0.0.7", "PSLAUNCH_LOCAL_PROCS": "1", "PSLAUNCH_SECRET": "s" * 64,
                   "PSLAUNCH_JOB_ID": "j", "PSLAUNCH_PROCESS": "j/worker-1", "PS_START_TIMEOUT": "60"}
    assert not any(k.startswith("DMLC_PS_ROOT") for k in env)  # no scheduler (launch.py's -s 0)


def test_torch_contract_key_by_key() -> None:
    place = pc.HostRank(rank=3, local_rank=1, local_world_size=2, group_rank=1, group_world_size=2)
    env = pc.torch_contract(master_addr="10.0.0.1", master_port=9092, task_id=3, num_workers=4, cluster="ssh",
                            secret="s" * 64, job_id="j", start_timeout=60, place=place, node_host="10.0.0.8")
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "9092", "RANK": "3", "WORLD_SIZE": "4",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                   "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "DMLC_ROLE": "worker", "DMLC_TASK_ID": "3",
                   "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "0", "DMLC_JOB_CLUSTER": "ssh",
                   "DMLC_NODE_HOST": "10.0.0.8", "PSLAUNCH_LOCAL_PROCS": "2", "PSLAUNCH_SECRET": "s" * 64,
                   "PSLAUNCH_JOB_ID": "j", "PSLAUNCH_PROCESS": "j/worker-3", "PS_START_TIMEOUT": "60"}
    # placed by a batch system: what depends on the hosts comes later (pscontract.torch_placement)
    later = pc.torch_contract(master_addr="10.0.0.1", master_port=9092, task_id=3, num_workers=4, cluster="sge",
                              secret="s", job_id="j", start_timeout=60, place=None)
    assert set(env) - set(later) == set(pc.torch_placement(place)) | {"DMLC_NODE_HOST"}


def test_attempt_env_is_the_jobs_count_on_every_role() -> None:
    ps = pc.attempt_env(attempt=2, max_restarts=3, run_id="r1", tracker="ps")
    assert ps == {"PSLAUNCH_ATTEMPT": "2", "PSLAUNCH_MAX_RESTARTS": "3", "PSLAUNCH_RUN_ID": "r1",
                  "DMLC_NUM_ATTEMPT": "2"}
    torch = pc.attempt_env(attempt=2, max_restarts=3, run_id="r1", tracker="torch")
    assert torch == {**ps, "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
                     "TORCHELASTIC_RUN_ID": "r1"}
    assert set(torch) <= pc.owned("torch") and set(ps) <= pc.owned("ps")  # (never an inherited value)
    with pytest.raises(ValueError):
        pc.attempt_env(attempt=-1, max_restarts=0, run_id="r", tracker="ps")


def test_torch_defaults_are_torchruns_unless_the_launcher_has_a_value() -> None:
    # torchrun: TORCHELASTIC_SIGNALS_TO_HANDLE from its --signals-to-handle default, and
    # os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") in its agent (local_elastic_agent.py)
    assert pc.torch_defaults({}) == {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                                     "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    mine = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert pc.torch_defaults({**mine, "PATH": "/bin"}) == mine
    assert not set(pc.torch_defaults({})) & pc.owned("torch")  # (not owned: --env sets them)


@pytest.mark.parametrize("hosts, expected", [
    ([], []),
    (["a", "a", "a"], [(0, 0, 3, 0, 1), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1)]),
    (["a", "b", "a", "b"], [(0, 0, 2, 0, 2), (2, 0, 2, 1, 2), (1, 1, 2, 0, 2), (3, 1, 2, 1, 2)]),
    (["b", "a", "c", "a"], [(0, 0, 1, 0, 3), (1, 0, 2, 1, 3), (3, 0, 1, 2, 3), (2, 1, 2, 1, 3)]),
])
def test_host_ranks_number_host_by_host(hosts, expected) -> None:
    got = [(r.rank, r.local_rank, r.local_world_size, r.group_rank, r.group_world_size) for r in pc.host_ranks(hosts)]
    assert got == expected


def test_owned_variables_per_tracker() -> None:
    assert pc.owned("ps") == pc.owned("rabit") == pc.owned("xgboost") == pc.CONTRACT
    assert pc.owned("torch") >= pc.CONTRACT | {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    assert "DMLC_TRACKER_URI" in pc.CONTRACT and "RANK" not in pc.CONTRACT
    with pytest.raises(ValueError):
        pc.owned("mpi")


def test_service_endpoint_is_the_scheduler_or_the_tracker() -> None:
    assert pc.service_endpoint({"DMLC_PS_ROOT_URI": "1.1.1.1", "DMLC_PS_ROOT_PORT": "9091"}) == ("1.1.1.1", 9091)
    assert pc.service_endpoint({"DMLC_TRACKER_URI": "2.2.2.2", "DMLC_TRACKER_PORT": "9"}) == ("2.2.2.2", 9)
    assert pc.service_endpoint({"MASTER_ADDR": "3.3.3.3", "MASTER_PORT": "x"}) == ("3.3.3.3", 0)
    assert pc.service_endpoint({"PATH": "/bin"}) is None


def test_torch_sockets_follow_dmlc_interface_unless_set() -> None:
    assert pc.torch_sockets({"MASTER_ADDR": "1.2.3.4"}, "ib0") == {"GLOO_SOCKET_IFNAME": "ib0",
                                                                  "NCCL_SOCKET_IFNAME": "=ib0"}
    assert pc.torch_sockets({"MASTER_ADDR": "1.2.3.4", "GLOO_SOCKET_IFNAME": "eth1"}, "ib0") == {
        "NCCL_SOCKET_IFNAME": "=ib0"}
    assert pc.torch_sockets({"DMLC_PS_ROOT_URI": "1.2.3.4"}, "ib0") == {}  # not a torch job
    assert pc.torch_sockets({"MASTER_ADDR": "1.2.3.4"}, None) == {}


def test_short_secret_values_are_redacted_as_whole_words_only() -> None:
    env = {"DB_PASSWORD": "ab", "API_TOKEN": "x9", "PS_VERBOSE": "1"}
    assert jobenv.redact_text("password=ab token x9.", env) == "password=<redacted> token <redacted>."
    # inside a longer word or number it is left alone: "ab" is not hidden in "about" or "cab9"
    assert jobenv.redact_text("about cab9 1ab", env) == "about cab9 1ab"
    assert jobenv.redact_text("PS_VERBOSE=1", env) == "PS_VERBOSE=1"  # not secret-named


def test_redactor_hides_every_value_longest_first() -> None:
    r = jobenv.Redactor(["secret-1", "secret-12", "", "q"])
    assert r("a secret-12 b secret-1 c q d") == "a <redacted> b <redacted> c <redacted> d"
    assert not jobenv.Redactor(["", ""]) and jobenv.Redactor(["x"])


def test_each_attempt_has_markers_of_its_own() -> None:
    """A node agent's watchdog of attempt k, cleaning up after it, never stops attempt k+1's processes."""
    assert pc.process_marker("j", "worker-1") == pc.process_marker("j", "worker-1", 0) == "j/worker-1"
    assert pc.process_marker("j", "worker-1", 2) == "j/worker-1@2"
