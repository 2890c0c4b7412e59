#!/usr/bin/env bash
# MXNet 1.9.1 (C++ ps-lite) in its own venv, .venv-mxnet: the real client the
# launcher must serve exactly as launch.py does (tests marked mxnet).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
if ! .venv-mxnet/bin/python -c 'import mxnet' 2>/dev/null; then
    log "creating .venv-mxnet with mxnet==1.9.1"
    python3 -m venv .venv-mxnet
    .venv-mxnet/bin/python -m pip install -q --disable-pip-version-check mxnet==1.9.1 "numpy<1.24" >&2
fi
echo "export PSLAUNCH_MXNET_PYTHON=$PWD/.venv-mxnet/bin/python"
