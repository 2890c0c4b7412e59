# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""docs/mxnet.md's walk-through, run: an MXNet 1.9.1 MNIST training under pslaunch, locally and over ssh.

The walk-through uses MXNet's own ``example/image-classification/train_mnist.py``. Set
``PSLAUNCH_MXNET_EXAMPLE`` to that directory of an MXNet 1.9.1 checkout (``git clone -b 1.9.1
https://github.com/apache/mxnet``) and these tests run it exactly as the walk-through says:
``python -m trainer.data --export-idx data`` beside it, then ``pslaunch ... python train_mnist.py``.
Without it (the CI machines cannot fetch MXNet's sources) they run the walk-through's commands with
``scripts/bench_train_mxnet.py``, which trains the same way (MXNet's symbols, ``Module.fit``,
its kvstore, its Speedometer) from the same MNIST.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.helpers import REPO, pslaunch_argv
from support.testbed import Testbed, testbed  # noqa: F401
from support.trainer import mnist_dir

pytestmark = [pytest.mark.integration, pytest.mark.mxnet]

EXAMPLE = os.environ.get("PSLAUNCH_MXNET_EXAMPLE")
TRAIN = ["--network", "mlp", "--kv-store", "dist_sync", "--num-epochs", "1", "--num-examples", "6400",
         "--disp-batches", "10"]


def workdir(tmp_path: Path) -> tuple[Path, list[str]]:
    """The directory the walk-through runs in, and the program with its data arguments."""
    d = tmp_path / "image-classification"
    if EXAMPLE:
        shutil.copytree(Path(EXAMPLE), d, ignore=shutil.ignore_patterns("data", "*.pyc", "__pycache__"))
        # the walk-through's step 2: MNIST where the example looks for it (it downloads only what is missing)
        subprocess.run([sys.executable, "-m", "trainer.data", "--export-idx", str(d / "data"), "--data-dir",
                        str(mnist_dir())], check=True, capture_output=True, timeout=120, cwd=REPO)
        return d, ["train_mnist.py"]
    d.mkdir()
    return d, [str(REPO / "scripts" / "bench_train_mxnet.py"), "--data-dir", str(mnist_dir())]


def check_training(r: subprocess.CompletedProcess, workers: list[str]) -> None:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    for w in workers:
        speed = [x for x in text.splitlines() if x.startswith(f"[{w}]") and re.search(r"Epoch\[0\] Batch \[", x)]
        assert speed, f"no Speedometer line from {w}"
        acc = re.findall(rf"^\[{re.escape(w)}\] .*Epoch\[0\] Validation-accuracy=([0-9.]+)", text, re.M)
        assert acc and float(acc[-1]) > 0.8, (w, acc)


@pytest.mark.timeout(300)
def test_walkthrough_local(mxnet: str, tmp_path: Path) -> None:
    d, program = workdir(tmp_path)
    r = subprocess.run(pslaunch_argv("-n", "2", "-s", "1", "--timeout", "240", mxnet, *program, *TRAIN),
                       capture_output=True, text=True, timeout=280, cwd=d)
    check_training(r, ["worker 0", "worker 1"])
    assert "Resizing training data to 50 batches per machine" in r.stdout + r.stderr  # dist_sync: 6400 / 2 / 64


@pytest.mark.ssh
@pytest.mark.timeout(360)
def test_walkthrough_over_ssh(mxnet: str, testbed: Testbed, tmp_path: Path) -> None:
    d, program = workdir(tmp_path)
    dst = f"{testbed.sync_root}/mxnet-example-{uuid.uuid4().hex[:6]}"
    hosts = ",".join(h.addr_a for h in testbed.hosts[:2])
    env = testbed.env()
    r = subprocess.run(pslaunch_argv("-n", "2", "-s", "2", "-H", hosts, "--sync-dst-dir", dst, "--env",
                                     f"DMLC_INTERFACE={testbed.subnet_b}", "--env", "PSLAUNCH_NETGUARD_LOG",
                                     "--timeout", "300", mxnet, *program, *TRAIN),
                       capture_output=True, text=True, timeout=340, cwd=d, env=env)
    h0, h1 = testbed.hosts[:2]
    check_training(r, [f"worker 0 @ {h0.addr_a}", f"worker 1 @ {h1.addr_a}"])
    if EXAMPLE:  # the example and its data went to the hosts by the sync
        listing = testbed.run(h0, ["find", dst, "-name", "*.gz", "-o", "-name", "train_mnist.py"]).stdout
        assert "train_mnist.py" in listing and "train-images-idx3-ubyte.gz" in listing, listing
