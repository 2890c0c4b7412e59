"""The task wrapper: what a batch system runs in each task of a job (sge, yarn, slurm).

A batch system starts N identical copies of one command and tells each copy its index in its
own way: Grid Engine sets ``SGE_TASK_ID`` (1-based), skein sets ``SKEIN_CONTAINER_ID``
(``worker_3``, 0-based), Slurm sets ``SLURM_PROCID`` (0-based within the job step). This
wrapper turns that into the launcher's contract:

* ``DMLC_TASK_ID``: the role's first task id plus the 0-based index (workers ``0..N-1``,
  servers ``N..N+S-1``, the same numbering as every backend);
* ``DMLC_NODE_HOST``: worked out here, on the execution host
  (:func:`pscontract.netif.node_address`);
* the job's variables, from the task file the launcher wrote (mode 0600, so the job secret is
  never part of the job's description in ``qstat -j`` or YARN's application spec), on top of
  the task's own environment. Where the batch system carries the launcher's environment to the
  task without recording it (``srun`` sends it to the nodes' slurmd directly), the same document
  comes in environment variables instead (``--task-env NAME``: ``NAME``, then ``NAME_1``, ...
  where it is longer than one variable may be), which the wrapper removes before the command
  starts: no file to share, none to clean up, and no value on a command line.

Then it runs the command through the node agent (:mod:`.agent`): connected to the launcher's
hub (the task file's ``hub``), the task's start, output and exit code reach the launcher at
once, and the launcher can stop it gracefully or make it dump its stacks, which a batch
system's own controls cannot do. The output is also written to the task's own stdout and
stderr (the batch system's files keep it), unless ``--no-tee``. Without a connection the task
still runs, its output only in those files; with ``--in-band`` its frames (start, output,
exit) go in-band to its stdout and stderr instead (transport c of :mod:`.protocol`), for a
launcher that reads the task's output as it is written (``srun`` relays it). The wrapper
exits with the command's exit code (128+N for signal N; 127 when it does not exist, 126 when
it cannot be executed).

A batch system's notice (SIGUSR1, SIGUSR2: Grid Engine's ``-notify`` before a suspension or a
removal) reaches the wrapper, which passes it on to the command's group; in a Slurm step, whose
signals (``--signal``, ``scancel --signal``) reach every process of the step already, it only
keeps the wrapper alive (:class:`.agent.Agent`'s ``pass_notices``).

Task file (JSON)::

    {"version": 2,
     "argv": ["python", "train.py"],            # optional (yarn passes argv after --)
     "env": {"PATH": "..."},                    # for every role
     "roles": {"server": {"first_task_id": 2, "count": 1, "env": {...}},
               "worker": {"first_task_id": 0, "count": 2, "env": {...},
                          "local_procs": [2, 1]}},  # optional: PSLAUNCH_LOCAL_PROCS by index
     # a replacement's role (one task, started while the job runs) also has, by index:
     #   "idents": [7]      the id its agent connects as (else DMLC_TASK_ID): one the hub admitted for it
     #   "processes": [...] its PSLAUNCH_PROCESS (else worked out from the job, role, index and attempt)
     "hub": ["10.0.0.1", 9092],                 # optional: where the agent connects
     "placement": {"timeout": 120.0},           # optional: report the host, wait for the rest
     "grace": 10.0,                             # --kill-grace
     "usage": 1.0}                              # optional: report CPU and RSS every 1.0 s (u frames)

With ``placement``, the agent tells the launcher which host it runs on and waits (at most
``timeout`` seconds) for the variables that depend on which tasks share a host (torch's
``RANK``, ``LOCAL_RANK``, ...; :mod:`.protocol`, *Placement*), then starts the command
with them.

Run as ``node.command("task") --task-file F --role worker --index sge`` (or from the node
bundle: ``python3 pslaunch-node.zip ...``), or ``... --task-env PSLAUNCH_TASK --role worker
--index slurm --no-tee --in-band -- COMMAND...``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Mapping, MutableMapping, Sequence

import pscontract as pc
from pscontract import netif

from .agent import Agent, AgentError, Channel, catch_signals, connect

TASK_FILE_VERSION = 2
# What the batch systems set in each task: Grid Engine's 1-based array index and job number,
# skein's "<service>_<instance>".
SGE_TASK_ID = "SGE_TASK_ID"
SGE_JOB_ID = "JOB_ID"
SKEIN_CONTAINER_ID = "SKEIN_CONTAINER_ID"
# Slurm: the task's rank within its job step (0-based), and the step's id for the start frame (p).
SLURM_PROCID = "SLURM_PROCID"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_ID = "SLURM_STEP_ID"
# Ray: the index the launcher's actor gives its wrapper (0-based within the role), and the actor's
# node address (Ray's own, ``ray.util.get_node_ip_address()``): DMLC_NODE_HOST where DMLC_INTERFACE
# does not choose one. Both are set by the actor and removed before the command starts.
RAY_INDEX = "PSLAUNCH_RAY_INDEX"
RAY_NODE_IP = "PSLAUNCH_RAY_NODE_IP"
# Kubernetes: the Pod's rank label, which its spec gives the wrapper through the downward API.
K8S_INDEX = "PSLAUNCH_K8S_INDEX"
INDEX_SOURCES = ("sge", "skein", "slurm", "ray", "k8s")
PREFIX = "pslaunch task"


class TaskError(Exception):
    """The task cannot start; ``str(e)`` is one line for the task's error file."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def task_index(source: str, environ: Mapping[str, str]) -> int:
    """The 0-based index of this task within its role.

    Args:
        source: ``sge`` (``SGE_TASK_ID``, 1-based), ``skein``
            (``SKEIN_CONTAINER_ID`` = ``<service>_<instance>``, 0-based), ``slurm``
            (``SLURM_PROCID``, 0-based: one job step per role), ``ray`` (``PSLAUNCH_RAY_INDEX``,
            0-based, set by the launcher's actor) or ``k8s`` (``PSLAUNCH_K8S_INDEX``: the Pod's
            ``pslaunch.io/rank`` label).
        environ: the task's environment.

    Raises:
        TaskError: the variable is missing or malformed (for example
            ``SGE_TASK_ID=undefined`` in a job that is not an array).
    """
    if source == "sge":
        raw = environ.get(SGE_TASK_ID, "")
        if not raw.isdigit() or int(raw) < 1:
            raise TaskError(f"{SGE_TASK_ID}={raw!r}: not a task of an array job "
                            "(pslaunch submits bulk jobs; is this running outside Grid Engine?)")
        return int(raw) - 1
    if source == "skein":
        raw = environ.get(SKEIN_CONTAINER_ID, "")
        _, _, instance = raw.rpartition("_")
        if not instance.isdigit():
            raise TaskError(f"{SKEIN_CONTAINER_ID}={raw!r}: expected <service>_<instance>")
        return int(instance)
    if source == "slurm":
        raw = environ.get(SLURM_PROCID, "")
        if not raw.isdigit():
            raise TaskError(f"{SLURM_PROCID}={raw!r}: not a task of a Slurm job step "
                            "(is this running outside srun?)")
        return int(raw)
    if source == "ray":
        raw = environ.get(RAY_INDEX, "")
        if not raw.isdigit():
            raise TaskError(f"{RAY_INDEX}={raw!r}: not a task of a pslaunch Ray actor")
        return int(raw)
    if source == "k8s":
        raw = environ.get(K8S_INDEX, "")
        if not raw.isdigit():
            raise TaskError(f"{K8S_INDEX}={raw!r}: not a pslaunch Pod (its spec sets it from the rank label)")
        return int(raw)
    raise TaskError(f"unknown index source {source!r} (expected one of {', '.join(INDEX_SOURCES)})")


def load_task_file(path: str) -> dict[str, Any]:
    """Read and check the task file; :class:`TaskError` with the reason otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise TaskError(f"cannot read the task file {path}: {e.strerror or e} "
                        "(is the launcher's directory shared with this host?)") from None
    except ValueError as e:
        raise TaskError(f"task file {path} is not valid JSON: {e}") from None
    return _checked(doc, f"task file {path}")


#: The most characters of the task document in one variable: Linux's execve refuses a single
#: ``NAME=VALUE`` over 128 KiB (E2BIG), so a larger document (a job with a few hundred KiB of
#: variables) goes on in ``NAME_1``, ``NAME_2``, ... (:func:`task_env_chunks`).
TASK_ENV_CHUNK = 96 * 1024


def task_env_chunks(name: str, text: str) -> dict[str, str]:
    """``text`` (the task document's JSON) as variables ``name``, ``name_1``, ... of at most
    :data:`TASK_ENV_CHUNK` characters each, in order (what :func:`take_task_env` joins)."""
    parts = [text[i:i + TASK_ENV_CHUNK] for i in range(0, len(text), TASK_ENV_CHUNK)] or [""]
    return {(name if n == 0 else f"{name}_{n}"): part for n, part in enumerate(parts)}


def take_task_env(name: str, environ: MutableMapping[str, str]) -> dict[str, Any]:
    """The task document from variable ``name`` of ``environ`` (and its continuations ``name_1``,
    ... :func:`task_env_chunks`), which are removed from it (the command must not inherit the job's
    secret twice, nor a copy of every role's variables)."""
    raw = environ.pop(name, None)
    n = 1
    while raw is not None and f"{name}_{n}" in environ:
        raw += environ.pop(f"{name}_{n}")
        n += 1
    if raw is None:
        raise TaskError(f"{name} is not set: the launcher passes the task document in it "
                        "(did the batch system drop the launcher's environment?)")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise TaskError(f"{name} is not valid JSON: {e}") from None
    return _checked(doc, f"the task document in {name}")


def _checked(doc: Any, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("version") != TASK_FILE_VERSION:
        raise TaskError(f"{where}: unsupported version {doc.get('version') if isinstance(doc, dict) else None!r}"
                        f" (this wrapper reads version {TASK_FILE_VERSION})")
    return doc


def node_address(environ: Mapping[str, str]) -> str:
    """``DMLC_NODE_HOST`` for this node (:func:`pscontract.netif.node_address`; toward the job's
    scheduler or tracker, :func:`pscontract.service_endpoint`)."""
    service = pc.service_endpoint(environ)
    if not environ.get(pc.INTERFACE, "").strip() and service is None:
        raise TaskError(f"neither {pc.ROOT_URI} nor {pc.TRACKER_URI} nor {pc.MASTER_ADDR} is set in the task file")
    try:
        return netif.node_address(environ.get(pc.INTERFACE), service[0] if service else None)
    except netif.NetifError as e:
        raise TaskError(f"cannot work out this node's address: {e}") from None


def torch_sockets(env: Mapping[str, str]) -> dict[str, str]:
    """A torch job's gloo and NCCL on the network its ranks reach each other on: the interface
    ``DMLC_INTERFACE`` selects here, else the one that carries ``DMLC_NODE_HOST`` (the address
    that routes to the store); nothing where the user set them (:func:`pscontract.torch_sockets`)."""
    if not env.get(pc.MASTER_ADDR):
        return {}
    try:
        return pc.torch_sockets(env, netif.carrier_name(env.get(pc.INTERFACE), env.get(pc.NODE_HOST)))
    except netif.NetifError as e:
        raise TaskError(f"cannot work out this node's interface: {e}") from None


def task_environment(doc: Mapping[str, Any], role: str, index: int,
                     environ: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: the task's own, then the job's, then the contract.

    Args:
        doc: the task file.
        role: ``server`` or ``worker``.
        index: 0-based index within the role (:func:`task_index`).
        environ: the task's environment as the batch system set it.

    Raises:
        TaskError: unknown role, or an index outside the role's count.
    """
    roles = doc.get("roles") or {}
    if role not in roles:
        raise TaskError(f"role {role!r} is not in the task file (it has {', '.join(sorted(roles)) or 'none'})")
    spec = roles[role]
    count = int(spec["count"])
    if not 0 <= index < count:
        raise TaskError(f"{role} index {index} is out of range: the job has {count} {role}(s)")
    env = dict(environ)
    env.update(doc.get("env") or {})
    env.update(spec.get("env") or {})
    env[pc.ROLE] = role
    env[pc.TASK_ID] = str(int(spec["first_task_id"]) + index)
    attempt = env.get(pc.ATTEMPT, "0")
    env[pc.PROCESS] = pc.process_marker(env.get(pc.JOB_ID, "job"), f"{role}-{index}",
                                        int(attempt) if attempt.isdigit() else 0)
    processes = spec.get("processes")
    if isinstance(processes, list) and index < len(processes):  # (a replacement's marker of its own)
        env[pc.PROCESS] = str(processes[index])
    local = spec.get("local_procs")
    if isinstance(local, list) and index < len(local):  # (known where the launcher placed the tasks)
        env[pc.LOCAL_PROCS] = str(int(local[index]))
    return env


def agent_ident(doc: Mapping[str, Any], role: str, index: int, env: Mapping[str, str]) -> int:
    """The id this task's agent connects to the hub as: its task id, or the one the launcher
    admitted for it (a replacement, the role's ``idents``: the lost task keeps its own)."""
    idents = (doc.get("roles") or {}).get(role, {}).get("idents")
    if isinstance(idents, list) and index < len(idents):
        return int(idents[index])
    return int(env[pc.TASK_ID])


def _report(directory: str, role: str, rank: int, env: Mapping[str, str]) -> None:
    """Tell the launcher where this task runs (host, pid), through the shared directory."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "node_host": env.get(pc.NODE_HOST),
              "time": time.time()}
    path = os.path.join(directory, f"{role}-{rank}.started")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass  # only informational (labels and --summary-json)


def _connect(doc: Mapping[str, Any], ident: int, env: Mapping[str, str]) -> Channel | None:
    """The channel to the launcher's hub, or None (with a note in the task's error file)."""
    address = doc.get("hub")
    if not address:
        return None
    try:
        return connect(address, ident, env.get(pc.SECRET, ""))
    except (OSError, ValueError) as e:
        print(f"{PREFIX}: warning: cannot connect to the launcher at {address[0]}:{address[1]} from "
              f"{socket.gethostname()} ({e}); the output stays in this task's files", file=sys.stderr, flush=True)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    catch_signals()
    ap = argparse.ArgumentParser(prog="pslaunch task", description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--task-file", help="the task document, a JSON file")
    source.add_argument("--task-env", metavar="NAME", help="the task document, in environment variable NAME")
    ap.add_argument("--role", required=True, choices=("server", "worker"))
    ap.add_argument("--index", required=True, choices=INDEX_SOURCES)
    ap.add_argument("--report-dir", default=None, help="write <role>-<rank>.started here")
    ap.add_argument("--no-tee", action="store_true",
                    help="while connected, do not also write the output to this task's own stdout/stderr")
    ap.add_argument("--in-band", action="store_true",
                    help="without a connection, write the frames (start, output, exit) in-band "
                         "to stdout and stderr")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND... (else the task file's argv)")
    a = ap.parse_args(argv)
    try:
        doc = load_task_file(a.task_file) if a.task_file else take_task_env(a.task_env, os.environ)
        index = task_index(a.index, os.environ)
        env = task_environment(doc, a.role, index, os.environ)
        ray_ip = env.pop(RAY_NODE_IP, "")
        env.pop(RAY_INDEX, None)
        # on Ray, the actor's node address, as Ray knows the node (DMLC_INTERFACE still chooses where set)
        env[pc.NODE_HOST] = ray_ip if ray_ip and not env.get(pc.INTERFACE, "").strip() else node_address(env)
        env.update(torch_sockets(env))
        command = list(a.command[1:] if a.command[:1] == ["--"] else a.command) or list(doc.get("argv") or [])
        if not command:
            raise TaskError("no command: neither after -- nor in the task file")
    except TaskError as e:
        print(f"{PREFIX}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if a.report_dir:
        _report(a.report_dir, a.role, index, env)
    ident = agent_ident(doc, a.role, index, env)
    agent = Agent(float(doc.get("grace", 10.0)), _connect(doc, ident, env),
                  fallback="in-band" if a.in_band else "plain", tee=not a.no_tee, here=socket.gethostname(),
                  prefix=PREFIX, watchdog=True, pass_notices=a.index != "slurm",
                  usage=float(doc.get("usage") or 0.0))
    placement = doc.get("placement")
    if placement:
        try:
            env.update(agent.placement(ident, float(placement.get("timeout", 120.0))))
        except AgentError as e:
            return agent.fail(ident, str(e), e.code)
    start = {"addr": env[pc.NODE_HOST]}
    if a.index == "slurm" and os.environ.get(SLURM_STEP_ID, "").isdigit():
        start["step"] = f"{os.environ.get(SLURM_JOB_ID, '')}.{os.environ[SLURM_STEP_ID]}"
    return agent.run([{"id": ident, "argv": command, "env": env, "start": start}])[0]

if __name__ == "__main__":
    sys.exit(main())
