"""The live job status: one line at the bottom of the terminal while a job runs.

::

    pslaunch 0:42 | scheduler 1/1, server 2/2, worker 4/4 | h1: 3, h2: 3 | worker 0: epoch 1 batch 300, 1,234 samples/s

Processes running per role (of how many) and per host (when there is more than one), the
time since the launch, and what worker 0 last said in MXNet's Speedometer format
(``Epoch[1] Batch [200-300]\\tSpeed: 1234.56 samples/sec\\taccuracy=0.95``, which MXNet programs
and our trainer print). :func:`status_text` builds the line (pure); :class:`Progress` feeds it
to the console's status line (``launcher.runtime.output``), which keeps it apart from the
labelled output.

Shown only when the launcher's stdout is a terminal, and not with ``--no-progress``.
"""

from __future__ import annotations

import re
import shutil
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ..runtime.handle import ProcessHandle
from ..runtime.output import Console, is_terminal

#: how often the line is redrawn, at most (seconds)
INTERVAL = 0.5
ROLES = ("scheduler", "server", "worker")

# MXNet's Speedometer: "Epoch[0] Batch [100-200]\tSpeed: 1234.56 samples/sec\taccuracy=0.912"
# (MXNet < 1.2 wrote "Batch [200]"); metrics follow as name=value.
_SPEED_RE = re.compile(r"Epoch\[(\d+)\]\s+Batch\s*\[(?:\d+-)?(\d+)\]\s+Speed:\s*([0-9.]+)\s*samples/sec(.*)$")
_METRIC_RE = re.compile(r"([A-Za-z][\w-]*)=([0-9.eE+-]+)")
_VALIDATION_RE = re.compile(r"Epoch\[(\d+)\]\s+Validation-([\w-]+)=([0-9.eE+-]+)")


@dataclass(frozen=True)
class Latest:
    """What worker 0 last reported."""

    epoch: int
    batch: Optional[int] = None
    speed: Optional[float] = None
    metric: Optional[tuple[str, float]] = None
    validation: Optional[tuple[str, float]] = None


def parse_line(line: str, previous: Optional[Latest] = None) -> Optional[Latest]:
    """A Speedometer or validation line of MXNet's ``fit`` -> :class:`Latest`; None for any other line."""
    m = _SPEED_RE.search(line)
    if m:
        metric = _METRIC_RE.search(m.group(4))
        return Latest(epoch=int(m.group(1)), batch=int(m.group(2)), speed=float(m.group(3)),
                      metric=(metric.group(1), float(metric.group(2))) if metric else None)
    m = _VALIDATION_RE.search(line)
    if m:
        base = previous if previous is not None and previous.epoch == int(m.group(1)) else Latest(int(m.group(1)))
        return Latest(epoch=base.epoch, batch=base.batch, speed=base.speed, metric=base.metric,
                      validation=(m.group(2), float(m.group(3))))
    return None


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def status_text(running: Mapping[str, tuple[int, int]], hosts: Mapping[str, int], elapsed: float,
                latest: Optional[Latest], width: int, restarts: str = "") -> str:
    """The status line (pure): ``running`` maps a role to (running, total), ``hosts`` a host to
    its running processes, ``restarts`` the restarts so far (``restart 1/3``; empty: none); cut
    to ``width`` characters."""
    parts = [f"pslaunch {_clock(elapsed)}" + (f" ({restarts})" if restarts else "")]
    parts.append(", ".join(f"{role} {running[role][0]}/{running[role][1]}" for role in ROLES if role in running))
    if len(hosts) > 1:
        shown = sorted(hosts.items())
        text = ", ".join(f"{h}: {n}" for h, n in shown[:8])
        parts.append(text + (f", +{len(shown) - 8} hosts" if len(shown) > 8 else ""))
    if latest is not None:
        bits = [f"epoch {latest.epoch}"]
        if latest.batch is not None:
            bits.append(f"batch {latest.batch}")
        text = "worker 0: " + " ".join(bits)
        if latest.speed is not None:
            text += f", {latest.speed:,.0f} samples/s"
        if latest.metric is not None:
            text += f", {latest.metric[0]} {latest.metric[1]:.4g}"
        if latest.validation is not None:
            text += f", validation {latest.validation[0]} {latest.validation[1]:.4g}"
        parts.append(text)
    line = " | ".join(p for p in parts if p)
    width = max(10, width - 1)  # never the last column: a line that fills it wraps on some terminals
    return line if len(line) <= width else line[:width - 1] + "…"


def counts(handles: Iterable[ProcessHandle], expected: Mapping[str, int]) -> tuple[dict[str, tuple[int, int]],
                                                                                   dict[str, int]]:
    """Running processes per role (of ``expected``) and per host, from the handles."""
    running = {role: 0 for role in expected}
    hosts: dict[str, int] = {}
    for h in handles:
        if h.poll() is None:
            role = str(h.proc.role)
            running[role] = running.get(role, 0) + 1
            hosts[h.host] = hosts.get(h.host, 0) + 1
    return {role: (running.get(role, 0), total) for role, total in expected.items() if total}, hosts


class Progress:
    """Draws the status line for one job (see the module docstring); :meth:`tick` from the
    supervisor's loop, :meth:`close` before the final report."""

    def __init__(self, console: Console, expected: Mapping[str, int], start: float,
                 width: Optional[int] = None) -> None:
        self.console = console
        self.expected = dict(expected)
        self.start = start
        self.width = width
        self.latest: Optional[Latest] = None
        #: the job's restarts so far, shown after the clock (``restart 1/3``; empty: none yet)
        self.restarts = ""
        self._lock = threading.Lock()
        self._last = -1.0
        console.observe("worker-0", self._line)

    @classmethod
    def create(cls, console: Console, enabled: bool, expected: Mapping[str, int], start: float) -> Optional[Progress]:
        """A Progress when ``enabled`` and the console's stdout is a terminal, else None."""
        if not enabled or not is_terminal(console.stdout):
            return None
        return cls(console, expected, start)

    def _line(self, line: str) -> None:
        with self._lock:
            found = parse_line(line, self.latest)
            if found is not None:
                self.latest = found

    def tick(self, handles: Sequence[ProcessHandle], now: float) -> None:
        if now - self._last < INTERVAL:
            return
        self._last = now
        running, hosts = counts(handles, self.expected)
        width = self.width or _terminal_columns()
        with self._lock:
            latest = self.latest
        self.console.set_status(status_text(running, hosts, now - self.start, latest, width, self.restarts))

    def close(self) -> None:
        self.console.clear_status()


def _terminal_columns() -> int:
    """The terminal's width (``$COLUMNS`` first); 100 when standard output is no terminal."""
    return shutil.get_terminal_size((100, 24)).columns
