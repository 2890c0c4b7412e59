"""The Kubernetes test cluster itself (scripts/setup-k8s.sh; CI builds and starts it): a real
kube-apiserver with TLS and RBAC on loopback, and pslaunch's service account holding a launcher's
rights and nothing more. The ``--launcher k8s`` tests stand on what these check.
"""

from __future__ import annotations

import re
import subprocess
import uuid

import pytest
import urllib3
from support.helpers import pid_alive
from support.k8s_testbed import K8sCluster, setup_k8s

pytestmark = [pytest.mark.integration, pytest.mark.k8s]

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def pod_body(name: str) -> dict:
    """A Pod as the launcher makes them, for a node that does not exist: it stays Pending."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"pslaunch.io/job": name, "pslaunch.io/role": "worker"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
            "containers": [{"name": "main", "image": "localhost/pslaunch:none", "command": ["true"]}],
        },
    }


def forbidden(call, *args, **kwargs) -> int:
    """The HTTP status of a call that RBAC (or authentication) must refuse."""
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as e:
        call(*args, **kwargs)
    return e.value.status


def component_pids(cluster: K8sCluster) -> dict[str, int]:
    run = cluster.admin_kubeconfig.parent / "run"
    return {name: int((run / f"{name}.pid").read_text()) for name in COMPONENTS}


def test_the_launcher_account_creates_pods_services_and_configmaps_in_its_namespace(k8s_cluster: K8sCluster) -> None:
    core = k8s_cluster.core()
    ns, name = k8s_cluster.namespace, f"rbac-{uuid.uuid4().hex[:8]}"
    created = core.create_namespaced_pod(ns, pod_body(name))
    try:
        assert created.metadata.uid
        assert core.read_namespaced_pod(name, ns).status.phase == "Pending"  # no node for it
        listed = core.list_namespaced_pod(ns, label_selector=f"pslaunch.io/job={name}")
        assert [p.metadata.name for p in listed.items] == [name]
        core.create_namespaced_service(ns, {"metadata": {"name": name}, "spec": {
            "clusterIP": "None", "selector": {"pslaunch.io/job": name}, "ports": [{"port": 9000}]}})
        core.create_namespaced_config_map(ns, {"metadata": {"name": name}, "data": {"k": "v"}})
        core.list_namespaced_event(ns)
        core.list_node()  # the launcher reads the Nodes (cluster-wide, read only)
    finally:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        for delete in (core.delete_namespaced_service, core.delete_namespaced_config_map):
            try:
                delete(name, ns)
            except Exception:  # noqa: BLE001 - it may not have been created
                pass


def test_the_launcher_account_reads_no_secrets_and_stays_in_its_namespace(k8s_cluster: K8sCluster) -> None:
    core = k8s_cluster.core()
    assert forbidden(core.list_namespaced_secret, "kube-system") == 403
    assert forbidden(core.list_namespaced_secret, k8s_cluster.namespace) == 403
    # it creates and deletes its jobs' Secrets, but reads none, not even its own token's
    admin = k8s_cluster.core(admin=True)
    token = admin.read_namespaced_service_account("pslaunch", k8s_cluster.namespace).secrets[0].name
    assert forbidden(core.read_namespaced_secret, token, k8s_cluster.namespace) == 403
    assert forbidden(core.list_namespaced_pod, "kube-system") == 403
    assert forbidden(core.create_namespaced_pod, "default", pod_body(f"out-{uuid.uuid4().hex[:8]}")) == 403
    assert forbidden(core.delete_node, "any-node") == 403
    # an admin reads them: the refusals above are RBAC's, not a broken apiserver
    assert k8s_cluster.core(admin=True).list_namespaced_secret("kube-system") is not None


def test_a_client_without_credentials_is_refused(k8s_cluster: K8sCluster) -> None:
    from kubernetes import client

    authed = k8s_cluster.client().configuration
    conf = client.Configuration()
    conf.host, conf.ssl_ca_cert = authed.host, authed.ssl_ca_cert  # TLS checked against the testbed's CA
    assert forbidden(client.CoreV1Api(client.ApiClient(conf)).list_namespaced_pod, k8s_cluster.namespace) in (401, 403)


def test_a_yaml_response_leaves_the_apiserver_up(k8s_cluster: K8sCluster) -> None:
    """kube-apiserver 1.20.2 built with Go >= 1.18 and its vendored reflect2 1.0.1 dies (SIGSEGV) when
    it encodes a map as YAML or pretty JSON; setup-k8s.sh builds it with Debian's reflect2 1.0.2."""
    admin = k8s_cluster.client(admin=True)
    ns, name = k8s_cluster.namespace, f"yaml-{uuid.uuid4().hex[:8]}"
    core = k8s_cluster.core(admin=True)
    core.create_namespaced_pod(ns, pod_body(name))  # labels: a map for the encoder
    pid = component_pids(k8s_cluster)["kube-apiserver"]
    try:
        url = f"{admin.configuration.host}/api/v1/namespaces/{ns}/pods/{name}"
        for accept in ("application/yaml", "application/json;pretty=true"):
            try:
                r = admin.rest_client.pool_manager.request("GET", url, headers={"Accept": accept}, timeout=20,
                                                           retries=False)
            except urllib3.exceptions.HTTPError as e:
                raise AssertionError(f"GET with Accept: {accept}: {e} (kube-apiserver running: "
                                     f"{pid_alive(pid)}; a SIGSEGV in reflect2 in its log?)") from e
            assert r.status == 200, (accept, r.status, r.data[:300])
            assert b"pslaunch.io/role" in r.data
        assert pid_alive(pid), "kube-apiserver died answering a YAML GET"
        assert core.read_namespaced_pod(name, ns).metadata.name == name
    finally:
        if pid_alive(pid):
            core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_the_cluster_listens_on_loopback_only(k8s_cluster: K8sCluster) -> None:
    pids = component_pids(k8s_cluster)
    ss = subprocess.run(["ss", "-Hltnup"], capture_output=True, text=True, check=True).stdout
    seen: dict[str, list[str]] = {name: [] for name in COMPONENTS}
    for line in ss.splitlines():
        for name, pid in pids.items():
            if re.search(rf"pid={pid},", line):
                seen[name].append(line.split()[4])
    assert all(seen.values()), f"a component listens nowhere (not running?): {seen}"
    assert all(a.startswith("127.0.0.1:") for addrs in seen.values() for a in addrs), seen


def test_start_again_keeps_the_running_cluster(k8s_cluster: K8sCluster) -> None:
    before = component_pids(k8s_cluster)
    r = setup_k8s("start")
    assert r.returncode == 0, r.stderr[-2000:]
    assert component_pids(k8s_cluster) == before
    status = setup_k8s("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.count("healthy") == len(COMPONENTS), status.stdout
