"""``--gpus-per-process`` and a hostfile's ``gpus=``: the slices, the hostfile grammar, the checks
made before anything starts, and the dry run that shows each worker's CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest
from support.helpers import spec_of

import pscontract as pc
from launcher import cli
from launcher.errors import ConfigError
from launcher.spec.hosts import parse_host_list, parse_lines
from launcher.spec.job import Host, JobSpec
from launcher.spec.plan import build_plan, worker_gpus

# --- the slices -------------------------------------------------------------------------------


@pytest.mark.parametrize("count, per, gpus, expected", [
    (2, 2, None, ["0,1", "2,3"]),
    (3, 1, None, ["0", "1", "2"]),
    (1, 4, None, ["0,1,2,3"]),
    (2, 1, [0, 2], ["0", "2"]),
    (2, 1, [5, 2, 7], ["5", "2"]),  # (the order the hostfile gives; the last GPU is left out)
    (2, 2, [0, 1, 4, 5], ["0,1", "4,5"]),
    (2, None, [0, 2], ["0,2", "0,2"]),  # (gpus= alone: every worker sees the host's listed GPUs)
])
def test_slices(count, per, gpus, expected) -> None:
    assert pc.gpu_slices(count, per, gpus) == expected


def test_too_few_gpus_is_said() -> None:
    with pytest.raises(ValueError, match=r"3 workers x 2 GPUs need 6 GPUs; gpus= names 4 \(0,1,2,3\)"):
        pc.gpu_slices(3, 2, [0, 1, 2, 3])


# --- the hostfile -----------------------------------------------------------------------------


def test_hostfile_gpus() -> None:
    hosts = parse_lines(["a gpus=0,2", "b slots=2 gpus=0-3", "c gpus=0-1,4  # comment", "d"], "hosts")
    assert [h.gpus for h in hosts] == [(0, 2), (0, 1, 2, 3), (0, 1, 4), None]
    assert hosts[1].slots == 2


@pytest.mark.parametrize("line, says", [
    ("a gpus=", "hosts:1: gpus='': give the host's GPU indices, e.g. gpus=0,2 or gpus=0-3"),
    ("a gpus=x", "gpus='x': give the host's GPU indices"),
    ("a gpus=0,,1", "gpus='0,,1': give the host's GPU indices"),
    ("a gpus=3-1", "a range runs upwards"),
    ("a gpus=0-5000", "gpus='0-5000': give"),
    ("a gpus=0,1,0", "hosts:1: gpus=0,1,0: GPU 0 is listed twice"),
    ("a gpus=0 gpus=1", "hosts:1: gpus given twice"),
    ("a gpu=0", "unknown setting 'gpu'; known: slots, gpus"),
])
def test_a_bad_gpus_setting_is_one_line(line, says) -> None:
    with pytest.raises(ConfigError) as e:
        parse_lines([line], "hosts")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_inline_list_keeps_a_gpus_list_whole() -> None:
    hosts = parse_host_list("h1 gpus=0,2 slots=2,h2,h3 gpus=1,3-4")
    assert [(h.name, h.slots, h.gpus) for h in hosts] == [("h1", 2, (0, 2)), ("h2", None, None),
                                                           ("h3", None, (1, 3, 4))]
    assert [h.name for h in parse_host_list("h1,2,h2")] == ["h1", "2", "h2"]  # (no gpus= before it: a host)


# --- the plan ---------------------------------------------------------------------------------


def spec(**kw) -> JobSpec:
    return JobSpec(**{"command": ("python", "t.py"), "num_workers": 2, "num_servers": 0, **kw})


def cuda(plan) -> dict[str, str | None]:
    return {p.name: p.env.get(pc.CUDA_VISIBLE_DEVICES) for p in plan.all}


def plan_of(s: JobSpec, addresses=None, here=None):
    return build_plan(s, root_uri="10.0.0.1", root_port=9091, secret="s" * 64, job_id="j",
                      addresses=addresses or {}, here=here, inherit_environ=False)


def test_local_workers_get_consecutive_slices_and_servers_none() -> None:
    s = spec(num_workers=2, num_servers=1, gpus_per_process=2)
    plan = plan_of(s, here="127.0.0.1")
    assert cuda(plan) == {"scheduler": None, "server-0": None, "worker-0": "0,1", "worker-1": "2,3"}
    assert [p.gpus for p in plan.all] == [None, None, "0,1", "2,3"]  # (what --summary-json records)


def test_each_host_slices_its_own_gpus_in_local_rank_order() -> None:
    a, b = Host("a", slots=2, gpus=(0, 2)), Host("b", slots=2)
    s = spec(num_workers=4, launcher="ssh", hosts=(a, b), gpus_per_process=1, tracker="torch")
    plan = plan_of(s, addresses={a: "10.0.0.11", b: "10.0.0.12"})
    got = {p.name: (p.env[pc.LOCAL_RANK], p.host.name, p.env[pc.CUDA_VISIBLE_DEVICES]) for p in plan.procs}
    assert got == {"worker-0": ("0", "a", "0"), "worker-1": ("1", "a", "2"),
                   "worker-2": ("0", "b", "0"), "worker-3": ("1", "b", "1")}


def test_a_hosts_gpus_alone_is_every_workers_view_of_that_host() -> None:
    a, b = Host("a", gpus=(1, 3)), Host("b")
    s = spec(num_workers=4, launcher="ssh", hosts=(a, b))
    # (a collective job numbers its workers host by host: 0 and 1 on a)
    assert cuda(plan_of(s, addresses={a: "10.0.0.11", b: "10.0.0.12"})) == {
        "worker-0": "1,3", "worker-1": "1,3", "worker-2": None, "worker-3": None}


def test_ps_workers_round_robin_get_their_hosts_slices() -> None:
    a, b = Host("a", gpus=(0, 1, 2, 3)), Host("b", gpus=(4, 5))
    s = spec(num_workers=4, num_servers=2, launcher="ssh", hosts=(a, b), gpus_per_process=1)
    # servers 0, 1 on a, b; workers 0, 2 on a; workers 1, 3 on b
    assert cuda(plan_of(s, addresses={a: "10.0.0.11", b: "10.0.0.12"})) == {
        "scheduler": None, "server-0": None, "server-1": None,
        "worker-0": "0", "worker-1": "4", "worker-2": "1", "worker-3": "5"}


def test_the_slice_wins_over_a_forwarded_value_and_says_so() -> None:
    s = spec(gpus_per_process=1, environ=(("CUDA_VISIBLE_DEVICES", "7"),))
    plan = plan_of(s, here="127.0.0.1")
    assert cuda(plan) == {"worker-0": "0", "worker-1": "1"} and plan.overridden == ("CUDA_VISIBLE_DEVICES",)
    plain = plan_of(spec(environ=(("CUDA_VISIBLE_DEVICES", "7"),)), here="127.0.0.1")
    assert cuda(plain) == {"worker-0": "7", "worker-1": "7"} and plain.overridden == ()  # (without: forwarded)


def test_no_gpu_option_sets_nothing() -> None:
    assert worker_gpus(spec()) == {}
    assert cuda(plan_of(spec(), here="127.0.0.1")) == {"worker-0": None, "worker-1": None}


@pytest.mark.parametrize("kw, says", [
    (dict(gpus_per_process=0), "--gpus-per-process must be a whole number from 1 to 1024, got 0"),
    (dict(gpus_per_process=2, env=(("CUDA_VISIBLE_DEVICES", "0,1"),)),
     "--env CUDA_VISIBLE_DEVICES=0,1 and --gpus-per-process 2 both choose the workers' GPUs; keep one"),
    (dict(gpus_per_process=1, env_worker=(("CUDA_VISIBLE_DEVICES", "3"),)),
     "--env-worker CUDA_VISIBLE_DEVICES=3 and --gpus-per-process 1 both choose"),
    (dict(launcher="ssh", hosts=(Host("a", gpus=(0,), origin="hosts:1"),), env=(("CUDA_VISIBLE_DEVICES", "1"),)),
     "--env CUDA_VISIBLE_DEVICES=1 and the hostfile's gpus= (hosts:1) both choose"),
    (dict(gpus_per_process=1, launcher="slurm"),
     "--gpus-per-process 1: --launcher slurm decides where the workers run"),
])
def test_the_spec_refuses(kw, says) -> None:
    with pytest.raises(ConfigError) as e:
        spec(**kw)
    assert says in str(e.value)


def test_an_env_server_value_is_no_conflict() -> None:
    s = spec(num_servers=1, gpus_per_process=1, env_server=(("CUDA_VISIBLE_DEVICES", "5"),))
    assert cuda(plan_of(s, here="127.0.0.1"))["server-0"] == "5"


# --- the command line -------------------------------------------------------------------------



def test_the_option_and_its_yaml_key(tmp_path) -> None:
    assert spec_of(["-n", "2", "--gpus-per-process", "2", "true"]).gpus_per_process == 2
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 2\ngpus-per-process: 1\ncommand: [python, t.py]\n")
    assert spec_of(["--config", str(cfg)]).gpus_per_process == 1


def test_a_host_with_too_few_gpus_is_one_line_before_anything_starts(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.11 gpus=0,2\n10.0.0.12\n")
    code = cli.main(["-n", "4", "-s", "0", "-H", str(hosts), "--gpus-per-process", "2", "--dry-run", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"pslaunch: error: {hosts}:1: 10.0.0.11: 2 workers x 2 GPUs need 4 GPUs; gpus= names 2 (0,2); lower " \
           "--gpus-per-process, name more GPUs in gpus=, or place fewer workers there (slots=)" == err


def test_the_dry_run_shows_each_workers_gpus(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.11 slots=2 gpus=0,2\n10.0.0.12 slots=2\n")
    assert cli.main(["-n", "4", "-H", str(hosts), "--tracker", "torch", "--host-ip", "10.0.0.1",
                     "--gpus-per-process", "1", "--dry-run", "python", "ddp.py"]) == 0
    out = capsys.readouterr().out
    assert "10.0.0.11 slots=2 gpus=0,2, 10.0.0.12 slots=2" in out
    assert "GPUs: 1 GPU(s) per worker (--gpus-per-process), from each host's gpus= where the hostfile names " \
           "them, else counted from 0: each worker's CUDA_VISIBLE_DEVICES is below" in out
    own = {line.split(":")[0].strip(): line.split(": ")[1].split() for line in out.splitlines()
           if line.startswith("  worker ")}
    assert [[v for v in own[f"worker {r} @ {h}"] if v.startswith("CUDA")] for r, h in
            ((0, "10.0.0.11"), (1, "10.0.0.11"), (2, "10.0.0.12"), (3, "10.0.0.12"))] == [
        ["CUDA_VISIBLE_DEVICES=0"], ["CUDA_VISIBLE_DEVICES=2"], ["CUDA_VISIBLE_DEVICES=0"],
        ["CUDA_VISIBLE_DEVICES=1"]]


def test_the_local_dry_run_counts_up(capsys) -> None:
    assert cli.main(["-n", "2", "-s", "0", "--gpus-per-process", "2", "--dry-run", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "  worker 0: CUDA_VISIBLE_DEVICES=0,1 " in out and "  worker 1: CUDA_VISIBLE_DEVICES=2,3 " in out
