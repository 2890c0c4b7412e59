"""scripts/bench_train.py: every contender is tried in the settings it is fastest in, and the table
names the one that won (MXNet's naive engine included: its lenet is fastest on both cores with it)."""

from __future__ import annotations

from support.helpers import load_script

NAIVE = {"MXNET_ENGINE_TYPE": "NaiveEngine"}


def test_in_one_process_each_runs_on_one_core_and_on_all_and_mxnet_also_with_its_naive_engine() -> None:
    b = load_script("bench_train")
    ours = b.settings("ours", "local", 2)
    assert [(s.threads, s.env) for s in ours] == [(1, {}), (2, {})]
    mxnet = b.settings("mxnet", "local", 2)
    assert [(s.threads, s.env) for s in mxnet] == [(1, {}), (2, {}), (2, NAIVE)]
    assert [s.label for s in mxnet] == ["1 thread", "2 threads", "2 threads, naive engine"]
    # one core: nothing to choose between thread counts, the engines still differ
    assert [(s.threads, s.env) for s in b.settings("mxnet", "local", 1)] == [(None, {}), (None, NAIVE)]


def test_under_the_launcher_each_process_has_one_thread_and_mxnet_tries_both_engines() -> None:
    b = load_script("bench_train")
    for mode in ("dist_sync", "dist_async", "pair"):
        assert [(s.threads, s.env) for s in b.settings("ours", mode, 2)] == [(None, {})]
        mxnet = b.settings("mxnet", mode, 2)
        assert [(s.threads, s.env) for s in mxnet] == [(None, {}), (None, NAIVE)]
        assert [s.label for s in mxnet] == ["", "naive engine"]


def test_the_table_names_the_winning_setting() -> None:
    b = load_script("bench_train")
    assert b._setting({"mxnet_setting": "2 threads, naive engine"}, "mxnet") == " (2 threads, naive engine)"
    assert b._setting({"ours_setting": ""}, "ours") == ""
    assert b._setting({}, "ours") == ""
