"""scripts/bench_train.py: every contender is tried in the settings it is fastest in, and the table
names the one that won (MXNet's naive engine included: its lenet is fastest on both cores with it)."""

from __future__ import annotations

import importlib.util
import sys

from support.helpers import REPO

SCRIPT = REPO / "scripts" / "bench_train.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


NAIVE = {"MXNET_ENGINE_TYPE": "NaiveEngine"}


def test_in_one_process_each_runs_on_one_core_and_on_all_and_mxnet_also_with_its_naive_engine() -> None:
    b = load()
    ours = b.settings("ours", "local", 2)
    assert [(s.threads, s.env) for s in ours] == [(1, {}), (2, {})]
    mxnet = b.settings("mxnet", "local", 2)
    assert [(s.threads, s.env) for s in mxnet] == [(1, {}), (2, {}), (2, NAIVE)]
    assert [s.label for s in mxnet] == ["1 thread", "2 threads", "2 threads, naive engine"]
    # one core: nothing to choose between thread counts, the engines still differ
    assert [(s.threads, s.env) for s in b.settings("mxnet", "local", 1)] == [(None, {}), (None, NAIVE)]


def test_under_the_launcher_each_process_has_one_thread_and_mxnet_tries_both_engines() -> None:
    b = load()
    for mode in ("dist_sync", "dist_async", "pair"):
        assert [(s.threads, s.env) for s in b.settings("ours", mode, 2)] == [(None, {})]
        mxnet = b.settings("mxnet", mode, 2)
        assert [(s.threads, s.env) for s in mxnet] == [(None, {}), (None, NAIVE)]
        assert [s.label for s in mxnet] == ["", "naive engine"]


def test_the_table_names_the_winning_setting() -> None:
    b = load()
    assert b._threads({"mxnet_setting": "2 threads, naive engine"}, "mxnet") == " (2 threads, naive engine)"
    assert b._threads({"ours_setting": ""}, "ours") == ""
    assert b._threads({}, "ours") == ""
