#!/usr/bin/env bash
# Real XGBoost for the tracker tests (marker xgboost), each in its own venv so
# that neither the project's .venv nor the launcher ever imports xgboost:
#   .venv-xgb20  xgboost 2.0.3: the last release whose rabit engine speaks dmlc's
#                tracker protocol and reads DMLC_TRACKER_URI/PORT itself
#                (its own tracker.py, run by xgboost_child.py --tracker rabit);
#   .venv-xgb30  xgboost 3.0.x: the new tracker protocol, served by its own
#                xgboost.tracker.RabitTracker (launcher/trackers/xgboost_child.py).
# 3.0 is installed as the xgboost-cpu wheel: the same `xgboost` package without
# the CUDA build and its nvidia-nccl-cu12 dependency (hundreds of MB for nothing
# on a CPU machine). numpy<2 for 2.0.3: its wheel was built against numpy 1.x.
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.."
test_venv .venv-xgb20 'import sys, xgboost; sys.exit(xgboost.__version__ != "2.0.3")' \
    xgboost==2.0.3 "numpy<2"
test_venv .venv-xgb30 'import sys, xgboost; sys.exit(not xgboost.__version__.startswith("3.0."))' \
    "xgboost-cpu==3.0.*"
echo "export PSLAUNCH_XGB20_PYTHON=$PWD/.venv-xgb20/bin/python"
echo "export PSLAUNCH_XGB30_PYTHON=$PWD/.venv-xgb30/bin/python"
