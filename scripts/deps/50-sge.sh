#!/usr/bin/env bash
# Grid Engine for the sge tests: a one-node cluster (scripts/setup-sge.sh installs,
# configures and starts it, ~20 s from nothing, ~5 s when it runs already) and the
# drmaa package in the project's venv. stdout: the exports libdrmaa needs
# (SGE_ROOT, SGE_CELL, DRMAA_LIBRARY_PATH, GLIBC_TUNABLES).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
PY=${PSLAUNCH_PYTHON:-.venv/bin/python}
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("drmaa") is None)' 2>/dev/null; then
    log "installing drmaa==0.7.9 (the [sge] extra) into $PY"
    "$PY" -m pip install -q --disable-pip-version-check drmaa==0.7.9 >&2
fi
require_users sgeadmin=gridengine-common
scripts/setup-sge.sh start
require_users sgeadmin=gridengine-common
