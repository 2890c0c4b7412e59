"""What torchrun's programs and libraries expect of ``pslaunch --tracker torch``, held against the real ones.

* Lightning 2.6 (``strategy="ddp"`` on the CPU, 2 processes): it picks ``TorchElasticEnvironment``,
  starts no process of its own, and trains (the loss falls; DDP keeps both ranks' parameters equal);
* Accelerate 1.15's own test script (what ``accelerate test`` runs) with 2 processes: it passes, and prints
  line for line what it prints under torchrun;
* a program that dumps its environment, under the real ``torchrun --nproc-per-node 2`` and under
  ``pslaunch -n 2 --tracker torch`` on this machine: every variable torchrun adds, pslaunch adds
  too, with the same value wherever one host's values must agree. What torchrun sets and pslaunch
  does not is listed below with the reason, so a new variable of torchrun's fails the test.

Lightning and Accelerate come from .venv-torchlibs (scripts/deps/75-torchlibs.sh, exact pins, torch
2.13.0 CPU; ``$PSLAUNCH_TORCHLIBS_PYTHON``); torchrun is the test's own Python's torch.
Programs: tests/bin/lightning_ddp.py, tests/bin/env_dump.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import BIN, REPO, free_port, run_pslaunch

pytestmark = pytest.mark.integration

LIGHTNING = str(BIN / "lightning_ddp.py")
ENV_DUMP = str(BIN / "env_dump.py")
DEADLINE = 540  # liveness only: importing torch and Lightning in two processes on a loaded 2-core machine

#: torchrun's variables that pslaunch does not set, each with why (none today: a new one fails the test)
TORCHRUN_ONLY: dict[str, str] = {}
#: torchrun's variables that pslaunch sets to another value on purpose, each with why
OTHER_VALUE = {
    "MASTER_PORT": "each launcher's store listens on a free port of its own",
    "TORCHELASTIC_RUN_ID": "torchrun's --rdzv-id ('none' unless given); pslaunch's job id, the same in every attempt",
    "TORCHELASTIC_ERROR_FILE": "a file of each process's own, in each launcher's own directory",
}
#: what pslaunch adds beyond torchrun's set: its own and dmlc's contract, and Python's output settings
PSLAUNCH_PREFIXES = ("DMLC_", "PSLAUNCH_", "PS_")
PSLAUNCH_EXTRA = {"PYTHONUNBUFFERED": "output line by line", "PYTHONFAULTHANDLER": "--timeout dumps Python stacks"}


def torchlibs_python() -> str:
    """.venv-torchlibs's Python; the test is skipped without it (and fails so under CI: marker torchlibs)."""
    python = os.environ.get("PSLAUNCH_TORCHLIBS_PYTHON") or str(REPO / ".venv-torchlibs" / "bin" / "python")
    if not os.path.exists(python):
        pytest.skip("no Lightning/Accelerate venv (run scripts/deps/75-torchlibs.sh; it prints "
                    "PSLAUNCH_TORCHLIBS_PYTHON)")
    return python


def launcher_free_environ() -> dict[str, str]:
    """This process's environment without anything a launcher sets: what both launchers start from."""
    launchers = ("DMLC_", "PSLAUNCH_", "PS_", "TORCHELASTIC_", "MASTER_", "PET_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
             "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER"}
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith(launchers)}


def added(out: Path, parent: dict[str, str]) -> dict[str, dict[str, str]]:
    """Per ``RANK``: what env_dump.py saw that ``parent`` did not have (or had with another value)."""
    got = {}
    for f in sorted(out.glob("env-*.json")):
        env = json.loads(f.read_text())
        got[env.get("RANK", "none")] = {k: v for k, v in env.items() if parent.get(k) != v}
    return got


def test_a_torch_worker_sees_every_variable_torchrun_gives_it(tmp_path: Path) -> None:
    parent = launcher_free_environ()
    theirs, ours = tmp_path / "torchrun", tmp_path / "pslaunch"
    theirs.mkdir()
    ours.mkdir()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), ENV_DUMP, str(theirs)], env=parent, capture_output=True, text=True,
                       timeout=DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    p = run_pslaunch("-n", "2", "--tracker", "torch", sys.executable, ENV_DUMP, str(ours), env=parent,
                     timeout=DEADLINE)
    assert p.returncode == 0, p.stdout + p.stderr
    torchrun, pslaunch = added(theirs, parent), added(ours, parent)
    assert sorted(torchrun) == sorted(pslaunch) == ["0", "1"], (sorted(torchrun), sorted(pslaunch))
    names = set(torchrun["0"]) | set(torchrun["1"])
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"} <= names, names  # (it ran)
    for rank in ("0", "1"):
        missing = set(torchrun[rank]) - set(pslaunch[rank])
        assert missing == set(TORCHRUN_ONLY), (
            f"rank {rank}: torchrun sets {sorted(missing - set(TORCHRUN_ONLY))} and pslaunch does not "
            f"(set it, or list it in TORCHRUN_ONLY with the reason); listed but set now: "
            f"{sorted(set(TORCHRUN_ONLY) - missing)}")
        differ = {k: (v, pslaunch[rank][k]) for k, v in torchrun[rank].items()
                  if k in pslaunch[rank] and pslaunch[rank][k] != v}
        assert set(differ) == set(OTHER_VALUE), (rank, differ)
        extra = {k for k in set(pslaunch[rank]) - names
                 if not k.startswith(PSLAUNCH_PREFIXES) and k not in PSLAUNCH_EXTRA}
        assert not extra, f"rank {rank}: pslaunch sets {sorted(extra)} and torchrun does not"
    # what the comparison rests on: one host's placement, the same under both
    for rank in ("0", "1"):
        assert (pslaunch[rank]["RANK"], pslaunch[rank]["LOCAL_RANK"], pslaunch[rank]["GROUP_RANK"]) == (rank, rank, "0")
        assert pslaunch[rank]["TORCHELASTIC_ERROR_FILE"] != torchrun[rank]["TORCHELASTIC_ERROR_FILE"]
    shown = {**pslaunch["0"], "PSLAUNCH_SECRET": "<redacted>"}
    table = "\n".join(f"  {k:34} torchrun={torchrun['0'].get(k)!r:40} pslaunch={shown.get(k)!r}"
                      for k in sorted(names | set(shown)))
    print(f"rank 0, what each launcher adds:\n{table}")


@pytest.mark.torchlibs
@pytest.mark.slow
@pytest.mark.timeout(DEADLINE + 60)
def test_lightning_ddp_on_the_cpu_finds_the_cluster_and_trains(tmp_path: Path) -> None:
    python = torchlibs_python()
    out = tmp_path / "out"
    out.mkdir()
    r = run_pslaunch("-n", "2", "--tracker", "torch", "--kill-grace", "2", python, LIGHTNING, "--out", str(out),
                     timeout=DEADLINE, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}
    assert sorted(ranks) == [0, 1], r.stdout + r.stderr
    for rank, x in ranks.items():
        assert (x["global_rank"], x["local_rank"], x["world_size"], x["node_rank"]) == (rank, rank, 2, 0), x
        assert x["cluster_environment"] == "TorchElasticEnvironment" and x["creates_processes_externally"], x
        assert x["strategy"] == "DDPStrategy" and x["launcher_procs"] == 0, x  # Lightning started no rank
        assert x["children_while_training"] == [], x  # and nothing started under the rank
        assert x["state"] == "finished", x
        losses = x["epoch_losses"]
        assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
        assert losses[-1] < losses[0] / 4, losses
    pids = {x["pid"] for x in ranks.values()}
    assert len(pids) == 2 and not pids & {x["ppid"] for x in ranks.values()}  # neither rank started the other
    assert ranks[0]["params"] == pytest.approx(ranks[1]["params"], rel=1e-6)  # DDP: one model on both ranks
    for rank in (0, 1):  # each rank said so once
        assert sum(f"lightning rank {rank} pid " in line for line in r.stdout.splitlines()) == 1, r.stdout


#: runs the script given as its argument as ``__main__`` and, once it returned, leaves at once
#: (an exception in it is a traceback and exit 1, as without this)
LEAVE_AT_ONCE = ("import os, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
                 "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")


def rank_lines(stdout: str, rank: int) -> list[str]:
    """What worker ``rank`` printed, from pslaunch's console (its ``[worker N] `` lines)."""
    label = f"[worker {rank}] "
    return [line[len(label):] for line in stdout.splitlines() if line.startswith(label)]


@pytest.mark.torchlibs
@pytest.mark.slow
@pytest.mark.timeout(2 * DEADLINE + 60)
def test_accelerates_own_test_script_passes_with_two_processes_as_under_torchrun(tmp_path: Path) -> None:
    python = torchlibs_python()
    where = subprocess.run([python, "-c", "import importlib.util as u; "
                            "print(u.find_spec('accelerate').submodule_search_locations[0])"],
                           capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    script = Path(where.stdout.strip(), "test_utils", "scripts", "test_script.py")  # what `accelerate test` runs
    assert script.is_file(), script
    # On a machine without an accelerator, Accelerate is distributed only with ACCELERATE_USE_CPU (what
    # `accelerate launch --cpu` sets): under either launcher, without it each process runs alone
    # (DistributedType.NO). The script writes a file into its working directory: one of its own each.
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    # Both launchers run the script through LEAVE_AT_ONCE: once it has returned, each rank leaves
    # without the interpreter's finalization, where torch 2.13 with gloo sometimes aborts
    # ("terminate called without an active exception", exit 134: a fresh CI run saw it once under
    # pslaunch, in rank 1 with no Python frame left). That abort is issue 32's open part, held
    # apart from what this test checks: that Accelerate's own checks pass as under torchrun.
    theirs, ours = tmp_path / "torchrun", tmp_path / "pslaunch"
    theirs.mkdir()
    ours.mkdir()
    logs = tmp_path / "torchrun-logs"  # (each rank's output a file of its own: on one pipe, lines interleave)
    t = subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "--log-dir", str(logs), "--redirects", "3",
                        "--no-python", python, "-c", LEAVE_AT_ONCE, str(script)],
                       env=env, cwd=theirs, capture_output=True, text=True, timeout=DEADLINE)
    assert t.returncode == 0, t.stdout + t.stderr
    r = run_pslaunch("-n", "2", "--tracker", "torch", "--kill-grace", "2", python, "-c", LEAVE_AT_ONCE,
                     str(script), timeout=DEADLINE, cwd=ours, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.count("Distributed environment: DistributedType.MULTI_CPU  Backend: gloo") == 2, out
    assert "Num processes: 2" in out and "Process index: 0" in out and "Process index: 1" in out, out
    for passed in ("All rng are properly synched.", "Shuffled dataloader passing.",
                   "Training yielded the same results on one CPU or distributed setup with batch split.",
                   "**Breakpoint trigger test**"):
        assert passed in out, (passed, out)
    for rank in (0, 1):  # each rank printed line for line what it printed under torchrun
        (under_torchrun,) = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        assert rank_lines(out, rank) == under_torchrun.read_text().splitlines(), (rank, out)
