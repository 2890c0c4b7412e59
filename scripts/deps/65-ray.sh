#!/usr/bin/env bash
# Ray for the ray tests: ray==2.60.0 (the [ray] extra, 79 MB wheel) in the project's venv, after
# torch (scripts/setup.sh installed it first; ray pulls no torch, and the check below says so if a
# later release did). The cluster itself (scripts/setup-ray.sh: a head and two workers in network
# namespaces, ~20 s, ~1 GiB) is started by the tests' ray_cluster fixture only when a ray test
# runs, and stopped after the session. stdout: PSLAUNCH_RAY_TESTBED.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
PY=${PSLAUNCH_PYTHON:-$PWD/.venv/bin/python}
torch_before=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
if ! "$PY" -c 'import ray, sys; sys.exit(ray.__version__ != "2.60.0")' 2>/dev/null; then
    log "installing ray==2.60.0 (the [ray] extra) into $PY"
    "$PY" -m pip install -q --disable-pip-version-check ray==2.60.0 >&2
fi
torch_after=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
[ "$torch_before" = "$torch_after" ] || die "installing ray changed torch ($torch_before -> $torch_after)"
scripts/setup-ray.sh env
