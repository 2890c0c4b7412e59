#!/usr/bin/env bash
# Tools the core tests use: procps (ps, pgrep), iproute2 (ip, ss).
source "$(dirname "$0")/lib.sh"
apt_install procps iproute2
