"""scripts/gpu_check.py: what it runs on one and on two GPUs, and its one line without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from support.helpers import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.py"


def test_the_plan_for_one_and_for_two_gpus() -> None:
    g = load_script("gpu_check")
    train = str(REPO / "scripts" / "train_mnist.py")
    one = g.plan(1, ("device", "dist_device_sync"), "py", ["--network", "lenet"])
    assert [(r.kv_store, r.gpus, r.workers) for r in one] == [("device", "0", 1),
                                                              ("dist_device_sync", "0", 2)]
    assert one[0].argv == ("py", train, "--gpus", "0", "--network", "lenet", "--kv-store", "device")
    assert one[1].argv[:8] == ("py", "-m", "launcher", "--launcher", "local", "-n", "2", "-s")
    two = g.plan(4, ("device", "dist_device_sync", "dist_allreduce"), "py", [])
    assert [(r.kv_store, r.gpus, r.workers) for r in two] == [
        ("device", "0", 1), ("dist_device_sync", "0", 2), ("dist_allreduce", "0", 1),
        ("device", "0,1", 1), ("dist_device_sync", "0,1", 2), ("dist_allreduce", "0,1", 2)]
    assert two[-1].argv[5:9] == ("-n", "2", "--tracker", "torch")


def test_the_kv_store_choices_come_from_the_trainer() -> None:
    from trainer.train_mnist import KV_TYPES

    assert load_script("gpu_check").kv_store_choices() == tuple(KV_TYPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_in_one_line_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA here (torch "), proc.stderr
