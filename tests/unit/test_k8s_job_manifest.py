"""``pslaunch manifest`` (issue 37, item 4): the job as plain Kubernetes YAML, a Kubeflow PyTorchJob
or MXJob, from launcher/backends/k8s.py's pure builders, against golden files
(``PSLAUNCH_UPDATE_GOLDEN=1`` rewrites them); the command's refusals, one line each.
tests/integration/test_k8s_manifest_cli.py applies a printed job on the test cluster."""

from __future__ import annotations

import json
from typing import Any

import click
import pytest
import yaml
from support.helpers import load_script
from support.uisample import check_golden

import pscontract as pc
from launcher import cli
from launcher.backends import k8s
from launcher.cli import manifest as manifest_cli
from launcher.cli.job import build_spec
from launcher.spec.job import JobSpec

JOB_ID, SECRET = "0123456789ab", "s3cr3t-" + "f" * 57
ENVIRON = {"PATH": "/usr/bin:/bin", "HOME": "/root", "DMLC_INTERFACE": "eth0", "PS_VERBOSE": "1"}


def spec_for(args: list[str], environ: dict[str, str] = ENVIRON) -> tuple[JobSpec, str]:
    """The spec ``pslaunch manifest ARGS`` builds (with a fixed environment), and its --format."""
    ctx = manifest_cli.manifest_command.make_context("pslaunch manifest", list(args))
    kw = dict(ctx.params)
    return build_spec({**kw, "launcher": "k8s"}, environ), kw["fmt"]


def objects_for(args: list[str]) -> tuple[str, list[dict[str, Any]], JobSpec]:
    spec, fmt = spec_for(args)
    job, objects = k8s.job_manifest(spec, fmt, job_id=JOB_ID, secret=SECRET)
    return job, objects, spec


def golden(name: str, args: list[str]) -> list[dict[str, Any]]:
    job, objects, _ = objects_for(args)
    fmt = spec_for(args)[1]
    text = k8s.manifest_yaml(job, fmt, objects)
    check_golden(name, text)
    assert list(yaml.safe_load_all(text)) == objects  # (the YAML is the objects)
    return objects


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """A container's env as {name: value, or ("secret", key), or ("field", path)}."""
    out: dict[str, Any] = {}
    for e in container["env"]:
        ref = e.get("valueFrom") or {}
        if "secretKeyRef" in ref:
            out[e["name"]] = ("secret", ref["secretKeyRef"]["key"])
        elif "fieldRef" in ref:
            out[e["name"]] = ("field", ref["fieldRef"]["fieldPath"])
        else:
            out[e["name"]] = e["value"]
    return out


PS_ARGS = ["--k8s-image", "registry.example/train:1", "--k8s-namespace", "team-a", "-n", "2", "-s", "1",
           "--worker-cores", "2", "--worker-memory", "2g", "--timeout", "3600", "--jobname", "mnist",
           "--env", "WANDB_API_KEY=k-123", "--env-worker", "A=$(HOME) $$", "python3", "train.py", "--lr", "$x"]


def test_golden_plain_ps_job() -> None:
    objects = golden("k8s_manifest_plain.yaml", PS_ARGS)
    secret, service, *pods = objects
    assert [o["kind"] for o in objects] == ["Secret", "Service", "Pod", "Pod", "Pod", "Pod"]
    assert secret["stringData"] == {"PSLAUNCH_SECRET": SECRET, "WANDB_API_KEY": "k-123"}
    assert service["spec"]["clusterIP"] == "None" and "ownerReferences" not in service["metadata"]
    assert all(o["metadata"]["namespace"] == "team-a" for o in objects)
    text = json.dumps(pods)
    assert SECRET not in text and "k-123" not in text  # (only in the Secret: Pods read it by reference)
    assert [p["metadata"]["name"] for p in pods] == ["mnist-scheduler", "mnist-server-0", "mnist-worker-0",
                                                     "mnist-worker-1"]
    for pod in pods:
        assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["subdomain"] == "mnist"
        assert pod["spec"]["activeDeadlineSeconds"] == 3600
        assert set(pod["metadata"]["labels"]) == {k8s.LABEL_JOB, k8s.LABEL_ROLE, k8s.LABEL_RANK}
        env = env_of(pod["spec"]["containers"][0])
        assert env[pc.ROOT_URI] == "scheduler.mnist" and env[pc.ROOT_PORT] == "9091"
        assert env[pc.SECRET] == ("secret", pc.SECRET) and env["WANDB_API_KEY"] == ("secret", "WANDB_API_KEY")
        assert env[pc.ROLE] == pod["metadata"]["labels"][k8s.LABEL_ROLE]
        assert env[pc.INTERFACE] == "eth0" and env["PS_VERBOSE"] == "1"  # (forwarded, as a run forwards them)
        assert "PATH" not in env and "HOME" not in env  # (the image's own, not this shell's)
        if env[pc.ROLE] != "scheduler":
            assert env[pc.NODE_HOST] == ("field", "status.podIP")
    scheduler = pods[0]["spec"]
    assert scheduler["hostname"] == "scheduler" and "resources" not in scheduler["containers"][0]
    assert pods[2]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "2048Mi"}}


def test_the_pods_environment_is_the_plans() -> None:
    """Every variable of every process as the plan builds it (the contract's one module), and
    what a kubelet expands the Pod's values and command to is what was written."""
    job, objects, spec = objects_for(PS_ARGS)
    plan = k8s.manifest_plan(spec, job=job, job_id=JOB_ID, secret=SECRET)
    expand = load_script("k8s_node").expand
    secrets = objects[0]["stringData"]
    for proc, pod in zip(plan.all, objects[2:]):
        container = pod["spec"]["containers"][0]
        got = {}
        for name, value in env_of(container).items():
            if isinstance(value, tuple):
                got[name] = secrets[value[1]] if value[0] == "secret" else "<field>"
            else:
                got[name] = expand(value, {"HOME": "/home/else"})
        assert {k: v for k, v in got.items() if v != "<field>"} == dict(proc.env)
        assert [expand(a, {}) for a in container["command"]] == ["python3", "train.py", "--lr", "$x"]
    worker = {e["name"]: e.get("value") for e in objects[4]["spec"]["containers"][0]["env"]}
    assert worker["A"] == "$$(HOME) $$$$"  # (written so that a kubelet leaves "$(HOME) $$")


def test_golden_plain_torch_job() -> None:
    objects = golden("k8s_manifest_torch.yaml", ["--k8s-image", "img:1", "--jobname", "ddp", "-n", "3", "--tracker",
                                                 "torch", "python3", "ddp.py"])
    pods = objects[2:]
    assert [p["metadata"]["name"] for p in pods] == ["ddp-worker-0", "ddp-worker-1", "ddp-worker-2"]
    for rank, pod in enumerate(pods):
        env = env_of(pod["spec"]["containers"][0])
        # rank 0 hosts the store (no agent store): every Pod a host of its own
        assert env[pc.MASTER_ADDR] == "worker-0.ddp" and env[pc.MASTER_PORT] == "9091"
        assert env[pc.USE_AGENT_STORE] == "False"
        assert (env[pc.TORCH_RANK], env[pc.GROUP_RANK], env[pc.LOCAL_RANK], env[pc.WORLD_SIZE]) == \
            (str(rank), str(rank), "0", "3")


def test_golden_pytorchjob() -> None:
    objects = golden("k8s_manifest_pytorchjob.yaml", ["--format", "pytorchjob", "--k8s-image", "img:1", "--jobname",
                                                      "ddp", "-n", "3", "--tracker", "torch", "python3", "ddp.py"])
    secret, job = objects
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: r["replicas"] for k, r in replicas.items()} == {"Master": 1, "Worker": 2}
    for r in replicas.values():
        assert r["restartPolicy"] == "Never"
        c = r["template"]["spec"]["containers"][0]
        assert c["name"] == "pytorch" and c["ports"] == [{"name": "pytorchjob-port", "containerPort": 9091}]
        env = env_of(c)
        assert not set(env) & {pc.MASTER_ADDR, pc.MASTER_PORT, pc.TORCH_RANK, pc.WORLD_SIZE}  # (the operator's)
        assert not set(env) & {pc.TASK_ID, pc.GROUP_RANK, pc.PROCESS}  # (per process: no place in a template)
        assert env[pc.SECRET] == ("secret", pc.SECRET) and env[pc.USE_AGENT_STORE] == "False"
    assert secret["stringData"] == {pc.SECRET: SECRET}
    _, one = objects_for(["--format", "pytorchjob", "--k8s-image", "i", "-n", "1", "--tracker", "torch", "x"])[:2]
    assert list(one[1]["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_golden_mxjob() -> None:
    objects = golden("k8s_manifest_mxjob.yaml", ["--format", "mxjob", "--k8s-image", "img:1", "--jobname", "mx",
                                                 "-n", "2", "-s", "2", "--server-cores", "3", "python3",
                                                 "train_mnist.py"])
    job = objects[1]
    assert (job["kind"], job["spec"]["jobMode"]) == ("MXJob", "MXTrain")
    replicas = job["spec"]["mxReplicaSpecs"]
    assert {k: r["replicas"] for k, r in replicas.items()} == {"Scheduler": 1, "Server": 2, "Worker": 2}
    for r in replicas.values():
        c = r["template"]["spec"]["containers"][0]
        assert c["name"] == "mxnet" and c["ports"] == [{"name": "mxjob-port", "containerPort": 9091}]
        env = env_of(c)
        assert not set(env) & k8s.MXJOB_SETS and pc.TASK_ID not in env
        assert env[pc.SECRET] == ("secret", pc.SECRET)
    assert replicas["Server"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "3"}}


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["manifest", *args])
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize("args, words", [
    (["-n", "2", "-s", "1", "x"], "needs --k8s-image"),
    (["--k8s-image", "i", "-n", "2", "-s", "0", "x"], "--tracker rabit has no manifest"),
    (["--k8s-image", "i", "-n", "2", "--tracker", "xgboost", "x"], "--tracker xgboost has no manifest"),
    (["--k8s-image", "i", "--format", "pytorchjob", "-n", "2", "-s", "1", "x"], "maps to --format mxjob or plain"),
    (["--k8s-image", "i", "--format", "mxjob", "-n", "2", "--tracker", "torch", "x"], "maps to --format pytorchjob"),
    (["--k8s-image", "i", "-n", "2", "-s", "1", "--max-restarts", "2", "x"], "--max-restarts has no manifest"),
    (["--k8s-image", "i", "-n", "2", "-s", "1", "--gpus-per-process", "1", "x"], "cannot give them disjoint GPUs"),
    (["--k8s-image", "i", "-n", "2", "-s", "1", "--launcher", "ssh", "x"], "drop --launcher ssh"),
    (["--k8s-image", "i", "--format", "yaml", "-n", "1", "x"], "'yaml' is not one of"),
    (["--k8s-image", "i", "-n", "1", "-s", "1", "--k8s-namespace", "Team", "x"], "not a Kubernetes namespace"),
    (["--k8s-image", "i", "-n", "2", "-s", "1", "--env-worker", "A_TOKEN=1", "--env-server", "A_TOKEN=2", "x"],
     "give it once with --env"),
    (["--k8s-image", "i", "-n", "2", "-s", "1", "-H", "h1,h2", "x"], "does not use a hostfile"),
    (["--k8s-image", "i", "-n", "0", "x"], "-n"),
])
def test_each_bad_input_is_one_line_and_exit_2(args: list[str], words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == "", (code, out, err)
    assert "\n" not in err and "Traceback" not in err and err.startswith("pslaunch: error: "), err
    assert words in err, err


def test_the_command_prints_yaml_with_a_new_secret_each_time(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--k8s-image", "i", "-n", "1", "-s", "1", "--log-dir", "/nonexistent/x", "--ui", "python3", "t.py"]
    code, out, err = run_cli(args, capsys)
    assert code == 0 and err == "", err
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Pod", "Pod", "Pod"]
    assert out.startswith("# pslaunch manifest --format plain: job pslaunch-python3-")
    code, again, _ = run_cli(args, capsys)
    first = docs[0]["stringData"][pc.SECRET]
    second = list(yaml.safe_load_all(again))[0]["stringData"][pc.SECRET]
    assert code == 0 and len(first) == 64 and first != second


def test_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    assert "Examples:" in out and "pslaunch manifest --format pytorchjob" in out and "kubectl apply -f -" in out
    for option in ("--format", "--k8s-image", "--k8s-namespace", "--tracker", "--env", "-n, --num-workers"):
        assert option in out, option


def test_it_takes_every_option_of_a_run() -> None:
    from launcher.cli.run import with_backend_options

    run = {o for p in with_backend_options().params if isinstance(p, click.Option) for o in p.opts}
    mine = {o for p in manifest_cli.manifest_command.params if isinstance(p, click.Option) for o in p.opts}
    assert run - mine == {"--version"}
