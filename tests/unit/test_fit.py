"""The training loop's pieces and a few small in-process runs through the local kvstore (real MNIST)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import trainer as train_helpers

from trainer import fit as T  # noqa: E402
from trainer import kvstore  # noqa: E402
from trainer.data import MNIST, load_mnist  # noqa: E402
from trainer.metrics import MetricsFile, check_metrics_path, metrics_path  # noqa: E402
from trainer.models import create_model  # noqa: E402


@pytest.fixture(scope="module")
def mnist() -> MNIST:
    return load_mnist(train_helpers.mnist_dir(), download_missing=False)


# --- batch split ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "work_load", "sizes"),
    [
        (64, [3, 1], [48, 16]),
        (64, [1, 1, 1], [21, 21, 22]),  # MXNet: B=64 on 3 GPUs
        (60, [1, 5], [10, 50]),  # the seed's 1:5 CPU:GPU example
        (64, [1], [64]),
        (10, [1, 1, 1, 1], [2, 2, 2, 4]),  # round(2.5) == 2: the shortfall goes last
        (7, [1, 1], [4, 3]),  # round(3.5) == 4 twice: the excess is cut from the end
    ],
)
def test_split_batch_like_mxnet(batch: int, work_load: list[float], sizes: list[int]) -> None:
    slices = T.split_batch(batch, work_load)
    assert [s.stop - s.start for s in slices] == sizes
    assert slices[0].start == 0 and slices[-1].stop == batch
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))


def test_split_batch_empty_slice_is_an_error() -> None:
    with pytest.raises(T.FitError, match="leaves a device without samples"):
        T.split_batch(2, [1, 1, 1])
    with pytest.raises(T.FitError, match="positive numbers"):
        T.split_batch(8, [1, 0])


def test_rescale_grad() -> None:
    assert T.rescale_grad("local", 64, 1) == 1 / 64
    assert T.rescale_grad("device", 64, 1) == 1 / 64
    assert T.rescale_grad("dist_sync", 64, 2) == 1 / 128
    assert T.rescale_grad("dist_device_sync", 32, 4) == 1 / 128
    assert T.rescale_grad("dist_async", 64, 2) == 1 / 256
    assert T.rescale_grad("dist_async", 64, 1) == 1 / 64


def test_optimizer_spec_defaults() -> None:
    spec = T.optimizer_spec(T.TrainConfig(), "device", 1, 938)
    assert spec == {"name": "sgd", "learning_rate": 0.05, "wd": 0.0001, "wd_mult": {}, "rescale_grad": 1 / 64,
                    "clip_gradient": None, "momentum": 0.9,
                    "lr_scheduler": {"name": "multifactor", "step": [9380], "factor": 0.1}}
    cfg = T.TrainConfig(lr_step_epochs=(2, 5), optimizer="adam")
    spec = T.optimizer_spec(cfg, "dist_async", 2, 469)
    assert "momentum" not in spec
    assert spec["lr_scheduler"]["step"] == [2 * 469 * 2, 5 * 469 * 2]  # async servers count every push
    assert "lr_scheduler" not in T.optimizer_spec(T.TrainConfig(lr_factor=1.0), "local", 1, 10)
    assert "lr_scheduler" not in T.optimizer_spec(T.TrainConfig(lr_step_epochs=()), "local", 1, 10)


def test_biases_get_no_weight_decay_as_in_mxnet() -> None:
    names = [n for n, _ in create_model("lenet").named_parameters()]
    spec = T.optimizer_spec(T.TrainConfig(), "dist_sync", 2, 10, names)
    decayed = [n for i, n in enumerate(names) if spec["wd_mult"].get(str(i), 1.0) == 1.0]
    assert decayed and all(n.endswith("weight") for n in decayed)
    assert {names[int(k)] for k in spec["wd_mult"]} == {n for n in names if n.endswith("bias")}


# --- gradients across devices ------------------------------------------------------------


@pytest.mark.parametrize("network", ["lenet", "mlp"])
def test_work_load_split_gradient_matches_one_device(mnist: MNIST, network: str) -> None:
    x = torch.from_numpy(mnist.train_images[:64]).unsqueeze(1).float() / 255
    y = torch.from_numpy(mnist.train_labels[:64].astype(np.int64))
    one = T.Replicas(network, [torch.device("cpu")], seed=1, channels_last=None)
    two = T.Replicas(network, [torch.device("cpu")] * 2, seed=1, channels_last=None)
    slices = T.split_batch(64, [3, 1])
    assert [(s.start, s.stop) for s in slices] == [(0, 48), (48, 64)]
    one.forward_backward(x, y, [slice(0, 64)])
    losses, correct = two.forward_backward(x, y, slices)
    assert len(losses) == 2 and len(correct) == 2
    for name, g1, g2 in zip(one.names, one.grads(), two.grads()):
        summed = g2[0] + g2[1]
        torch.testing.assert_close(summed, g1[0], rtol=1e-5, atol=1e-5 * g1[0].abs().max().item(), msg=name)


def test_two_cpu_replicas_through_the_local_kvstore_step_like_one(mnist: MNIST) -> None:
    x = torch.from_numpy(mnist.train_images[:64]).unsqueeze(1).float() / 255
    y = torch.from_numpy(mnist.train_labels[:64].astype(np.int64))
    cfg = T.TrainConfig(network="lenet")
    results = []
    for devices, work_load in ((1, [1]), (2, [3, 1])):
        reps = T.Replicas("lenet", [torch.device("cpu")] * devices, seed=2, channels_last=None)
        kv = kvstore.create("local")
        keys = list(range(len(reps.names)))
        kv.init(keys, reps.weights[0])
        kv.set_optimizer(T.optimizer_spec(cfg, "local", 1, 938))
        for _ in range(3):
            reps.forward_backward(x, y, T.split_batch(64, work_load))
            kv.pushpull(keys, reps.grads(), reps.outs())
            reps.zero_grad()
        if devices == 2:  # the replicas hold the same weights after each pull
            for a, b in zip(reps.weights[0], reps.weights[1]):
                assert torch.equal(a, b)
        results.append(reps.state_dict())
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-5, atol=1e-6, msg=k)


class _Recorder:
    """A real local kvstore that notes each push and pull (and whether backward was running)."""

    def __init__(self, kv: kvstore.KVStore) -> None:
        self.kv, self.calls = kv, []
        self.in_backward = False

    def push(self, keys, values, priority=0):  # noqa: ANN001, ANN201
        self.calls.append(("push", list(keys), self.in_backward))
        self.kv.push(keys, values, priority)

    def pull(self, keys, out, priority=0):  # noqa: ANN001, ANN201
        self.calls.append(("pull", list(keys), self.in_backward))
        self.kv.pull(keys, out, priority)

    def pushpull(self, keys, values, out, priority=0):  # noqa: ANN001, ANN201
        self.calls.append(("pushpull", list(keys), self.in_backward))
        self.kv.pushpull(keys, values, out, priority)


def _one_cpu(mnist: MNIST, network: str) -> tuple[torch.Tensor, torch.Tensor, T.Replicas, list[int], _Recorder]:
    """A batch of 64, one CPU replica of ``network``, its keys, and a recorded local kvstore holding them."""
    x = torch.from_numpy(mnist.train_images[:64]).unsqueeze(1).float() / 255
    y = torch.from_numpy(mnist.train_labels[:64].astype(np.int64))
    reps = T.Replicas(network, [torch.device("cpu")], seed=2, channels_last=None)
    store = kvstore.create("local")
    keys = list(range(len(reps.names)))
    store.init(keys, reps.weights[0])
    store.set_optimizer(T.optimizer_spec(T.TrainConfig(network=network), "local", 1, 938))
    return x, y, reps, keys, _Recorder(store)


def _three_steps(mnist: MNIST, network: str, overlapped: bool) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
    """Three steps of ``network`` through a local kvstore: the weights, and each step's calls."""
    x, y, reps, keys, kv = _one_cpu(mnist, network)
    steps = []
    with T.Overlap(kv, reps.params[0], keys) if overlapped else contextlib.nullcontext() as overlap:
        for _ in range(3):
            kv.calls = []
            kv.in_backward = True
            reps.forward_backward(x, y, [slice(0, 64)])
            kv.in_backward = False
            if overlap is not None:
                overlap.finish(reps.outs())
            else:
                kv.pushpull(keys, reps.grads(), reps.outs())
            reps.zero_grad()
            steps.append(kv.calls)
    return reps.state_dict(), steps


@pytest.mark.parametrize(("network", "calls"), [
    # LeNet: fc2 and fc1 (1.6 MB) leave during backward, the convolutions after it, then one pull
    ("lenet", [("push", [7, 6, 5, 4], True), ("push", [2, 3, 0, 1], False), ("pull", list(range(8)), False)]),
    # the MLP's 0.4 MB in all is one bucket: one pushpull after backward, as without the overlap
    ("mlp", [("pushpull", list(range(6)), False)]),
])
def test_overlap_pushes_big_layers_during_backward_and_steps_like_pushpull(
        mnist: MNIST, network: str, calls: list[tuple[str, list[int], bool]]) -> None:
    ref, _ = _three_steps(mnist, network, overlapped=False)
    got, steps = _three_steps(mnist, network, overlapped=True)
    assert steps == [calls] * 3
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_overlap_leaves_sending_to_the_training_thread(mnist: MNIST) -> None:
    # autograd runs a GPU's backward on a thread of its own: hooks there must not use the client
    x, y, reps, keys, kv = _one_cpu(mnist, "lenet")
    with T.Overlap(kv, reps.params[0], keys) as overlap:
        elsewhere = threading.Thread(target=reps.forward_backward, args=(x, y, [slice(0, 64)]))
        elsewhere.start()
        elsewhere.join()
        assert kv.calls == []
        overlap.finish(reps.outs())
    assert kv.calls == [("pushpull", keys, False)]


# --- checkpoints ---------------------------------------------------------------------


def test_checkpoint_path_and_atomic_save(tmp_path: Path) -> None:
    path = T.checkpoint_path(tmp_path / "sub" / "mnist", 3)
    assert path.name == "mnist-0003.pt"
    T.save_checkpoint(path, {"format": T.CHECKPOINT_FORMAT, "network": "mlp", "x": torch.ones(2)})
    assert [p.name for p in path.parent.iterdir()] == ["mnist-0003.pt"]
    assert torch.equal(T.load_checkpoint(path, "mlp")["x"], torch.ones(2))


def test_bad_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(T.FitError, match="does not exist"):
        T.load_checkpoint(tmp_path / "none-0001.pt", "mlp")
    bad = tmp_path / "bad-0001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(T.FitError, match="cannot read checkpoint") as info:
        T.load_checkpoint(bad, "mlp")
    assert "\n" not in str(info.value)
    other = tmp_path / "other-0001.pt"
    torch.save({"format": T.CHECKPOINT_FORMAT, "network": "lenet"}, other)
    with pytest.raises(T.FitError, match="holds a lenet network, not mlp"):
        T.load_checkpoint(other, "mlp")
    foreign = tmp_path / "foreign-0001.pt"
    torch.save({"weights": torch.ones(1)}, foreign)
    with pytest.raises(T.FitError, match="not a train_mnist checkpoint"):
        T.load_checkpoint(foreign, "mlp")


def _state(epoch: int, batch: int = 0, network: str = "mlp") -> dict[str, Any]:
    return {"format": T.CHECKPOINT_FORMAT, "network": network, "epoch": epoch, "batch": batch,
            "model": {"w": torch.full((1000,), float(epoch * 1000 + batch))}, "optimizer": {}}


def test_within_epoch_checkpoint_names_sort_by_position(tmp_path: Path) -> None:
    prefix = tmp_path / "m"
    assert T.checkpoint_path(prefix, 1, 40).name == "m-0001-000040.pt"
    assert T.checkpoint_path(prefix, 1, 0) == T.checkpoint_path(prefix, 1)
    for epoch, batch in ((1, 0), (1, 40), (1, 8), (2, 0), (0, 5)):
        T.save_checkpoint(T.checkpoint_path(prefix, epoch, batch), _state(epoch, batch))
    for stranger in ("m-0009.pt.bak", "mx-0009.pt", "m-0009.pt.123.abcd.tmp", "m-9.pt", "m-0009-12.pt"):
        (tmp_path / stranger).write_bytes(b"x")
    assert [pos for pos, _ in T.list_checkpoints(prefix)] == [(2, 0), (1, 40), (1, 8), (1, 0), (0, 5)]
    path, state = T.newest_checkpoint(prefix, "mlp")
    assert path.name == "m-0002.pt" and state["epoch"] == 2
    assert T.newest_checkpoint(tmp_path / "none", "mlp") is None
    assert T.newest_checkpoint(tmp_path / "nodir" / "m", "mlp") is None


def test_a_torn_or_misnamed_checkpoint_is_never_picked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # what a writer without the rename would leave when killed: the newest name, half its bytes
    prefix = tmp_path / "m"
    T.save_checkpoint(T.checkpoint_path(prefix, 1), _state(1))
    T.save_checkpoint(T.checkpoint_path(prefix, 1, 20), _state(1, 20))
    whole = T.checkpoint_path(prefix, 1, 20).read_bytes()
    T.checkpoint_path(prefix, 1, 40).write_bytes(whole[:len(whole) // 2])
    T.checkpoint_path(prefix, 1, 60).write_bytes(b"")
    T.checkpoint_path(prefix, 2).write_bytes(whole)  # whole, but epoch 1 batch 20 inside
    with caplog.at_level(logging.WARNING, logger="trainer.fit"):
        path, state = T.newest_checkpoint(prefix, "mlp")
    assert (path.name, state["epoch"], state["batch"]) == ("m-0001-000020.pt", 1, 20)
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 3 and all(m.startswith("Skipping ") for m in skipped), skipped
    assert torch.equal(state["model"]["w"], torch.full((1000,), 1020.0))


def test_resume_refuses_the_newest_checkpoint_of_another_network(tmp_path: Path) -> None:
    T.save_checkpoint(T.checkpoint_path(tmp_path / "m", 1), _state(1, network="lenet"))
    with pytest.raises(T.FitError, match="holds a lenet network, not mlp"):
        T.newest_checkpoint(tmp_path / "m", "mlp")


_SLOW_WRITER = """
import io, sys, time
import torch
from trainer import fit as T

real_save = torch.save
def half_then_wait(obj, f):
    buf = io.BytesIO()
    real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[:len(data) // 2])
    f.flush()
    print("half", flush=True)
    time.sleep(60)
    f.write(data[len(data) // 2:])
torch.save = half_then_wait
T.save_checkpoint(T.checkpoint_path(sys.argv[1], 2), {"format": T.CHECKPOINT_FORMAT, "network": "mlp",
                  "epoch": 2, "batch": 0, "model": {}, "optimizer": {}})
"""


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_the_newest(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    prefix = tmp_path / "m"
    T.save_checkpoint(T.checkpoint_path(prefix, 1), _state(1))
    child = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(prefix)], stdout=subprocess.PIPE, text=True,
                             env=train_helpers.child_env())
    try:
        assert child.stdout is not None and child.stdout.readline() == "half\n"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[0] == "m-0001.pt" and len(left) == 2 and left[1].startswith("m-0002.pt.") and left[1].endswith(".tmp")
    path, _ = T.newest_checkpoint(prefix, "mlp")
    assert path.name == "m-0001.pt"
    T.remove_checkpoints(prefix, (0, 0))  # what a --resume does with a killed writer's temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-0001.pt"]


# --- small runs ------------------------------------------------------------------------


def _run(cfg: T.TrainConfig, mnist: MNIST, plot: str | None = None, metrics: str | None = None) -> dict:
    with kvstore.create("local") as kv:
        if metrics is None:
            return T.fit(cfg, kv, mnist, plot=plot)
        with MetricsFile(metrics, kv.rank, 3) as sink:
            return T.fit(cfg, kv, mnist, plot=plot, metrics=sink)


def test_the_metrics_file_has_a_line_per_logged_interval_and_per_epoch(mnist: MNIST, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "epoch", "epoch": 9}\n')  # an attempt before: appended to, not replaced
    cfg = T.TrainConfig(network="mlp", num_epochs=2, num_examples=1600, batch_size=16, disp_batches=10)
    with caplog.at_level(logging.INFO):
        summary = _run(cfg, mnist, metrics=str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"event": "epoch", "epoch": 9}
    logged = [r.getMessage() for r in caplog.records if r.name == "trainer.fit" and "Speed:" in r.getMessage()]
    intervals = [x for x in lines[1:] if x["event"] == "interval"]
    assert len(intervals) == len(logged) == 2 * 9  # batches 10..90 of each 100-batch epoch, as the log
    for record, line in zip(intervals, logged):  # the same figures as the log line, which has 6 decimals
        epoch, first, last = map(int, re.match(r"Epoch\[(\d+)\] Batch \[(\d+)-(\d+)\]", line).groups())
        assert (record["epoch"], record["batch"] - record["batches"], record["batch"]) == (epoch, first, last)
        assert f"accuracy={record['accuracy']:.6f}" in line and record["loss"] > 0
        assert record["rank"] == 0 and record["attempt"] == 3 and record["samples_per_sec"] > 0
    epochs = [x for x in lines[1:] if x["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert [e["validation_accuracy"] for e in epochs] == [e["validation_accuracy"] for e in summary["epochs"]]
    assert lines[-1]["event"] == "epoch" and lines[-1]["timestamp"] >= intervals[-1]["timestamp"]


def test_the_plot_title_names_the_worker_it_shows() -> None:
    cfg = T.TrainConfig(network="lenet", batch_size=32)
    assert T.plot_title(cfg, "dist_sync", 4) == "lenet, kv-store dist_sync, batch 32: worker 0's curves (of 4 workers)"
    assert T.plot_title(cfg, "local", 1).endswith("(of 1 worker)")


def test_a_metrics_file_is_rank_0s_unless_its_name_has_the_rank(tmp_path: Path) -> None:
    assert metrics_path("m.jsonl", 0) == "m.jsonl" and metrics_path("m.jsonl", 1) is None
    assert metrics_path("m-{rank}.jsonl", 1) == "m-1.jsonl"
    assert check_metrics_path(str(tmp_path / "m-{rank}.jsonl")) is None
    assert "is a directory" in (check_metrics_path(str(tmp_path)) or "")
    assert "does not exist" in (check_metrics_path(str(tmp_path / "no" / "m.jsonl")) or "")


def test_a_metrics_file_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept\n")
    (tmp_path / "m.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        MetricsFile(str(tmp_path / "m.jsonl"), 0, None)
    assert victim.read_text() == "kept\n"


def test_fit_logs_mxnet_lines_and_returns_a_summary(mnist: MNIST, caplog: pytest.LogCaptureFixture,
                                                    tmp_path: Path) -> None:
    cfg = T.TrainConfig(network="mlp", num_epochs=2, num_examples=1280, disp_batches=5,
                        model_prefix=str(tmp_path / "m"))
    with caplog.at_level(logging.INFO):
        summary = _run(cfg, mnist, plot=str(tmp_path / "curve.png"))
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.fit"]
    speed = [m for m in lines if m.startswith("Epoch[0] Batch")]
    assert [m.split("\t")[0] for m in speed] == ["Epoch[0] Batch [0-5]", "Epoch[0] Batch [5-10]",
                                                 "Epoch[0] Batch [10-15]"]
    assert all(re.fullmatch(r"Epoch\[0\] Batch \[\d+-\d+\]\tSpeed: \d+\.\d\d samples/sec\taccuracy=\d\.\d{6}", m)
               for m in speed)
    for e in (0, 1):
        assert any(re.fullmatch(rf"Epoch\[{e}\] Train-accuracy=\d\.\d{{6}}", m) for m in lines)
        assert any(re.fullmatch(rf"Epoch\[{e}\] Time cost=\d+\.\d{{3}}", m) for m in lines)
        assert any(re.fullmatch(rf"Epoch\[{e}\] Validation-accuracy=\d\.\d{{6}}", m) for m in lines)
        assert f'Saved checkpoint to "{tmp_path / "m"}-000{e + 1}.pt"' in lines
    order = [m.split(" ", 1)[1].split("=")[0] for m in lines if m.startswith("Epoch[1]") and "Batch" not in m]
    assert order == ["Train-accuracy", "Time cost", "Validation-accuracy"]  # MXNet's order
    assert summary["batches_per_epoch"] == 20 and summary["parameters"] == 109_386
    assert len(summary["epochs"]) == 2 and summary["validation_accuracy"] > 0.8
    assert summary["epochs"][1]["train_loss"] < summary["epochs"][0]["train_loss"]
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_matches_an_uninterrupted_run(mnist: MNIST, tmp_path: Path) -> None:
    base = {"network": "mlp", "num_examples": 640, "disp_batches": 0, "lr_step_epochs": (2,), "seed": 4}
    _run(T.TrainConfig(num_epochs=3, model_prefix=str(tmp_path / "full"), **base), mnist)
    _run(T.TrainConfig(num_epochs=1, model_prefix=str(tmp_path / "part"), **base), mnist)
    resumed = _run(T.TrainConfig(num_epochs=3, model_prefix=str(tmp_path / "part"), load_epoch=1, **base), mnist)
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2]
    full = T.load_checkpoint(T.checkpoint_path(tmp_path / "full", 3), "mlp")
    part = T.load_checkpoint(T.checkpoint_path(tmp_path / "part", 3), "mlp")
    for k, v in full["model"].items():
        assert torch.equal(part["model"][k], v), k  # same data order, momentum, lr schedule and counts
    for k, (a, b) in enumerate(zip(full["optimizer"]["states"].values(), part["optimizer"]["states"].values())):
        assert a["count"] == b["count"] == 30, k
        assert torch.equal(a["arrays"]["mom"], b["arrays"]["mom"])
    assert [h["epoch"] for h in part["history"]] == [0, 1, 2]


class _DiesAfter:
    """The local kvstore, whose ``pushpull`` raises after ``n`` calls: a worker that fails mid-epoch."""

    def __init__(self, kv: Any, n: int) -> None:
        self._kv, self._left = kv, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def pushpull(self, *args: Any, **kw: Any) -> None:
        if self._left == 0:
            raise RuntimeError("killed")
        self._left -= 1
        self._kv.pushpull(*args, **kw)


def test_resume_inside_an_epoch_matches_an_uninterrupted_run(mnist: MNIST, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    base = {"network": "mlp", "num_examples": 640, "disp_batches": 4, "lr_step_epochs": (2,), "seed": 4,
            "num_epochs": 3, "checkpoint_every_batches": 3}
    _run(T.TrainConfig(model_prefix=str(tmp_path / "full"), **base), mnist)
    part = tmp_path / "part"
    with kvstore.create("local") as kv, pytest.raises(RuntimeError, match="killed"):
        T.fit(T.TrainConfig(model_prefix=str(part), **base), _DiesAfter(kv, 10 + 8), mnist)  # epoch 1, batch 8
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("part")) == \
        ["part-0001-000006.pt", "part-0001.pt"]  # the older within-epoch ones are gone
    with caplog.at_level(logging.INFO, logger="trainer.fit"):
        resumed = _run(T.TrainConfig(model_prefix=str(part), resume=True, attempt=1, **base), mnist)
    assert f'Resuming from checkpoint "{part}-0001-000006.pt" at epoch 1 batch 6 (attempt 1)' in caplog.messages
    assert [m.split("\t")[0] for m in caplog.messages if m.startswith("Epoch[1] Batch")] == ["Epoch[1] Batch [4-8]"]
    assert [(e["epoch"], e.get("first_batch", 0)) for e in resumed["epochs"]] == [(1, 6), (2, 0)]
    full = T.load_checkpoint(T.checkpoint_path(tmp_path / "full", 3), "mlp")
    again = T.load_checkpoint(T.checkpoint_path(part, 3), "mlp")
    for k, v in full["model"].items():
        assert torch.equal(again["model"][k], v), k  # the data order's place, momentum and counts restored
    for a, b in zip(full["optimizer"]["states"].values(), again["optimizer"]["states"].values()):
        assert a["count"] == b["count"] == 30 and torch.equal(a["arrays"]["mom"], b["arrays"]["mom"])
    assert [h["epoch"] for h in again["history"]] == [0, 1, 2]
    # a --resume of a finished run trains nothing and reports the last model
    done = _run(T.TrainConfig(model_prefix=str(part), resume=True, **base), mnist)
    assert done["validation_accuracy"] == full["history"][-1]["validation_accuracy"]


def test_resume_without_a_checkpoint_starts_from_scratch(mnist: MNIST, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    base = {"network": "mlp", "num_examples": 320, "disp_batches": 0, "num_epochs": 1}
    fresh = _run(T.TrainConfig(model_prefix=str(tmp_path / "a"), **base), mnist)
    with caplog.at_level(logging.INFO, logger="trainer.fit"):
        resumed = _run(T.TrainConfig(model_prefix=str(tmp_path / "b"), resume=True, **base), mnist)
    assert f"No complete checkpoint of {tmp_path / 'b'}: training from scratch" in caplog.messages
    assert resumed["validation_accuracy"] == fresh["validation_accuracy"]


def test_a_within_epoch_checkpoint_needs_the_same_data_order(mnist: MNIST, tmp_path: Path) -> None:
    base = {"network": "mlp", "num_examples": 640, "disp_batches": 0, "num_epochs": 1,
            "checkpoint_every_batches": 4, "model_prefix": str(tmp_path / "m")}
    with kvstore.create("local") as kv, pytest.raises(RuntimeError, match="killed"):
        T.fit(T.TrainConfig(**base), _DiesAfter(kv, 5), mnist)
    with pytest.raises(T.FitError, match=r"m-0000-000004.pt stopped inside an epoch of a run with --batch-size "
                                         r"64, --num-examples 640, --seed 0 on 1 worker\(s\); this run has 32, 640, 0"):
        _run(T.TrainConfig(resume=True, **{**base, "batch_size": 32}), mnist)


def test_resume_with_the_wrong_network(mnist: MNIST, tmp_path: Path) -> None:
    _run(T.TrainConfig(network="mlp", num_epochs=1, num_examples=64, disp_batches=0,
                       model_prefix=str(tmp_path / "m")), mnist)
    with pytest.raises(T.FitError, match="holds a mlp network, not lenet"):
        _run(T.TrainConfig(network="lenet", num_epochs=2, load_epoch=1, model_prefix=str(tmp_path / "m")), mnist)


def test_an_unwritable_model_prefix_is_one_line_before_training(mnist: MNIST, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(T.FitError, match="--model-prefix .*: cannot create .*file/sub") as info:
        _run(T.TrainConfig(model_prefix=str(tmp_path / "file" / "sub" / "m"), num_epochs=1, num_examples=64,
                           disp_batches=0), mnist)
    assert "\n" not in str(info.value)
    with pytest.raises(T.FitError, match="cannot write checkpoint .*m-0001.pt"):
        T.save_checkpoint(tmp_path / "file" / "m-0001.pt", {})


def test_fit_checks_its_configuration(mnist: MNIST) -> None:
    with pytest.raises(T.FitError, match="--num-examples 60001 must be between 1 and 60000"):
        _run(T.TrainConfig(num_examples=60001), mnist)
    with pytest.raises(T.FitError, match="has 1 entries for 2 devices"):
        _run(T.TrainConfig(devices=("cpu", "cpu"), work_load=(1.0,)), mnist)


# --- the plot, read back as an image --------------------------------------------------------------


def _blobs(png: Path, color: str, tolerance: int = 40, min_pixels: int = 4) -> int:
    """Connected regions (4-neighbour) of pixels within ``tolerance`` of ``color`` in the image:
    the markers of one series (a series joined by a line of its own colour would count once)."""
    import matplotlib.image

    img = (matplotlib.image.imread(str(png))[:, :, :3] * 255).astype(int)
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    mask = (np.abs(img - rgb).sum(axis=2) < tolerance)
    seen = np.zeros_like(mask)
    count = 0
    h, w = mask.shape
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        seen[y, x] = True
        stack, size = [(y, x)], 0
        while stack:
            cy, cx = stack.pop()
            size += 1
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        count += size >= min_pixels
    return count


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_plot_has_a_point_per_disp_batches_interval_and_per_epoch(mnist: MNIST, tmp_path: Path,
                                                                     epochs: int) -> None:
    """100 batches an epoch with --disp-batches 10 log 9 Speedometer lines (batches 10 to 90, as
    MXNet), so the image shows 9 interval points per epoch in each panel (loss and accuracy),
    plus one marker each in the legends; one validation point per epoch (a lone diamond when
    there is one epoch: no line joins it to anything)."""
    png = tmp_path / "curve.png"
    cfg = T.TrainConfig(network="mlp", num_epochs=epochs, num_examples=1600, batch_size=16, disp_batches=10)
    _run(cfg, mnist, plot=str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert _blobs(png, T.PLOT_INTERVAL_COLOR) == 2 * (9 * epochs + 1)
    if epochs == 1:
        assert _blobs(png, T.PLOT_VALIDATION_COLOR) == 1 + 1
        assert _blobs(png, T.PLOT_EPOCH_TRAIN_COLOR) == 2 * (1 + 1)
    without = tmp_path / "epochs-only.png"  # --disp-batches 0: per epoch only, as before
    T.plot_history(without, [{"epoch": 0, "train_loss": 0.5, "train_accuracy": 0.9, "validation_accuracy": 0.95}],
                   "t")
    assert _blobs(without, T.PLOT_INTERVAL_COLOR) == 0 and _blobs(without, T.PLOT_VALIDATION_COLOR) == 2
