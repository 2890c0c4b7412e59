"""Test helper run under the launcher: a program that says why it failed in its error file.

``--fail NAME`` (``worker-1``): a real torch program whose ``main`` is decorated with torch's
``torch.distributed.elastic.multiprocessing.errors.record``; process NAME raises a ValueError
after ``--delay`` seconds (torch writes it to ``TORCHELASTIC_ERROR_FILE``), the others sleep.

``--hostile OUT``: no torch; every worker abuses its error file at once, writes ``OUT/<name>.ready``,
and worker-0 exits 1 once all are ready: worker-0 writes 1 MiB of binary with escape sequences,
worker-1 puts a symbolic link to ``OUT/sentinel`` where the file goes, worker-2 puts a link to
``OUT/decoy`` (a directory holding an ``error.json``) where the file's directory was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

# spelled here on purpose: this program stands for any user program
ERROR_FILE, TASK_ID, NUM_WORKERS = "PSLAUNCH_ERROR_FILE", "DMLC_TASK_ID", "DMLC_NUM_WORKER"


def name() -> str:
    return f"worker-{os.environ.get(TASK_ID, '0')}"


def fail_here(me: str) -> None:
    raise ValueError(f"boom in {me}: the root cause")


def hostile(out: str) -> int:
    me, path = name(), os.environ[ERROR_FILE]
    if me == "worker-0":
        with open(path, "wb") as f:
            f.write(b"\x1b[2J\x1b]0;pwned\x07first line\x00\x9b\n" + os.urandom(1 << 20))
    elif me == "worker-1":
        os.symlink(os.path.join(out, "sentinel"), path)
    elif me == "worker-2":
        shutil.rmtree(os.path.dirname(path))
        os.symlink(os.path.join(out, "decoy"), os.path.dirname(path))
    open(os.path.join(out, me + ".ready"), "w").close()
    if me != "worker-0":
        time.sleep(60)
        return 0
    n = int(os.environ[NUM_WORKERS])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"worker-{i}.ready"))
                                                  for i in range(n)):
        time.sleep(0.05)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail", default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--hostile", default=None, metavar="OUT")
    a = ap.parse_args()
    if a.hostile:
        return hostile(a.hostile)
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run() -> None:
        me = name()
        if me == a.fail:
            time.sleep(a.delay)
            fail_here(me)
        time.sleep(60)

    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
