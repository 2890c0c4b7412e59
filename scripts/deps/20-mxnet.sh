#!/usr/bin/env bash
# MXNet 1.9.1 (C++ ps-lite) in its own venv, .venv-mxnet: the real client the
# launcher must serve exactly as launch.py does (tests marked mxnet).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
test_venv .venv-mxnet 'import mxnet' mxnet==1.9.1 "numpy<1.24"
echo "export PSLAUNCH_MXNET_PYTHON=$PWD/.venv-mxnet/bin/python"
