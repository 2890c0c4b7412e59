"""The test cluster's nodes (scripts/k8s_node.py, the project's stand-in for a kubelet) against the
real control plane: the scheduler binds a Pod, a node runs its command in a network namespace of
the Pod's own and reports phase, podIP and exit code; deleting a Pod stops its whole process tree.
The ``--launcher k8s`` tests stand on these. Deadlines are for liveness (a loaded 2-core CI box).
"""

from __future__ import annotations

import datetime as dt
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from support.helpers import pid_alive, wait_for
from support.k8s_testbed import K8sCluster

pytestmark = [pytest.mark.integration, pytest.mark.k8s]

NODES = ("kn0", "kn1", "kn2")
DEADLINE = 90.0


def pod_body(name: str, argv: list[str], **spec: Any) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"pslaunch.io/job": "node-test"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [{"name": "main", "image": "localhost/pslaunch:none", "command": argv[:1],
                            "args": argv[1:], **spec.pop("container", {})}],
            **spec,
        },
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_phase(cluster: K8sCluster, name: str, phases: tuple[str, ...]) -> Any:
    core = cluster.core()

    def phase() -> Any:
        pod = core.read_namespaced_pod(name, cluster.namespace)
        return pod if pod.status.phase in phases else None

    try:
        return wait_for(phase, DEADLINE, interval=0.2, what=f"pod {name} in {phases}")
    except AssertionError:
        pod = core.read_namespaced_pod(name, cluster.namespace)
        raise AssertionError(f"pod {name}: {pod.status}\nlog: {cluster.pod_log(pod)!r}") from None


def gone(cluster: K8sCluster, name: str) -> bool:
    from kubernetes.client.rest import ApiException

    try:
        cluster.core().read_namespaced_pod(name, cluster.namespace)
    except ApiException as e:
        return e.status == 404
    return False


@pytest.fixture
def pods(k8s_cluster: K8sCluster):
    """Names of the Pods a test makes; they are deleted (grace 0) after it."""
    names: list[str] = []
    yield names
    core = k8s_cluster.core()
    for name in names:
        try:
            core.delete_namespaced_pod(name, k8s_cluster.namespace, grace_period_seconds=0)
        except Exception:  # noqa: BLE001 - already gone
            pass


def netns_of(ip: str) -> Path:
    return Path("/run/netns") / ("psk8s-" + ip.replace(".", "-"))


def test_three_nodes_are_ready_with_fresh_leases(k8s_cluster: K8sCluster) -> None:
    from kubernetes import client

    admin = k8s_cluster.client(admin=True)
    nodes = {n.metadata.name: n for n in client.CoreV1Api(admin).list_node().items}
    assert set(NODES) <= set(nodes), sorted(nodes)
    cidrs = set()
    for name in NODES:
        ready = [c for c in nodes[name].status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True", nodes[name].status.conditions
        assert int(nodes[name].status.allocatable["pods"]) > 0
        cidrs.add(nodes[name].spec.pod_cidr)
    assert len(cidrs) == len(NODES), cidrs

    def renewed() -> bool:  # renewed every 10 s: within 30 s of now, on each node
        leases = client.CoordinationV1Api(admin)
        t = dt.datetime.now(dt.timezone.utc)
        return all((t - leases.read_namespaced_lease(n, "kube-node-lease").spec.renew_time).total_seconds() < 30
                   for n in NODES)

    wait_for(renewed, DEADLINE, interval=1, what="every node's lease renewed within 30 s")


def test_a_pod_runs_its_command_and_succeeds(k8s_cluster: K8sCluster, pods: list[str]) -> None:
    name = unique("ok")
    pods.append(name)
    script = 'echo "args=$0 $1 data=$DATA ip=$POD_IP node=$NODE cwd=$(pwd) host=$(hostname)"; cat /etc/hosts'
    k8s_cluster.core().create_namespaced_pod(k8s_cluster.namespace, pod_body(
        name, ["sh", "-c", script, "$(GREETING)", "two"], hostname="w0", subdomain="grp", container={
            "workingDir": "/tmp",
            "env": [{"name": "GREETING", "value": "hello"}, {"name": "DATA", "value": "$(GREETING)/data"},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}))
    pod = wait_phase(k8s_cluster, name, ("Succeeded", "Failed"))
    assert pod.status.phase == "Succeeded", (pod.status, k8s_cluster.pod_log(pod))
    assert pod.spec.node_name in NODES
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (0, "Completed")
    ip = pod.status.pod_ip
    assert ip and ip.startswith("10.202.8.") and pod.status.host_ip
    out = k8s_cluster.pod_log(pod)
    assert f"args=hello two data=hello/data ip={ip} node={pod.spec.node_name} cwd=/tmp host=w0" in out, out
    assert f"{ip}\tw0.grp.{k8s_cluster.namespace}.svc.cluster.local w0" in out, out
    wait_for(lambda: not netns_of(ip).exists(), DEADLINE, interval=0.2, what="the Pod's network namespace removed")


def test_a_failing_pod_is_failed_with_its_exit_code(k8s_cluster: K8sCluster, pods: list[str]) -> None:
    name = unique("fail")
    pods.append(name)
    k8s_cluster.core().create_namespaced_pod(k8s_cluster.namespace, pod_body(name, ["sh", "-c", "echo bad; exit 7"]))
    pod = wait_phase(k8s_cluster, name, ("Succeeded", "Failed"))
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (7, "Error")
    assert "bad" in k8s_cluster.pod_log(pod)


def test_a_command_that_does_not_exist_fails_the_pod(k8s_cluster: K8sCluster, pods: list[str]) -> None:
    name = unique("nocmd")
    pods.append(name)
    k8s_cluster.core().create_namespaced_pod(k8s_cluster.namespace, pod_body(name, ["/no/such/program"]))
    pod = wait_phase(k8s_cluster, name, ("Succeeded", "Failed"))
    assert pod.status.phase == "Failed"
    assert pod.status.container_statuses[0].state.terminated.exit_code != 0


def test_deleting_a_running_pod_stops_its_whole_process_tree(k8s_cluster: K8sCluster, pods: list[str],
                                                               tmp_path: Path) -> None:
    """SIGTERM (ignored here), the grace period, then SIGKILL to everything in the Pod's network
    namespace: a child in a session of its own (setsid) included; then the Pod is removed."""
    name = unique("del")
    pods.append(name)
    pids = tmp_path / "pids"
    # ($$$$: Kubernetes turns $$ in args into $, as the node program does)
    script = f'setsid sleep 1000 & echo $! >{pids}; echo $$$$ >>{pids}; trap "" TERM; while :; do sleep 0.2; done'
    k8s_cluster.core().create_namespaced_pod(k8s_cluster.namespace, pod_body(
        name, ["sh", "-c", script], terminationGracePeriodSeconds=2))
    pod = wait_phase(k8s_cluster, name, ("Running",))
    wait_for(lambda: len(pids.read_text().split()) == 2 if pids.exists() else False, DEADLINE, what="the pids")
    child, shell = (int(p) for p in pids.read_text().split())
    assert pid_alive(child) and pid_alive(shell)
    ip = pod.status.pod_ip
    assert netns_of(ip).exists()
    t0 = time.monotonic()
    k8s_cluster.core().delete_namespaced_pod(name, k8s_cluster.namespace)  # the Pod's own grace: 2 s
    wait_for(lambda: gone(k8s_cluster, name), DEADLINE, interval=0.1, what="the Pod removed by its node")
    took = time.monotonic() - t0
    assert not pid_alive(shell), "the container's process outlived its Pod"
    assert not pid_alive(child), "a setsid child outlived its Pod"
    assert took >= 1.5, f"removed after {took:.1f} s: the SIGTERM-ignoring shell got no grace period"
    wait_for(lambda: not netns_of(ip).exists(), DEADLINE, interval=0.2, what="the Pod's network namespace removed")


def test_pods_on_different_nodes_reach_each_other_by_pod_ip(k8s_cluster: K8sCluster, pods: list[str]) -> None:
    """Each Pod has its own network namespace and address; the server binds a port that the
    client's node namespace does not have, and the client reaches it by the server's podIP (no
    cluster DNS here: a peer's name does not resolve, see docs/k8s.md)."""
    server, client_ = unique("srv"), unique("cli")
    pods.extend([server, client_])
    core = k8s_cluster.core()
    code = ("import socket\ns = socket.socket(); s.bind(('0.0.0.0', 7070)); s.listen()\n"
            "c, a = s.accept(); c.sendall(('from ' + a[0]).encode()); c.close()")
    core.create_namespaced_pod(k8s_cluster.namespace, pod_body(
        server, ["python3", "-c", code], nodeSelector={"kubernetes.io/hostname": "kn0"}))
    srv = wait_phase(k8s_cluster, server, ("Running", "Succeeded", "Failed"))
    assert srv.status.phase == "Running", srv.status
    client_code = ("import os, socket, time\nfor i in range(300):\n"
                   "    try:\n        c = socket.create_connection((os.environ['SERVER'], 7070), timeout=5); break\n"
                   "    except OSError:\n        time.sleep(0.2)\nprint(c.recv(100).decode())")
    core.create_namespaced_pod(k8s_cluster.namespace, pod_body(
        client_, ["python3", "-c", client_code], nodeSelector={"kubernetes.io/hostname": "kn1"},
        container={"env": [{"name": "SERVER", "value": srv.status.pod_ip}]}))
    cli = wait_phase(k8s_cluster, client_, ("Succeeded", "Failed"))
    assert cli.status.phase == "Succeeded", (cli.status, k8s_cluster.pod_log(cli))
    assert (srv.spec.node_name, cli.spec.node_name) == ("kn0", "kn1")
    assert srv.status.pod_ip != cli.status.pod_ip
    assert f"from {cli.status.pod_ip}" in k8s_cluster.pod_log(cli)
    assert wait_phase(k8s_cluster, server, ("Succeeded", "Failed")).status.phase == "Succeeded"
    # the port is the server Pod's own: nothing listens on 7070 here
    assert ":7070 " not in subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
