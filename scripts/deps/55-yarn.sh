#!/usr/bin/env bash
# skein (the [yarn] extra) in the project's venv: the yarn tests check our specs with
# skein's own ApplicationSpec. No Hadoop: none can be installed here (docs/yarn.md).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
PY=${PSLAUNCH_PYTHON:-.venv/bin/python}
if ! "$PY" -c 'import skein' 2>/dev/null; then
    log "installing skein==0.8.2 (the [yarn] extra) into $PY"
    "$PY" -m pip install -q --disable-pip-version-check skein==0.8.2 >&2
fi
