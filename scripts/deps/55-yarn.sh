#!/usr/bin/env bash
# YARN for the yarn tests: skein (the [yarn] extra) in the project's venv, and the one-node YARN
# testbed (scripts/setup-yarn.sh: JDK 17 from Debian, Hadoop's client jars from the pyspark
# package on PyPI, downloaded once into /var/cache/pslaunch; it builds and starts the testbed:
# about 30 s from nothing, 3 s when built, 1 s when it runs already). stdout: JAVA_HOME,
# HADOOP_HOME, HADOOP_CONF_DIR and PATH for the tests (skein runs $HADOOP_HOME/bin/yarn).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
PY=${PSLAUNCH_PYTHON:-$PWD/.venv/bin/python}
if ! "$PY" -c 'import skein' 2>/dev/null; then
    log "installing skein==0.8.2 (the [yarn] extra) into $PY"
    "$PY" -m pip install -q --disable-pip-version-check skein==0.8.2 >&2
fi
PSLAUNCH_PYTHON=$PY scripts/setup-yarn.sh start
