#!/usr/bin/env python3
"""k8s_node.py - one node of the Kubernetes test cluster: a stand-in for the kubelet (the
virtual-kubelet pattern; docs/k8s.md says what it stands in for and what stays untested).

    k8s_node.py --kubeconfig NODE.kubeconfig --name kn0 --pod-cidr 10.202.8.32/27 \
        --bridge psk8s --gateway 10.202.8.1 --log-dir DIR

It registers a Node (capacity, Ready, addresses, podCIDR) and renews its Lease in
``kube-node-lease``; watches the Pods bound to it (``spec.nodeName``); gives each Pod a network
namespace of its own with an address from the node's podCIDR on the testbed's bridge (the work of
a CNI bridge plugin), and a kubelet-style /etc/hosts; runs each container's ``command``/``args``
(``$(VAR)`` expanded) with its ``env`` (values and the common fieldRefs) and ``workingDir`` as a
process in that namespace; reports ``Pending`` (with ``podIP``) -> ``Running`` ->
``Succeeded``/``Failed`` with each container's exit code; and on a Pod's deletion sends SIGTERM,
waits the grace period, SIGKILLs whatever is left in the Pod's namespace (``setsid`` children
included: the namespace is the Pod's, as a container's pid namespace would be) and deletes the
Pod with grace 0. There are no images: the container's command runs on this machine's
filesystem, as root. Runs as root (it makes network namespaces).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

NS_PREFIX = "psk8s-"  # the Pods' network namespaces: psk8s-<address with dashes>
LEASE_SECONDS = 40
RENEW_EVERY = 10.0
STATUS_EVERY = 60.0
log = logging.getLogger("k8s-node")


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# --- pure parts (unit-tested) ---------------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values: a defined VAR is
    replaced, an undefined one is left as written, ``$$`` is a literal ``$``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def field_ref(path: str, pod: dict[str, Any]) -> str:
    """The value of a downward-API ``fieldRef`` (those a kubelet resolves for env)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"fieldRef {path!r} is not supported by the test node")


def container_env(container: dict[str, Any], pod: dict[str, Any], base: dict[str, str],
                  secret: Optional[Callable[[str], dict[str, str]]] = None) -> dict[str, str]:
    """The process environment of a container: BASE (what an image would give), then the
    container's ``env`` in order, each value ``$(VAR)``-expanded against what came before
    (a ``secretKeyRef``'s value is not expanded, as a kubelet does not: ``secret(name)`` gives
    the Secret's decoded data)."""
    env = dict(base)
    for item in container.get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if "value" in item:
            env[item["name"]] = expand(item.get("value") or "", env)
        elif (item.get("valueFrom") or {}).get("fieldRef"):
            env[item["name"]] = field_ref(item["valueFrom"]["fieldRef"]["fieldPath"], pod)
        elif ref and secret is not None:
            data = secret(ref["name"])
            if ref["key"] not in data:
                raise ValueError(f"env {item['name']}: Secret {ref['name']} has no key {ref['key']}")
            env[item["name"]] = data[ref["key"]]
        elif item.get("valueFrom"):
            raise ValueError(f"env {item['name']}: only value, fieldRef and secretKeyRef are supported here")
        else:
            env[item["name"]] = ""
    return env


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args, expanded; a container without a command has nothing to run here (no images)."""
    command = container.get("command") or []
    if not command:
        raise ValueError(f"container {container.get('name')}: no command (the test node runs no images)")
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]


def hosts_file(pod: dict[str, Any], ip: str) -> str:
    """/etc/hosts as a kubelet writes it for a Pod: itself under its hostname and, with a
    subdomain, its FQDN ``<hostname>.<subdomain>.<namespace>.svc.cluster.local``."""
    meta, spec = pod["metadata"], pod["spec"]
    host = spec.get("hostname") or meta["name"]
    names = [host]
    if spec.get("subdomain"):
        names.insert(0, f"{host}.{spec['subdomain']}.{meta['namespace']}.svc.cluster.local")
    head = "# Kubernetes-managed hosts file (pslaunch's test node).\n127.0.0.1\tlocalhost\n"
    return head + f"{ip}\t{' '.join(names)}\n"


def netns_name(ip: str) -> str:
    return NS_PREFIX + ip.replace(".", "-")


def veth_name(ip: str) -> str:
    """The host end of the Pod's veth (15 characters at most)."""
    return "psk8s" + "".join(f"{int(p):02x}" for p in ip.split(".")[2:])


class Addresses:
    """The node's podCIDR, handed out one address per Pod (the bridge's gateway and the network's
    own addresses excluded)."""

    def __init__(self, cidr: str, reserved: set[str]) -> None:
        self.free = [str(a) for a in ipaddress.ip_network(cidr).hosts() if str(a) not in reserved]
        self.lock = threading.Lock()

    def take(self) -> str:
        with self.lock:
            if not self.free:
                raise RuntimeError("no free Pod address left on this node")
            return self.free.pop(0)

    def give(self, ip: str) -> None:
        with self.lock:
            self.free.append(ip)


# --- the system side ------------------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def netns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split()]


def make_netns(ip: str, prefix: int, bridge: str, gateway: str, hosts: str) -> str:
    """The Pod's network: its own namespace, lo, eth0 on the bridge with IP, a default route via
    the gateway, and /etc/netns/<ns>/hosts (ip netns exec mounts it over /etc/hosts)."""
    ns, veth = netns_name(ip), veth_name(ip)
    remove_netns(ip)
    Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
    Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
    sh("ip", "link", "set", veth + "p", "netns", ns)
    sh("ip", "-n", ns, "link", "set", veth + "p", "name", "eth0")
    sh("ip", "-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "link", "set", veth, "master", bridge, "up")
    sh("ip", "-n", ns, "route", "add", "default", "via", gateway)
    return ns


def kill_netns(ns: str, sig: int = signal.SIGKILL) -> None:
    for pid in netns_pids(ns):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def remove_netns(ip: str) -> None:
    ns = netns_name(ip)
    if Path(f"/run/netns/{ns}").exists():
        for _ in range(100):
            kill_netns(ns)
            if not netns_pids(ns):
                break
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", veth_name(ip)], capture_output=True, timeout=30)
    hosts = Path(f"/etc/netns/{ns}")
    if hosts.exists():
        for f in hosts.iterdir():
            f.unlink()
        hosts.rmdir()


@dataclass
class PodRun:
    """One Pod on this node: its address, its processes, and how they ended."""

    uid: str
    namespace: str
    name: str
    ip: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    started: dict[str, str] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    stopping: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Node:
    """The node: registration, lease, the Pod watch, and one thread per Pod."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kubernetes import client, config

        self.args = args
        self.api = config.new_client_from_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.net = ipaddress.ip_network(args.pod_cidr)
        self.addresses = Addresses(args.pod_cidr, {args.gateway})
        self.pods: dict[str, PodRun] = {}
        self.lock = threading.Lock()
        self.quit = threading.Event()
        self.log_dir = Path(args.log_dir)

    # registration and heartbeats

    def node_body(self) -> dict[str, Any]:
        cap = {"cpu": str(self.args.cpus), "memory": self.args.memory, "pods": str(len(self.addresses.free))}
        t = now().isoformat()
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.args.name, "labels": {
                "kubernetes.io/hostname": self.args.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "pslaunch.io/test-node": "true"}},
            "spec": {"podCIDR": self.args.pod_cidr, "podCIDRs": [self.args.pod_cidr]},
            "status": {
                "capacity": cap,
                "allocatable": cap,
                "addresses": [{"type": "InternalIP", "address": self.args.gateway},
                              {"type": "Hostname", "address": self.args.name}],
                "conditions": [self.ready_condition(t)],
                "nodeInfo": {"kubeletVersion": "v1.20.2-pslaunch-test-node", "kubeProxyVersion": "",
                             "operatingSystem": "linux", "architecture": "amd64", "containerRuntimeVersion":
                             "pslaunch-test-node://0", "osImage": "", "kernelVersion": os.uname().release,
                             "machineID": "", "systemUUID": "", "bootID": ""},
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            },
        }

    @staticmethod
    def ready_condition(t: str) -> dict[str, str]:
        return {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "pslaunch test node is ready",
                "lastHeartbeatTime": t, "lastTransitionTime": t}

    def register(self) -> None:
        """Create the Node, or take over one of the same name (its status replaced: Ready now)."""
        from kubernetes.client.rest import ApiException

        body = self.node_body()
        try:
            self.core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(self.args.name, {"metadata": {"labels": body["metadata"]["labels"]}})
        self.core.patch_node_status(self.args.name, {"status": body["status"]})
        self.node_uid = self.core.read_node(self.args.name).metadata.uid

    def heartbeat(self) -> None:
        """Renew the Lease every RENEW_EVERY s (the node-lifecycle controller's health signal) and
        the Ready condition every STATUS_EVERY s."""
        from kubernetes.client.rest import ApiException

        last_status = time.monotonic()
        while not self.quit.is_set():
            try:
                self.renew_lease()
                if time.monotonic() - last_status > STATUS_EVERY:
                    t = now().isoformat()
                    self.core.patch_node_status(self.args.name, {"status": {"conditions": [self.ready_condition(t)]}})
                    last_status = time.monotonic()
            except (ApiException, OSError) as e:  # the apiserver restarting: try again
                log.warning("heartbeat: %s", e)
            self.quit.wait(RENEW_EVERY)

    def renew_lease(self) -> None:
        from kubernetes.client.rest import ApiException

        spec = {"holderIdentity": self.args.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        try:
            self.coord.patch_namespaced_lease(self.args.name, "kube-node-lease", {"spec": spec})
        except ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", {
                "metadata": {"name": self.args.name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.args.name, "uid": self.node_uid}]},
                "spec": spec})

    # the Pods

    def watch(self) -> None:
        """List, then watch, the Pods bound to this node; each event reconciles that Pod."""
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        selector = f"spec.nodeName={self.args.name}"
        while not self.quit.is_set():
            try:
                listed = self.api.sanitize_for_serialization(
                    self.core.list_pod_for_all_namespaces(field_selector=selector))
                for pod in listed["items"]:
                    self.reconcile(pod)
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                   resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=300):
                    if self.quit.is_set():
                        w.stop()
                        break
                    pod = self.api.sanitize_for_serialization(ev["object"])
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self.reconcile(pod)
                    elif ev["type"] == "DELETED":
                        self.forget(pod["metadata"]["uid"], kill=True)
            except (ApiException, OSError, ValueError) as e:  # 410 Gone, a restarting apiserver: list again
                log.warning("watch: %s", e)
                self.quit.wait(1.0)

    def reconcile(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self.lock:
            run = self.pods.get(uid)
            if run is None:
                if meta.get("deletionTimestamp"):  # nothing of it runs here: the final delete
                    threading.Thread(target=self.delete_now, args=(meta["namespace"], meta["name"], uid),
                                     daemon=True).start()
                    return
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                run = self.pods[uid] = PodRun(uid, meta["namespace"], meta["name"])
                if pod.get("status", {}).get("phase") == "Running":  # lost with an earlier node program
                    threading.Thread(target=self.lost, args=(run, pod), daemon=True).start()
                else:
                    threading.Thread(target=self.run_pod, args=(run, pod), daemon=True).start()
                return
        if meta.get("deletionTimestamp") and not run.stopping:
            run.stopping = True
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            threading.Thread(target=self.stop_pod, args=(run, float(grace)), daemon=True).start()

    def run_pod(self, run: PodRun, pod: dict[str, Any]) -> None:
        """Network, then every container at once; the Pod's phase follows them."""
        try:
            run.ip = self.addresses.take()
            pod.setdefault("status", {})["podIP"] = run.ip
            pod["status"]["hostIP"] = self.args.gateway
            ns = make_netns(run.ip, self.net.prefixlen if self.args.prefix is None else self.args.prefix,
                            self.args.bridge, self.args.gateway, hosts_file(pod, run.ip))
            start_time = now().isoformat()
            self.patch_status(run, {"podIP": run.ip, "podIPs": [{"ip": run.ip}], "hostIP": self.args.gateway,
                                    "startTime": start_time})
            base = {"PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
                    "HOME": "/root", "HOSTNAME": pod["spec"].get("hostname") or run.name}
            plans = []
            for c in pod["spec"]["containers"]:
                env = container_env(c, pod, base, secret=lambda name: self.read_secret(run.namespace, name))
                plans.append((c, container_argv(c, env), env))
        except Exception as e:  # noqa: BLE001 - any reason is the Pod's failure, reported on it
            log.warning("pod %s/%s cannot start: %s", run.namespace, run.name, e)
            self.finish(run, pod, reason="StartError", message=str(e)[:500])
            return
        # the Pod's own hostname (a UTS namespace) as a kubelet gives it; then the command itself
        # (exec: the pid is the container's process)
        logs = self.log_dir / f"{run.namespace}_{run.name}_{run.uid}"
        logs.mkdir(parents=True, exist_ok=True)
        for c, argv, env in plans:
            if run.stopping:  # deleted while its network was made: start nothing more
                break
            out = open(logs / f"{c['name']}.log", "ab")  # noqa: SIM115 - the child holds it
            try:
                # its own session: SIGTERM goes to the container's process group, as to its pid 1
                run.procs[c["name"]] = subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                     env["HOSTNAME"], *argv], env=env, cwd=c.get("workingDir") or "/",
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                run.started[c["name"]] = now().isoformat()
            except OSError as e:
                out.write(f"test node: cannot start {argv[0]}: {e}\n".encode())
                run.codes[c["name"]] = 128
                run.finished[c["name"]] = now().isoformat()
            finally:
                out.close()
        if run.procs and not run.stopping:
            self.patch_status(run, {"phase": "Running", "conditions": self.conditions(True),
                                    "containerStatuses": self.container_statuses(run, pod)})
        for name, p in run.procs.items():
            run.codes[name] = p.wait()
            run.finished[name] = now().isoformat()
        kill_netns(ns)  # what is left of the Pod's processes dies with it (a pid namespace's end)
        self.finish(run, pod)

    def read_secret(self, namespace: str, name: str) -> dict[str, str]:
        """A Secret's data, decoded, as a kubelet reads it for ``secretKeyRef`` (the Node
        authorizer lets a node read the Secrets its Pods name, and no others)."""
        secret = self.core.read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    def lost(self, run: PodRun, pod: dict[str, Any]) -> None:
        for c in pod["spec"]["containers"]:
            run.codes[c["name"]] = 137
        self.finish(run, pod, reason="NodeRestarted", message="the test node program restarted; its processes are gone")

    def conditions(self, ready: bool) -> list[dict[str, str]]:
        t = now().isoformat()
        s = "True" if ready else "False"
        return [{"type": k, "status": v, "lastTransitionTime": t} for k, v in
                (("Initialized", "True"), ("Ready", s), ("ContainersReady", s), ("PodScheduled", "True"))]

    def container_statuses(self, run: PodRun, pod: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for c in pod["spec"]["containers"]:
            name = c["name"]
            if name in run.codes:
                code = run.codes[name]
                state = {"terminated": {"exitCode": code if code >= 0 else 128 - code,
                                        "signal": -code if code < 0 else None,
                                        "reason": "Completed" if code == 0 else "Error",
                                        "startedAt": run.started.get(name), "finishedAt": run.finished.get(name)}}
                if code < 0:
                    state["terminated"]["exitCode"] = 128 - code
                else:
                    del state["terminated"]["signal"]
            elif name in run.started:
                state = {"running": {"startedAt": run.started[name]}}
            else:
                state = {"waiting": {"reason": "ContainerCreating"}}
            out.append({"name": name, "image": c.get("image", ""), "imageID": "", "ready": "running" in state,
                        "restartCount": 0, "started": "running" in state, "state": state})
        return out

    def finish(self, run: PodRun, pod: dict[str, Any], reason: str = "", message: str = "") -> None:
        """The terminal phase (Succeeded if every container exited 0), the network removed, and,
        for a Pod being deleted, the final delete."""
        status: dict[str, Any] = {
            "phase": "Succeeded" if run.codes and all(c == 0 for c in run.codes.values()) and not reason else "Failed",
            "conditions": self.conditions(False), "containerStatuses": self.container_statuses(run, pod)}
        if reason:
            status["reason"], status["message"] = reason, message
        if not run.stopping:
            self.patch_status(run, status)
        if run.ip:
            remove_netns(run.ip)
            self.addresses.give(run.ip)
            run.ip = ""
        run.done.set()
        if run.stopping:
            self.delete_now(run.namespace, run.name, run.uid)

    def stop_pod(self, run: PodRun, grace: float) -> None:
        """SIGTERM to each container's process group, up to GRACE s for them to end, then SIGKILL
        to everything in the Pod's namespace; run_pod's end then deletes the Pod (grace 0)."""
        for p in list(run.procs.values()):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not run.done.wait(max(grace, 0.0)) and run.ip:
            kill_netns(netns_name(run.ip))
        if not run.procs and not run.done.wait(30):  # never started: nothing to wait for
            self.delete_now(run.namespace, run.name, run.uid)

    def delete_now(self, namespace: str, name: str, uid: str) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0,
                                            body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                        preconditions={"uid": uid}))
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("delete %s/%s: %s", namespace, name, e)

    def forget(self, uid: str, kill: bool) -> None:
        with self.lock:
            run = self.pods.pop(uid, None)
        if run and kill and not run.done.is_set():
            run.stopping = True
            if run.ip:
                kill_netns(netns_name(run.ip))

    def patch_status(self, run: PodRun, status: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        for attempt in range(5):
            try:
                self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
                return
            except ApiException as e:
                if e.status == 404:
                    return
                log.warning("status of %s/%s: %s", run.namespace, run.name, e)
            except OSError as e:
                log.warning("status of %s/%s: %s", run.namespace, run.name, e)
            time.sleep(0.5 * (attempt + 1))

    def cleanup_stale(self) -> None:
        """Namespaces of this node's addresses left by an earlier run (killed, not stopped)."""
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n"):
            ns = ns.split(" ")[0]
            if ns.startswith(NS_PREFIX):
                ip = ns[len(NS_PREFIX):].replace("-", ".")
                try:
                    if ipaddress.ip_address(ip) in self.net:
                        remove_netns(ip)
                except ValueError:
                    pass

    def shutdown(self) -> None:
        """The node program stops: its Pods' processes and networks go with it (the testbed
        stops), the Pods themselves are left to the API (they turn Failed on the next start)."""
        self.quit.set()
        with self.lock:
            runs = list(self.pods.values())
        for run in runs:
            run.stopping = True
            if run.ip:
                kill_netns(netns_name(run.ip))
        for run in runs:
            run.done.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--pod-cidr", required=True, help="this node's Pod addresses (part of the bridge's)")
    ap.add_argument("--prefix", type=int, default=None, help="the Pods' prefix on the bridge")
    ap.add_argument("--bridge", required=True)
    ap.add_argument("--gateway", required=True, help="the bridge's address: the Pods' route")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--cpus", type=int, default=8)
    ap.add_argument("--memory", default="8Gi")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    node = Node(args)
    signal.signal(signal.SIGTERM, lambda *_: node.quit.set())
    node.cleanup_stale()
    node.register()
    threading.Thread(target=node.heartbeat, daemon=True).start()
    threading.Thread(target=node.watch, daemon=True).start()
    log.info("node %s registered (pods %s on %s)", args.name, args.pod_cidr, args.bridge)
    node.quit.wait()
    node.shutdown()
    log.info("node %s stopped", args.name)


if __name__ == "__main__":
    main()
