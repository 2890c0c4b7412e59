#!/usr/bin/env python3
"""What the usage reports (``u`` frames, issue 33) cost on a node.

1. One look of :class:`launcher.node.procgroup.UsageMeter` (a pass over ``/proc``) and the sums
   for N process trees, on this machine as it is (its process count is printed).
2. A real node agent running N idle processes (``sleep``) for ``--seconds``, with ``usage=1.0``
   and without: the agent's own CPU time (the kernel's count, ``/proc/<pid>/schedstat``) and the
   bytes it wrote, by frame kind.

    .venv/bin/python scripts/bench_usage.py --procs 8 --seconds 20 [--threads 16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.node import procgroup, protocol  # noqa: E402
from launcher.node.protocol import Decoder  # noqa: E402


def cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def bench_look(n: int, looks: int) -> None:
    children = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(n)]
    try:
        for root, how in ((None, "every process of /proc"), (os.getpid(), "the tree under this process")):
            meter = procgroup.UsageMeter()
            meter.look(root)
            t0 = time.process_time()
            for _ in range(looks):
                meter.look(root)
                for c in children:
                    meter.usage(c.pid)
            each = (time.process_time() - t0) / looks
            print(f"one look at {how} + {n} sums: {each * 1e3:.2f} ms of CPU ({len(procgroup.scan() or ())} "
                  f"processes in /proc; {each * 1e3 / n:.3f} ms per process when one agent runs all {n})")
    finally:
        for c in children:
            c.kill()
            c.wait()


def idle_argv(seconds: float, threads: int) -> list[str]:
    """An idle process: ``sleep``, or a Python with ``threads`` more threads (a children file each)."""
    if not threads:
        return ["sleep", str(seconds)]
    return [sys.executable, "-S", "-c", f"import threading, time; [threading.Thread(target=time.sleep, "
            f"args=({seconds},), daemon=True).start() for _ in range({threads})]; time.sleep({seconds})"]


def run_agent(n: int, seconds: float, usage: float, threads: int) -> tuple[float, dict[bytes, int]]:
    """An agent (its own process) runs ``n`` idle processes; its CPU ms per second and bytes by kind."""
    specs = [{"id": i, "argv": idle_argv(seconds, threads), "env": {"PATH": "/usr/bin:/bin"}} for i in range(n)]
    code = (f"import sys; from launcher.node.agent import Agent, Channel; "
            f"sys.exit(Agent(1.0, Channel(0, 1), usage={usage!r}).run({specs!r})[0])")
    p = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    time.sleep(0.5)  # (its start-up is not what is measured)
    ns0, t0 = cpu_ns(p.pid), time.monotonic()
    time.sleep(seconds - 1.0)
    ns1, t1 = cpu_ns(p.pid), time.monotonic()
    out = p.stdout.read()  # type: ignore[union-attr]
    p.wait()
    sizes: dict[bytes, int] = {}
    for kind, _, payload in Decoder().feed(out):
        sizes[kind] = sizes.get(kind, 0) + protocol.HEAD.size + len(payload)
    return (ns1 - ns0) / 1e6 / (t1 - t0), sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--looks", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="the agent's processes: Pythons with this many "
                    "more threads (0: sleep)")
    a = ap.parse_args()
    bench_look(a.procs, a.looks)
    for usage in (0.0, protocol.USAGE_INTERVAL, 0.0, protocol.USAGE_INTERVAL):
        ms, sizes = run_agent(a.procs, a.seconds, usage, a.threads)
        u = sizes.get(protocol.USAGE, 0)
        each = u // max(1, round(a.seconds * a.procs))
        print(f"agent, {a.procs} idle processes ({a.threads} threads more each), usage={usage}: "
              f"{ms:.2f} ms of CPU per second; u frames {u} bytes = {u / a.seconds:.0f} B/s ({each} B each)")


if __name__ == "__main__":
    main()
