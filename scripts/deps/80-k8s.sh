#!/usr/bin/env bash
# Kubernetes for the k8s tests: the kubernetes client (the [k8s] extra; 35.x: 37 pulls aiohttp and
# pydantic for its asyncio client) in the project's venv, and the loopback control plane
# (scripts/setup-k8s.sh: Debian's Go 1.19 and etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler built from Debian's kubernetes source package once per machine, 5.5 min measured on
# 2 quiet cores (15 on busy ones), then cached in /var/cache/pslaunch/k8s; it starts the cluster and its 3 nodes,
# scripts/k8s_node.py run by this venv's Python: about 12 s, 1 s when it runs already). stdout: PSLAUNCH_K8S_KUBECONFIG, PSLAUNCH_K8S_ADMIN_KUBECONFIG and
# PSLAUNCH_K8S_NAMESPACE for the tests.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
PY=${PSLAUNCH_PYTHON:-$PWD/.venv/bin/python}
if ! "$PY" -c 'import kubernetes' 2>/dev/null; then
    log "installing kubernetes==35.0.0 (the [k8s] extra) into $PY"
    "$PY" -m pip install -q --disable-pip-version-check kubernetes==35.0.0 >&2
fi
scripts/setup-k8s.sh start
