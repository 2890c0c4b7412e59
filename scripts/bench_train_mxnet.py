#!/usr/bin/env python3
"""MXNet 1.9.1's MNIST training, as its ``example/image-classification/train_mnist.py`` does it.

``scripts/bench_train.py`` runs this beside ``train_mnist.py`` to report speed
ratios measured in the same run. It builds MXNet's ``lenet`` and ``mlp``
symbols, trains them with ``mx.mod.Module.fit`` through ``mx.kv.create(kv_store)``
(update on the kvstore, MXNet's rescale_grad, Xavier(gaussian, in, 2), SGD with
momentum and weight decay, a multi-factor schedule, the Speedometer) and prints
MXNet's own log lines, then one JSON line like train_mnist's.

One deviation, for short benchmark runs: every kv-store type gets MXNet's
``ResizeIter`` to ``ceil(num_examples / num_workers / batch_size)`` batches per
epoch (MXNet's fit does that for ``dist_sync`` only; with the default 60,000
examples the count is the same). The data is the same MNIST, read with
``trainer.data`` (numpy only) and scaled by 1/255 as the example does.

Run it with MXNet's Python, directly or under the launcher (``import mxnet``
turns the scheduler and server processes into their roles)::

    /opt/mxnet-venv/bin/python scripts/bench_train_mxnet.py --network lenet --kv-store local
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", choices=("lenet", "mlp"), default="lenet")
    p.add_argument("--kv-store", default="device")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--num-examples", type=int, default=60000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-factor", type=float, default=0.1)
    p.add_argument("--lr-step-epochs", default="10")
    p.add_argument("--mom", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=0.0001)
    p.add_argument("--disp-batches", type=int, default=100)
    p.add_argument("--data-dir", default=None)
    return p.parse_args()


def lenet(mx):  # noqa: ANN001, ANN201 - mxnet is imported late, for the server roles
    data = mx.sym.Variable("data")
    c1 = mx.sym.Convolution(data=data, kernel=(5, 5), num_filter=20)
    p1 = mx.sym.Pooling(data=mx.sym.Activation(data=c1, act_type="tanh"), pool_type="max", kernel=(2, 2),
                        stride=(2, 2))
    c2 = mx.sym.Convolution(data=p1, kernel=(5, 5), num_filter=50)
    p2 = mx.sym.Pooling(data=mx.sym.Activation(data=c2, act_type="tanh"), pool_type="max", kernel=(2, 2),
                        stride=(2, 2))
    f1 = mx.sym.FullyConnected(data=mx.sym.flatten(data=p2), num_hidden=500)
    f2 = mx.sym.FullyConnected(data=mx.sym.Activation(data=f1, act_type="tanh"), num_hidden=10)
    return mx.sym.SoftmaxOutput(data=f2, name="softmax")


def mlp(mx):  # noqa: ANN001, ANN201
    data = mx.sym.flatten(data=mx.sym.Variable("data"))
    f1 = mx.sym.Activation(data=mx.sym.FullyConnected(data=data, name="fc1", num_hidden=128), act_type="relu")
    f2 = mx.sym.Activation(data=mx.sym.FullyConnected(data=f1, name="fc2", num_hidden=64), act_type="relu")
    f3 = mx.sym.FullyConnected(data=f2, name="fc3", num_hidden=10)
    return mx.sym.SoftmaxOutput(data=f3, name="softmax")


class _Capture(logging.Handler):
    """Collects the epoch times and validation accuracies that Module.fit logs."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.val: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "Epoch[%d] Time cost=%.3f":
            self.times.append(float(record.args[1]))
        elif record.msg == "Epoch[%d] Validation-%s=%f" and record.args[1] == "accuracy":
            self.val.append(float(record.args[2]))


def main() -> int:
    args = parse_args()
    import mxnet as mx  # a scheduler or server process runs its role here and exits
    import numpy as np

    from trainer.data import load_mnist

    kv = mx.kv.create(args.kv_store)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s Node[{kv.rank}] %(message)s")
    capture = _Capture()
    logging.getLogger().addHandler(capture)
    data = load_mnist(args.data_dir)

    def scaled(images: np.ndarray) -> np.ndarray:
        return images.reshape(-1, 1, 28, 28).astype(np.float32) / 255

    train = mx.io.NDArrayIter(scaled(data.train_images), data.train_labels.astype(np.float32), args.batch_size,
                              shuffle=True)
    val = mx.io.NDArrayIter(scaled(data.test_images), data.test_labels.astype(np.float32), args.batch_size)
    epoch_size = math.ceil(int(args.num_examples / kv.num_workers) / args.batch_size)
    logging.info("Resizing training data to %d batches per machine", epoch_size)
    train = mx.io.ResizeIter(train, epoch_size)
    steps = [epoch_size * int(s) for s in args.lr_step_epochs.split(",") if int(s) > 0]
    optimizer_params = {"learning_rate": args.lr, "momentum": args.mom, "wd": args.wd,
                        "lr_scheduler": mx.lr_scheduler.MultiFactorScheduler(step=steps, factor=args.lr_factor)}
    net = lenet(mx) if args.network == "lenet" else mlp(mx)
    mod = mx.mod.Module(net, context=mx.cpu())
    mod.fit(train, eval_data=val, num_epoch=args.num_epochs, kvstore=kv, optimizer="sgd",
            optimizer_params=optimizer_params,
            initializer=mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2),
            eval_metric="acc", batch_end_callback=mx.callback.Speedometer(args.batch_size, args.disp_batches))
    samples = epoch_size * args.batch_size
    summary = {
        "framework": f"mxnet {mx.__version__}",
        "network": args.network,
        "kv_store": args.kv_store,
        "rank": kv.rank,
        "num_workers": kv.num_workers,
        "batch_size": args.batch_size,
        "batches_per_epoch": epoch_size,
        "epoch_times": capture.times,
        "samples_per_sec": round(len(capture.times) * samples / sum(capture.times), 2) if capture.times else None,
        "validation_accuracy": capture.val[-1] if capture.val else None,
        "validation_accuracies": capture.val,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
