"""train_mnist's command line: MXNet's flags and defaults, our additions, one-line usage errors."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

import pscontract as pc
from trainer import train_mnist as M


@pytest.fixture(autouse=True)
def _trainer_logger_restored() -> Iterator[None]:
    """main() configures the ``trainer`` logger (its own handler, no propagation): put it back, or
    a later test's caplog, which listens at the root, hears nothing of the trainer."""
    logger = logging.getLogger(M.LOGGER)
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], level, logger.propagate = saved
    logger.setLevel(level)


def test_mxnet_defaults() -> None:
    a = M.parse_args([])
    assert (a.network, a.gpus, a.kv_store, a.batch_size, a.num_epochs) == ("mlp", None, "device", 64, 20)
    assert (a.lr, a.lr_factor, a.lr_step_epochs, a.optimizer, a.mom, a.wd) == (0.05, 0.1, "10", "sgd", 0.9, 0.0001)
    assert (a.disp_batches, a.model_prefix, a.save_period, a.load_epoch, a.num_examples) == (100, None, 1, None, 60000)
    assert (a.cpus, a.work_load, a.data_dir, a.seed, a.threads, a.plot) == (None, None, None, 0, None, None)
    assert a.lr_step_list == [10]


def test_our_flags() -> None:
    a = M.parse_args(["--network", "lenet", "--cpus", "2", "--work-load-list", "3,1", "--lr-step-epochs", "5,8",
                      "--threads", "3", "--seed", "7", "--plot", "x.png", "--gpus", ""])
    assert a.work_load == (3.0, 1.0) and a.lr_step_list == [5, 8] and a.cpus == 2 and a.threads == 3
    assert a.gpus is None and a.gpu_list is None
    assert M.parse_args(["--gpus", "0,2", "--work-load-list", "1,5"]).gpu_list == [0, 2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "--batch-size: 0 must be at least 1"),
        (["--network", "resnet"], "argument --network: invalid choice: 'resnet'"),
        (["--kv-store", "nccl"], "argument --kv-store: invalid choice"),
        (["--load-epoch", "2"], "--load-epoch needs --model-prefix"),
        (["--resume"], "--resume needs --model-prefix"),
        (["--checkpoint-every-batches", "5"], "--checkpoint-every-batches needs --model-prefix"),
        (["--resume", "--load-epoch", "1", "--model-prefix", "m"], "use --resume or --load-epoch, not both"),
        (["--checkpoint-every-batches", "-1", "--model-prefix", "m"], "-1 must not be negative"),
        (["--load-epoch", "3", "--num-epochs", "3", "--model-prefix", "m"], "leaves nothing to do"),
        (["--gpus", "0", "--cpus", "2"], "use --gpus or --cpus, not both"),
        (["--gpus", "0,0"], "a GPU is listed twice"),
        (["--gpus", "x"], "--gpus 'x': expected integers"),
        (["--cpus", "2", "--work-load-list", "1"], "has 1 entries for 2 device(s)"),
        (["--work-load-list", "a"], "expected numbers such as 3,1"),
        (["--cpus", "2", "--work-load-list", "1,0"], "every share must be a positive number"),
        (["--lr-step-epochs", "0"], "values must be at least 1"),
        (["--lr-factor", "2"], "--lr-factor 2 must be in (0, 1]"),
        (["--mom", "1"], "--mom 1 must be below 1"),
        (["--lr", "-1"], "must be a finite number >= 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--seed", "-1"], "--seed: -1 must not be negative"),  # numpy's shuffling seed cannot be negative
    ],
)
def test_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(M.UsageError) as info:
        M.parse_args(argv)
    assert message in str(info.value)


def test_main_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert M.main(["--batch-size", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_mnist: error: argument --batch-size")


@pytest.mark.parametrize(("local", "cores", "expected"), [(None, 2, 2), ("3", 2, 1), ("2", 8, 4), ("1", 16, 16),
                                                          ("junk", 4, 4)])
def test_default_threads(monkeypatch: pytest.MonkeyPatch, local: str | None, cores: int, expected: int) -> None:
    monkeypatch.setattr(M.os, "sched_getaffinity", lambda pid: set(range(cores)))
    env = {} if local is None else {pc.LOCAL_PROCS: local}
    assert M.default_threads(env) == expected


@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_roles_without_parameter_servers_exit_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                role: str) -> None:
    env = pc.contract(role, root_uri="127.0.0.1", root_port=9, num_workers=1, num_servers=1, secret="s" * 32,
                           start_timeout=5, job_id="t", task_id=None if role == "scheduler" else 1, cluster="local")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert M.main(["--kv-store", "local"]) == 0
    assert f"this {role} exits: --kv-store local trains without parameter servers" in capsys.readouterr().err


def test_bad_role_environment_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(pc.ROLE, "server")
    monkeypatch.delenv(pc.ROOT_URI, raising=False)
    assert M.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not set" in err


def test_the_rank_prefix_survives_a_handler_copied_without_filters() -> None:
    # tqdm's logging_redirect_tqdm before 4.70 copies a console handler's formatter and stream but not
    # its filters: the Node[rank] prefix must come from the formatter alone.
    import logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        handler = M._setup_logging()
        handler.setFormatter(M._formatter(3))
        copy = logging.StreamHandler(handler.stream)
        copy.setFormatter(handler.formatter)
        record = logging.LogRecord("trainer.fit", logging.INFO, __file__, 1, "Epoch[0] Train-accuracy=%f", (0.5,), None)
        assert copy.format(record).endswith(" Node[3] Epoch[0] Train-accuracy=0.500000")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_help_states_each_default_once() -> None:
    import re

    text = M.build_parser().format_help()
    flat = " ".join(text.split())
    assert "(default: None)" not in flat
    for option in re.findall(r"^\s+(--[a-z-]+)", text, re.M):
        block = flat.split(f" {option} ", 1)[1].split(" --", 1)[0]
        assert block.count("(default") <= 1, (option, block)
    assert "(default: the CPU)" in flat and "(default: 64)" in flat
    # a flag's default reads as if the flag were on: --no-pin "(default: True)", --resume "(default: False)"
    assert "(default: True)" not in flat and "(default: False)" not in flat


@pytest.mark.parametrize(("threads", "local", "cores", "expected"), [
    (2, None, 2, False),  # alone, all the cores: threads of our own, left spinning
    (4, None, 2, True),
    (2, "3", 2, True),    # a worker beside a server and another worker, asked for 2 threads
    (1, "3", 2, False),
    (4, "2", 8, False),
    (5, "2", 8, True),
])
def test_oversubscribed(monkeypatch: pytest.MonkeyPatch, threads: int, local: str | None, cores: int,
                        expected: bool) -> None:
    monkeypatch.setattr(M.os, "sched_getaffinity", lambda pid: set(range(cores)))
    env = {} if local is None else {pc.LOCAL_PROCS: local}
    assert M.oversubscribed(threads, env) is expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("threads", "policy"), [("1", None), ("2", None), ("3", "PASSIVE")])
def test_openmp_threads_sleep_only_when_they_outnumber_the_cores(monkeypatch: pytest.MonkeyPatch, threads: str,
                                                                  policy: str | None) -> None:
    # sleeping OpenMP threads made a lone MLP 3.7x slower on 2 cores (LeNet 1.6x); spinning ones
    # collapse when the job's threads outnumber the cores
    from support.trainer import mnist_dir

    monkeypatch.setattr(M.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(pc.OMP_WAIT_POLICY, "")  # (recorded: the trainer's own setting is undone after the test)
    monkeypatch.delenv(pc.OMP_WAIT_POLICY)
    monkeypatch.delenv(pc.LOCAL_PROCS, raising=False)
    monkeypatch.delenv(pc.ROLE, raising=False)
    import torch

    before = torch.get_num_threads()
    try:
        assert M.main(["--kv-store", "local", "--network", "mlp", "--num-epochs", "1", "--num-examples", "640",
                       "--disp-batches", "0", "--threads", threads, "--data-dir", str(mnist_dir())]) == 0
    finally:
        torch.set_num_threads(before)
    assert M.os.environ.get(pc.OMP_WAIT_POLICY) == policy


@pytest.mark.parametrize(("env", "cores", "expected"), [
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "0"}, 2, [0]),
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "1"}, 2, [1]),
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "1"}, 5, [2, 3]),
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "0", "PSLAUNCH_LOCAL_PROCS": "2", "DMLC_TASK_ID": "1"}, 2, [1]),
    # another host has some of the job's processes: the task ids do not say who is here
    ({"DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "2", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "2"}, 2, None),
    ({"DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "0", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "0"}, 2, None),
    ({"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "PSLAUNCH_LOCAL_PROCS": "2", "DMLC_TASK_ID": "0"}, 2, None),
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": "2"}, 2, None),
    ({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_TASK_ID": "0"}, 2, None),  # not under pslaunch
    ({}, 2, None),
])
def test_worker_cores(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cores: int,
                      expected: list[int] | None) -> None:
    monkeypatch.setattr(M.os, "sched_getaffinity", lambda pid: set(range(10, 10 + cores)))
    want = None if expected is None else [10 + c for c in expected]
    assert M.worker_cores(env) == want
