"""Snapshots of the job page's contract (``launcher/ui``) for tests: the fixed sample job, a
large job built to size, and the golden-file check the chart and report tests use.

The sample (``tests/unit/ui_sample_snapshot.json``): a PS job on two hosts, a scheduler, 2
servers, 4 workers, two attempts (worker 3 killed by SIGKILL, then worker 2 failed with a
traceback), Speedometer throughput for every worker, 199 log lines.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1] / "unit"
SAMPLE = UNIT / "ui_sample_snapshot.json"
GOLDEN = UNIT / "golden"
#: set to 1 to rewrite the golden files from the code (then read the diff before committing it)
UPDATE = "PSLAUNCH_UPDATE_GOLDEN"


def sample_snapshot() -> dict:
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


def big_snapshot(workers: int = 253, servers: int = 2, lines: int = 1000, points: int = 1000,
                 width: int = 75) -> dict:
    """A finished job of ``1 + servers + workers`` processes, each with ``lines`` kept log lines of
    about ``width`` characters (every tenth on stderr) out of twice as many printed, and each
    worker with ``points`` throughput reports (one every 2 s, speeds spread so that the slowest
    and fastest are known: worker r runs at 1000 + r samples/s)."""
    start = 1796634000.0
    end = start + 2.0 * points + 5
    names = [("scheduler", "scheduler", 0)] + [(f"server-{i}", "server", i) for i in range(servers)] + \
            [(f"worker-{i}", "worker", i) for i in range(workers)]
    procs, logs, thr = [], {}, {}
    for k, (name, role, rank) in enumerate(names):
        failed = name == "worker-7"
        text = f"Epoch[3] Batch [1200-1300]\tSpeed: 1234.56 samples/sec\taccuracy=0.9{k:04d} "
        text = (text * 3)[:width]
        logs[name] = [[lines + i + 1, round(2.0 * i + 1, 3), "e" if i % 10 == 9 else "o", text]
                      for i in range(lines)]
        procs.append({"name": name, "role": role, "rank": rank, "label": f"{role} {rank}",
                      "host": f"node{k // 8:03d}", "pid": 10000 + k, "state": "failed" if failed else "stopped",
                      "exit_code": 1 if failed else None, "signal": None if failed else "SIGTERM",
                      "cpu": 95.5, "rss": 1_500_000_000, "last_line": text, "speed": 1000.0 + rank,
                      "epoch": 3, "batch": 1300, "lines": 2 * lines, "log": f"{name}.log"})
        if role == "worker":
            thr[name] = [[round(2.0 * i + 1 + k / 100, 3), 1000.0 + rank + (i % 7)] for i in range(points)]
    return {
        "job": {"id": "pslaunch-big", "command": "python train.py", "tracker": "ps-lite", "backend": "slurm",
                "state": "failed", "attempt": 0, "max_restarts": 0, "start": start, "elapsed": end - start,
                "end": end, "exit_code": 1, "logs": True,
                "attempts": [{"attempt": 0, "start": start, "end": end, "reason": "failure", "exit_code": 1,
                              "cause": None}]},
        "processes": procs,
        "throughput": thr,
        "failure": {"name": "worker-7", "headline": "worker 7 on node001 (pid 10010) exited with code 1",
                    "lines": [x[3] for x in logs["worker-7"][-10:]]},
        "logs": logs,
    }


def check_golden(name: str, text: str) -> None:
    """``text`` is the golden file ``tests/unit/golden/NAME`` (rewritten first under
    ``PSLAUNCH_UPDATE_GOLDEN=1``); else fail with the start of the diff."""
    path = GOLDEN / name
    if os.environ.get(UPDATE) == "1":
        path.write_text(text, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = list(difflib.unified_diff(expected.splitlines(), text.splitlines(), "golden", "now", lineterm=""))
        raise AssertionError(f"{path.name} differs from its golden file ({UPDATE}=1 rewrites it):\n"
                             + "\n".join(line[:300] for line in diff[:40]))
