#!/usr/bin/env bash
# Slurm for the slurm tests: a 4-node cluster on this machine, one slurmd per
# network namespace (scripts/setup-slurm.sh installs Debian's slurmctld, slurmd,
# slurm-client and munge, configures and starts them: ~15 s from nothing, ~1 s
# when it runs already). stdout: SLURM_CONF and PSLAUNCH_SLURM_TESTBED.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
require_users munge=munge slurm=slurm-wlm-basic-plugins
scripts/setup-slurm.sh start
require_users munge=munge slurm=slurm-wlm-basic-plugins
