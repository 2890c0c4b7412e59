"""Enter-to-all-running, as the cluster benchmarks (scripts/bench_launch_ray.py, bench_launch_k8s.py)
measure it: every process of a job runs :data:`JOB_SH`, which writes the time it started into
``$BENCH_OUT`` and waits until all ``$BENCH_EXPECTED`` have; :func:`time_to_all_running` runs one
launcher command and gives the last stamp minus the moment the launcher was started."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

JOB_SH = """#!/bin/sh
me="$DMLC_ROLE-$DMLC_TASK_ID"
date +%s.%N > "$BENCH_OUT/.$me" && mv "$BENCH_OUT/.$me" "$BENCH_OUT/$me"
end=$(( $(date +%s) + 120 ))
while [ "$(ls "$BENCH_OUT" | wc -l)" -lt "$BENCH_EXPECTED" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
"""
# (a slow poll: 64 processes polling every 50 ms fork thousands of times a second and slow the
# start of the rest; the stamps, not the poll, give the time)


def write_job(root: Path) -> Path:
    """:data:`JOB_SH` as ``root/job.sh``, executable."""
    job = root / "job.sh"
    job.write_text(JOB_SH)
    job.chmod(0o755)
    return job


def time_to_all_running(argv: list[str], env: dict[str, str], root: Path, expected: int) -> float:
    """Seconds from the launcher's start until the last of ``expected`` processes wrote its stamp
    (the launcher must pass ``BENCH_OUT`` and ``BENCH_EXPECTED`` on: ``--env`` both)."""
    out = Path(tempfile.mkdtemp(dir=root))
    out.chmod(0o777)
    env = dict(env, BENCH_OUT=str(out), BENCH_EXPECTED=str(expected))
    t0 = time.time()
    r = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=300)
    stamps = {p.name: float(p.read_text()) for p in out.iterdir() if not p.name.startswith(".")}
    if r.returncode != 0 or len(stamps) != expected:
        raise RuntimeError(f"{' '.join(argv[:8])}... exited {r.returncode}, {len(stamps)} of {expected} "
                           f"processes ran: {r.stderr[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return max(stamps.values()) - t0
