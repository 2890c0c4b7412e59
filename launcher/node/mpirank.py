"""The mpi backend's rank wrapper: mpirun starts one of these per server and worker.

mpirun runs ``node.command("mpirank") -- COMMAND...`` as every MPI rank. The wrapper

1. reads its MPI rank from ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK`` or ``PMI_RANK``; if none is
   set (or ``PSLAUNCH_MPI_RANK_SOURCE=mpi4py``) it asks mpi4py, and then calls
   ``MPI_Finalize`` itself before it exits, as Open MPI counts a rank that initialised MPI
   and did not finalise as failed;
2. looks its rank up in the table the launcher built (:mod:`.mpi_wire`) to learn its role,
   rank and task id, and builds the command's environment: what mpirun gave this rank, plus
   the role's and the rank's own variables, plus ``DMLC_NODE_HOST`` worked out here on the
   node (:func:`pscontract.netif.node_address`);
3. connects to the launcher's hub (the table's ``hub`` address; :mod:`.protocol`, transport b),
   and runs the command through the node agent (:mod:`.agent`), which reports its start, output
   and exit code as frames. If the connection cannot be made, the frames go through mpirun's
   output instead (transport c), with a warning (Open MPI's chunks from different ranks may then
   interleave in the middle of long lines, which is why the connection is the normal way).

mpirun's SIGTERM, SIGINT and SIGHUP (and the death of its daemon, our parent) stop the
command's group gracefully; SIGUSR1 and SIGUSR2 (which mpirun forwards to every rank) are passed
on to it, and SIGABRT makes it dump its Python stacks (:mod:`.agent`, 4). Exits with the
command's exit code (128+N for signal N).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from types import ModuleType
from typing import Optional, Sequence

import pscontract as pc
from pscontract import netif

from . import mpi_wire, protocol
from .agent import Agent, AgentError, Channel, Dropped, catch_signals, connect
from .procgroup import set_parent_death_signal

PREFIX = "pslaunch rank wrapper"
#: a rank whose command cannot start waits this long at most for the launcher to stop the job
#: (mpirun would otherwise see it exit first and print its own abort banner before the cause)
LINGER = 5.0
#: connections to the hub tried before falling back to mpirun's output, when the hub closes them
#: during the handshake (it drops the oldest unauthenticated connections when strangers crowd it)
CONNECT_TRIES = 4


def _rank(environ: dict[str, str]) -> tuple[int, Optional[int], Optional[ModuleType]]:
    """``(rank, size, the MPI module when mpi4py initialised MPI, else None)``."""
    rank = None if environ.get(mpi_wire.RANK_SOURCE) == "mpi4py" else mpi_wire.rank_from_environ(environ)
    if rank is not None:
        return rank, mpi_wire.size_from_environ(environ), None
    try:
        from mpi4py import MPI  # initialises MPI: finalised by main()
    except ImportError:
        raise AgentError(f"no MPI rank in the environment ({', '.join(mpi_wire.RANK_VARS)}) "
                         "and mpi4py is not installed (pip install mpi4py)") from None
    except Exception as e:  # noqa: BLE001 - mpi4py raises RuntimeError and others
        raise AgentError(f"mpi4py could not initialise MPI: {str(e).splitlines()[0] if str(e) else e!r}") from None
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), MPI


def _connect(table: dict, rank: int, env: dict[str, str]) -> Optional[Channel]:
    """The channel to the launcher's hub, or None (with a warning) when it cannot be opened."""
    address = table.get("hub")
    if not address:
        return None
    try:
        secret = env.get(pc.SECRET, "")
        if not secret:
            raise ValueError(f"{pc.SECRET} is not set")
        for attempt in range(1, CONNECT_TRIES + 1):
            try:
                return connect(address, rank, secret)
            except Dropped:
                if attempt == CONNECT_TRIES:
                    raise
                time.sleep(0.05 * attempt)
        return None
    except (OSError, ValueError) as e:
        message = (f"{PREFIX}: warning: cannot send this rank's output to the launcher at {address[0]}:{address[1]} "
                   f"from {socket.gethostname()} ({e}); it goes through mpirun's output instead, where long "
                   "lines of different ranks may mix").encode("utf-8", "replace")[:protocol.LINE_PAYLOAD]
        os.write(2, protocol.envelope(protocol.STDERR, rank, message))
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``mpirank [--] COMMAND...``; returns the command's exit code."""
    catch_signals()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    environ = dict(os.environ)
    rank: Optional[int] = None
    mpi: Optional[ModuleType] = None
    try:
        if not args:
            raise AgentError("no command given")
        if os.getppid() != parent:
            raise AgentError("mpirun's daemon died before the rank started", 143)
        rank, size, mpi = _rank(environ)
        try:
            table = mpi_wire.decode_table(environ.get(mpi_wire.TABLE, ""))
            _, _, job_env = mpi_wire.rank_entry(table, rank, size)
        except mpi_wire.TableError as e:
            raise AgentError(str(e)) from None
        env = mpi_wire.child_environ(environ, job_env)
        try:
            service = pc.service_endpoint(env)  # the scheduler's or the tracker's address
            env[pc.NODE_HOST] = netif.node_address(env.get(pc.INTERFACE), service[0] if service else None,
                                                   env.get(pc.NODE_HOST))
            if env.get(pc.MASTER_ADDR):  # (a torch job's gloo and NCCL: the network its ranks share)
                env.update(pc.torch_sockets(env, netif.carrier_name(env.get(pc.INTERFACE), env[pc.NODE_HOST])))
        except netif.NetifError as e:
            raise AgentError(f"on {socket.gethostname()}: cannot work out this node's address: {e}") from None
        agent = Agent(float(table.get("grace", 10.0)), _connect(table, rank, env), fallback="in-band",
                      linger=LINGER, here=socket.gethostname(), prefix=PREFIX, watchdog=True,
                      usage=float(table.get("usage") or 0.0))
        start = {"addr": env[pc.NODE_HOST], "source": "mpi4py" if mpi else "env"}
        code = agent.run([{"id": rank, "argv": args, "env": env, "start": start}])[0]
    except AgentError as e:
        code = e.code
        if rank is None:
            os.write(2, f"{PREFIX}: error: {e}\n".encode("utf-8", "replace"))
        else:
            Agent(0.0, fallback="in-band", prefix=PREFIX).error(rank, str(e), code)
    if mpi is not None:
        try:
            mpi.Finalize()
        except Exception:  # noqa: BLE001 - the exit code matters more than a finalize problem
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
