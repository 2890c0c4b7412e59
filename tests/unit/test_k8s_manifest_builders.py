"""The Kubernetes objects of a job (launcher/backends/k8s.py): names, labels, owner, the headless
Service and the Pods, against golden files (``PSLAUNCH_UPDATE_GOLDEN=1`` rewrites them).
tests/integration/test_k8s_manifests.py checks that a real apiserver takes them and a node runs them."""

from __future__ import annotations

import json

import pytest
from support.helpers import load_script
from support.uisample import check_golden

from launcher.backends import k8s
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec

OWNER = {"apiVersion": "v1", "kind": "ConfigMap", "name": "job-1", "uid": "0f0e-uid"}
DOC = {"version": 2, "argv": ["python3", "train.py"], "env": {},
       "roles": {"worker": {"first_task_id": 0, "count": 2, "env": {"DMLC_ROLE": "worker", "A": "$(HOME) $$"}}},
       "hub": ["10.202.8.1", 9092], "grace": 10.0}


def proc(role: Role = Role.WORKER, rank: int = 1) -> ProcSpec:
    return ProcSpec(role=role, rank=rank, task_id=rank, host=None, argv=("python3", "train.py"))


def dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("job_id, name", [
    ("job-1", "job-1"),
    ("MyJob_2026.12.07", "myjob-2026-12-07"),
    ("20261207-abc", "psl-20261207-abc"),
    ("--", "psl"),
    ("x" * 80, "x" * k8s.NAME_MAX),
    ("a" * 39 + "-b", "a" * 39),  # no trailing dash after the cut
])
def test_job_object_name_is_a_dns_label(job_id: str, name: str) -> None:
    assert k8s.job_object_name(job_id) == name


def test_pod_names_and_labels() -> None:
    assert k8s.pod_name("job-1", proc(), 0) == "job-1-worker-1"
    assert k8s.pod_name("job-1", proc(Role.SERVER, 0), 2) == "job-1-server-0-2"
    assert len(k8s.pod_name("x" * k8s.NAME_MAX, proc(rank=999), 99)) <= 63
    assert k8s.labels("job-1", proc(), 3) == {"pslaunch.io/job": "job-1", "pslaunch.io/role": "worker",
                                               "pslaunch.io/rank": "1", "pslaunch.io/attempt": "3"}
    assert k8s.owner_reference({"metadata": {"name": "job-1", "uid": "0f0e-uid", "resourceVersion": "5"}}) == OWNER


def test_golden_parent_and_service() -> None:
    check_golden("k8s_parent_service.json",
                 dump([k8s.parent_manifest("job-1", "Job-1"), k8s.service_manifest("job-1", OWNER)]))


def test_golden_worker_pod() -> None:
    pod = k8s.pod_manifest("job-1", proc(), attempt=0, owner=OWNER, image="localhost/pslaunch:test",
                           wrapper=["python3", "-m", "launcher.node.task"], task_doc=DOC, kill_grace=10.0,
                           workdir="/work", node_selector={"kubernetes.io/hostname": "kn1"})
    check_golden("k8s_worker_pod.json", dump(pod))
    # what the wrapper gets: the document back, its index from the rank label
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    # what a kubelet expands it to (the test node's expansion; "$(HOME)" defined there too)
    expand = load_script("k8s_node").expand
    assert json.loads(expand(env["PSLAUNCH_TASK"]["value"], {"HOME": "/root"})) == DOC
    assert env["PSLAUNCH_K8S_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['pslaunch.io/rank']"


def test_a_long_task_document_is_split_like_slurms() -> None:
    big = dict(DOC, env={"X": "y" * 200_000})
    pod = k8s.pod_manifest("job-1", proc(), attempt=1, owner=OWNER, image="i", wrapper=["w"], task_doc=big,
                           kill_grace=2.5)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names == ["PSLAUNCH_TASK", "PSLAUNCH_TASK_1", "PSLAUNCH_TASK_2", "PSLAUNCH_K8S_INDEX"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 3 + k8s.GRACE_MARGIN
    assert "workingDir" not in pod["spec"]["containers"][0] and "nodeSelector" not in pod["spec"]


def test_golden_secret_and_a_pod_that_reads_it() -> None:
    secret = k8s.secret_manifest("job-1", OWNER, DOC)
    pod = k8s.pod_manifest("job-1", proc(), attempt=0, owner=OWNER, image="localhost/pslaunch:test",
                           wrapper=["python3", "-m", "launcher.node.task"], task_doc=DOC, kill_grace=10.0,
                           secret=k8s.secret_name("job-1"), cpus=2)
    check_golden("k8s_secret_pod.json", dump([secret, pod]))
    # the document as written in the Secret (no kubelet expands a Secret's value), nowhere in the Pod
    assert json.loads(secret["stringData"]["PSLAUNCH_TASK"]) == DOC
    assert "hub" not in json.dumps(pod) and "$(HOME)" not in json.dumps(pod)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["PSLAUNCH_TASK"] == {"name": "PSLAUNCH_TASK", "valueFrom": {"secretKeyRef": {
        "name": "job-1-task", "key": "PSLAUNCH_TASK"}}}
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2"}}


def test_scheduler_reason_from_the_condition_else_the_event() -> None:
    pending = {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient cpu."}]}, "spec": {}}
    assert k8s.scheduler_reason(pending, []) == "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu."
    events = [{"reason": "FailedScheduling", "message": "old", "lastTimestamp": "2026-12-07T20:00:00Z"},
              {"reason": "FailedScheduling", "message": "0/3 nodes:\n  no", "lastTimestamp": "2026-12-07T20:01:00Z"},
              {"reason": "Scheduled", "message": "x", "lastTimestamp": "2026-12-07T20:02:00Z"}]
    assert k8s.scheduler_reason({"status": {}, "spec": {}}, events) == "FailedScheduling: 0/3 nodes: no"
    assert "node kn1" in k8s.scheduler_reason({"status": {}, "spec": {"nodeName": "kn1"}}, [])
    assert "not placed yet" in k8s.scheduler_reason({"status": {}, "spec": {}}, [])


@pytest.mark.parametrize("status, end", [
    ({"phase": "Running"}, None),
    ({"phase": "Succeeded", "containerStatuses": [{"name": "main", "state": {"terminated": {"exitCode": 0}}}]},
     (0, "")),
    ({"phase": "Failed", "containerStatuses": [{"name": "main", "state": {"terminated": {
        "exitCode": 137, "reason": "Error"}}}]}, (137, "Error")),
    ({"phase": "Failed", "reason": "StartError", "message": "no such file"}, (1, "StartError no such file")),
])
def test_pod_end(status: dict, end: object) -> None:
    assert k8s.pod_end({"status": status}) == end


def test_options_and_the_kubeconfig_path(tmp_path, monkeypatch) -> None:
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError, match="not a Kubernetes namespace"):
        k8s.K8sOptions(namespace="Bad_NS")
    with pytest.raises(ConfigError, match="--k8s-image needs an image"):
        k8s.K8sOptions(image=" ")
    assert k8s.kubeconfig_path({"KUBECONFIG": "/a:/b"}) == "/a:/b"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert k8s.kubeconfig_path({}) is None
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("")
    assert k8s.kubeconfig_path({}) == str(tmp_path / ".kube" / "config")


def test_the_kubeconfig_contexts_namespace_else_default(tmp_path) -> None:
    pytest.importorskip("kubernetes")
    conf = tmp_path / "kubeconfig"
    conf.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: k, cluster: "
                    "{server: 'https://127.0.0.1:1'}}]\nusers: [{name: u, user: {token: t}}]\n"
                    "contexts: [{name: c, context: {cluster: k, user: u, namespace: team-a}}]\n")
    api, ns = k8s.connect({"KUBECONFIG": str(conf)})
    assert ns == "team-a" and api.configuration.host == "https://127.0.0.1:1"
    conf.write_text(conf.read_text().replace(", namespace: team-a", ""))
    assert k8s.connect({"KUBECONFIG": str(conf)})[1] == "default"


def test_the_reaper_leaves_the_job_alone_once_the_launcher_said_done() -> None:
    import subprocess
    import sys

    from launcher import node

    code = (f"import sys; sys.path.insert(0, {node.ROOT!r}); from launcher.backends.k8s import reaper_main; "
            "sys.exit(reaper_main())")
    # "done": nothing to do, no cluster asked (there is none: KUBECONFIG names no file)
    r = subprocess.run([sys.executable, "-c", code, "ns", "job-1"], input="done\n", capture_output=True, text=True,
                       timeout=60, env={"KUBECONFIG": "/nonexistent", "PATH": "/usr/bin:/bin"})
    assert (r.returncode, r.stderr) == (0, "")
    # the pipe's end without it: it tries to delete the job (and says why it cannot here)
    r = subprocess.run([sys.executable, "-c", code, "ns", "job-1"], input="", capture_output=True, text=True,
                       timeout=60, env={"KUBECONFIG": "/nonexistent", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "Kubernetes configuration /nonexistent" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
