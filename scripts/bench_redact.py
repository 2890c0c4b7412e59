#!/usr/bin/env python3
"""What hiding the job's secrets in output costs.

1. Per line, in isolation: ``launcher.spec.env.Redactor`` on a typical training log line, with no
   secret, long secrets (the 64-character job secret and an API token) and a short one (a
   2-character password is hidden only where it stands alone, by a regular expression).
2. End to end: a worker prints LINES lines through ``pslaunch -n 1 -s 0`` (local backend); the CPU
   time of the launcher and the program together, median of --repeat runs, without a secret in the
   job, with a long one and with a short one (``--env NAME``).

    python scripts/bench_redact.py [--lines 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.spec.env import Redactor, is_secret  # noqa: E402

LINE = "epoch 3 batch 1200 loss 0.2134 accuracy 0.9312 speed 4512.3 samples/s lr 0.01"
CASES = {
    "no secret": {},
    "long secret (API_TOKEN, 22 chars)": {"API_TOKEN": "tok-7f3a7f3a7f3a7f3a7f"},
    "short secret (DB_PASSWORD, 2 chars)": {"DB_PASSWORD": "pq"},
}


def per_line() -> None:
    print("| secret values | ns per line |")
    print("|---|---|")
    for secrets in ([], ["a" * 64], ["a" * 64, "tok-" + "7f3a" * 6, "hunter2x"], ["a" * 64, "pq"]):
        r = Redactor(secrets)
        n = 200_000
        t = time.perf_counter()
        for _ in range(n):
            r(LINE)
        ns = (time.perf_counter() - t) / n * 1e9
        print(f"| {', '.join(f'{len(s)} chars' for s in secrets) or 'none'} | {ns:.0f} |")


def end_to_end(lines: int, repeat: int) -> None:
    prog = f"for i in range({lines}): print('epoch 3 batch', i, 'loss 0.2134 accuracy 0.9312 samples/s')"
    clean = {k: v for k, v in os.environ.items() if not is_secret(k)}
    cpu: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(repeat):
        for name, extra in CASES.items():  # interleaved: load changes hit every case alike
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            argv = [sys.executable, "-m", "launcher", "-n", "1", "-s", "0"]
            for k in extra:
                argv += ["--env", k]
            subprocess.run([*argv, sys.executable, "-c", prog], cwd=REPO, env=dict(clean, **extra),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    base = statistics.median(cpu["no secret"])
    print(f"\n| job ({lines} lines printed) | CPU s, median of {repeat} | extra per line |")
    print("|---|---|---|")
    for name, values in cpu.items():
        m = statistics.median(values)
        extra = "" if name == "no secret" else f"{(m - base) / lines * 1e6:+.2f} µs"
        print(f"| {name} | {m:.2f} | {extra} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    per_line()
    end_to_end(a.lines, a.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
