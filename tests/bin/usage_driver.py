"""pslaunch, with every process handle's ``usage()`` written down while the job runs.

``usage_driver.py PSLAUNCH-ARGS...`` runs the job as ``python -m launcher`` would, and every
0.5 s appends one JSON line per process handle to ``$PSLAUNCH_USAGE_LOG``: ``{"t", "name", "pid",
"usage": [cpu, rss] | null, "kernel": cpu | null}``, where ``kernel`` is the percent of one core
the process's group used since the last line by the kernel's own count (``/proc/<pid>/schedstat``,
read here: the testbeds' hosts share this machine's pid namespace), the independent value the
tests compare with. ``PSLAUNCH_USAGE_SWITCH=0`` forces the switch off (``JobSpec.wants_usage``),
``1`` on, as ``--ui``/``--report`` would.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from launcher import cli
from launcher.node import procgroup
from launcher.run import supervisor
from launcher.spec.job import JobSpec

INTERVAL = 0.5
running: list[supervisor.Supervisor] = []


def _run_ns(pgid: int) -> int | None:
    total, found = 0, False
    for p in procgroup.scan() or ():
        if p.pgid == pgid:
            try:
                with open(f"/proc/{p.pid}/schedstat") as f:
                    total += int(f.read().split()[0])
                found = True
            except OSError:
                pass
    return total if found else None


def watch(path: str) -> None:
    last: dict[str, tuple[float, int]] = {}
    with open(path, "a", encoding="utf-8") as log:
        while True:
            time.sleep(INTERVAL)
            if not running:
                continue
            for h in list(running[0].handles):
                now, ns, kernel = time.monotonic(), _run_ns(h.pid) if h.pid else None, None
                if ns is not None and h.name in last:
                    t0, ns0 = last[h.name]
                    kernel = (ns - ns0) / 1e9 / (now - t0) * 100.0
                if ns is not None:
                    last[h.name] = (now, ns)
                value = h.usage()
                log.write(json.dumps({"t": time.time(), "name": h.name, "pid": h.pid,
                                      "usage": list(value) if value is not None else None, "kernel": kernel}) + "\n")
                log.flush()


def main() -> int:
    switch = os.environ.get("PSLAUNCH_USAGE_SWITCH", "1") == "1"
    JobSpec.wants_usage = property(lambda self: switch)  # type: ignore[method-assign,assignment]
    init = supervisor.Supervisor.__init__

    def remember(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        init(self, *a, **kw)
        running.append(self)

    supervisor.Supervisor.__init__ = remember  # type: ignore[method-assign]
    threading.Thread(target=watch, args=(os.environ["PSLAUNCH_USAGE_LOG"],), daemon=True).start()
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
