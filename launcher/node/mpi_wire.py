"""What the mpi backend and its rank wrapper share: the rank table and the MPI variables.

The launcher builds the table (``launcher.backends.mpi``), mpirun carries it to every rank in
one environment variable (no secret on a command line), and each rank's wrapper
(:mod:`.mpirank`) finds its own entry by its MPI rank. Table, as JSON::

    {"grace": 10.0,                              # the job's --kill-grace
     "roles": {"server": {...}, "worker": {...}}, # variables every rank of a role shares
     "ranks": [[role, rank within the role, {its own variables}], ...],   # by MPI rank
     "pinned": {"PATH": ..., "LD_LIBRARY_PATH": ...},  # values mpirun may rewrite on the way
     "hub": [host, port],                         # where the wrappers connect (optional)
     "usage": 1.0}                                # report CPU and RSS every 1.0 s (optional: u frames)

Standard library only.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any, Mapping, Optional

# The rank table, as one environment value.
TABLE = "PSLAUNCH_MPI_TABLE"
# "env" (default) or "mpi4py": where the rank wrapper takes its MPI rank from.
RANK_SOURCE = "PSLAUNCH_MPI_RANK_SOURCE"
# Set by mpirun in every rank: Open MPI, PMIx (Open MPI 5), PMI (MPICH/Hydra).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# Placed last in mpirun's environment: MPICH 4.0's mpiexec does not pass the last
# variable of its environment to remote ranks, even when -genvlist names it.
ENV_END = "PSLAUNCH_MPI_ENV_END"
# mpirun rewrites these on the way (Open MPI prepends its own prefix): the job's values are restored.
REWRITTEN = ("PATH", "LD_LIBRARY_PATH")

TABLE_VERSION = 1


class TableError(ValueError):
    """The table is missing, from another version, or corrupt."""


def encode_table(table: Mapping[str, Any]) -> str:
    """The table as one environment value: compressed JSON, base64."""
    raw = json.dumps(table, separators=(",", ":"), sort_keys=True).encode()
    return f"z{TABLE_VERSION}:" + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def decode_table(text: str) -> dict[str, Any]:
    """Inverse of :func:`encode_table`; :class:`TableError` on a bad value."""
    prefix = f"z{TABLE_VERSION}:"
    if not text or not text.startswith(prefix):
        raise TableError(f"{TABLE} is missing or from another pslaunch version; "
                         "start this wrapper through pslaunch --launcher mpi")
    try:
        table = json.loads(zlib.decompress(base64.b64decode(text[len(prefix):])))
    except (ValueError, zlib.error) as e:
        raise TableError(f"{TABLE} is corrupt: {e}") from None
    if not isinstance(table, dict) or not isinstance(table.get("ranks"), list):
        raise TableError(f"{TABLE} is corrupt: no rank list")
    return table


def rank_from_environ(environ: Mapping[str, str]) -> Optional[int]:
    """The MPI rank that mpirun put in the environment, or None."""
    for name in RANK_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def size_from_environ(environ: Mapping[str, str]) -> Optional[int]:
    for name in SIZE_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def rank_entry(table: Mapping[str, Any], rank: int, size: Optional[int]) -> tuple[str, int, dict[str, str]]:
    """``(role, rank within the role, environment)`` for MPI rank ``rank``."""
    ranks = table["ranks"]
    if size is not None and size != len(ranks):
        raise TableError(f"mpirun started {size} ranks but the job has {len(ranks)} servers and workers; "
                         "do not add -n/-np to --mpirun-args")
    if not 0 <= rank < len(ranks):
        raise TableError(f"MPI rank {rank} is not in the job's table of {len(ranks)} ranks")
    role, role_rank, own = ranks[rank]
    env = dict(table.get("pinned", {}))
    env.update(table.get("roles", {}).get(role, {}))
    env.update(own)
    return role, int(role_rank), env


def child_environ(environ: Mapping[str, str], job_env: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: this rank's (from mpirun) under the job's, minus the table."""
    env = {k: v for k, v in environ.items() if k not in (TABLE, RANK_SOURCE)}
    env.update(job_env)
    return env
