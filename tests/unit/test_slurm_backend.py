"""The slurm backend's pure parts (launcher/backends/slurm.py): Slurm's host lists and job records,
the salloc and srun it runs, placement over an allocation, what srun's messages mean, the dry run.
The backend itself runs on a real Slurm in tests/integration/test_slurm.py and the conformance suite.
Host lists are Slurm's to expand: those tests run the real ``scontrol`` (it reads slurm.conf and asks
no daemon), marked ``slurm``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from launcher.backends import slurm as S
from launcher.errors import ConfigError, LaunchError
from launcher.spec.job import Host, JobSpec, Role

# `scontrol show job -d 183` on the test cluster (salloc --no-shell -N2 -n5): block distribution
SHOW_JOB = """JobId=183 JobName=s2cap
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A
   Partition=debug AllocNode:Sid=localhost:30527
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=sn[0-1]
   BatchHost=sn0
   NumNodes=2 NumCPUs=5 NumTasks=5 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=5,mem=500M,node=2,billing=5
   JOB_GRES=(null)
     Nodes=sn0 CPU_IDs=0-3 Mem=400 GRES=
     Nodes=sn1 CPU_IDs=0 Mem=100 GRES=
   MinCPUsNode=1 MinMemoryCPU=100M MinTmpDiskNode=0
   Command=(null)
   WorkDir=/tmp

"""


#: ``scontrol show hostnames`` works here: Slurm's client commands and a slurm.conf (scripts/setup-slurm.sh)
needs_scontrol = pytest.mark.skipif(
    shutil.which("scontrol") is None or not os.path.exists(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"),
    reason="needs Slurm's scontrol and a slurm.conf (scripts/setup-slurm.sh)")


def spec(**kw) -> JobSpec:
    base = dict(command=("python", "train.py"), num_workers=3, num_servers=2, launcher="slurm", jobname="j")
    base.update(kw)
    return JobSpec(**base)


# --- host lists and job records ------------------------------------------------------------------


@pytest.mark.slurm
@needs_scontrol
@pytest.mark.parametrize("text, names", [
    ("sn0", ["sn0"]),
    ("sn[0-3]", ["sn0", "sn1", "sn2", "sn3"]),
    ("sn[0,2],gpu1", ["sn0", "sn2", "gpu1"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
])
def test_hostnames_are_slurms(text, names) -> None:
    assert S.hostnames(text) == names


@pytest.mark.slurm
@needs_scontrol
@pytest.mark.parametrize("text", ["sn[3-1]", "sn[a-b]"])
def test_a_host_list_slurm_cannot_read_is_one_line(text) -> None:
    # (scontrol prints its complaint and nothing else, with exit code 0)
    with pytest.raises(LaunchError) as e:
        S.hostnames(text)
    assert str(e.value).startswith(f"Slurm cannot read the host list {text!r}: ") and "\n" not in str(e.value)
    assert "Invalid hostlist" in str(e.value)


def test_hostnames_without_scontrol_is_one_line(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"^scontrol: not found on PATH$"):
        S.hostnames("sn[0-1]")


def test_expand_ids() -> None:
    assert S.expand_ids("0") == [0] and S.expand_ids("0-3") == [0, 1, 2, 3]
    assert S.expand_ids("0-1,4,6-7") == [0, 1, 4, 6, 7]
    with pytest.raises(ValueError):
        S.expand_ids("a-b")


@pytest.mark.slurm
@needs_scontrol
def test_parse_job() -> None:
    a = S.parse_job(SHOW_JOB, "183")
    assert (a.job_id, a.state, a.reason, a.nodes, a.cpus, a.cpus_per_task) == \
        ("183", "RUNNING", "", ("sn0", "sn1"), (4, 1), 1)
    with pytest.raises(LaunchError, match="printed no record of job 18"):
        S.parse_job(SHOW_JOB, "18")


def test_parse_job_leaves_the_cpus_unknown_when_a_detail_line_cannot_be_expanded(monkeypatch, tmp_path) -> None:
    """A Nodes= detail line that scontrol fails on costs the per-node CPU counts, not the start."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\ncase "$3" in "sn[0-1]") echo sn0 sn1;; *) echo "broken: $3" >&2; exit 1;; esac\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    a = S.parse_job(SHOW_JOB, "183")
    assert (a.nodes, a.cpus) == (("sn0", "sn1"), ())


def test_parse_job_pending() -> None:
    text = "JobId=7 JobName=x\n   JobState=PENDING Reason=Resources Dependency=(null)\n   NodeList=(null)\n"
    a = S.parse_job(text, "7")
    assert a.state == "PENDING" and a.reason == "Resources" and a.nodes == () and a.cpus == ()


# --- the allocation pslaunch asks for ------------------------------------------------------------------


def test_build_salloc_defaults() -> None:
    assert S.build_salloc(spec()) == ["salloc", "--no-shell", "--job-name=j", "--ntasks=5", "--cpus-per-task=1"]


def test_build_salloc_golden() -> None:
    s = spec(queue="gpu", worker_cores=2, server_cores=4, worker_memory_mb=1000, server_memory_mb=6000,
             timeout=100.0, kill_grace=5.0,
             options=S.SlurmOptions(account="proj", nodes=8, args="--constraint=ib --qos='high prio'"))
    assert S.build_salloc(s) == [
        "salloc", "--no-shell", "--job-name=j", "--ntasks=5", "--cpus-per-task=4", "--partition=gpu", "--nodes=5",
        "--mem-per-cpu=1500M", "--time=4", "--account=proj", "--constraint=ib", "--qos=high prio"]


def test_servers_do_not_count_without_servers() -> None:
    s = spec(num_servers=0, server_cores=8, server_memory_mb=9000, worker_memory_mb=512)
    assert "--cpus-per-task=1" in S.build_salloc(s) and "--mem-per-cpu=512M" in S.build_salloc(s)


def test_time_limit_leaves_room_for_the_teardown() -> None:
    assert S.time_limit_minutes(None, 10) is None
    assert S.time_limit_minutes(3, 1) == 2          # (3 + 1 + 90) s
    assert S.time_limit_minutes(600, 10) == 12      # pslaunch, not Slurm, stops a job at --timeout


@pytest.mark.parametrize("queue, partition", [(None, None), ("default", None), ("gpu", "gpu")])
def test_partition_of(queue, partition) -> None:
    assert S.partition_of(queue) == partition


@pytest.mark.parametrize("queue", ["a b", "a,b"])
def test_partition_must_be_one_name(queue) -> None:
    with pytest.raises(ConfigError, match="give one partition name"):
        S.SlurmBackend.check_spec(spec(queue=queue))


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--slurm-nodes must be at least 1"):
        S.SlurmOptions(nodes=0)
    with pytest.raises(ConfigError, match="--slurm-args '--comment=\"x': No closing quotation"):
        S.SlurmOptions(args='--comment="x')
    with pytest.raises(ConfigError, match="--slurm-account 'a b'"):
        S.SlurmOptions(account="a b")


def test_no_hostfile() -> None:
    with pytest.raises(ConfigError, match="--launcher slurm does not use a hostfile"):
        S.SlurmBackend.check_spec(spec(hosts=(Host("a"),), hostfile="hosts"))


# --- placement ---------------------------------------------------------------------------------------


def test_placement_in_an_allocation_made_here_respects_its_slots() -> None:
    alloc = S.Allocation("183", "RUNNING", nodes=("sn0", "sn1"), cpus=(4, 1), made_here=True)
    hosts = S.placement_hosts(alloc)
    assert hosts == (Host("sn0", slots=4), Host("sn1", slots=1))
    where = S.place_on(spec(), hosts)
    assert where == {(Role.SERVER, 0): "sn0", (Role.SERVER, 1): "sn1", (Role.WORKER, 0): "sn0",
                     (Role.WORKER, 1): "sn0", (Role.WORKER, 2): "sn0"}
    # --overcommit: one CPU per node whatever the task count; slots that cannot hold the job are dropped
    over = S.Allocation("9", "RUNNING", nodes=("a", "b"), cpus=(1, 1), made_here=True)
    assert S.placement_hosts(over, procs=16) == (Host("a"), Host("b"))
    # 2 CPUs per task: 4 CPUs are 2 slots
    two = S.Allocation("1", "RUNNING", nodes=("a", "b"), cpus=(4, 2), cpus_per_task=2, made_here=True)
    assert [h.slots for h in S.placement_hosts(two)] == [2, 1]


def test_placement_in_the_users_allocation_is_round_robin() -> None:
    alloc = S.Allocation("5", "RUNNING", nodes=("n1", "n2", "n3"), cpus=(1, 1, 1))
    where = S.place_on(spec(num_workers=4, num_servers=1), S.placement_hosts(alloc))
    assert [where[k] for k in sorted(where, key=lambda k: (k[0] is Role.WORKER, k[1]))] == \
        ["n1", "n2", "n3", "n1", "n2"]
    assert [h.name for h in S.placement_hosts(alloc, nodes=2)] == ["n1", "n2"]  # --slurm-nodes 2


def test_too_few_slots_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="the Slurm allocation has too few task slots"):
        S.place_on(spec(), (Host("a", slots=2), Host("b", slots=1)))


# --- the steps ------------------------------------------------------------------------------------------


def test_build_srun_golden() -> None:
    s = spec(worker_cores=2, options=S.SlurmOptions(srun_args="--gpus-per-task=1"))
    argv = S.build_srun(s, Role.WORKER, ["sn1", "sn0", "sn1"], job_id="42", wrapper=["py", "-S", "-c", "W"],
                        in_allocation=False, srun="/usr/bin/srun")
    assert argv == ["/usr/bin/srun", "--jobid=42", "--job-name=j.worker", "--ntasks=3", "--distribution=arbitrary",
                    "--nodelist=sn1,sn0,sn1", "--overlap", "--overcommit", "--kill-on-bad-exit=0", "--label",
                    "--export=ALL", "--input=none", "--cpus-per-task=2", "--gpus-per-task=1", "py", "-S", "-c", "W",
                    "--task-env", "PSLAUNCH_TASK", "--role", "worker", "--index", "slurm", "--no-tee", "--in-band",
                    "--", "python", "train.py"]


def test_overlap_only_where_srun_knows_it() -> None:
    assert S.parse_version("slurm-wlm 22.05.8") == (22, 5) and S.parse_version("slurm 20.11.9") == (20, 11)
    assert S.parse_version("?") is None
    argv = S.build_srun(spec(), Role.SERVER, ["a"], job_id="1", wrapper=["W"], in_allocation=True, overlap=False)
    assert "--overlap" not in argv and "--overcommit" in argv


def test_cores_in_the_users_allocation_only_when_asked() -> None:
    argv = S.build_srun(spec(), Role.SERVER, ["a"], job_id="1", wrapper=["W"], in_allocation=True)
    assert not any(a.startswith("--cpus-per-task") for a in argv)  # the allocation's own applies
    argv = S.build_srun(spec(server_cores=3), Role.SERVER, ["a"], job_id="1", wrapper=["W"], in_allocation=True)
    assert "--cpus-per-task=3" in argv


def test_step_environment() -> None:
    environ = {"PATH": "/bin", "SLURM_JOB_ID": "5", "SLURM_NTASKS_PER_NODE": "2", "SLURM_DISTRIBUTION": "block",
               "SLURM_EXPORT_ENV": "NONE", "PSLAUNCH_TASK": "stale"}
    env = S.step_environment(environ, {"version": 2, "roles": {}})
    assert env == {"PATH": "/bin", "SLURM_JOB_ID": "5", "PSLAUNCH_TASK": '{"version":2,"roles":{}}'}


def test_scancel_command() -> None:
    assert S.scancel_command(["5.1"], "/usr/bin/scancel") == ["/usr/bin/scancel", "5.1"]
    assert S.scancel_command([], "/usr/bin/scancel") is None and S.scancel_command(["5"], None) is None


# --- what srun says ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, code", [
    ("Exited with exit code 7", 7),
    ("Segmentation fault", 128 + signal.SIGSEGV),
    ("Segmentation fault (core dumped)", 128 + signal.SIGSEGV),
    ("Killed", 137),
    ("Terminated", 143),
    ("Interrupt", 130),
    ("Something else", None),
])
def test_exit_code_of_status(text, code) -> None:
    assert S.exit_code_of_status(text) == code


def test_parse_srun_line() -> None:
    said = S.parse_srun_line("srun: error: sn3: task 1: Killed")
    assert (said.kind, said.node, said.tasks, said.code) == ("status", "sn3", (1,), 137)
    said = S.parse_srun_line("srun: error: sn1: tasks 0-2,5: Exited with exit code 3")
    assert said.tasks == (0, 1, 2, 5) and said.code == 3
    assert S.parse_srun_line("srun: error: Node failure on sn2").node == "sn2"
    said = S.parse_srun_line("slurmstepd-sn0: error: *** STEP 124.1 ON sn0 CANCELLED AT 2026-12-01T21:37:41 DUE TO "
                             "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    assert (said.kind, said.node, said.text) == ("cancelled", "sn0", "NODE FAILURE")
    said = S.parse_srun_line("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-01-01T00:00:00 "
                             "DUE TO TIME LIMIT ***")
    assert (said.kind, said.text) == ("cancelled", "TIME LIMIT")
    said = S.parse_srun_line("slurmstepd-sn1: error: *** STEP 9.0 ON sn1 CANCELLED AT 2026-01-01T00:00:00 ***")
    assert (said.kind, said.text) == ("cancelled", "")
    assert S.parse_srun_line("srun: Job step aborted: Waiting up to 4 seconds").kind == "other"


def test_down_nodes() -> None:
    assert S.down_nodes("sn0 idle\nsn1 mix*\nsn2 down*\nsn3 alloc\nsn4 drain\nsn5 fail\n") == \
        ["sn1", "sn2", "sn4", "sn5"]


# --- dry run, doctor, the CLI ----------------------------------------------------------------------------


def _dry_run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "--launcher", "slurm", "--dry-run", *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.timeout(60)
def test_dry_run_outside_an_allocation_shows_salloc_and_the_steps() -> None:
    env = {"PATH": "/usr/bin:/bin", "DMLC_INTERFACE": "lo"}
    r = _dry_run("-n", "2", "-s", "1", "--jobname", "mnist", "--queue", "gpu", "--timeout", "300", "python", "t.py",
                 env=env)
    assert r.returncode == 0, r.stderr
    assert "  salloc --no-shell --job-name=mnist --ntasks=3 --cpus-per-task=1 --partition=gpu --time=7" in r.stdout
    assert "servers: srun '--jobid=<allocation>' --job-name=mnist.server --ntasks=1" in r.stdout
    assert "'--nodelist=<node of worker 0>,<node of worker 1>'" in r.stdout
    assert "PSLAUNCH_SECRET=" in r.stdout and "0" * 64 not in r.stdout  # redacted


@pytest.mark.slurm
@needs_scontrol
@pytest.mark.timeout(60)
def test_dry_run_inside_an_allocation_shows_the_placement() -> None:
    env = {"PATH": "/usr/bin:/bin", "DMLC_INTERFACE": "lo", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]"}
    r = _dry_run("-n", "3", "-s", "2", "python", "t.py", env=env)
    assert r.returncode == 0, r.stderr
    assert "Slurm: inside allocation 77 (SLURM_JOB_ID; nodes n[1-3])" in r.stdout
    assert "--jobid=77 --job-name=pslaunch-python.server --ntasks=2 --distribution=arbitrary --nodelist=n1,n2" \
        in r.stdout
    assert "--ntasks=3 --distribution=arbitrary --nodelist=n3,n1,n2" in r.stdout


@pytest.mark.timeout(60)
def test_the_scheduler_address_is_required() -> None:
    r = _dry_run("-n", "1", "python", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "<DMLC_INTERFACE or --host-ip>" in r.stdout
    r = subprocess.run([sys.executable, "-m", "launcher", "--launcher", "slurm", "-n", "1", "true"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    if r.returncode == 2 and "needs Slurm's" in r.stderr:
        pytest.skip("no Slurm commands here")
    assert r.returncode == 2 and "--launcher slurm cannot tell which address" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_missing_slurm_commands_are_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "launcher", "--launcher", "slurm", "--host-ip", "127.0.0.1", "-n", "1",
                        "true"], capture_output=True, text=True, timeout=60, env={"PATH": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip() == ("pslaunch: error: --launcher slurm needs Slurm's srun on PATH (install Slurm's client "
                                "commands, e.g. Debian's slurm-client, or load your site's slurm module); pslaunch "
                                "doctor --launcher slurm checks the rest")


@pytest.mark.timeout(60)
def test_doctor_without_slurm_commands(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "launcher", "doctor", "--launcher", "slurm", "--host-ip", "127.0.0.1"],
                       capture_output=True, text=True, timeout=60, env={"PATH": str(tmp_path),
                                                                         "SLURM_CONF": str(tmp_path / "none")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "  commands  FAIL  srun, scontrol, scancel, sinfo, squeue, salloc not found on PATH" in r.stdout
    assert "  address   ok    --host-ip 127.0.0.1" in r.stdout
    assert r.stdout.rstrip().endswith("module") and "controller" not in r.stdout


def test_doctor_options_and_the_hostfile_doctor_stay_apart(tmp_path, monkeypatch, capsys) -> None:
    """``--launcher slurm`` among the doctor's options runs Slurm's checks (here: no Slurm command on
    PATH), the job's other options accepted; a ``--launcher`` after the command is the command's."""
    from launcher import cli

    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["doctor", "-n", "2", "--launcher=slurm", "--queue", "q", "-H", "h1,h2", "python", "x.py"]) == 1
    assert "commands: srun" in capsys.readouterr().out
    assert cli.main(["doctor", "prog", "--launcher", "slurm"]) == 2
    assert "give the job's hosts: -H FILE" in capsys.readouterr().err


def test_the_task_document_carries_local_procs() -> None:
    # what the wrapper reads (launcher/node/task.py): the role's variables, and processes per node by index
    doc = json.loads(json.dumps({"version": 2, "roles": {"worker": {"first_task_id": 0, "count": 2, "env": {},
                                                                    "local_procs": [2, 1]}}}))
    from launcher.node import task

    assert task.task_environment(doc, "worker", 0, {})["PSLAUNCH_LOCAL_PROCS"] == "2"
