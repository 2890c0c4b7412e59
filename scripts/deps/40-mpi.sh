#!/usr/bin/env bash
# MPI for the mpi backend's tests: both Open MPI and MPICH (Debian packages),
# addressed by their real paths because Debian's alternatives point `mpirun`
# at only one of them, plus mpi4py in .venv (its PyPI wheel loads whichever
# libmpi the job runs under; the rank wrapper only needs it as a fallback).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
apt_install openmpi-bin mpich
for bin in /usr/bin/mpirun.openmpi /usr/bin/mpirun.mpich; do
    [ -x "$bin" ] || die "$bin is missing after installing openmpi-bin and mpich"
done
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import mpi4py' 2>/dev/null; then
    log "installing mpi4py into .venv (the version pyproject's mpi extra asks for)"
    .venv/bin/python -m pip install -q --disable-pip-version-check 'mpi4py>=4.1' >&2
fi
log "$(/usr/bin/mpirun.openmpi --version 2>&1 | head -n1); $(/usr/bin/mpirun.mpich --version 2>&1 | head -n2 | tr '\n' ' ')"
echo "export PSLAUNCH_MPIRUN_OPENMPI=/usr/bin/mpirun.openmpi"
echo "export PSLAUNCH_MPIRUN_MPICH=/usr/bin/mpirun.mpich"
