"""The job's Kubernetes objects (launcher/backends/k8s.py) on the test cluster, created as
pslaunch's service account: the apiserver takes them, the nodes run the Pods' task wrapper (the
task document arrives as written, each Pod's index from its rank label), the headless Service
lists every Pod, and deleting the parent removes everything (the garbage collector).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from support.helpers import wait_for
from support.k8s_testbed import K8sCluster

from launcher import node
from launcher.backends import k8s
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec

pytestmark = [pytest.mark.integration, pytest.mark.k8s]
DEADLINE = 90.0

# each worker prints its variables, waits for the file GO (the Pods run meanwhile: a headless
# Service lists no ended Pod), and exits with its task id (worker 1 fails: 1)
PROGRAM = ("import json, os, sys, time; print('VARS ' + json.dumps({k: os.environ.get(k) for k in "
           "('DMLC_TASK_ID', 'DMLC_ROLE', 'DMLC_NODE_HOST', 'A', 'PSLAUNCH_TASK')}), flush=True)\n"
           "end = time.time() + 300\nwhile not os.path.exists(GO) and time.time() < end: time.sleep(0.1)\n"
           "sys.exit(int(os.environ['DMLC_TASK_ID']))")


def test_the_jobs_objects_run_on_the_cluster_and_go_with_their_parent(k8s_cluster: K8sCluster,
                                                                      tmp_path: Path) -> None:
    from kubernetes.client.rest import ApiException

    core, ns = k8s_cluster.core(), k8s_cluster.namespace
    job = k8s.job_object_name(f"manifests-{uuid.uuid4().hex[:8]}")
    go = tmp_path / "go"
    doc = {"version": 2, "argv": [sys.executable, "-S", "-c", f"GO = {str(go)!r}\n" + PROGRAM], "env": {},
           "roles": {"worker": {"first_task_id": 0, "count": 2, "env": {
               "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.202.8.1", "DMLC_PS_ROOT_PORT": "9000",
               "A": "$(HOME) $$"}}},
           "grace": 2.0}
    parent = core.create_namespaced_config_map(ns, k8s.parent_manifest(job, job))
    owner = k8s.owner_reference(core.api_client.sanitize_for_serialization(parent))
    try:
        core.create_namespaced_service(ns, k8s.service_manifest(job, owner))
        names = []
        for rank in (0, 1):
            proc = ProcSpec(role=Role.WORKER, rank=rank, task_id=rank, host=None, argv=())
            pod = k8s.pod_manifest(job, proc, attempt=0, owner=owner, image="localhost/pslaunch:none",
                                   wrapper=node.command("task", python=sys.executable), task_doc=doc, kill_grace=2.0,
                                   node_selector={"kubernetes.io/hostname": f"kn{rank}"})
            names.append(core.create_namespaced_pod(ns, pod).metadata.name)

        # the headless Service's Endpoints name both Pods by address and hostname (the endpoints controller)
        def endpoints() -> dict:
            ep = k8s_cluster.core(admin=True).read_namespaced_endpoints(job, ns)
            addrs = [a for s in ep.subsets or [] for a in (s.addresses or []) + (s.not_ready_addresses or [])]
            return {a.hostname: a.ip for a in addrs} if len(addrs) == 2 else {}

        seen = wait_for(endpoints, DEADLINE, interval=0.3, what="the Service's endpoints")
        go.touch()

        def ended() -> list:
            pods = [core.read_namespaced_pod(n, ns) for n in names]
            return pods if all(p.status.phase in ("Succeeded", "Failed") for p in pods) else []

        pods = wait_for(ended, DEADLINE, interval=0.2, what="both Pods ended")
        for rank, pod in enumerate(pods):
            out = k8s_cluster.pod_log(pod)
            line = next((x for x in out.splitlines() if x.startswith("VARS ")), None)
            assert line, out
            got = json.loads(line[5:])
            # the wrapper's index from the rank label; the document as written (no $ expanded);
            # the document itself not passed on to the command; the node's address: the Pod's own
            assert got == {"DMLC_TASK_ID": str(rank), "DMLC_ROLE": "worker", "DMLC_NODE_HOST": pod.status.pod_ip,
                           "A": "$(HOME) $$", "PSLAUNCH_TASK": None}, out
            assert pod.status.container_statuses[0].state.terminated.exit_code == rank
            assert pod.status.phase == ("Succeeded" if rank == 0 else "Failed")
            assert pod.spec.node_name == f"kn{rank}"
        assert seen == {"worker-0": pods[0].status.pod_ip, "worker-1": pods[1].status.pod_ip}
    finally:
        core.delete_namespaced_config_map(job, ns)

    def all_gone() -> bool:
        left = core.list_namespaced_pod(ns, label_selector=f"{k8s.LABEL_JOB}={job}").items
        try:
            core.read_namespaced_service(job, ns)
            return False
        except ApiException as e:
            return e.status == 404 and not left

    wait_for(all_gone, DEADLINE, interval=0.3, what="the garbage collector removing the job's Pods and Service")
