"""``pslaunch manifest`` on the test cluster (issue 37, item 4): the printed plain YAML of a PS job
(the bundled trainer's KVStore, tests/bin/kv_worker.py, as scheduler, server and 2 workers) is
created as it is, as pslaunch's service account, and runs to the end with nothing of pslaunch
running: every Pod Succeeded, the workers' sums right (the scheduler found by its Pod's DNS name,
every role authenticated with the secret from the printed Secret), and everything deleted after.

The test cluster has no cluster DNS (docs/k8s.md: a Pod's /etc/hosts names only itself), so
:class:`StandInDNS` plays CoreDNS's part for the job's headless Service: it reads the Service's
Endpoints (the real endpoints controller's, with each Pod's hostname) and appends their records
(``<hostname>.<service>.<namespace>.svc.cluster.local`` and the short ``<hostname>.<service>``) to
each running Pod's hosts file (the node program's /etc/netns/<ns>/hosts, which ``ip netns exec``
mounts over the Pod's /etc/hosts). A record shows up some time after a Pod starts, as on a
cluster; the job's command waits for the scheduler's name before it runs the trainer, which
resolves ``DMLC_PS_ROOT_URI`` once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helpers import REPO, load_script, wait_for
from support.k8s_testbed import K8sCluster

import pscontract as pc
from launcher.backends import k8s

pytestmark = [pytest.mark.integration, pytest.mark.k8s, pytest.mark.timeout(300)]
DEADLINE = 180.0
WORKER = REPO / "tests" / "bin" / "kv_worker.py"
DDP = REPO / "tests" / "bin" / "ddp_worker.py"


def wait_for_name(var: str) -> str:
    """A shell script for every Pod: wait until the peer's name in ``$var`` is in the Pod's hosts
    file, write what it resolves to (and ``$var`` and ``DMLC_NODE_HOST``) to ``$0/<hostname>.dns``,
    then run the program. (On a cluster the loop would be ``until getent hosts ...``; here a name not
    in the hosts file goes to this machine's nameserver, which no Pod reaches: each try would wait
    out the resolver's timeout.)"""
    return (f'out=$0; until grep -qw -- "${var}" /etc/hosts; do sleep 0.2; done; '
            f'getent hosts "${var}" > "$out/$(hostname).dns"; '
            f'echo "${var} $DMLC_NODE_HOST" >> "$out/$(hostname).dns"; exec "$@"')


class StandInDNS:
    """Cluster DNS for one headless Service, in hosts files (see the module docstring)."""

    def __init__(self, cluster: K8sCluster, job: str) -> None:
        self.core, self.admin = cluster.core(), cluster.core(admin=True)
        self.ns, self.job = cluster.namespace, job
        self.netns_name = load_script("k8s_node").netns_name
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def records(self) -> list[str]:
        from kubernetes.client.rest import ApiException

        try:
            ep = self.admin.read_namespaced_endpoints(self.job, self.ns)
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        addrs = [a for s in ep.subsets or [] for a in (s.addresses or []) + (s.not_ready_addresses or [])]
        return [f"{a.ip}\t{a.hostname}.{self.job}.{self.ns}.svc.cluster.local {a.hostname}.{self.job}\n"
                for a in addrs if a.hostname]

    def write(self, lines: list[str]) -> None:
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"{k8s.LABEL_JOB}={self.job}").items
        for pod in pods:
            if pod.status.phase not in ("Pending", "Running") or not pod.status.pod_ip:
                continue
            path = Path("/etc/netns") / self.netns_name(pod.status.pod_ip) / "hosts"
            try:
                have = path.read_text()
                missing = "".join(line for line in lines if line not in have)
                if missing:  # (appended in place, never created: the mount is of this file)
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                    with os.fdopen(fd, "w") as f:
                        f.write(missing)
            except OSError:
                continue  # (the Pod ended and its namespace went meanwhile)

    def run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.write(self.records())
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))

    def __enter__(self) -> StandInDNS:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def manifest(*args: str) -> list[dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "launcher", "manifest", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return list(yaml.safe_load_all(r.stdout))


def delete_job(cluster: K8sCluster, job: str) -> None:
    """What the manifest's header says: delete the job's Pods, Service and Secret by its label."""
    from kubernetes.client.rest import ApiException

    core, ns = cluster.core(), cluster.namespace
    core.delete_collection_namespaced_pod(ns, label_selector=f"{k8s.LABEL_JOB}={job}", grace_period_seconds=0)
    for fn, name in ((core.delete_namespaced_service, job), (core.delete_namespaced_secret, f"{job}-secret")):
        try:
            fn(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise


def run_printed_job(cluster: K8sCluster, job: str, objects: list[dict[str, Any]]) -> list[Any]:
    """Create the printed objects as they are, as pslaunch's service account (its rights are
    enough to apply a job), with the stand-in DNS; return every Pod once all have ended."""
    from kubernetes import utils

    ns, admin, api = cluster.namespace, cluster.core(admin=True), cluster.client()
    with StandInDNS(cluster, job) as dns:
        for o in objects:
            utils.create_from_dict(api, o, namespace=ns)
        names = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]

        def ended() -> list:
            pods = [admin.read_namespaced_pod(n, ns) for n in names]
            return pods if all(p.status.phase in ("Succeeded", "Failed") for p in pods) else []

        pods = wait_for(ended, DEADLINE, interval=0.5, what="every Pod of the printed job ended")
    assert not dns.errors, dns.errors
    return pods  # type: ignore[return-value]


def check_found(out: Path, pods: list[Any], peer: Any, name: str) -> None:
    """Each of ``pods`` resolved ``name`` (its variable's value) to ``peer``'s Pod address, and its
    own ``DMLC_NODE_HOST`` was its Pod's address."""
    for pod in pods:
        host = pod.spec.hostname
        resolved, said = (out / f"{host}.dns").read_text().splitlines()
        value, _, node_host = said.partition(" ")
        assert value == name and resolved.split()[0] == peer.status.pod_ip, (host, resolved, said)
        assert node_host == pod.status.pod_ip, (host, said)


def check_secret_only_in_its_secret(cluster: K8sCluster, job: str, secret: str, pods: list[Any]) -> None:
    """The secret is in the Secret only (no Pod's spec holds it; each Pod names the Secret)."""
    admin = cluster.core(admin=True)
    for pod in pods:
        assert secret not in json.dumps(admin.api_client.sanitize_for_serialization(pod.spec))
        env = {e.name: e for e in pod.spec.containers[0].env}
        assert env[pc.SECRET].value_from.secret_key_ref.name == f"{job}-secret"


def all_gone(cluster: K8sCluster, job: str) -> None:
    admin, ns, selector = cluster.core(admin=True), cluster.namespace, f"{k8s.LABEL_JOB}={job}"

    def gone() -> bool:
        return not (admin.list_namespaced_pod(ns, label_selector=selector).items
                    or admin.list_namespaced_service(ns, label_selector=selector).items
                    or admin.list_namespaced_secret(ns, label_selector=selector).items)

    wait_for(gone, 60, interval=0.3, what="the job's Pods, Service and Secret deleted")


def test_a_printed_ps_job_runs_on_the_cluster_without_pslaunch(k8s_cluster: K8sCluster, tmp_path: Path) -> None:
    ns = k8s_cluster.namespace
    job = k8s.job_object_name(f"manifest-{uuid.uuid4().hex[:8]}")
    out = tmp_path / "out"
    out.mkdir()
    objects = manifest("--k8s-image", "localhost/pslaunch:none", "--k8s-namespace", ns, "--jobname", job,
                       "-n", "2", "-s", "1", "--start-timeout", "150", "--env", f"PYTHONPATH={REPO}",
                       "--env", f"{pc.BIGARRAY_BOUND}=100", "sh", "-c", wait_for_name(pc.ROOT_URI), str(out),
                       sys.executable, str(WORKER), "sync", "--out", str(out))
    assert [o["kind"] for o in objects] == ["Secret", "Service", "Pod", "Pod", "Pod", "Pod"]
    try:
        pods = run_printed_job(k8s_cluster, job, objects)
        logs = {p.metadata.name: k8s_cluster.pod_log(p) for p in pods}
        assert [p.status.phase for p in pods] == ["Succeeded"] * 4, logs
        # the workers pushed and pulled through the server: the scheduler and the secret worked
        results = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("worker-*.json")}
        assert sorted(results) == [0, 1] and results[0]["sum"] == [6.0] * 4, (results, logs)
        # every other Pod found the scheduler's by DMLC_PS_ROOT_URI, its DNS name
        check_found(out, pods[1:], pods[0], f"scheduler.{job}")
        check_secret_only_in_its_secret(k8s_cluster, job, objects[0]["stringData"][pc.SECRET], pods)
    finally:
        delete_job(k8s_cluster, job)
    all_gone(k8s_cluster, job)


def test_a_printed_torch_job_runs_on_the_cluster_without_pslaunch(k8s_cluster: K8sCluster, tmp_path: Path) -> None:
    """DDP (gloo) over 2 Pods: rank 0 hosts the rendezvous store itself at MASTER_ADDR, its Pod's
    DNS name; each Pod a host of its own."""
    ns = k8s_cluster.namespace
    job = k8s.job_object_name(f"manifest-{uuid.uuid4().hex[:8]}")
    out = tmp_path / "out"
    out.mkdir()
    objects = manifest("--k8s-image", "localhost/pslaunch:none", "--k8s-namespace", ns, "--jobname", job,
                       "-n", "2", "--tracker", "torch", "--start-timeout", "150",
                       "sh", "-c", wait_for_name(pc.MASTER_ADDR), str(out), sys.executable, str(DDP),
                       "--out", str(out))
    assert [o["kind"] for o in objects] == ["Secret", "Service", "Pod", "Pod"]
    try:
        pods = run_printed_job(k8s_cluster, job, objects)
        logs = {p.metadata.name: k8s_cluster.pod_log(p) for p in pods}
        assert [p.status.phase for p in pods] == ["Succeeded"] * 2, logs
        records = {r["rank"]: r for r in (json.loads(f.read_text()) for f in out.glob("task-*.json"))}
        assert sorted(records) == [0, 1] and {r["world"] for r in records.values()} == {2}, (records, logs)
        assert records[0]["params"] == records[1]["params"]  # (DDP: the ranks' gradients averaged)
        for rank, r in records.items():
            got = r["env"]
            assert (got["MASTER_ADDR"], got["RANK"], got["LOCAL_RANK"], got["TORCHELASTIC_USE_AGENT_STORE"]) == \
                (f"worker-0.{job}", str(rank), "0", "False"), got
        check_found(out, pods, pods[0], f"worker-0.{job}")
        check_secret_only_in_its_secret(k8s_cluster, job, objects[0]["stringData"][pc.SECRET], pods)
    finally:
        delete_job(k8s_cluster, job)
    all_gone(k8s_cluster, job)


@pytest.mark.parametrize("fmt, job_args", [
    ("pytorchjob", ["-n", "3", "--tracker", "torch"]),
    ("mxjob", ["-n", "2", "-s", "2"]),
])
def test_the_kubeflow_jobs_templates_pass_the_apiservers_validation(k8s_cluster: K8sCluster, fmt: str,
                                                                    job_args: list[str]) -> None:
    """No Kubeflow operator (nor its CRDs) is on the test cluster: what the apiserver can check is
    each replica's Pod template and the Secret, created with ``dryRun=All`` (validated and
    admitted, not stored). The PyTorchJob's and MXJob's own fields are held to golden files only."""
    ns, core = k8s_cluster.namespace, k8s_cluster.core()
    secret, job = manifest("--format", fmt, "--k8s-image", "localhost/pslaunch:none", "--k8s-namespace", ns,
                           *job_args, "python3", "train.py")
    core.create_namespaced_secret(ns, secret, dry_run="All")
    replicas = job["spec"]["pytorchReplicaSpecs" if fmt == "pytorchjob" else "mxReplicaSpecs"]
    for kind, replica in replicas.items():
        template = replica["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{job['metadata']['name']}-{kind.lower()}-0",
                            "labels": template["metadata"]["labels"]},
               "spec": {**template["spec"], "restartPolicy": replica["restartPolicy"]}}
        made = core.create_namespaced_pod(ns, pod, dry_run="All")
        assert made.spec.containers[0].name == ("pytorch" if fmt == "pytorchjob" else "mxnet")
    assert core.list_namespaced_pod(ns, label_selector=f"{k8s.LABEL_JOB}={job['metadata']['name']}").items == []
