#!/usr/bin/env bash
# Installs and starts what the test suite needs beyond scripts/setup.sh, by
# running scripts/deps/*.sh in order. Progress goes to stderr; stdout carries
# only `export NAME=VALUE` lines for the tests (eval or source them).
set -euo pipefail
cd "$(dirname "$0")/.."
for step in scripts/deps/[0-9]*.sh; do
    t0=$(date +%s.%N)
    printf '[deps] %s\n' "$step" >&2
    bash "$step"
    printf '[deps] %s took %.1fs\n' "$step" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" >&2
done
