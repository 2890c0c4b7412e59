"""Which server holds which key: balanced by bytes, big arrays split across all servers.

MXNet puts a small key on server ``(key * 9973) % S``. With LeNet's keys
alternating weight and bias that sends every weight to server 0 when S = 2
(dmlc-reference 4.6). Here each array goes to the server with the fewest
bytes so far, largest arrays first within one ``init`` call, which is the
classic longest-processing-time greedy rule. Arrays with at least
``bigarray_bound`` elements are cut into ``S`` contiguous parts with MXNet's
sizes, part ``i`` on server ``i``. On the wire no part is bigger than
:data:`~trainer.kv.protocol.CHUNK_BYTES`: a bigger one is cut again into
chunks, numbered on (part indices are per key, in order), on the same server.

Every worker calls ``init`` with the same keys, shapes and order, so every
worker computes the same placement without asking anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .protocol import CHUNK_BYTES


@dataclass(frozen=True)
class Part:
    """Elements ``[lo, hi)`` of a flattened array live on ``server`` as part ``index``."""

    server: int
    index: int
    lo: int
    hi: int


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """MXNet's split: part ``i`` has ``round(n/S*(i+1)) - round(n/S*i)`` elements."""
    edges = [int(round(n / parts * i)) for i in range(parts + 1)]
    edges[-1] = n
    return [(edges[i], edges[i + 1]) for i in range(parts)]


class Placement:
    """Assigns keys to servers and remembers the bytes each server holds.

    Args:
        num_servers: S, at least 1.
        bigarray_bound: arrays with at least this many elements are split.
        chunk_bytes: the largest part on the wire.
    """

    def __init__(self, num_servers: int, bigarray_bound: int = 1_000_000,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if num_servers < 1:
            raise ValueError("a placement needs at least one server")
        self.num_servers = num_servers
        self.bigarray_bound = bigarray_bound
        self.chunk_bytes = chunk_bytes
        self.loads = [0] * num_servers

    def _chunks(self, server: int, lo: int, hi: int, itemsize: int, first: int) -> list[Part]:
        step = max(1, self.chunk_bytes // itemsize)
        return [Part(server, first + i, a, min(a + step, hi))
                for i, a in enumerate(range(lo, hi, step))] or [Part(server, first, lo, hi)]

    def assign(self, sizes: Sequence[tuple[int, int]]) -> list[list[Part]]:
        """Place arrays given as ``(elements, itemsize)``; returns their parts, in input order."""
        result: list[list[Part]] = [[] for _ in sizes]
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i][0] * sizes[i][1])
        for i in order:
            n, itemsize = sizes[i]
            if n >= self.bigarray_bound and self.num_servers > 1:
                parts: list[Part] = []
                for s, (lo, hi) in enumerate(split_bounds(n, self.num_servers)):
                    parts += self._chunks(s, lo, hi, itemsize, len(parts))
                    self.loads[s] += (hi - lo) * itemsize
                result[i] = parts
            else:
                s = min(range(self.num_servers), key=lambda j: (self.loads[j], j))
                self.loads[s] += n * itemsize
                result[i] = self._chunks(s, 0, n, itemsize, 0)
        return result
