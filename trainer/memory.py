"""Keep freed memory in the process instead of handing it back to the kernel at every step.

glibc's malloc serves a block of more than 128 KB (its starting ``M_MMAP_THRESHOLD``) with a
fresh ``mmap`` and gives the heap's free top back once it exceeds ``M_TRIM_THRESHOLD``. A
training step allocates and frees the same few-megabyte activations and gradients every time
(LeNet at batch 64: a 2.9 MB pooling gradient, the 1.6 MB fc1 gradient, ...), so each step
maps new pages and faults on every one of them: 600-3,000 minor faults per LeNet step, a fifth
of its time on one thread (a whole epoch on one thread: 2,285-2,477 against 3,595-3,851
samples/s). MXNet keeps a pool of its own; raising both thresholds gives torch, numpy and
ZeroMQ's buffers the same: a freed block serves the next step. Memory stays at the process's
peak instead of shrinking between steps. A worker sets them before it imports torch, and every
process that moves arrays through the KV store when it creates its ZeroMQ context
(:func:`trainer.kv.transport.bulk_context`).

Only glibc has ``mallopt``; elsewhere (macOS, musl) nothing changes. A user who tunes malloc
through the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_``, or ``GLIBC_TUNABLES`` naming ``glibc.malloc``) keeps their settings.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

#: ``mallopt`` parameters (``<malloc.h>``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Blocks up to this size come from the heap (where glibc's own adaptive threshold stops, on
#: 64-bit): bigger ones, a validation batch's activations, are still mapped and unmapped.
MMAP_THRESHOLD = 32 << 20
#: The heap's free top goes back to the kernel only above this.
TRIM_THRESHOLD = 256 << 20

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_tunes_malloc(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` already sets glibc's malloc thresholds (then they are left alone)."""
    return any(k in environ for k in USER_SETTINGS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process.

    Returns:
        True when both are set; False without glibc or when the environment tunes malloc.
    """
    if not sys.platform.startswith("linux") or user_tunes_malloc(os.environ if environ is None else environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter runs on
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # The trim threshold first: setting either one also stops glibc's own adjustment of both.
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
