"""``--launcher k8s``: one Pod per process on a Kubernetes cluster, no operator (issue 37; docs/k8s.md).

pslaunch is a client of the apiserver (the ``kubernetes`` package, the ``k8s`` extra, imported
only here): kubeconfig from ``KUBECONFIG`` or ``~/.kube/config``, else in-cluster. For a job it
creates, in ``--k8s-namespace`` (default: the kubeconfig context's, else ``default``), what the
pure builders below make:

* one **parent**, a ConfigMap named after the job (:func:`parent_manifest`): every other object
  names it in its ``ownerReferences``, so deleting the parent makes the garbage collector remove
  the rest, even after the launcher is gone;
* one **Secret** with the task document (:func:`secret_manifest`: the job's variables, its
  secret among them), which each Pod reads through ``secretKeyRef``: never in a Pod's spec;
* one **headless Service** (:func:`service_manifest`: ``clusterIP: None``, selecting the job's
  Pods, ``publishNotReadyAddresses``), and ``hostname``/``subdomain`` on every Pod, so that a
  cluster with DNS gives each Pod the name ``<process>.<job>.<namespace>.svc``;
* one **Pod per process** (:func:`pod_manifest`), ``restartPolicy: Never`` (pslaunch owns
  restarts), labelled ``pslaunch.io/{job,role,rank,attempt}``, requesting its role's
  ``--worker-cores``/``--server-cores`` CPUs, running pslaunch's task wrapper
  (``launcher.node.task --index k8s``, from ``--k8s-image``, which must hold this pslaunch at the
  same path, as a Slurm node's shared filesystem does) like a Slurm or Ray task: its index within
  its role from its own ``pslaunch.io/rank`` label (the downward API), and its node agent
  connecting back to the launcher's hub (on the scheduler's address: ``DMLC_INTERFACE`` or
  ``--host-ip``) for output, exit codes and graceful stops.

Then :class:`K8sBackend` follows the Pods (a list by the job's label every
:attr:`K8sBackend.poll_every` s: phase, node and ``podIP``, the container's exit code); a Pod
still Pending after ``--start-timeout`` fails the launch with one line in the scheduler's words
(:func:`scheduler_reason`). At the end it deletes the Pods, the Secret, the Service and the
parent (propagation ``Background``) and waits until no Pod of the job is left; the node stops a
deleted Pod's processes (SIGTERM, then SIGKILL after its grace period, ``--kill-grace`` +
:data:`GRACE_MARGIN`). A launcher that dies first (SIGKILL) leaves that to its reaper
(:func:`reaper_main`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..node import task as task_wrapper
from ..runtime.output import ProcOutput
from ..spec import env as jobenv
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan, ProcSpec, build_plan, placement_env
from .base import BackendOption
from .batch import AGENT_GONE_WAIT, BatchBackend, BatchTask, build_task_file

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


def service_manifest(job: str, owner: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's headless Service: the ``subdomain`` of its Pods (their DNS names, where the
    cluster has DNS), with not-yet-ready Pods listed (a PS scheduler is looked up before it is
    "ready" in any sense a probe could tell). ``owner`` None: no ownerReferences (a manifest's
    Service, which no parent of a running launcher owns)."""
    meta: dict[str, Any] = {"name": job, "labels": labels(job)}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"clusterIP": "None", "selector": labels(job), "publishNotReadyAddresses": True}}


def wrapper_args(proc: ProcSpec) -> list[str]:
    """The task wrapper's arguments for one Pod (after the program that runs it)."""
    return ["--task-env", TASK_ENV, "--role", str(proc.role), "--index", "k8s"]


def task_doc_chunks(task_doc: Mapping[str, Any]) -> dict[str, str]:
    """The task document as the wrapper's variables ``PSLAUNCH_TASK``, ``PSLAUNCH_TASK_1``, ...
    (:func:`launcher.node.task.task_env_chunks`): the keys of the job's Secret, or env values."""
    return task_wrapper.task_env_chunks(TASK_ENV, json.dumps(task_doc, separators=(",", ":")))


def secret_name(job: str) -> str:
    """The job's Secret: ``<job>-task`` (the task document, which holds the job's secret)."""
    return f"{job}-task"


def secret_manifest(job: str, owner: Mapping[str, Any], task_doc: Mapping[str, Any]) -> dict[str, Any]:
    """The job's Secret: the task document in the keys :func:`task_doc_chunks` names, read by the
    Pods through ``secretKeyRef`` (never in a Pod's spec, which whoever may read Pods can read).
    ``stringData`` as written: a kubelet expands ``$(VAR)`` in ``value`` fields, not in a Secret's."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(job), "labels": labels(job), "ownerReferences": [dict(owner)]},
            "stringData": task_doc_chunks(task_doc)}


def pod_manifest(job: str, proc: ProcSpec, *, attempt: int, owner: Mapping[str, Any], image: str,
                 wrapper: Sequence[str], task_doc: Mapping[str, Any], kill_grace: float,
                 workdir: Optional[str] = None, node_selector: Optional[Mapping[str, str]] = None,
                 secret: Optional[str] = None, cpus: Optional[float] = None) -> dict[str, Any]:
    """One process's Pod.

    Args:
        wrapper: the argv that runs the task wrapper in the image (``python3 -m
            launcher.node.task``, or the node bundle).
        task_doc: the role's task document (:func:`launcher.backends.batch.build_task_file`).
        kill_grace: ``--kill-grace``; the Pod's grace period is :data:`GRACE_MARGIN` s longer.
        secret: the job's Secret (:func:`secret_manifest`): the Pod reads the document from it
            (``secretKeyRef``); None: the document is in the Pod's spec (the builders' first form).
        cpus: the CPUs the container requests (``--worker-cores``/``--server-cores``): the
            scheduler places the Pod only where they are free.
    """
    chunks = task_doc_chunks(task_doc)
    if secret:
        env: list[dict[str, Any]] = [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}}
                                     for k in chunks]
    else:
        # every "$" doubled: the kubelet expands $(VAR) and turns $$ into $ in env values, and the
        # document must arrive as written (a user's variable may hold either)
        env = [{"name": k, "value": v.replace("$", "$$")} for k, v in chunks.items()]
    env.append({"name": task_wrapper.K8S_INDEX,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_RANK}']"}}})
    container: dict[str, Any] = {"name": CONTAINER, "image": image, "command": [*wrapper, *wrapper_args(proc)],
                                 "env": env}
    if workdir:
        container["workingDir"] = workdir
    if cpus:
        container["resources"] = {"requests": {"cpu": f"{cpus:g}"}}
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


# --- ``pslaunch manifest``: the same job as YAML, with no launcher (issue 37, item 4) ---------------

#: what ``pslaunch manifest --format`` prints
MANIFEST_FORMATS = ("plain", "pytorchjob", "mxjob")
KUBEFLOW_API = "kubeflow.org/v1"
#: the container and port names each Kubeflow operator looks for in a replica's template
PYTORCH_CONTAINER, PYTORCH_PORT = "pytorch", "pytorchjob-port"
MXNET_CONTAINER, MXNET_PORT = "mxnet", "mxjob-port"
#: what each operator sets in every replica's container itself: left out of the templates
PYTORCHJOB_SETS = frozenset({pc.MASTER_ADDR, pc.MASTER_PORT, pc.TORCH_RANK, pc.WORLD_SIZE})
MXJOB_SETS = frozenset({pc.ROOT_URI, pc.ROOT_PORT, pc.NUM_SERVER, pc.NUM_WORKER, pc.ROLE})


def manifest_job_name(spec: JobSpec, job_id: str) -> str:
    """The manifest's object name: ``--jobname`` (stable, for a pipeline that applies the same job
    again), else the job's name and its id (``pslaunch-python3-3fa29b...``), as a DNS label."""
    return job_object_name(spec.jobname or f"{spec.name}-{job_id}")


def manifest_secret_name(job: str) -> str:
    """The manifest's Secret: ``<job>-secret`` (``PSLAUNCH_SECRET`` and every secret-named variable)."""
    return f"{job}-secret"


def peer_address(job: str, proc: ProcSpec) -> str:
    """A Pod's DNS name as its peers write it: ``<hostname>.<service>``, the headless Service's
    record for the Pod, which the Pods' search path (``<namespace>.svc.<cluster domain>``) completes.
    The short form keeps the namespace and the cluster's domain out of the manifest."""
    return f"{process_host(proc)}.{job}"


def manifest_refusal(spec: JobSpec, fmt: str) -> Optional[str]:
    """Why the job has no manifest of format ``fmt``, in one line that names the fix; None: it has."""
    if spec.tracker in ("rabit", "xgboost"):
        return (f"--tracker {spec.tracker} has no manifest: its tracker runs inside pslaunch, which a manifest "
                "leaves out; run the job with --launcher k8s, or print a ps job (-s 1 or more) or --tracker torch")
    if fmt == "pytorchjob" and spec.tracker != "torch":
        return ("--format pytorchjob is a collective torch job (--tracker torch); a ps job (scheduler, servers, "
                "workers) maps to --format mxjob or plain")
    if fmt == "mxjob" and spec.tracker != "ps":
        return (f"--format mxjob is a ps job (scheduler, servers, workers: -s 1 or more); a --tracker {spec.tracker} "
                "job maps to --format pytorchjob or plain")
    if spec.max_restarts:
        return ("--max-restarts has no manifest: restarts are pslaunch's, and nothing of pslaunch runs a manifest's "
                "job; drop it, or run the job with --launcher k8s")
    return None


def manifest_plan(spec: JobSpec, *, job: str, job_id: str, secret: str) -> Plan:
    """The job's plan when no launcher runs it: the ps scheduler (or a torch job's rank 0, which
    then hosts the rendezvous store itself: ``TORCHELASTIC_USE_AGENT_STORE`` False) is a Pod of the
    job, found by its DNS name (:func:`peer_address`) on the first port of ``--port-range`` (each Pod
    has its ports to itself); each torch worker is a host of its own (:func:`placement_env`: its
    ``RANK``, ``LOCAL_RANK`` 0, ``GROUP_RANK``). Nothing of the launcher's environment is inherited."""
    first = ProcSpec(Role.SCHEDULER if spec.has_scheduler else Role.WORKER, 0, None, None, ())
    plan = build_plan(spec, root_uri=peer_address(job, first), root_port=spec.port_range[0], secret=secret,
                      job_id=job_id, inherit_environ=False, scheduler_inherits=False)
    if spec.tracker != "torch":
        return plan
    placed = placement_env(plan.procs, {p.task_id: p.name for p in plan.procs if p.task_id is not None})
    procs = tuple(replace(p, awaits_placement=False, env={**p.env, **placed.get(p.task_id or 0, {}),
                                                          pc.USE_AGENT_STORE: "False"})
                  for p in plan.procs)
    return replace(plan, procs=procs)


def manifest_secret_data(procs: Sequence[ProcSpec]) -> dict[str, str]:
    """The job's secret variables (``PSLAUNCH_SECRET``, and any whose name looks secret:
    :func:`launcher.spec.env.is_secret`) for the manifest's Secret: one value per name."""
    data: dict[str, str] = {}
    for p in procs:
        for k, v in sorted(p.env.items()):
            if jobenv.is_secret(k) and data.setdefault(k, v) != v:
                raise ConfigError(f"{k} has a different value for servers and workers (--env-server, --env-worker); "
                                  "a manifest's Secret holds one value per name: give it once with --env")
    return data


def manifest_env(env: Mapping[str, str], secret: str, *, role: Role,
                 skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A container's ``env`` from a process's variables (sorted; ``skip`` left out): a secret one
    through ``secretKeyRef`` to the job's Secret, every other one as written (each ``$`` doubled:
    a kubelet expands ``$(VAR)`` and ``$$`` in values); a server's or worker's ``DMLC_NODE_HOST``
    is its Pod's address (the downward API) where the plan leaves it to the node."""
    out: list[dict[str, Any]] = []
    for k in sorted(env):
        if k in skip:
            continue
        if jobenv.is_secret(k):
            out.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}})
        else:
            out.append({"name": k, "value": env[k].replace("$", "$$")})
    if role is not Role.SCHEDULER and pc.NODE_HOST not in env and pc.NODE_HOST not in skip:
        out.append({"name": pc.NODE_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return out


def _container(spec: JobSpec, role: Role, name: str, argv: Sequence[str], env: list[dict[str, Any]],
               port: Optional[tuple[str, int]] = None) -> dict[str, Any]:
    """A container that runs ``argv`` directly (each ``$`` doubled: a kubelet expands ``$(VAR)``
    and ``$$`` in a command too) with its role's CPU and memory requests (the scheduler: none)."""
    opts: K8sOptions = spec.options or K8sOptions()
    container: dict[str, Any] = {"name": name, "image": opts.image, "command": [a.replace("$", "$$") for a in argv],
                                 "env": env}
    requests: dict[str, str] = {}
    if role is not Role.SCHEDULER:
        server = role is Role.SERVER
        cpus = spec.server_cores if server else spec.worker_cores
        memory = spec.server_memory_mb if server else spec.worker_memory_mb
        if cpus:
            requests["cpu"] = f"{cpus:g}"
        if memory:
            requests["memory"] = f"{memory}Mi"
    if requests:
        container["resources"] = {"requests": requests}
    if port is not None:
        container["ports"] = [{"name": port[0], "containerPort": port[1]}]
    return container


def _pod_spec(spec: JobSpec, containers: list[dict[str, Any]]) -> dict[str, Any]:
    """What every Pod of a manifest has: ``restartPolicy: Never``, no service-account token, no
    service links, ``--kill-grace`` between SIGTERM and SIGKILL."""
    return {"restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": int(math.ceil(spec.kill_grace)), "containers": containers}


def _metadata(name: str, namespace: Optional[str], object_labels: Mapping[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = dict(object_labels)
    return meta


def manifest_secret(job: str, namespace: Optional[str], data: Mapping[str, str]) -> dict[str, Any]:
    """The manifest's Secret (``stringData``: a Secret's values are not expanded)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(manifest_secret_name(job), namespace, labels(job)), "stringData": dict(data)}


def plain_manifest(spec: JobSpec, plan: Plan, job: str) -> list[dict[str, Any]]:
    """The job as core objects: its Secret, a headless Service and one Pod per process
    (``restartPolicy: Never``, ``hostname``/``subdomain``, labels ``pslaunch.io/{job,role,rank}``),
    each running the command directly with its role's environment (``--timeout``: the Pods'
    ``activeDeadlineSeconds``)."""
    ns = (spec.options or K8sOptions()).namespace
    secret = manifest_secret_name(job)
    service = service_manifest(job, None)
    service["metadata"] = _metadata(job, ns, labels(job))
    out = [manifest_secret(job, ns, manifest_secret_data(plan.all)), service]
    for p in plan.all:
        pod = _pod_spec(spec, [_container(spec, p.role, CONTAINER, p.argv, manifest_env(p.env, secret, role=p.role))])
        pod = {"hostname": process_host(p), "subdomain": job, **pod}
        if spec.timeout:
            pod["activeDeadlineSeconds"] = int(math.ceil(spec.timeout))
        out.append({"apiVersion": "v1", "kind": "Pod",
                    "metadata": _metadata(pod_name(job, p, 0), ns, labels(job, p)), "spec": pod})
    return out


def _shared_env(procs: Sequence[ProcSpec]) -> dict[str, str]:
    """The variables every one of ``procs`` has with the same value: what a replica's one
    template can hold (``DMLC_TASK_ID``, ``PSLAUNCH_PROCESS`` and other per-process ones cannot)."""
    first = dict(procs[0].env)
    return {k: v for k, v in first.items() if all(p.env.get(k) == v for p in procs[1:])}


def _replica(spec: JobSpec, job: str, procs: Sequence[ProcSpec], *, container: str, port: tuple[str, int],
             skip: frozenset[str]) -> dict[str, Any]:
    """One replica type of a Kubeflow job: ``procs`` (one role) as one template."""
    role = procs[0].role
    env = manifest_env(_shared_env(procs), manifest_secret_name(job), role=role, skip=skip)
    return {"replicas": len(procs), "restartPolicy": "Never",
            "template": {"metadata": {"labels": {**labels(job), LABEL_ROLE: str(role)}},
                         "spec": _pod_spec(spec, [_container(spec, role, container, procs[0].argv, env, port)])}}


def _kubeflow(spec: JobSpec, plan: Plan, job: str, kind: str, replica_specs: str,
              replicas: Mapping[str, dict[str, Any]], extra: Mapping[str, Any]) -> list[dict[str, Any]]:
    ns = (spec.options or K8sOptions()).namespace
    body: dict[str, Any] = {**extra, replica_specs: dict(replicas)}
    if spec.timeout:
        body["runPolicy"] = {"activeDeadlineSeconds": int(math.ceil(spec.timeout))}
    return [manifest_secret(job, ns, manifest_secret_data(plan.all)),
            {"apiVersion": KUBEFLOW_API, "kind": kind, "metadata": _metadata(job, ns, labels(job)), "spec": body}]


def pytorchjob_manifest(spec: JobSpec, plan: Plan, job: str) -> list[dict[str, Any]]:
    """The job as a Kubeflow PyTorchJob: Master (worker 0) and Worker (the other n-1), container
    ``pytorch`` with the port ``pytorchjob-port``; the operator sets ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` itself."""
    port = (PYTORCH_PORT, plan.root_port)
    workers = [p for p in plan.procs if p.role is Role.WORKER]
    replicas = {"Master": _replica(spec, job, workers[:1], container=PYTORCH_CONTAINER, port=port,
                                   skip=PYTORCHJOB_SETS)}
    if len(workers) > 1:
        replicas["Worker"] = _replica(spec, job, workers[1:], container=PYTORCH_CONTAINER, port=port,
                                      skip=PYTORCHJOB_SETS)
    # (what differs between the Master and the Workers beyond the operator's variables is dropped)
    shared = set(_shared_env(workers))
    for r in replicas.values():
        c = r["template"]["spec"]["containers"][0]
        c["env"] = [e for e in c["env"] if e["name"] in shared or e["name"] == pc.NODE_HOST]
    return _kubeflow(spec, plan, job, "PyTorchJob", "pytorchReplicaSpecs", replicas, {})


def mxjob_manifest(spec: JobSpec, plan: Plan, job: str) -> list[dict[str, Any]]:
    """The job as a Kubeflow MXJob (``jobMode: MXTrain``): Scheduler, Server and Worker replicas,
    container ``mxnet`` with the port ``mxjob-port``; the operator sets ``DMLC_PS_ROOT_URI``,
    ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and ``DMLC_ROLE`` itself."""
    assert plan.scheduler is not None
    port = (MXNET_PORT, plan.root_port)
    replicas = {}
    for kind, procs in (("Scheduler", [plan.scheduler]),
                        ("Server", [p for p in plan.procs if p.role is Role.SERVER]),
                        ("Worker", [p for p in plan.procs if p.role is Role.WORKER])):
        replicas[kind] = _replica(spec, job, procs, container=MXNET_CONTAINER, port=port, skip=MXJOB_SETS)
    return _kubeflow(spec, plan, job, "MXJob", "mxReplicaSpecs", replicas, {"jobMode": "MXTrain"})


MANIFEST_BUILDERS = {"plain": plain_manifest, "pytorchjob": pytorchjob_manifest, "mxjob": mxjob_manifest}


def job_manifest(spec: JobSpec, fmt: str, *, job_id: str, secret: str) -> tuple[str, list[dict[str, Any]]]:
    """``(the job's object name, its objects)`` in format ``fmt``; pure: the job id and secret are given.

    Raises:
        ConfigError: the job has no such manifest (:func:`manifest_refusal`).
    """
    if fmt not in MANIFEST_BUILDERS:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(MANIFEST_FORMATS)}")
    why = manifest_refusal(spec, fmt)
    if why:
        raise ConfigError(why)
    job = manifest_job_name(spec, job_id)
    plan = manifest_plan(spec, job=job, job_id=job_id, secret=secret)
    return job, MANIFEST_BUILDERS[fmt](spec, plan, job)


def manifest_yaml(job: str, fmt: str, objects: Sequence[Mapping[str, Any]]) -> str:
    """The objects as one YAML stream, after a comment that says what it is and that it holds the
    job's secret (in its Secret: apply it, keep it out of a repository)."""
    import yaml

    head = (f"# pslaunch manifest --format {fmt}: job {job}. The Secret {manifest_secret_name(job)} holds the job's "
            "secret:\n# apply it (kubectl apply -f -), keep it out of a repository. "
            f"Delete: kubectl delete {'pods,services' if fmt == 'plain' else fmt},secrets -l {LABEL_JOB}={job}\n")
    return head + yaml.safe_dump_all([dict(o) for o in objects], sort_keys=False, default_flow_style=False,
                                     explicit_start=True)


# --- the backend ---------------------------------------------------------------------------------

log = logging.getLogger(__name__)

#: where a Pod's own service account puts the namespace it runs in (in-cluster configuration)
INCLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
#: seconds :meth:`K8sBackend.release` waits, beyond the Pods' grace period, for them to be gone
GONE_WAIT = 30.0


@dataclass(frozen=True)
class K8sOptions:
    """``--k8s-*``: the ``namespace`` (None: the kubeconfig context's, else ``default``) and the
    ``image`` the Pods run (required: a Pod must name one)."""

    namespace: Optional[str] = None
    image: Optional[str] = None

    def __post_init__(self) -> None:
        if self.namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace):
            raise ConfigError(f"--k8s-namespace {self.namespace!r} is not a Kubernetes namespace name "
                              "(lowercase letters, digits and '-', at most 63)")
        if self.image is not None and not self.image.strip():
            raise ConfigError("--k8s-image needs an image: the one the Pods run (with this pslaunch and Python)")


def load_kubernetes() -> Any:
    """Import the ``kubernetes`` client, or raise a one-line :class:`BackendUnavailableError`."""
    if importlib.util.find_spec("kubernetes") is None:
        raise BackendUnavailableError("--launcher k8s needs the kubernetes package in pslaunch's Python: pip install "
                                      "'.[k8s]' in your clone of pslaunch")
    import kubernetes

    return kubernetes


def kubeconfig_path(environ: Mapping[str, str]) -> Optional[str]:
    """``KUBECONFIG`` (a list of files, as kubectl reads it), else ``~/.kube/config`` where it
    exists; None: none (in-cluster, where the Pod's service account is)."""
    if environ.get("KUBECONFIG"):
        return environ["KUBECONFIG"]
    home = os.path.expanduser("~/.kube/config")
    return home if os.path.exists(home) else None


def connect(environ: Mapping[str, str]) -> tuple[Any, str]:
    """``(ApiClient, the configuration's namespace)``: from the kubeconfig (:func:`kubeconfig_path`;
    its current context's namespace, else ``default``), else in-cluster (the Pod's namespace)."""
    k = load_kubernetes()
    from kubernetes import client, config

    path = kubeconfig_path(environ)
    try:
        if path is not None:
            api = config.new_client_from_config(config_file=path)
            _, active = config.list_kube_config_contexts(config_file=path)
            return api, str(((active or {}).get("context") or {}).get("namespace") or "default")
        if environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            with open(INCLUSTER_NAMESPACE, encoding="utf-8") as f:
                return client.ApiClient(cfg), f.read().strip() or "default"
    except (OSError, k.config.ConfigException) as e:
        raise LaunchError(f"cannot read the Kubernetes configuration {path or '(in-cluster)'}: "
                          f"{' '.join(str(e).split())}") from None
    raise LaunchError("--launcher k8s finds no cluster: set KUBECONFIG (or write ~/.kube/config), or run pslaunch in "
                      "a Pod of the cluster")


def api_error(e: Any) -> str:
    """An ``ApiException`` in one line: its status and the apiserver's message."""
    try:
        message = json.loads(e.body).get("message") or e.reason
    except (TypeError, ValueError, AttributeError):
        message = getattr(e, "reason", "") or str(e)
    return f"{getattr(e, 'status', '')} {' '.join(str(message).split())}".strip()


def scheduler_reason(pod: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    """Why a Pending Pod does not run, in the scheduler's words: its ``PodScheduled`` condition's
    message, else its latest ``FailedScheduling`` event; else its node (placed, not started yet).
    ``pod`` and ``events`` as the API returns them (camelCase dicts)."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
            return f"{c.get('reason') or 'Unschedulable'}: {c['message']}"
    failed = [e for e in events if e.get("reason") == "FailedScheduling"]
    if failed:
        last = max(failed, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
        return f"FailedScheduling: {' '.join(str(last.get('message') or '').split())}"
    node_name = (pod.get("spec") or {}).get("nodeName")
    if node_name:
        return f"placed on node {node_name}, not started by it yet"
    return "not placed yet (no word from the scheduler)"


def pod_end(pod: Mapping[str, Any]) -> Optional[tuple[int, str]]:
    """``(exit code, reason)`` of a Pod that ended (Succeeded or Failed); None while it has not.
    The container's exit code (128+N for signal N); a Pod that failed without one (it never
    started) is 1 with the Pod's reason and message."""
    status = pod.get("status") or {}
    if status.get("phase") not in ("Succeeded", "Failed"):
        return None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == CONTAINER and term and term.get("exitCode") is not None:
            code = int(term["exitCode"])
            why = "" if code == 0 else " ".join(f"{term.get('reason') or ''} {term.get('message') or ''}".split())
            return code, why
    why = " ".join(f"{status.get('reason') or ''} {status.get('message') or ''}".split())
    return (0, "") if status["phase"] == "Succeeded" else (1, why or "its Pod failed")


def delete_job(core: Any, namespace: str, job: str, parent: bool = True) -> list[str]:
    """Delete every object of ``job`` (Pods by label, the Secret, the Service, the parent with
    propagation ``Background``); returns one line per failure (a 404 is not one)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    selector = f"{LABEL_JOB}={job}"
    steps = [("Pods", lambda: core.delete_collection_namespaced_pod(namespace, label_selector=selector)),
             ("Secret", lambda: core.delete_namespaced_secret(secret_name(job), namespace)),
             ("Service", lambda: core.delete_namespaced_service(job, namespace))]
    if parent:
        steps.append(("parent ConfigMap", lambda: core.delete_namespaced_config_map(
            job, namespace, body=client.V1DeleteOptions(propagation_policy="Background"))))
    errors = []
    for what, step in steps:
        try:
            step()
        except ApiException as e:
            if e.status != 404:
                errors.append(f"cannot delete the job's {what} in namespace {namespace}: {api_error(e)}")
        except OSError as e:
            errors.append(f"cannot delete the job's {what} in namespace {namespace}: {e}")
    return errors


def reaper_main() -> int:
    """The reaper (``python -c ... reaper_main() NAMESPACE JOB``): started by the launcher in a
    session of its own once the job's parent exists, it reads its stdin until the end. ``done``
    first: the launcher deleted the job itself. The end without it: the launcher died (SIGKILL,
    OOM), and the reaper deletes the job's objects (the nodes then stop the Pods' processes)."""
    import sys

    namespace, job = sys.argv[1], sys.argv[2]
    said = sys.stdin.read()
    if said.startswith("done"):
        return 0
    try:
        api, _ = connect(os.environ)
    except LaunchError as e:
        print(f"pslaunch (reaper of job {job}): {e}; kubectl delete configmap {job} -n {namespace} removes it",
              file=sys.stderr)
        return 1
    from kubernetes import client

    errors = delete_job(client.CoreV1Api(api), namespace, job)
    for line in errors:
        print(f"pslaunch (reaper of job {job}): {line}", file=sys.stderr)
    return 1 if errors else 0


class K8sTask(BatchTask):
    """One process of the job: its Pod."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: K8sBackend, pod: str) -> None:
        super().__init__(proc, output, backend, host="(k8s)")
        self.pod = pod
        self.state = "Pending"
        self.seen = False  # the Pod was listed once (a Pod missing after that was deleted)
        self.gone = False  # no Pod of this name exists any more
        self.ended_seen: Optional[float] = None  # when the follower first saw the Pod ended (monotonic)

    def where(self) -> str:
        return f"Pod {self.pod}"


class K8sBackend(BatchBackend):
    """Kubernetes Pods, one per process, with no operator (see the module docstring and docs/k8s.md)."""

    name = "k8s"
    elsewhere = "the Kubernetes Pods"
    poll_every = 0.3
    close_wait = 20.0
    Options = K8sOptions
    options = (
        BackendOption(("--k8s-namespace",), "namespace", "the namespace of the job's Pods, Service, ConfigMap and "
                      "Secret (default: the kubeconfig context's, else default).", metavar="NS"),
        BackendOption(("--k8s-image",), "image", "the image the Pods run (required): it must hold this pslaunch at "
                      "the same path and the job's Python and program.", metavar="IMAGE"),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._api: Any = None
        self._core: Any = None
        self.namespace = ""
        self.job = ""
        self._parent = False  # the parent was created (release deletes it)
        self._reaper: Optional[subprocess.Popen[bytes]] = None

    # -- what the rest of the launcher asks of the class ------------------------------------------

    @classmethod
    def check_spec(cls, spec: JobSpec) -> None:
        super().check_spec(spec)
        opts: K8sOptions = spec.options or K8sOptions()
        if not opts.image:
            raise ConfigError("--launcher k8s needs --k8s-image IMAGE: the image the Pods run (it must hold this "
                              "pslaunch at the same path, and the job's Python and program)")

    @classmethod
    def where(cls, spec: JobSpec, plan: Plan) -> str:
        opts: K8sOptions = spec.options or K8sOptions()
        return f"Kubernetes Pods (namespace {opts.namespace or 'of the kubeconfig'})"

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        opts: K8sOptions = spec.options or K8sOptions()
        ns = opts.namespace or "(the kubeconfig context's, else default)"
        return [f"Kubernetes: in namespace {ns}, a parent "
                "ConfigMap named after the job, a Secret with the task document (the job secret), a headless Service, "
                f"and one Pod per process ({len(plan.procs)}; image {opts.image}, restartPolicy Never, labels "
                f"{LABEL_JOB}, {LABEL_ROLE}, {LABEL_RANK}, {LABEL_ATTEMPT}), each running the task wrapper, which "
                "connects back to the scheduler's address; everything is deleted at the end"]

    # -- set-up ------------------------------------------------------------------------------------

    def check(self) -> None:
        load_kubernetes()

    def _connect(self) -> None:
        if self._core is not None:
            return
        from kubernetes import client

        self._api, default_ns = connect(os.environ)
        self._core = client.CoreV1Api(self._api)
        opts: K8sOptions = self.spec.options or K8sOptions()
        self.namespace = opts.namespace or default_ns

    def _create(self, what: str, fn: Any, body: Mapping[str, Any]) -> Any:
        """Create one object; an API error is one line naming it, the namespace and the reason."""
        from kubernetes.client.rest import ApiException

        try:
            return fn(self.namespace, body)
        except ApiException as e:
            hint = ""
            if e.status == 403:
                hint = (" (pslaunch's account lacks that right in this namespace: see the RBAC rules in "
                        "docs/k8s.md)")
            raise LaunchError(f"Kubernetes refused to create the job's {what} in namespace {self.namespace}: "
                              f"{api_error(e)}{hint}") from None
        except OSError as e:  # urllib3's errors are OSErrors: the apiserver cannot be reached
            raise LaunchError(f"cannot reach the Kubernetes apiserver to create the job's {what}: {e}") from None

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        self._connect()
        core = self._core
        opts: K8sOptions = self.spec.options or K8sOptions()
        assert opts.image
        env = procs[0].env
        self.job = job_object_name(env.get(pc.JOB_ID, "job"))
        attempt = int(env.get(pc.ATTEMPT, "0") or 0)
        doc = build_task_file(self.spec, procs, hub=hub)
        parent = self._create("parent ConfigMap", core.create_namespaced_config_map,
                              parent_manifest(self.job, env.get(pc.JOB_ID, self.job)))
        self._parent = True
        self._start_reaper()
        owner = owner_reference(self._api.sanitize_for_serialization(parent))
        self._create("Secret", core.create_namespaced_secret, secret_manifest(self.job, owner, doc))
        self._create("Service", core.create_namespaced_service, service_manifest(self.job, owner))
        wrapper = node.command("task")
        workdir = self.spec.workdir or os.getcwd()
        for p in procs:
            cpus = self.spec.server_cores if p.role is Role.SERVER else self.spec.worker_cores
            body = pod_manifest(self.job, p, attempt=attempt, owner=owner, image=opts.image, wrapper=wrapper,
                                task_doc=doc, kill_grace=self.spec.kill_grace, workdir=workdir,
                                secret=secret_name(self.job), cpus=cpus)
            t = K8sTask(p, self.console.proc(p.name, p.label, str(p.role)), self, body["metadata"]["name"])
            self.add_task(t)
            self._create(f"Pod {t.pod}", core.create_namespaced_pod, body)
        log.info("created %d Pods in namespace %s (job %s)", len(procs), self.namespace, self.job)
        return self.tasks

    def _start_reaper(self) -> None:
        """The reaper (:func:`reaper_main`), in a session of its own (a signal to the launcher's
        group does not reach it), holding the write end of a pipe that only this process holds:
        if the launcher dies without saying ``done``, the reaper deletes the job's objects."""
        code = (f"import sys; sys.path.insert(0, {node.ROOT!r}); from launcher.backends.k8s import reaper_main; "
                "sys.exit(reaper_main())")
        try:
            self._reaper = subprocess.Popen([sys.executable, "-c", code, self.namespace, self.job],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            start_new_session=True, close_fds=True)
        except OSError as e:
            log.warning("cannot start the reaper of the job's Kubernetes objects (%s): a launcher killed with "
                        "SIGKILL would leave them; kubectl delete configmap %s -n %s removes them", e, self.job,
                        self.namespace)

    def _stop_reaper(self) -> None:
        """The launcher deleted the job itself: tell the reaper so, and let it go."""
        reaper, self._reaper = self._reaper, None
        if reaper is None or reaper.stdin is None:
            return
        try:
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
            reaper.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            reaper.kill()
            reaper.wait()

    def helper_pids(self) -> set[int]:
        return {self._reaper.pid} if self._reaper is not None else set()

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        """One line: how many Pods do not run, and why in the scheduler's words (grouped)."""
        whys: dict[str, list[str]] = {}
        for t in pending:
            assert isinstance(t, K8sTask)
            whys.setdefault(self._pending_reason(t), []).append(t.label)
        parts = "; ".join(f"{', '.join(labels_)}: {why}" for why, labels_ in whys.items())
        return (f"{len(pending)} of {len(self.tasks)} Pods not running after --start-timeout {timeout:g}s in "
                f"namespace {self.namespace} ({parts})")

    def _pending_reason(self, t: K8sTask) -> str:
        """Why ``t``'s Pod does not run yet (:func:`scheduler_reason`), or why its agent is not heard."""
        from kubernetes.client.rest import ApiException

        try:
            pod = self._api.sanitize_for_serialization(self._core.read_namespaced_pod(t.pod, self.namespace))
            events = self._api.sanitize_for_serialization(self._core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.name={t.pod}").items)
        except (ApiException, OSError) as e:
            return f"cannot read its Pod: {api_error(e)}"
        if (pod.get("status") or {}).get("phase") == "Running":
            return (f"its Pod runs on node {pod['spec'].get('nodeName')}, but its task wrapper has not connected to "
                    f"the launcher at {self.hub.address[0] if self.hub else '?'} (can the Pods reach it? "
                    "DMLC_INTERFACE or --host-ip choose the address)")
        return scheduler_reason(pod, events)

    # -- following the Pods ------------------------------------------------------------------------

    def poll_once(self) -> None:
        if self._core is None or not self.job:
            return
        items = self._core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_JOB}={self.job}").items
        pods = {p.metadata.name: self._api.sanitize_for_serialization(p) for p in items}
        for t in list(self.tasks):
            assert isinstance(t, K8sTask)
            pod = pods.get(t.pod)
            if pod is None:
                t.gone = t.seen or t.terminated
                if t.seen and t.code is None:
                    self.set_code(t, 128 + signal.SIGKILL, "its Pod was deleted", ended_at=time.time())
                continue
            t.seen, t.gone = True, False
            status = pod.get("status") or {}
            phase = status.get("phase") or "Pending"
            with self.lock:
                t.state = phase
                if phase == "Running" and not t.ran and self.hub is None:
                    t.ran = True  # (no agent will say it)
                if t.host == "(k8s)" and status.get("podIP"):
                    t.host = f"{pod['spec'].get('nodeName')}/{status['podIP']}"
            end = pod_end(pod)
            if end is not None and t.code is None:
                # its agent's connection, last output and exit frame may still be on their way
                # (the Pod ends once the wrapper has sent them; a busy launcher's hub may not even
                # have taken the connection yet): its word first, the Pod's after AGENT_GONE_WAIT
                t.ended_seen = t.ended_seen or time.monotonic()
                if (self.hub is not None and t.channel != "closed"
                        and time.monotonic() - t.ended_seen < AGENT_GONE_WAIT):
                    continue
                code, why = end
                if code != 0 and not (status.get("containerStatuses") or []):
                    t.failure = f"its Pod could not start: {why}"
                self.set_code(t, code, "" if code == 0 else why, ended_at=time.time())

    def settled(self) -> bool:
        return all(t.code is not None for t in self.tasks)

    # -- stopping ----------------------------------------------------------------------------------

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """Delete the Pods of ``tasks`` (the node stops their processes: SIGTERM, then SIGKILL after
        the Pods' grace period)."""
        from kubernetes.client.rest import ApiException

        for t in tasks:
            assert isinstance(t, K8sTask)
            if t.terminated or self._core is None:
                continue
            t.terminated = True
            try:
                self._core.delete_namespaced_pod(t.pod, self.namespace)
            except ApiException as e:
                if e.status != 404:
                    log.warning("cannot delete Pod %s: %s", t.pod, api_error(e))
            except OSError as e:
                log.warning("cannot delete Pod %s: %s", t.pod, e)

    def release(self) -> None:
        """Delete the parent (the garbage collector removes what it owns), the Secret, the Service
        and every Pod of the job (not left to the collector: its pace is its own), and wait until
        no Pod of the job is left."""
        from kubernetes.client.rest import ApiException

        if self._core is None or not self.job:
            return
        core, ns, job = self._core, self.namespace, self.job
        selector = f"{LABEL_JOB}={job}"
        for line in delete_job(core, ns, job, parent=self._parent):
            log.warning("%s", line)
        deadline = time.monotonic() + self.spec.kill_grace + GRACE_MARGIN + GONE_WAIT
        left: list[str] = []
        while time.monotonic() < deadline:
            try:
                left = [p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=selector).items]
            except (ApiException, OSError) as e:
                log.debug("listing the job's Pods: %s", e)
            if not left:
                break
            time.sleep(0.2)
        if left:
            log.warning("Kubernetes has not removed the job's Pods %s in namespace %s yet; check with kubectl get pods "
                        "-n %s -l %s", ", ".join(left), ns, ns, selector)
        self._stop_reaper()
        self._api.close()
        self._core = None
