"""The loopback Kubernetes control plane from the tests' side (scripts/setup-k8s.sh builds and starts it).

It is etcd, kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2, built from Debian's
``kubernetes`` source package, on 127.0.0.1 with TLS and RBAC, and 3 nodes (scripts/k8s_node.py).
The :func:`k8s_cluster` session fixture starts it (idempotent: about a second when it runs
already) and hands out two identities:
pslaunch's service account (only a launcher's rights, in one namespace) and an admin
(``system:masters``) for the tests' own checks and clean-up.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.helpers import REPO

SETUP = REPO / "scripts" / "setup-k8s.sh"


@dataclass(frozen=True)
class K8sCluster:
    """Where the test cluster is and who the tests may be on it."""

    kubeconfig: Path  # pslaunch's service account
    admin_kubeconfig: Path  # system:masters
    namespace: str

    def client(self, admin: bool = False) -> Any:
        """A ``kubernetes.client.ApiClient`` as pslaunch's service account (or as the admin)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.admin_kubeconfig if admin else self.kubeconfig))

    def core(self, admin: bool = False) -> Any:
        """``CoreV1Api`` as pslaunch's service account (or as the admin)."""
        from kubernetes import client

        return client.CoreV1Api(self.client(admin))

    def pod_log(self, pod: Any, container: str = "main") -> str:
        """What a container wrote (the node program's log file: the API's log endpoint needs a
        real kubelet)."""
        meta = pod.metadata
        path = self.admin_kubeconfig.parent / "pods" / f"{meta.namespace}_{meta.name}_{meta.uid}" / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def setup_k8s(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``scripts/setup-k8s.sh ARGS`` (stdout: its export lines; stderr: its progress)."""
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, timeout=timeout)


@functools.cache
def k8s_problem() -> str | None:
    """Why the test cluster cannot run here (one line), or None. Building it is not a test's job:
    10 to 15 minutes once per machine (scripts/deps/80-k8s.sh does it in CI)."""
    if importlib.util.find_spec("kubernetes") is None:
        return "the kubernetes client is not installed (pip install -e '.[k8s]', or scripts/deps/80-k8s.sh)"
    if os.geteuid() != 0:
        return "scripts/setup-k8s.sh runs as root"
    if setup_k8s("built", timeout=30).returncode != 0:
        return "the control plane is not built (scripts/setup-k8s.sh build: 10 to 15 min, once per machine)"
    return None


def parse_exports(text: str) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of setup-k8s.sh's stdout, as a dict."""
    return dict(line.removeprefix("export ").split("=", 1) for line in text.splitlines() if line.startswith("export "))


@pytest.fixture(scope="session")
def k8s_cluster() -> K8sCluster:
    """The running test cluster (started here if it is not running; left running for the next session)."""
    problem = k8s_problem()
    if problem:
        pytest.skip(f"no Kubernetes test cluster: {problem}")
    r = setup_k8s("start")
    assert r.returncode == 0, f"scripts/setup-k8s.sh start failed:\n{r.stderr[-3000:]}"
    env = parse_exports(r.stdout)
    return K8sCluster(
        kubeconfig=Path(env["PSLAUNCH_K8S_KUBECONFIG"]),
        admin_kubeconfig=Path(env["PSLAUNCH_K8S_ADMIN_KUBECONFIG"]),
        namespace=env["PSLAUNCH_K8S_NAMESPACE"],
    )
