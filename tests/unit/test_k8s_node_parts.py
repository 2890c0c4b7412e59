"""The pure parts of the Kubernetes test cluster's node program (scripts/k8s_node.py): what a
kubelet does to a Pod's command, env and /etc/hosts before it runs anything."""

from __future__ import annotations

import pytest
from support.helpers import load_script

node = load_script("k8s_node")

POD = {
    "metadata": {"name": "job-worker-1", "namespace": "ns1", "uid": "u-1",
                 "labels": {"pslaunch.io/rank": "1"}, "annotations": {}},
    "spec": {"nodeName": "kn1", "hostname": "worker-1", "subdomain": "job", "serviceAccountName": "default"},
    "status": {"podIP": "10.202.8.65", "hostIP": "10.202.8.1"},
}


def test_expand_replaces_defined_variables_and_keeps_the_rest() -> None:
    env = {"A": "1", "B_C": "x y"}
    assert node.expand("$(A)-$(B_C)", env) == "1-x y"
    assert node.expand("$(MISSING) $A", env) == "$(MISSING) $A"  # undefined: as written; $A is the shell's
    assert node.expand("$$(A) $$", env) == "$(A) $"  # $$ escapes


def test_container_env_in_order_with_field_refs() -> None:
    c = {"name": "main", "env": [
        {"name": "ROOT", "value": "/w"},
        {"name": "DATA", "value": "$(ROOT)/data"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['pslaunch.io/rank']"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "EMPTY"},
    ]}
    env = node.container_env(c, POD, {"PATH": "/bin", "ROOT": "base"})
    assert env == {"PATH": "/bin", "ROOT": "/w", "DATA": "/w/data", "POD_IP": "10.202.8.65", "RANK": "1",
                   "NODE": "kn1", "EMPTY": ""}


def test_container_env_refuses_what_the_test_node_cannot_give() -> None:
    with pytest.raises(ValueError, match="only value, fieldRef and secretKeyRef"):
        node.container_env({"env": [{"name": "S", "valueFrom": {"configMapKeyRef": {"name": "s", "key": "k"}}}]},
                           POD, {})
    with pytest.raises(ValueError, match="not supported"):
        node.field_ref("status.podIPs", POD)


def test_container_env_reads_secret_key_refs_unexpanded() -> None:
    asked = []

    def secret(name: str) -> dict[str, str]:
        asked.append(name)
        return {"k": "$(A) $$ as written"}

    c = {"env": [{"name": "A", "value": "1"},
                 {"name": "S", "valueFrom": {"secretKeyRef": {"name": "job-task", "key": "k"}}}]}
    assert node.container_env(c, POD, {}, secret=secret) == {"A": "1", "S": "$(A) $$ as written"}
    assert asked == ["job-task"]
    with pytest.raises(ValueError, match="Secret job-task has no key other"):
        ref = {"secretKeyRef": {"name": "job-task", "key": "other"}}
        node.container_env({"env": [{"name": "S", "valueFrom": ref}]}, POD, {}, secret=secret)


def test_container_argv_is_command_then_args_expanded() -> None:
    c = {"name": "main", "command": ["python3", "-c"], "args": ["print('$(X)')", "$(Y)"]}
    assert node.container_argv(c, {"X": "hi"}) == ["python3", "-c", "print('hi')", "$(Y)"]
    with pytest.raises(ValueError, match="no command"):
        node.container_argv({"name": "main", "args": ["a"]}, {})


def test_hosts_file_names_the_pod_like_a_kubelet() -> None:
    assert node.hosts_file(POD, "10.202.8.65").splitlines()[1:] == [
        "127.0.0.1\tlocalhost", "10.202.8.65\tworker-1.job.ns1.svc.cluster.local worker-1"]
    bare = {"metadata": {"name": "p", "namespace": "ns1"}, "spec": {}}
    assert node.hosts_file(bare, "10.202.8.66").splitlines()[-1] == "10.202.8.66\tp"


def test_addresses_come_from_the_node_cidr_and_come_back() -> None:
    a = node.Addresses("10.202.8.32/27", {"10.202.8.1"})
    got = [a.take() for _ in range(30)]
    assert got[0] == "10.202.8.33" and got[-1] == "10.202.8.62" and len(set(got)) == 30
    with pytest.raises(RuntimeError, match="no free Pod address"):
        a.take()
    a.give("10.202.8.40")
    assert a.take() == "10.202.8.40"


def test_interface_and_namespace_names_fit_the_kernel() -> None:
    for ip in ("10.202.8.33", "10.202.8.254"):
        assert len(node.veth_name(ip) + "p") <= 15  # the peer's temporary name too
    assert node.veth_name("10.202.8.33") != node.veth_name("10.202.8.34")
    assert node.netns_name("10.202.8.33") == "psk8s-10-202-8-33"
