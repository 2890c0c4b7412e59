"""train_mnist as real processes on real MNIST: alone, and under the launcher with parameter servers."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
import uuid
from pathlib import Path

import pytest
import torch
from support import trainer as H

from trainer import data as D  # noqa: E402
from trainer.fit import checkpoint_path, load_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def mnist_dir() -> Path:
    return H.mnist_dir()


def _one_line_error(proc: subprocess.CompletedProcess, code: int, text: str, alone: bool = True) -> None:
    """One error line (and, with ``alone``, nothing else: the mistake was caught before any work)."""
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("train_mnist: error: ")]
    assert len(errors) == 1 and text in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    if alone:
        assert len(lines) == 1, proc.stderr


def _weights(prefix: Path, epoch: int, network: str = "lenet") -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint_path(prefix, epoch), network)["model"]


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lenet_300_batches_reach_95_percent() -> None:
    proc = H.run_train("--network", "lenet", "--kv-store", "local", "--num-epochs", "1", "--num-examples", "19200",
                       timeout=170)
    assert proc.returncode == 0, proc.stderr
    (summary,) = H.summaries(proc.stdout)
    assert summary["batches_per_epoch"] == 300
    assert summary["validation_accuracy"] >= 0.95
    assert proc.stdout.strip().splitlines()[-1].startswith("{")  # the JSON line is last
    speed = re.findall(r"Node\[0\] Epoch\[0\] Batch \[(\d+)-(\d+)\]\tSpeed: [\d.]+ samples/sec\taccuracy=[\d.]+",
                       proc.stderr)
    assert speed == [("0", "100"), ("100", "200"), ("200", "300")] or speed == [("0", "100"), ("100", "200")]
    assert re.search(r"Node\[0\] Epoch\[0\] Validation-accuracy=0\.9\d{5}\n", proc.stderr)
    assert "\r" not in proc.stderr  # no progress bar without a terminal


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dist_sync_two_workers_equal_one_worker_with_double_batch(tmp_path: Path) -> None:
    # A large --wd makes a difference in weight decay (biases get none, on the servers as locally) visible.
    common = ("--network", "lenet", "--num-epochs", "1", "--num-examples", "640", "--disp-batches", "0",
              "--seed", "3", "--wd", "0.5")
    dist = H.run_launched(*common, "--kv-store", "dist_sync", "--batch-size", "64",
                          "--model-prefix", str(tmp_path / "dist"), "--metrics-file", str(tmp_path / "m-{rank}.jsonl"),
                          timeout=200)
    assert dist.returncode == 0, dist.stdout + dist.stderr
    # The same command ran as scheduler and server too, and every process exited 0.
    assert re.search(r"all 4 processes exited 0", dist.stdout + dist.stderr)
    s0, s1 = H.summaries(dist.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # the same weights on both workers
    for rank, summary in enumerate((s0, s1)):  # --metrics-file with {rank}: a file per worker, its own figures
        (epoch,) = [json.loads(x) for x in (tmp_path / f"m-{rank}.jsonl").read_text().splitlines()]
        assert (epoch["event"], epoch["rank"], epoch["attempt"]) == ("epoch", rank, 0)
        assert epoch["train_accuracy"] == summary["train_accuracy"]
    # every process of the job on this host: each worker keeps its own cores (the server floats)
    cores = {w: c for w, c in re.findall(r"^\[worker (\d)\] .*torch thread\(s\), devices cpu(?:, cores ([\d,]+))?$",
                                          dist.stdout + dist.stderr, re.M)}
    assert sorted(cores) == ["0", "1"], dist.stderr
    if len(os.sched_getaffinity(0)) >= 2:
        mine = [set(map(int, cores[w].split(","))) for w in ("0", "1")]
        assert all(mine) and not mine[0] & mine[1] and mine[0] | mine[1] <= os.sched_getaffinity(0), cores
    else:
        assert cores == {"0": "", "1": ""}, cores
    one = H.run_train(*common, "--kv-store", "local", "--batch-size", "128", "--model-prefix", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    assert H.summaries(one.stdout)[0]["batches_per_epoch"] == 5
    _assert_close(_weights(tmp_path / "dist", 1), _weights(tmp_path / "one", 1), 1e-4)
    assert not (tmp_path / "dist-0001.pt").with_name("dist-1-0001.pt").exists()  # rank 0 alone writes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dist_async_converges_at_the_default_learning_rate() -> None:
    # MXNet's 1/b scaling diverges here (accuracy 0.10); ours, 1/(N*N*b), learns.
    proc = H.run_launched("--network", "lenet", "--kv-store", "dist_async", "--num-epochs", "1",
                          "--num-examples", "19200", "--disp-batches", "0", timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = H.summaries(proc.stdout)
    assert [s["kv_store"] for s in summaries] == ["dist_async", "dist_async"]
    assert all(s["batches_per_epoch"] == 150 for s in summaries)
    assert all(s["validation_accuracy"] >= 0.9 for s in summaries), summaries


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_resumes_under_dist_sync(tmp_path: Path) -> None:
    common = ("--network", "lenet", "--num-examples", "640", "--disp-batches", "0", "--seed", "5",
              "--lr-step-epochs", "1", "--batch-size", "64")
    prefix = tmp_path / "ck"
    first = H.run_launched(*common, "--kv-store", "dist_sync", "--num-epochs", "1", "--model-prefix", str(prefix))
    assert first.returncode == 0, first.stdout + first.stderr
    second = H.run_launched(*common, "--kv-store", "dist_sync", "--num-epochs", "2", "--load-epoch", "1",
                            "--model-prefix", str(prefix))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f'Loaded checkpoint from "{prefix}-0001.pt" (epoch 1)' in second.stdout + second.stderr
    assert [s["epochs"][0]["epoch"] for s in H.summaries(second.stdout)] == [1, 1]
    # One machine with batch 2b, uninterrupted: the same weights (momentum, counts and lr schedule restored).
    ref = H.run_train(*[a if a != "64" else "128" for a in common], "--kv-store", "local", "--num-epochs", "2",
                      "--model-prefix", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    _assert_close(_weights(prefix, 2), _weights(tmp_path / "ref", 2), 1e-4)
    states = load_checkpoint(checkpoint_path(prefix, 2), "lenet")["optimizer"]["states"]
    assert {s["count"] for s in states.values()} == {10}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_worker_killed_inside_an_epoch_restarts_and_resumes_under_dist_sync(tmp_path: Path) -> None:
    # 3 epochs of 50 batches per worker; worker 1 dies in epoch index 1 (the second of three),
    # after rank 0's checkpoint at its batch 10; one command (--max-restarts 1 --resume) ends as
    # a job that never failed (the same seed).
    common = ("--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "3", "--num-examples", "6400",
              "--disp-batches", "0", "--seed", "7", "--checkpoint-every-batches", "10", "--resume")
    t0 = time.monotonic()
    ref = H.run_launched(*common, "--model-prefix", str(tmp_path / "ref"), timeout=200)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    t_ref = time.monotonic() - t0
    prefix = tmp_path / "part"
    tag = uuid.uuid4().hex
    t1 = time.monotonic()
    with subprocess.Popen(H.launched_argv(*common, "--model-prefix", str(prefix),
                                          launcher_args=("--max-restarts", "1", "--restart-delay", "0.1")),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=H.child_env(PSLAUNCH_TEST_TAG=tag), cwd=H.REPO) as job:
        H.kill_worker_at(checkpoint_path(prefix, 1, 10), tag, job)
        out, _ = job.communicate(timeout=300)
    t_job = time.monotonic() - t1
    assert job.returncode == 0, out
    assert re.search(r"attempt 1/2 failed: worker 1 .*killed by SIGKILL; restarting", out), out
    assert f"No complete checkpoint of {prefix}: training from scratch (attempt 0)" in out
    at = re.search(r'\[worker 0\] .* Resuming from checkpoint "(.+)" at epoch 1 batch (\d+) \(attempt 1\)', out)
    assert at and at[1] == str(checkpoint_path(prefix, 1, int(at[2]))) and int(at[2]) >= 10, out
    assert f"Resuming from rank 0's checkpoint at epoch 1 batch {at[2]} (attempt 1)" in out
    s_ref, s_res = H.summaries(ref.stdout), H.summaries(out)
    assert [[e["epoch"] for e in s["epochs"]] for s in s_res] == [[1, 2], [1, 2]], s_res
    acc_ref, acc_res = s_ref[0]["validation_accuracy"], s_res[0]["validation_accuracy"]
    print(f"dist_sync: validation accuracy uninterrupted {acc_ref}, restarted and resumed at epoch 1 batch {at[2]} "
          f"{acc_res}; seconds: uninterrupted {t_ref:.1f}, both attempts {t_job:.1f}")
    assert abs(acc_res - acc_ref) <= 0.005, (acc_ref, acc_res)
    final = [_weights(p, 3) for p in (tmp_path / "ref", prefix)]
    # Bit for bit, in fact: the servers' sum of two workers' gradients is the same in either order.
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.timeout(120)
def test_scheduler_and_server_exit_0_without_parameter_servers() -> None:
    proc = H.run_launched("--network", "mlp", "--kv-store", "local", "--num-epochs", "1", "--num-examples", "640",
                          "--disp-batches", "0", workers=1, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "all 3 processes exited 0" in out
    for role in ("scheduler", "server"):
        assert f"train_mnist: this {role} exits: --kv-store local trains without parameter servers" in out
    assert len(H.summaries(proc.stdout)) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_scheduler_and_server_start_without_what_only_a_worker_needs(role: str) -> None:
    # python -X importtime lists every import on stderr; the role gives up after 1 s alone
    import pscontract as pc

    env = H.child_env(**pc.contract(role, root_uri="127.0.0.1", root_port=9, num_workers=1,
                                    num_servers=1, secret="ab" * 32, start_timeout=1, job_id="j",
                                    task_id=None if role == "scheduler" else 1,
                                    cluster=None if role == "scheduler" else "local",
                                    node_host=None if role == "scheduler" else "127.0.0.1"))
    proc = subprocess.run([*H.train_argv("--kv-store", "dist_sync")[:1], "-X", "importtime",
                           *H.train_argv("--kv-store", "dist_sync")[1:]],
                          capture_output=True, text=True, timeout=50, env=env, cwd=H.REPO)
    assert proc.returncode == 1, proc.stderr  # alone: it times out, as it should
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", proc.stderr, re.M))
    assert f"trainer.kv.{role}" in imported, proc.stderr
    assert not imported & {"torch", "trainer.models", "trainer.data", "trainer.fit", "tqdm",
                           "matplotlib"}, sorted(imported)


@pytest.mark.timeout(60)
def test_gpus_without_cuda_is_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _one_line_error(H.run_train("--gpus", "0"), 2, "--gpus 0: CUDA is not available")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--batch-size", "0"], "--batch-size: 0 must be at least 1"),
        (["--cpus", "2", "--work-load-list", "1"], "has 1 entries for 2 device(s)"),
        (["--plot", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),
        # an unwritable format is found before training, not after it (the default run is 20 epochs)
        (["--plot", "p.txt"], "--plot p.txt: matplotlib cannot write .txt files"),
        (["--plot", "/tmp"], "--plot /tmp is a directory"),
        (["--metrics-file", "/nonexistent-dir/m-{rank}.jsonl"], "the directory /nonexistent-dir does not exist"),
        (["--cpus", "4", "--batch-size", "3"], "leaves a device without samples"),
    ],
)
def test_user_mistakes_are_one_line(argv: list[str], text: str) -> None:
    proc = H.run_train(*argv)
    _one_line_error(proc, 2, text)


@pytest.mark.timeout(60)
def test_a_first_run_of_matplotlib_on_a_machine_adds_no_line(tmp_path: Path) -> None:
    """The first import on a machine (an empty matplotlib config and cache directory) logs
    "generated new fontManager" at INFO: that record is matplotlib's, not the trainer's, and never
    reaches the user (a fresh CI machine once saw it ahead of the one-line error)."""
    mpl = tmp_path / "mpl"
    proc = H.run_train("--plot", "p.txt", env=H.child_env(MPLCONFIGDIR=str(mpl)))
    _one_line_error(proc, 2, "--plot p.txt: matplotlib cannot write .txt files")
    assert any(mpl.glob("fontlist-*.json")), "matplotlib did not build its font list: the test saw no first run"


@pytest.mark.timeout(60)
def test_dist_store_outside_a_job_is_one_line() -> None:
    env = {k: v for k, v in H.child_env().items() if not k.startswith(("DMLC_", "PSLAUNCH_"))}
    _one_line_error(H.run_train("--kv-store", "dist_sync", env=env), 1, "kvstore: ", alone=False)


@pytest.mark.timeout(60)
def test_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    proc = H.run_train("--kv-store", "local", "--model-prefix", str(tmp_path / "x"), "--load-epoch", "4")
    _one_line_error(proc, 1, f"checkpoint {tmp_path / 'x'}-0004.pt does not exist", alone=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("corrupt", ["truncated", "gzip"])
def test_corrupt_data_files_are_one_line(tmp_path: Path, corrupt: str) -> None:
    m = D.load_mnist(H.MNIST_DIR, download_missing=False)
    for key, spec in D.FILES.items():
        D.write_idx(tmp_path / spec.gz_name, getattr(m, key)[:100])
    bad = tmp_path / D.FILES["train_images"].gz_name
    if corrupt == "truncated":
        bad.unlink()
        raw = D.idx_bytes(m.train_images[:100])
        (tmp_path / D.FILES["train_images"].name).write_bytes(raw[:-10])
        text = "train-images-idx3-ubyte: truncated: the header promises 78400 bytes of data"
    else:
        bad.write_bytes(bad.read_bytes()[:500])
        text = "train-images-idx3-ubyte.gz: corrupt or truncated gzip file"
    _one_line_error(H.run_train("--kv-store", "local", data_dir=tmp_path), 1, text, alone=False)


@pytest.mark.timeout(120)
def test_progress_bar_on_a_terminal() -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(H.train_argv("--kv-store", "local", "--num-epochs", "1", "--num-examples", "640",
                                         "--disp-batches", "5"),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=H.child_env(), cwd=H.REPO)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 100)
        if not ready:
            proc.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(30) == 0
    text = out.decode(errors="replace")
    assert "Epoch[0]: " in text and "batch/s" in text  # tqdm's bar
    assert re.search(r"Node\[0\] Epoch\[0\] Validation-accuracy=", text)
    # Lines logged under the bar keep the rank prefix and format cleanly.
    assert re.search(r"Node\[0\] Epoch\[0\] Batch \[0-5\]\tSpeed: ", text)
    assert "Logging error" not in text
