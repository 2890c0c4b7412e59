from __future__ import annotations

import dataclasses

import pytest

import pscontract as pc
from launcher.errors import ConfigError
from launcher.spec.job import Host, JobSpec
from launcher.spec.plan import build_plan, by_host, place

A, B, C = Host("A"), Host("B"), Host("C")


def test_dmlc_placement_three_hosts() -> None:
    # launch.py with -n 3 -s 2 over A, B, C: server0->A, server1->B, worker0->C, worker1->A, worker2->B
    got = [(str(s.role), s.rank, s.task_id, s.host.name) for s in place(3, 2, [A, B, C])]
    assert got == [
        ("server", 0, 3, "A"),
        ("server", 1, 4, "B"),
        ("worker", 0, 0, "C"),
        ("worker", 1, 1, "A"),
        ("worker", 2, 2, "B"),
    ]


def test_task_ids_workers_first_servers_after() -> None:
    slots = place(4, 2)
    assert sorted((s.task_id, str(s.role), s.rank) for s in slots) == [
        (0, "worker", 0), (1, "worker", 1), (2, "worker", 2), (3, "worker", 3), (4, "server", 0), (5, "server", 1)]
    assert all(s.host is None for s in slots)
    # servers come first in start order
    assert [str(s.role) for s in slots][:2] == ["server", "server"]


def test_slots_cap_hosts_and_skip_full_ones() -> None:
    a, b = Host("a", slots=1), Host("b", slots=3)
    got = [s.host.name for s in place(3, 1, [a, b])]
    assert got == ["a", "b", "b", "b"]


def test_hosts_without_slots_are_unlimited() -> None:
    got = [s.host.name for s in place(4, 2, [Host("a", slots=1), Host("b")])]
    assert got == ["a", "b", "b", "b", "b", "b"]


def test_not_enough_slots() -> None:
    with pytest.raises(ConfigError, match="5 processes .* do not fit in the hostfile's 3 slots"):
        place(3, 2, [Host("a", slots=1), Host("b", slots=2)])


def test_no_servers() -> None:
    slots = place(2, 0, [A, B])
    assert [(str(s.role), s.rank, s.task_id, s.host.name) for s in slots] == [
        ("worker", 0, 0, "A"), ("worker", 1, 1, "B")]


def spec(**kw) -> JobSpec:
    base = dict(command=("python", "t.py"), num_workers=2, num_servers=1,
                environ=(("HOME", "/root"), ("PS_VERBOSE", "1"), ("DMLC_INTERFACE", "lo"),
                         ("PYTHONPATH", "/x"), ("LD_LIBRARY_PATH", "/l"), ("OMP_NUM_THREADS", "4"),
                         ("KMP_AFFINITY", "c"), ("MXNET_X", "1"), ("AWS_SECRET_ACCESS_KEY", "s3cr3t"),
                         ("CUDA_VISIBLE_DEVICES", "0"), ("UNRELATED", "u"),
                         ("DMLC_ROLE", "worker"), ("DMLC_PS_ROOT_URI", "10.9.9.9")))
    base.update(kw)
    return JobSpec(**base)


def make(s: JobSpec, inherit: bool = False, addresses=None, here: str | None = "10.0.0.1"):
    return build_plan(s, root_uri="10.0.0.1", root_port=9091, secret="ab" * 32, job_id="j1",
                      addresses=addresses or {}, here=here, inherit_environ=inherit)


def test_contract_per_role_key_by_key() -> None:
    plan = make(spec())
    sched = plan.scheduler
    assert sched is not None and sched.task_id is None
    for key, value in {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9091",
                       "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_SECRET": "ab" * 32,
                       "PS_START_TIMEOUT": "60", "PSLAUNCH_JOB_ID": "j1"}.items():
        assert sched.env[key] == value
    assert "DMLC_TASK_ID" not in sched.env and "DMLC_NODE_HOST" not in sched.env
    by_name = {p.name: p for p in plan.procs}
    assert list(by_name) == ["server-0", "worker-0", "worker-1"]
    expect = {
        "server-0": dict(DMLC_ROLE="server", DMLC_TASK_ID="2"),
        "worker-0": dict(DMLC_ROLE="worker", DMLC_TASK_ID="0"),
        "worker-1": dict(DMLC_ROLE="worker", DMLC_TASK_ID="1"),
    }
    for name, own in expect.items():
        env = by_name[name].env
        contract = {**own, "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9091", "DMLC_NUM_WORKER": "2",
                    "DMLC_NUM_SERVER": "1", "DMLC_JOB_CLUSTER": "local", "DMLC_NODE_HOST": "10.0.0.1",
                    "PSLAUNCH_SECRET": "ab" * 32, "PS_START_TIMEOUT": "60", "PSLAUNCH_JOB_ID": "j1",
                    "PSLAUNCH_LOCAL_PROCS": "3"}
        for k, v in contract.items():
            assert env[k] == v, (name, k)


def test_forwarded_set_and_nothing_else_without_inheritance() -> None:
    env = make(spec()).procs[1].env
    for k, v in {"PS_VERBOSE": "1", "DMLC_INTERFACE": "lo", "PYTHONPATH": "/x", "LD_LIBRARY_PATH": "/l",
                 "OMP_NUM_THREADS": "4", "KMP_AFFINITY": "c", "MXNET_X": "1", "CUDA_VISIBLE_DEVICES": "0",
                 "AWS_SECRET_ACCESS_KEY": "s3cr3t"}.items():
        assert env[k] == v
    assert "HOME" not in env and "UNRELATED" not in env
    assert env["PYTHONUNBUFFERED"] == "1" and env["PYTHONFAULTHANDLER"] == "1"


def test_local_inherits_whole_environment_lowest() -> None:
    env = make(spec(), inherit=True).procs[1].env
    assert env["HOME"] == "/root" and env["UNRELATED"] == "u"


def test_omp_default_one_thread() -> None:
    s = spec(environ=(("HOME", "/root"),))
    assert make(s).procs[0].env["OMP_NUM_THREADS"] == "1"


def test_precedence_contract_role_env_forwarded() -> None:
    s = spec(env=(("PS_VERBOSE", "2"), ("FOO", "cli"), ("BAR", "cli"), ("DMLC_ROLE", "x")),
             env_worker=(("FOO", "worker"), ("DMLC_NUM_WORKER", "9")),
             env_server=(("FOO", "server"),))
    plan = make(s)
    server, worker = plan.procs[0], plan.procs[1]
    assert worker.env["FOO"] == "worker" and server.env["FOO"] == "server"
    assert worker.env["BAR"] == "cli" and worker.env["PS_VERBOSE"] == "2"
    assert worker.env["DMLC_ROLE"] == "worker" and worker.env["DMLC_NUM_WORKER"] == "2"
    assert plan.scheduler.env["FOO"] == "cli"  # per-role values are for servers/workers only
    # inherited DMLC_ROLE / DMLC_PS_ROOT_URI and --env DMLC_ROLE are overridden and reported
    assert set(plan.overridden) >= {"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_NUM_WORKER"}


def test_node_host_unknown_left_to_wrapper() -> None:
    s = spec(launcher="mpi", hosts=(A, B))
    plan = make(s, here=None)
    assert all(pc.NODE_HOST not in p.env for p in plan.procs)
    assert {p.env["DMLC_JOB_CLUSTER"] for p in plan.procs} == {"mpi"}


def test_local_procs_counts_per_host() -> None:
    s = spec(launcher="ssh", hosts=(A, B, C), num_workers=3, num_servers=2)
    plan = make(s, addresses={A: "1.1.1.1", B: "2.2.2.2", C: "3.3.3.3"}, here=None)
    got = {p.name: (p.host.name, p.env["PSLAUNCH_LOCAL_PROCS"], p.env["DMLC_NODE_HOST"]) for p in plan.procs}
    assert got == {"server-0": ("A", "2", "1.1.1.1"), "server-1": ("B", "2", "2.2.2.2"),
                   "worker-0": ("C", "1", "3.3.3.3"), "worker-1": ("A", "2", "1.1.1.1"),
                   "worker-2": ("B", "2", "2.2.2.2")}
    assert plan.procs[0].label == "server 0 @ A"


def test_a_batch_system_places_the_processes_so_nothing_per_host_is_known() -> None:
    plan = make(spec(launcher="sge"), here=None)
    assert all(pc.NODE_HOST not in p.env and pc.LOCAL_PROCS not in p.env for p in plan.procs)


def test_no_scheduler_with_zero_servers() -> None:
    plan = make(spec(num_servers=0))
    assert plan.scheduler is None
    assert [p.env["DMLC_NUM_SERVER"] for p in plan.procs] == ["0", "0"]


def test_p3_sets_van_type() -> None:
    env = make(spec(p3=True)).procs[0].env
    assert env["DMLC_PS_VAN_TYPE"] == "p3" and env["DMLC_PS_WATER_MARK"] == "10"


# --- collective jobs (--tracker rabit, xgboost, torch) -----------------------------------------------


def test_a_job_of_workers_only_uses_the_rabit_tracker_by_default() -> None:
    assert spec(num_servers=0).tracker == "rabit"
    assert spec().tracker == "ps"


@pytest.mark.parametrize("kw, message", [
    (dict(tracker="torch", num_servers=1), "--tracker torch runs workers only; drop -s 1"),
    (dict(tracker="ps", num_servers=0), "--tracker ps needs servers"),
    (dict(tracker="ps", num_servers=1, tracker_python="python3"), "--tracker-python is the Python of --tracker "
                                                                  "rabit, xgboost or torch; --tracker ps runs none"),
    (dict(tracker="horovod", num_servers=0), "--tracker horovod: choose one of ps, rabit, xgboost, torch"),
])
def test_tracker_rules(kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        spec(**kw)


def test_the_builtin_scheduler_replaces_only_the_schedulers_command() -> None:
    s = spec(scheduler="builtin")
    plan = build_plan(s, root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j", inherit_environ=False)
    assert plan.scheduler is not None
    # (with the site packages, no -S: the builtin scheduler imports pyzmq)
    assert plan.scheduler.argv[1] == "-c" and "from launcher.trackers.pslite import main" in plan.scheduler.argv[2]
    assert all(p.argv == ("python", "t.py") for p in plan.procs)
    default = build_plan(spec(), root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j",
                         inherit_environ=False)
    assert default.scheduler is not None and default.scheduler.argv == ("python", "t.py")
    assert default.scheduler.env == plan.scheduler.env  # the same contract either way


def test_the_builtin_scheduler_is_told_the_jobs_hosts() -> None:
    peers = "PSLAUNCH_SCHEDULER_PEERS"
    ssh = dataclasses.replace(spec(scheduler="builtin"), hosts=(A, B))
    plan = build_plan(ssh, root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j", inherit_environ=False,
                      addresses={A: "10.0.0.5", B: "B"})
    assert plan.scheduler is not None and plan.scheduler.env[peers] == "A,B,10.0.0.5"
    here = build_plan(spec(scheduler="builtin"), root_uri="127.0.0.1", root_port=9091, secret="x" * 64, job_id="j",
                      here="127.0.0.1", inherit_environ=False)
    assert here.scheduler is not None and here.scheduler.env[peers] == "127.0.0.1"
    # a batch system places the nodes later, mpirun's hosts may connect from addresses their names
    # are not (the launcher found none for them): anyone; MXNet's own scheduler has no such gate
    later = build_plan(spec(scheduler="builtin"), root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j",
                       inherit_environ=False)
    mpi = build_plan(ssh, root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j", inherit_environ=False)
    mxnet = build_plan(dataclasses.replace(spec(), hosts=(A,)), root_uri="10.0.0.1", root_port=9091,
                       secret="x" * 64, job_id="j", inherit_environ=False, addresses={A: "10.0.0.5"})
    for p in (later, mpi, mxnet):
        assert p.scheduler is not None and peers not in p.scheduler.env
    # the user's own list stands (--env, or '*' for anyone)
    mine = dataclasses.replace(ssh, env=((peers, "*"),))
    plan = build_plan(mine, root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j", inherit_environ=False,
                      addresses={A: "10.0.0.5", B: "B"})
    assert plan.scheduler is not None and plan.scheduler.env[peers] == "*"


def test_workers_are_numbered_host_by_host_in_a_collective_job() -> None:
    slots = by_host(place(5, 0, [A, B]))
    assert [(s.rank, s.task_id, s.host.name) for s in slots] == [(0, 0, "A"), (1, 1, "A"), (2, 2, "A"),
                                                                  (3, 3, "B"), (4, 4, "B")]
    # slots= caps as in every job; N equal to the slots gives each host exactly its slots
    hosts = [Host("A", slots=3), Host("B", slots=1)]
    assert [s.host.name for s in by_host(place(4, 0, hosts))] == ["A", "A", "A", "B"]
    assert [s.host.name for s in place(4, 0, hosts)] == ["A", "B", "A", "A"]  # (dmlc's order, for ps)


def test_rabit_workers_get_the_tracker_and_no_scheduler() -> None:
    s = spec(num_servers=0, launcher="ssh", hosts=(A, B))
    plan = make(s, addresses={A: "1.1.1.1", B: "2.2.2.2"}, here=None)
    assert plan.scheduler is None
    for p in plan.procs:
        assert not any(k.startswith("DMLC_PS_ROOT") for k in p.env), p.env  # not even the inherited one
        assert p.env["DMLC_TRACKER_URI"] == "10.0.0.1" and p.env["DMLC_TRACKER_PORT"] == "9091"
        assert (p.env["DMLC_ROLE"], p.env["DMLC_NUM_WORKER"], p.env["DMLC_NUM_SERVER"]) == ("worker", "2", "0")
        assert p.env["DMLC_TASK_ID"] == str(p.rank) and p.env["DMLC_JOB_CLUSTER"] == "ssh"
    assert [(p.host.name, p.env["DMLC_NODE_HOST"]) for p in plan.procs] == [("A", "1.1.1.1"), ("B", "2.2.2.2")]


def test_torch_workers_get_torchruns_contract_across_hosts() -> None:
    s = spec(num_servers=0, num_workers=5, tracker="torch", launcher="ssh", hosts=(A, B),
             environ=(("RANK", "7"), ("MASTER_PORT", "1"), ("HOME", "/h")))
    plan = make(s, addresses={A: "1.1.1.1", B: "2.2.2.2"}, here=None, inherit=True)
    got = [(p.host.name, p.env["RANK"], p.env["LOCAL_RANK"], p.env["LOCAL_WORLD_SIZE"], p.env["GROUP_RANK"],
            p.env["GROUP_WORLD_SIZE"], p.env["DMLC_TASK_ID"]) for p in plan.procs]
    assert got == [("A", "0", "0", "3", "0", "2", "0"), ("A", "1", "1", "3", "0", "2", "1"),
                   ("A", "2", "2", "3", "0", "2", "2"), ("B", "3", "0", "2", "1", "2", "3"),
                   ("B", "4", "1", "2", "1", "2", "4")]
    for p in plan.procs:
        assert p.env["MASTER_ADDR"] == "10.0.0.1" and p.env["MASTER_PORT"] == "9091"  # the store, not rank 0
        assert p.env["WORLD_SIZE"] == "5" and p.env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert p.env["HOME"] == "/h" and not p.awaits_placement
    assert {"RANK", "MASTER_PORT"} <= set(plan.overridden)


def test_torch_workers_get_torchruns_defaults_below_the_users_values() -> None:
    plain = make(spec(num_servers=0, tracker="torch"))
    for p in plain.procs:
        assert p.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        assert p.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # the launcher's environment, then --env and --env-worker, win over torchrun's defaults, on any backend
    environ = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGINT"))
    mine = make(spec(num_servers=0, tracker="torch", launcher="ssh", hosts=(A,), environ=environ), here=None)
    assert {(p.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], p.env["TORCHELASTIC_SIGNALS_TO_HANDLE"])
            for p in mine.procs} == {("3", "SIGINT")}
    cli = make(spec(num_servers=0, tracker="torch", environ=environ, env=(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),),
                    env_worker=(("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM"),)))
    assert {(p.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], p.env["TORCHELASTIC_SIGNALS_TO_HANDLE"])
            for p in cli.procs} == {("0", "SIGTERM")} and not cli.overridden
    # not torchrun's job: nothing of it
    for other in (make(spec()), make(spec(num_servers=0, tracker="rabit"))):
        assert not any("TORCH_NCCL_ASYNC_ERROR_HANDLING" in p.env or "TORCHELASTIC_SIGNALS_TO_HANDLE" in p.env
                       for p in other.procs)


def test_a_torch_job_on_a_batch_system_awaits_its_placement() -> None:
    plan = make(spec(num_servers=0, tracker="torch", launcher="sge"), here=None)
    assert all(p.awaits_placement and "RANK" not in p.env for p in plan.procs)
    rabit = make(spec(num_servers=0, launcher="sge"), here=None)
    assert not any(p.awaits_placement for p in rabit.procs)


def test_the_spec_and_the_plan_are_frozen_and_a_process_compares_without_its_env() -> None:
    spec = JobSpec(num_workers=1, num_servers=0, command=("true",))
    proc = build_plan(spec, root_uri="10.0.0.1", root_port=9091, secret="x" * 64, job_id="j",
                      inherit_environ=False).procs[0]
    for obj, name in ((spec, "num_workers"), (proc, "rank"), (A, "name")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 2)
    assert proc == dataclasses.replace(proc, env={"X": "1"}) and hash(proc) != 0
    assert dataclasses.replace(proc, rank=5) != proc
