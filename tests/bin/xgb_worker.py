"""A small XGBoost worker for the tracker tests; run with a Python that has xgboost.

It trains a binary classifier (``hist``) on a shard of a deterministic
synthetic data set and writes ``<out>/<name>.json`` with its rank, world size,
task id, the SHA-256 of the dumped model and its predictions on the whole data
set (float32 bytes in hex, so equality is exact).

Modes (``--api``):

* ``env``: XGBoost 2.0 style, ``xgboost.collective.CommunicatorContext()`` with
  no arguments; rabit reads DMLC_TRACKER_URI, DMLC_TRACKER_PORT, DMLC_TASK_ID.
* ``rabit``: the dmlc-era script style of XGBoost <= 1.x, ``xgboost.rabit.init()``
  and ``xgboost.rabit.finalize()`` (a deprecated alias in 2.0).
* ``args``: XGBoost 2.1+ style, ``CommunicatorContext(dmlc_tracker_uri=...,
  dmlc_tracker_port=..., dmlc_task_id=...)`` built from those variables, since
  2.1+ reads none of them itself.
* ``solo``: no collective at all; ``--shard K/N`` or the whole data set.

``--exit-before-join CODE`` exits before talking to any tracker (``TASK:CODE``: only the worker
whose ``DMLC_TASK_ID`` is TASK);
``--no-tracker SECONDS`` sleeps and exits 0 without ever talking to it.
``--only-rank`` joins, writes rank and task id, and leaves without training.
``--wait-for PATH`` waits after joining, before training, until PATH exists (60 s at most).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

PARAMS = {
    "objective": "binary:logistic",
    "tree_method": "hist",
    "max_depth": 3,
    "eta": 0.3,
    "max_bin": 64,  # above the distinct values per feature: the quantile cuts are exact everywhere
    "nthread": 1,  # one thread: histograms summed in one order
    "base_score": 0.5,  # no intercept estimated from the data
    "seed": 0,
}
ROUNDS = 8


def make_data(rows: int):
    import numpy as np

    rng = np.random.RandomState(20240607)
    x = rng.randint(0, 16, size=(rows, 6)).astype(np.float32)  # 16 distinct values per feature
    score = x[:, 0] - x[:, 1] + 0.5 * x[:, 2] * (x[:, 3] > 7) + rng.normal(0, 2.0, rows)
    y = (score > 2.0).astype(np.float32)
    return x, y


def shard(x, y, k: int, n: int):
    lo, hi = len(x) * k // n, len(x) * (k + 1) // n
    return x[lo:hi], y[lo:hi]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=["env", "rabit", "args", "solo"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--shard", default=None, help="K/N for --api solo (default: all the data)")
    ap.add_argument("--exit-before-join", default=None, metavar="[TASK:]CODE")
    ap.add_argument("--no-tracker", type=float, default=None)
    ap.add_argument("--only-rank", action="store_true")
    ap.add_argument("--wait-for", default=None, metavar="PATH")
    a = ap.parse_args()
    out = Path(a.out)
    task_id = os.environ.get("DMLC_TASK_ID", "NULL")
    name = a.name or f"task-{task_id}"

    if a.exit_before_join is not None:
        who, _, code = a.exit_before_join.rpartition(":")
        if who in ("", task_id):
            print(f"xgb_worker task {task_id}: exiting with {code} before joining", file=sys.stderr, flush=True)
            return int(code)
    if a.no_tracker is not None:
        time.sleep(a.no_tracker)
        return 0

    import xgboost
    from xgboost import collective

    x, y = make_data(a.rows)
    result = {"xgboost": xgboost.__version__, "task_id": task_id, "pid": os.getpid()}

    def train(xs, ys):
        dtrain = xgboost.DMatrix(xs, label=ys)
        booster = xgboost.train(PARAMS, dtrain, ROUNDS, evals=[(dtrain, "train")], verbose_eval=True)
        dump = "\n".join(booster.get_dump(dump_format="json"))
        preds = booster.predict(xgboost.DMatrix(x)).astype("<f4")
        return {"model_sha256": hashlib.sha256(dump.encode()).hexdigest(), "predictions": preds.tobytes().hex(),
                "train_rows": int(len(xs))}

    def distributed():
        rank, world = collective.get_rank(), collective.get_world_size()
        result.update(rank=rank, world=world)
        collective.communicator_print(f"xgb_worker task {task_id}: rank {rank} of {world}")
        end = time.monotonic() + 60
        while a.wait_for and not os.path.exists(a.wait_for) and time.monotonic() < end:
            time.sleep(0.05)
        if not a.only_rank:
            result.update(train(*shard(x, y, rank, world)))

    if a.api == "solo":
        if a.shard:
            k, n = (int(v) for v in a.shard.split("/"))
            result.update(train(*shard(x, y, k, n)))
        else:
            result.update(train(x, y))
    elif a.api == "env":
        with collective.CommunicatorContext():
            distributed()
    elif a.api == "rabit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            xgboost.rabit.init()
            try:
                distributed()
            finally:
                xgboost.rabit.finalize()
    else:
        args = {"dmlc_tracker_uri": os.environ["DMLC_TRACKER_URI"],
                "dmlc_tracker_port": int(os.environ["DMLC_TRACKER_PORT"]),
                "dmlc_task_id": task_id}
        with collective.CommunicatorContext(**args):
            distributed()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
