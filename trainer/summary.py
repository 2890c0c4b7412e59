"""The final JSON summary line of ``train_mnist`` and how to read it back.

Light on purpose (no torch): benchmarks and tests parse launcher output with it.
"""

from __future__ import annotations

import json
from typing import Any


def read_summaries(text: str) -> list[dict[str, Any]]:
    """The JSON summary lines in ``text``, in order; launcher prefixes such as
    ``[worker 0] `` before the ``{`` are skipped, other lines ignored."""
    out = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(value, dict) and "samples_per_sec" in value and "validation_accuracy" in value:
            out.append(value)
    return out
