"""A DDP job's clean end stays clean, many times in a row (issue 32, item 2).

pytorch/examples' ``ddp-tutorial-series/multinode.py`` (gloo on the CPU) finished its epochs under
``pslaunch --tracker torch`` and then aborted at exit in 2 of its runs (``terminate called
without an active exception``, exit 134), while rank 0 still wrote its snapshot and rank 1 was
leaving. tests/bin/ddp_epochs.py ends the same way (rank 0 saves a snapshot after each epoch,
every rank calls ``destroy_process_group()`` and returns, through the interpreter's
finalization, with no ``os._exit``): a job of it must end with exit 0 every time, with no abort
in any rank's output, and with the store serving until the last rank has ended.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from support.helpers import BIN, run_pslaunch

pytestmark = pytest.mark.integration

EPOCHS = str(BIN / "ddp_epochs.py")
RUNS = 20
ABORT = re.compile(r"terminate called|Fatal Python error|Aborted|core dumped")


@pytest.mark.timeout(1200)
def test_a_ddp_job_ends_cleanly_twenty_times_in_a_row(tmp_path: Path) -> None:
    bad: list[str] = []
    for i in range(RUNS):
        t0 = time.monotonic()
        r = run_pslaunch("-n", "2", "--tracker", "torch", "--no-progress", "--log-level", "debug", sys.executable,
                         EPOCHS, "--epochs", "2", "--snapshot", str(tmp_path / f"snapshot-{i}.pt"), timeout=240)
        out = r.stdout + r.stderr
        if r.returncode != 0 or ABORT.search(out):
            bad.append(f"run {i + 1}: exit {r.returncode} after {time.monotonic() - t0:.1f}s\n{out[-3000:]}")
            continue
        assert "rank 0: epoch 1 snapshot saved" in out, out
        assert "all 2 processes exited 0" in r.stderr, r.stderr
    assert not bad, f"{len(bad)} of {RUNS} clean ends were not clean:\n" + "\n".join(bad)
