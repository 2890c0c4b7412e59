"""The trainer's dist_sync (scripts/train_mnist.py) under --launcher mpi, Open MPI and MPICH."""

from __future__ import annotations

import pytest
from support import trainer as H
from support.helpers import run_pslaunch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.mpi]


@pytest.mark.timeout(240)
def test_trainer_dist_sync_under_mpi(mpirun, tmp_path) -> None:
    H.mnist_dir()  # the shared MNIST cache (no download)
    train = H.train_argv("--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1",
                         "--num-examples", "640", "--batch-size", "64", "--disp-batches", "0", "--seed", "3",
                         "--model-prefix", str(tmp_path / "m"))
    r = run_pslaunch("--launcher", "mpi", "--mpirun", mpirun, "--kill-grace", "1", "-n", "2", "-s", "1",
                     "--timeout", "200", *train,
                     env=H.child_env(), timeout=220)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 4 processes exited 0" in r.stderr
    s0, s1 = H.summaries(r.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # the same weights on both workers
    assert any(line.startswith("[worker 1] ") and "validation_accuracy" in line for line in r.stdout.splitlines())
