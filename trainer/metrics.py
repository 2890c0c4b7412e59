"""``--metrics-file``: the trainer's figures as JSON lines, for a program rather than a reader.

One line per ``--disp-batches`` interval (the Speedometer line's figures) and one per epoch
(the summary's epoch record with the validation accuracy), each with the worker's rank, the
launcher's attempt and the wall-clock time::

    {"event": "interval", "epoch": 0, "batch": 200, "batches": 100, "samples_per_sec": 4210.5,
     "accuracy": 0.91, "loss": 0.29, "rank": 0, "attempt": 0, "timestamp": 1796620000.1}
    {"event": "epoch", "epoch": 0, "train_accuracy": 0.93, "validation_accuracy": 0.96, ...}

A path with ``{rank}`` in it gives every worker its own file; without it only rank 0 writes, as
for ``--plot`` (two workers appending to one file on a shared disk would interleave their
lines). The file is appended to: a job that ``--resume``\\s after a restart goes on in it, and
``attempt`` tells the attempts apart. Each line is written whole and flushed, so a reader
following the file (``tail -f``) never sees half a line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

RANK_FIELD = "{rank}"


def metrics_path(template: str, rank: int) -> str | None:
    """Where worker ``rank`` writes: the template with its rank, or None when it writes nothing
    (a template without ``{rank}`` is rank 0's alone)."""
    if RANK_FIELD in template:
        return template.replace(RANK_FIELD, str(rank))
    return template if rank == 0 else None


def check_metrics_path(template: str) -> str | None:
    """What is wrong with ``--metrics-file TEMPLATE`` before training starts, in one line, or None
    (finding out at the first interval would waste the run's start)."""
    path = template.replace(RANK_FIELD, "0")
    if os.path.isdir(path):
        return (f"--metrics-file {template} is a directory; name the file, "
                f"e.g. {os.path.join(template, 'metrics.jsonl')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--metrics-file {template}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--metrics-file {template}: the directory {parent} is not writable"
    return None


class MetricsFile:
    """An open ``--metrics-file``; :meth:`write` adds one JSON line.

    Opened with ``O_NOFOLLOW``: in a shared directory such as /tmp another user could have
    planted a link at the name to make this process append to a file of its choosing.
    """

    def __init__(self, path: str, rank: int, attempt: int | None) -> None:
        self.path = path
        self._fixed = {"rank": rank, "attempt": attempt}
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, **fields, **self._fixed, "timestamp": round(time.time(), 3)}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
