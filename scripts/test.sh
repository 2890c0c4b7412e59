#!/usr/bin/env bash
# Runs the whole test suite, after installing everything it needs: the project
# (scripts/setup.sh), system packages and services for the backend tests
# (scripts/install-test-deps.sh: sshd, rsync, MPI, Grid Engine, MXNet 1.9.1).
# Needs root (apt-get, network namespaces, Grid Engine). Extra arguments go to pytest.
# The tests run in PSLAUNCH_TEST_WORKERS pytest-xdist workers (2; 0 runs them in this process):
# most of their time is waiting on real processes and services. The tests of one shared service
# (Slurm, Grid Engine, YARN: tests/suite_rules.py) run in one worker, one after the other.
# Before the tests, ruff and mypy check the code (config in pyproject.toml); a lint or type error
# fails the run too, but the tests still run, so that one run reports everything.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s.%N)
phase() {  # phase NAME CMD...: run a phase, print its time, return its exit code
    local name=$1; shift
    local t0 status=0; t0=$(date +%s.%N)
    printf '\n=== %s\n' "$name" >&2
    "$@" || status=$?  # (set -e does not apply inside a function called from ||)
    printf '=== %s took %.1fs (exit code %d)\n' "$name" \
        "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$status" >&2
    return "$status"
}
phase "set-up (scripts/setup.sh)" scripts/setup.sh
lint() {  # both, whatever the first says: 0 when both pass
    local status=0
    .venv/bin/ruff check . || status=1
    .venv/bin/mypy || status=1
    return "$status"
}
lint_rc=0
phase "lint (ruff check ., mypy)" lint || lint_rc=$?
DEPS_ENV=$(mktemp)
phase "test dependencies and services (scripts/install-test-deps.sh)" \
    bash -c "scripts/install-test-deps.sh > '$DEPS_ENV'"
# shellcheck disable=SC1090
source "$DEPS_ENV"
rm -f "$DEPS_ENV"
rc=0
WORKERS=${PSLAUNCH_TEST_WORKERS:-2}
[[ $WORKERS =~ ^[0-9]+$ ]] || { echo "PSLAUNCH_TEST_WORKERS must be a number (0: no workers)" >&2; exit 2; }
phase "tests (pytest, $WORKERS workers)" .venv/bin/python -m pytest -n "$WORKERS" --dist loadgroup "$@" || rc=$?
printf '=== total %.1fs, lint exit code %d, pytest exit code %d\n' \
    "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$lint_rc" "$rc" >&2
if [ "$rc" -eq 0 ] && [ "$lint_rc" -ne 0 ]; then
    rc=1  # the tests passed, the lint did not
fi
exit $rc
