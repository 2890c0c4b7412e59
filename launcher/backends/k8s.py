"""Kubernetes objects for a job (issue 37): the pure builders of the future ``--launcher k8s``.

Not a backend yet (it is not registered: ``--launcher k8s`` does not exist). What is here is the
shape of what that backend will create, checked against the test cluster's real apiserver and
nodes (``tests/integration/test_k8s_manifests.py``), so that the backend itself only has to
create, watch and delete them:

* one **parent**, a ConfigMap named after the job (:func:`parent_manifest`): every other object
  names it in its ``ownerReferences``, so deleting the parent makes the garbage collector remove
  the rest, even after the launcher is gone;
* one **headless Service** (:func:`service_manifest`: ``clusterIP: None``, selecting the job's
  Pods, ``publishNotReadyAddresses``), and ``hostname``/``subdomain`` on every Pod, so that a
  cluster with DNS gives each Pod the name ``<process>.<job>.<namespace>.svc``;
* one **Pod per process** (:func:`pod_manifest`), ``restartPolicy: Never`` (pslaunch owns
  restarts), labelled ``pslaunch.io/{job,role,rank,attempt}``, running pslaunch's task wrapper
  (``launcher.node.task --index k8s``) like a Slurm or Grid Engine task: the task document (the
  job's variables) in ``PSLAUNCH_TASK``, the Pod's index within its role from its own
  ``pslaunch.io/rank`` label (the downward API), and the wrapper's node agent connecting back to
  the launcher's hub for output, exit codes and graceful stops.

Open (for the backend): the task document carries the job's secret and sits in the Pod's spec,
readable by whoever may read Pods in the namespace (a Secret per job, with ``secretKeyRef``,
needs Secret rights that pslaunch's service account does not have today); and the Pods must
reach the launcher's hub, which on a real cluster means the launcher runs in the cluster or is
reachable from it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Optional, Sequence

from ..node import task as task_wrapper
from ..spec.plan import ProcSpec

GROUP = "pslaunch.io"
LABEL_JOB, LABEL_ROLE, LABEL_RANK, LABEL_ATTEMPT = (f"{GROUP}/{k}" for k in ("job", "role", "rank", "attempt"))
TASK_ENV = "PSLAUNCH_TASK"
CONTAINER = "main"
#: Seconds a Pod's grace period exceeds ``--kill-grace``: the wrapper stops its command within
#: ``--kill-grace`` and then reports the exit code; the Pod's own SIGKILL must not come first.
GRACE_MARGIN = 5
NAME_MAX = 40  # the job's part of every name: Pod names add "-worker-123-9" and stay <= 63


def job_object_name(job_id: str) -> str:
    """The job's name for its Kubernetes objects: an RFC 1123 label (lowercase letters, digits,
    ``-``; starting with a letter) of at most :data:`NAME_MAX` characters, from the job id."""
    name = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name or not name[0].isalpha():
        name = "psl-" + name
    return name[:NAME_MAX].rstrip("-") or "psl"


def process_host(proc: ProcSpec) -> str:
    """The Pod's ``hostname``: ``server-0``, ``worker-3`` (the process's name, a DNS label)."""
    return proc.name


def pod_name(job: str, proc: ProcSpec, attempt: int) -> str:
    """``<job>-<process>`` for the first attempt, ``<job>-<process>-<attempt>`` after it (a
    replacement must not wait for its predecessor's name to be free)."""
    base = f"{job}-{process_host(proc)}"
    return base if attempt == 0 else f"{base}-{attempt}"


def labels(job: str, proc: Optional[ProcSpec] = None, attempt: Optional[int] = None) -> dict[str, str]:
    """The job's label, and a Pod's role, rank and attempt."""
    out = {LABEL_JOB: job}
    if proc is not None:
        out[LABEL_ROLE] = str(proc.role)
        out[LABEL_RANK] = str(proc.rank)
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    return out


def parent_manifest(job: str, job_id: str) -> dict[str, Any]:
    """The job's parent object: a ConfigMap, the owner of everything else of the job."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": job, "labels": labels(job)},
            "data": {"job-id": job_id}}


def owner_reference(parent: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to the parent as the apiserver returned it (it needs the uid)."""
    meta = parent["metadata"]
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": meta["name"], "uid": meta["uid"]}


def service_manifest(job: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The job's headless Service: the ``subdomain`` of its Pods (their DNS names, where the
    cluster has DNS), with not-yet-ready Pods listed (a PS scheduler is looked up before it is
    "ready" in any sense a probe could tell)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": job, "labels": labels(job), "ownerReferences": [dict(owner)]},
            "spec": {"clusterIP": "None", "selector": labels(job), "publishNotReadyAddresses": True}}


def wrapper_args(proc: ProcSpec) -> list[str]:
    """The task wrapper's arguments for one Pod (after the program that runs it)."""
    return ["--task-env", TASK_ENV, "--role", str(proc.role), "--index", "k8s"]


def pod_manifest(job: str, proc: ProcSpec, *, attempt: int, owner: Mapping[str, Any], image: str,
                 wrapper: Sequence[str], task_doc: Mapping[str, Any], kill_grace: float,
                 workdir: Optional[str] = None, node_selector: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """One process's Pod.

    Args:
        wrapper: the argv that runs the task wrapper in the image (``python3 -m
            launcher.node.task``, or the node bundle).
        task_doc: the role's task document (:func:`launcher.backends.batch.build_task_file`).
        kill_grace: ``--kill-grace``; the Pod's grace period is :data:`GRACE_MARGIN` s longer.
    """
    # every "$" doubled: the kubelet expands $(VAR) and turns $$ into $ in env values, and the
    # document must arrive as written (a user's variable may hold either)
    doc = json.dumps(task_doc, separators=(",", ":"))
    env: list[dict[str, Any]] = [{"name": k, "value": v.replace("$", "$$")}
                                 for k, v in task_wrapper.task_env_chunks(TASK_ENV, doc).items()]
    env.append({"name": task_wrapper.K8S_INDEX,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_RANK}']"}}})
    container: dict[str, Any] = {"name": CONTAINER, "image": image, "command": [*wrapper, *wrapper_args(proc)],
                                 "env": env}
    if workdir:
        container["workingDir"] = workdir
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": process_host(proc),
        "subdomain": job,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": int(math.ceil(kill_grace)) + GRACE_MARGIN,
        "containers": [container],
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(job, proc, attempt), "labels": labels(job, proc, attempt),
                         "ownerReferences": [dict(owner)]},
            "spec": spec}
