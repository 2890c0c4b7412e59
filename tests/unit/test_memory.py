"""trainer.memory: a training step reuses freed pages instead of faulting on new ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.memory import keep_freed_memory, user_tunes_malloc

REPO = Path(__file__).resolve().parents[2]

# Thirty LeNet steps at batch 64 on one thread, after ten to warm up; prints the minor page
# faults per step. With "keep", trainer.memory sets the thresholds first.
STEPS = r"""
import json, resource, sys
keep = sys.argv[1] == "keep"
from trainer.memory import keep_freed_memory
kept = keep_freed_memory() if keep else False
import torch
import torch.nn.functional as F
from trainer.models import create_model
torch.set_num_threads(1)
model = create_model("lenet", seed=1, channels_last=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
def step():
    x = torch.rand(64, 1, 28, 28)
    y = torch.randint(0, 10, (64,))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    opt.zero_grad()
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30
print(json.dumps({"kept": kept, "faults_per_step": faults}))
"""


def _faults_per_step(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_step_reuses_freed_pages() -> None:
    default = _faults_per_step("default")
    kept = _faults_per_step("keep")
    assert kept["kept"] is True
    # glibc's defaults map and fault in every multi-megabyte block anew: 600 to 3,000 faults
    # per LeNet step; with the thresholds raised the last step's pages serve (0 per step, up to
    # 18 where the heap still grew once after the warm-up; 50 once on a loaded CI machine, when the
    # default's took 486: a bound of a tenth of those failed there).
    assert default["faults_per_step"] > 300, (default, kept)
    assert kept["faults_per_step"] < min(60, default["faults_per_step"] / 4), (default, kept)


def test_the_users_own_malloc_settings_are_kept() -> None:
    assert user_tunes_malloc({"MALLOC_MMAP_THRESHOLD_": "1000000"})
    assert user_tunes_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_tunes_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"})
    assert not user_tunes_malloc({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2", "PATH": "/bin"})
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"}) is False
