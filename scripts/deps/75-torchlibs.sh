#!/usr/bin/env bash
# Real Lightning and Accelerate for the torch tracker's tests (marker torchlibs,
# tests/integration/test_torch_libraries.py), in a venv of their own (.venv-torchlibs) so that
# neither the project's .venv nor the launcher ever imports them. Exact pins: these tests hold
# what the libraries read of torchrun's environment, and a new release may read more.
# torch 2.13.0 goes in first (the CPU wheel, as setup.sh installs it), then the libraries under
# a constraint that keeps that torch: no open range may pull a CUDA build (GBs of nvidia-*).
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
LIGHTNING=2.6.6
ACCELERATE=1.15.0
# (the check reads the installed versions, not the modules: importing torch and both libraries
# takes seconds, tens of seconds on a loaded machine, and a cached venv is checked at every run)
test_venv .venv-torchlibs "import sys, importlib.metadata as m
sys.exit((m.version('torch'), m.version('lightning'), m.version('accelerate')) != ('2.13.0+cpu', '$LIGHTNING', '$ACCELERATE')
         or any((d.metadata['Name'] or '').lower().startswith('nvidia-') for d in m.distributions()))" \
    torch==2.13.0 \; -c scripts/deps/torch-cpu.txt "lightning==$LIGHTNING" "accelerate==$ACCELERATE"
cuda=$(.venv-torchlibs/bin/python -m pip list --format=freeze 2>/dev/null | grep -i '^nvidia-' || true)
[ -z "$cuda" ] || die ".venv-torchlibs has CUDA packages ($(echo $cuda)): remove $(readlink -f .venv-torchlibs) and run $0 again"
echo "export PSLAUNCH_TORCHLIBS_PYTHON=$PWD/.venv-torchlibs/bin/python"
