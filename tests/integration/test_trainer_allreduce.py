"""The trainer's ``dist_allreduce`` kvstore (trainer/collective.py) under ``pslaunch --tracker torch``:
the kvstore's semantics with real processes (tests/bin/kv_worker.py, as for the parameter-server
stores), and LeNet trained by ``dist_allreduce`` and by ``dist_sync`` from one command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from support import trainer as H
from support.helpers import BIN, REPO

pytestmark = pytest.mark.integration


def kv_job(tmp_path: Path, scenario: str, workers: int = 2) -> dict[int, dict]:
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "launcher", "-n", str(workers), "--tracker", "torch", "--kill-grace",
                        "2", sys.executable, str(BIN / "kv_worker.py"), scenario, "--type", "dist_allreduce",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=150,
                       env=H.child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    results = {json.loads(f.read_text())["rank"]: json.loads(f.read_text()) for f in out.glob("worker-*.json")}
    assert sorted(results) == list(range(workers)), r.stdout + r.stderr
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario, workers", [("sync", 2), ("sync", 3), ("optim", 2), ("wd", 2)])
def test_allreduce_store_semantics(tmp_path: Path, scenario: str, workers: int) -> None:
    # the same checks as the parameter-server stores pass: integer sums across workers (int and
    # str keys, rank 0's init wins, lists of keys, per-device lists, numpy values, non-contiguous
    # outs), optimizer steps and their states, wd_mult
    results = kv_job(tmp_path, scenario, workers)
    if scenario == "sync":
        assert results[0]["sum"] == [3.0 * workers] * 4
    else:
        assert results[0] == {**results[1], "rank": 0}  # the same weights on every worker


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lenet_trains_the_same_with_allreduce_as_with_parameter_servers() -> None:
    H.mnist_dir()
    args = ("--network", "lenet", "--num-epochs", "1", "--num-examples", "1280", "--batch-size", "64",
            "--disp-batches", "0", "--seed", "3")
    sync = H.run_launched(*args, "--kv-store", "dist_sync", timeout=300)
    assert sync.returncode == 0, sync.stderr
    allreduce = subprocess.run([sys.executable, "-m", "launcher", "-n", "2", "--tracker", "torch",
                                *H.train_argv(*args, "--kv-store", "dist_allreduce")], capture_output=True, text=True,
                               timeout=300, env=H.child_env(), cwd=REPO)
    assert allreduce.returncode == 0, allreduce.stderr
    s_sync, s_all = H.summaries(sync.stdout), H.summaries(allreduce.stdout)
    assert [s["kv_store"] for s in s_all] == ["dist_allreduce"] * 2
    assert s_all[0]["validation_accuracy"] == s_all[1]["validation_accuracy"]  # one model on both workers
    assert s_all[0]["batches_per_epoch"] == s_sync[0]["batches_per_epoch"] == 10
    # the same start (rank 0's weights), data, rescaling and steps: only the order of float
    # additions differs (the servers sum in another order than gloo)
    assert abs(s_all[0]["validation_accuracy"] - s_sync[0]["validation_accuracy"]) <= 0.005, (s_all, s_sync)
    assert abs(s_all[0]["train_accuracy"] - s_sync[0]["train_accuracy"]) <= 0.01


def _allreduce_job(*args: str, restarts: int = 0) -> list[str]:
    return H.launched_argv(*args, "--kv-store", "dist_allreduce", servers=0,
                           launcher_args=("--tracker", "torch", "--max-restarts", str(restarts),
                                          "--restart-delay", "0.1"))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_restarted_allreduce_job_ends_with_the_parameters_of_an_uninterrupted_one(tmp_path: Path) -> None:
    from trainer.fit import checkpoint_path, load_checkpoint

    H.mnist_dir()
    common = ("--network", "lenet", "--num-epochs", "3", "--num-examples", "6400", "--disp-batches", "0",
              "--seed", "7", "--checkpoint-every-batches", "10", "--resume")
    t0 = time.monotonic()
    ref = subprocess.run(_allreduce_job(*common, "--model-prefix", str(tmp_path / "ref")), capture_output=True,
                         text=True, timeout=200, env=H.child_env(), cwd=REPO)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    t_ref = time.monotonic() - t0
    prefix = tmp_path / "part"
    tag = uuid.uuid4().hex
    t1 = time.monotonic()
    with subprocess.Popen(_allreduce_job(*common, "--model-prefix", str(prefix), restarts=1), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=H.child_env(PSLAUNCH_TEST_TAG=tag),
                          cwd=REPO) as job:
        H.kill_worker_at(checkpoint_path(prefix, 1, 10), tag, job)
        out, _ = job.communicate(timeout=300)
    t_job = time.monotonic() - t1
    assert job.returncode == 0, out
    assert re.search(r"attempt 1/2 failed: worker 1 .*killed by SIGKILL; restarting", out), out
    at = re.search(r'Resuming from checkpoint "(.+)" at epoch 1 batch (\d+) \(attempt 1\)', out)
    assert at and int(at[2]) >= 10, out
    final = [load_checkpoint(checkpoint_path(p, 3), "lenet") for p in (tmp_path / "ref", prefix)]
    # the same weights, momentum and update counts, bit for bit: rank 0's checkpoint holds the
    # weights and momentum every worker had at that batch boundary, the data order continues from
    # it, and gloo sums the same gradients in the same order
    for k, v in final[0]["model"].items():
        assert torch.equal(final[1]["model"][k], v), k
    for a, b in zip(final[0]["optimizer"]["states"].values(), final[1]["optimizer"]["states"].values()):
        assert a["count"] == b["count"] == 150 and torch.equal(a["arrays"]["mom"], b["arrays"]["mom"])
    acc = [H.summaries(r)[0]["validation_accuracy"] for r in (ref.stdout, out)]
    assert acc[0] == acc[1]
    print(f"dist_allreduce: validation accuracy uninterrupted {acc[0]}, restarted and resumed at epoch 1 batch "
          f"{at[2]} {acc[1]}; seconds: uninterrupted {t_ref:.1f}, both attempts {t_job:.1f}")
