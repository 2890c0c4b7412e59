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
