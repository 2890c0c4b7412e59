"""The ray backend: servers and workers on an existing Ray cluster, each under pslaunch's own node agent.

pslaunch is a Ray driver (``ray.init(address=...)``: ``--ray-address``, else ``RAY_ADDRESS``, else
``auto``, the cluster of the node it runs on). A driver needs a raylet on its own machine, so
pslaunch runs on a node of the cluster (the head, usually), as any Ray driver does. For a job of
N processes it makes:

* one placement group of N bundles, one per process, ``{"CPU": cores}`` (``--worker-cores``,
  ``--server-cores``; plus ``{"GPU": n}`` for each worker with ``--ray-gpus n``), ``PACK`` by
  default, ``STRICT_SPREAD`` (each on its own node) with ``--ray-spread``. A group that Ray cannot
  place within ``--start-timeout`` is removed again and the launch fails with one line that
  names what is missing (:func:`describe_unplaced`);
* one actor per bundle, reserving the bundle's resources (so Ray's accounting and the
  ``CUDA_VISIBLE_DEVICES`` Ray sets are right), whose only work is to run pslaunch's task
  wrapper (``launcher.node.task``, sent as the node bundle: the node needs no pslaunch
  installation) with the node's Python. The wrapper connects to the job's hub like a Slurm or
  Grid Engine task's (``launcher.backends.batch``): the env contract, labelled output through
  pslaunch's channel (not Ray's log monitor), ``--log-dir``, the watchdog, graceful stops,
  stack dumps and exit codes are those of every backend. ``DMLC_NODE_HOST`` is the actor's node
  address as Ray knows it (``ray.util.get_node_ip_address()``), unless ``DMLC_INTERFACE``
  chooses one.

The task document (the job's variables, its secret among them) goes to each actor as an argument
of its one method call (inside the cluster's trust boundary, as Ray's own traffic: Ray neither logs
nor keeps a method call's arguments; docs/ray.md, "Security"), and from the actor to the wrapper in its environment
(``PSLAUNCH_TASK``, which the wrapper removes): never on a command line, never printed. A
cluster with token authentication is reached with the token Ray itself reads (``RAY_AUTH_TOKEN``
or Ray's token file); pslaunch neither reads nor shows it.

Teardown: SIGTERM (then SIGKILL after ``--kill-grace``) through each agent, which stops its
command's process group and every process that carries the job's marker (children that called
``setsid`` included, which Ray's own process-group cleanup misses); then ``ray.kill`` of every
actor and the removal of the placement group. The wrapper gets SIGTERM when its actor dies
(parent-death signal), and the actors die with the driver, so a launcher killed with SIGKILL
leaves nothing either.

A node lost mid-job (the actor's call fails and its raylet takes no connection, or Ray marked
the node dead: :func:`node_lost`) is said as slurm says it: the process's exit code is 1, its
reason names the node. ``--max-restarts`` places every attempt anew (a backend per attempt);
``--restart-scope process`` replaces a lost worker in place (:meth:`RayBackend.submit_replacement`).

``ray`` is imported only here, inside the methods (it takes about a second): the ``ray`` extra
(``pip install '.[ray]'`` in a clone of pslaunch).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..node import task as task_wrapper
from ..runtime.output import ProcOutput
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan, ProcSpec
from .base import BackendOption
from .batch import BatchBackend, BatchTask, agent_line, build_task_file, task_roles

log = logging.getLogger(__name__)

RAY_ADDRESS = "RAY_ADDRESS"
#: the environment variable that carries the task document from the actor to the wrapper
TASK_ENV = "PSLAUNCH_TASK"
STRATEGIES = {False: "PACK", True: "STRICT_SPREAD"}
#: Ray's namespace for the job's actors and placement group (names: ``pslaunch-<job id>``)
NAMESPACE = "pslaunch"


# --- options and pure builders -------------------------------------------------------------


@dataclass(frozen=True)
class RayOptions:
    """``--ray-*``: ``address`` of the cluster (None: ``RAY_ADDRESS``, else ``auto``), ``spread``
    (``STRICT_SPREAD``: every process on its own node), ``gpus`` per worker."""

    address: Optional[str] = None
    spread: bool = False
    gpus: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 0 <= self.gpus <= 1024:
            raise ConfigError(f"--ray-gpus must be a whole number from 0 to 1024, got {self.gpus!r}")
        if self.address is not None and not str(self.address).strip():
            raise ConfigError("--ray-address needs an address: HOST:PORT of the head's GCS, or auto")
        if self.address is not None and str(self.address).strip().lower().startswith("ray://"):
            raise ConfigError(f"--ray-address {self.address.strip()}: Ray Client (ray://) is not supported; run "
                              f"pslaunch on a node of the cluster (the head) with --ray-address HOST:PORT of the "
                              f"head's GCS, or auto")


def cluster_address(opts: RayOptions, environ: Mapping[str, str]) -> str:
    """Where the driver connects: ``--ray-address``, else ``RAY_ADDRESS``, else ``auto``."""
    return (opts.address or environ.get(RAY_ADDRESS, "") or "auto").strip()


def bundles(spec: JobSpec, procs: Sequence[ProcSpec]) -> list[dict[str, float]]:
    """One bundle per process, in the order of ``procs``: its role's cores, and a worker's GPUs."""
    opts: RayOptions = spec.options or RayOptions()
    out = []
    for p in procs:
        b: dict[str, float] = {"CPU": float(spec.server_cores if p.role is Role.SERVER else spec.worker_cores)}
        if p.role is Role.WORKER and opts.gpus:
            b["GPU"] = float(opts.gpus)
        out.append(b)
    return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _shape(b: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_number(v)}" for k, v in sorted(b.items())) + "}"


def describe_unplaced(wanted: Sequence[Mapping[str, float]], strategy: str, free: Sequence[Mapping[str, float]],
                      timeout: float) -> str:
    """The one line for a placement group that Ray could not place within ``--start-timeout``.

    Args:
        wanted: the bundles asked for.
        strategy: ``PACK`` or ``STRICT_SPREAD``.
        free: each alive node's free resources (``CPU``, ``GPU``, ...).

    Example:
        >>> describe_unplaced([{"CPU": 2}] * 4, "PACK", [{"CPU": 2}, {"CPU": 2}, {"CPU": 2}], 30)
        ... # doctest: +NORMALIZE_WHITESPACE
        'Ray could not place the job within --start-timeout 30s: it needs 4 bundles of {CPU: 2};
         the cluster has 3 nodes with 2 CPUs free each (6 in all)'
    """
    shapes: dict[str, int] = {}
    for b in wanted:
        shapes[_shape(b)] = shapes.get(_shape(b), 0) + 1
    need = " + ".join(f"{n} bundle{'s' if n != 1 else ''} of {s}" for s, n in shapes.items())
    if strategy == "STRICT_SPREAD":
        need += ", each on its own node (--ray-spread)"
    keys = sorted({k for b in wanted for k in b})
    parts = []
    for key in keys:
        name = {"CPU": "CPUs", "GPU": "GPUs"}.get(key, key)
        values = [float(f.get(key, 0.0)) for f in free]
        if values and all(v == values[0] for v in values):
            each = f"{_number(values[0])} {name} free each"
        else:
            each = f"{', '.join(_number(v) for v in values)} {name} free"
        parts.append(f"{each} ({_number(sum(values))} in all)")
    have = f"the cluster has {len(free)} node{'s' if len(free) != 1 else ''}"
    if parts:
        have += " with " + "; ".join(parts)
    return f"Ray could not place the job within --start-timeout {timeout:g}s: it needs {need}; {have}"


def asked_bundles(job: Mapping[str, Any], opts: RayOptions) -> list[dict[str, float]]:
    """The bundles of the job whose command line ``pslaunch doctor`` was given (its values by
    parameter name: ``num_workers``, ``worker_cores``, ...); [] when it names no process."""
    def whole(name: str, default: int) -> int:
        value = job.get(name)
        if value is None:
            return default
        try:
            return int(str(value).split(":")[-1])  # (-n MIN:MAX: the most it may ask for)
        except ValueError:
            return default
    workers, servers = whole("num_workers", 0), whole("num_servers", 0)
    worker = {"CPU": float(whole("worker_cores", 1)), **({"GPU": float(opts.gpus)} if opts.gpus else {})}
    return [dict(worker) for _ in range(workers)] + [{"CPU": float(whole("server_cores", 1))} for _ in range(servers)]


def fits(wanted: Sequence[Mapping[str, float]], strategy: str, free: Sequence[Mapping[str, float]]) -> bool:
    """Whether ``wanted`` fits the nodes' ``free`` resources now (first fit, largest first; for
    ``STRICT_SPREAD`` each bundle on a node of its own). A check for the doctor: Ray decides."""
    spare = [dict(f) for f in free]
    used: set[int] = set()
    for b in sorted(wanted, key=lambda b: -sum(b.values())):
        for i, node_free in enumerate(spare):
            if strategy == "STRICT_SPREAD" and i in used:
                continue
            if all(node_free.get(k, 0.0) >= v for k, v in b.items()):
                for k, v in b.items():
                    node_free[k] = node_free.get(k, 0.0) - v
                used.add(i)
                break
        else:
            return False
    return True


def actor_class() -> type:
    """The actor that runs one task wrapper; defined in a function so that Ray ships it by value
    (a node needs no pslaunch installation: the wrapper comes as the node bundle)."""

    class PslaunchTask:
        """Runs one pslaunch task wrapper on its node; nothing else."""

        def __init__(self) -> None:
            self.child: Any = None

        def run(self, bundle: bytes, args: list, env: dict, cwd: str) -> int:
            """Start the wrapper (``python BUNDLE ARGS``, ``env`` over the actor's own environment),
            wait for it, return its exit code (128+N for signal N)."""
            import os
            import shutil
            import sys
            import tempfile

            import ray

            where = tempfile.mkdtemp(prefix="pslaunch-ray-")
            try:
                path = os.path.join(where, "node.zip")
                with open(path, "wb") as f:
                    f.write(bundle)
                child_env = dict(os.environ)
                child_env.update(env)
                child_env["PSLAUNCH_RAY_NODE_IP"] = ray.util.get_node_ip_address()
                self.child = self.spawn([sys.executable, path, *args], child_env, cwd)
                code = self.child.wait()
                return 128 - code if code < 0 else code
            finally:
                shutil.rmtree(where, ignore_errors=True)

        def spawn(self, argv: list, env: dict, cwd: str) -> Any:
            """Start ``argv`` from a thread of its own that lives exactly as long as the child.

            The child asks for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``: the wrapper
            then stops its command when the actor is killed). Linux sends that signal when the
            *thread* that forked the child ends, not the process; this actor is threaded
            (``max_concurrency=2``: methods run on Ray's pool threads, whose lifetime is Ray's
            business), so forking on the caller's thread would let Ray end the wrapper by retiring a
            thread. The thread here only forks and waits: it ends after the child has, or with the
            actor's process. The child also checks, after asking, that its parent is still the
            actor (it may have died between the fork and the ``prctl``)."""
            import ctypes
            import os
            import signal
            import subprocess
            import threading

            actor_pid = os.getpid()
            libc = ctypes.CDLL(None, use_errno=True)

            def die_with_actor() -> None:
                libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
                if os.getppid() != actor_pid:
                    os.kill(os.getpid(), signal.SIGTERM)

            started: dict = {}
            ready = threading.Event()

            def fork_and_wait() -> None:
                try:
                    started["child"] = subprocess.Popen(argv, env=env, cwd=cwd if os.path.isdir(cwd) else None,
                                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_actor)
                except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                    started["error"] = e
                    return
                finally:
                    ready.set()
                started["child"].wait()

            threading.Thread(target=fork_and_wait, name="pslaunch-wrapper", daemon=True).start()
            ready.wait()
            if "error" in started:
                raise started["error"]
            return started["child"]

        def node(self) -> dict:
            import os
            import socket

            import ray
            return {"ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "pid": os.getpid()}

    return PslaunchTask


def load_ray() -> Any:
    """Import ``ray``, or raise a one-line :class:`BackendUnavailableError`."""
    if importlib.util.find_spec("ray") is None:
        raise BackendUnavailableError("--launcher ray needs the ray package in pslaunch's Python: pip install "
                                      "'.[ray]' in your clone of pslaunch (ray==2.60.0, the cluster's release)")
    import ray

    return ray


# --- the handle ------------------------------------------------------------------------------


class RayTask(BatchTask):
    """One process of the job: its actor, and the reference of the actor's one call."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: RayBackend, index: int, actor: Any,
                 ref: Any, ident: Optional[int] = None) -> None:
        super().__init__(proc, output, backend, host="(ray)", ident=ident)
        self.index = index            # its bundle
        self.actor = actor
        self.ref = ref
        self.resolved = False         # the actor's call returned or failed: Ray holds nothing of it running
        self.state = "pending"
        self.node_id = ""             # the Ray node its bundle is on, and that node's raylet (address, port)
        self.node_addr = ""
        self.raylet_port = 0
        self.node_gone = False        # Ray lost its node (a replacement needs a bundle elsewhere)

    def where(self) -> str:
        return f"Ray actor of bundle {self.index}"


# --- the backend -----------------------------------------------------------------------------


class RayBackend(BatchBackend):
    """An existing Ray cluster. See the module docstring."""

    name = "ray"
    can_replace = True
    poll_every = 0.2
    close_wait = 20.0
    Options = RayOptions
    options = (
        BackendOption(("--ray-address",), "address", "the Ray cluster's address, HOST:PORT of its GCS "
                      "(default: RAY_ADDRESS, else auto: the cluster of this node). pslaunch is a Ray driver: "
                      "it must run on a node of the cluster (the head, usually); Ray Client (ray://) is not "
                      "supported.", metavar="ADDR"),
        BackendOption(("--ray-spread",), "spread", "put every process on its own node (STRICT_SPREAD; "
                      "default PACK).", kind="flag", default=False),
        BackendOption(("--ray-gpus",), "gpus", "GPUs each worker's actor reserves (Ray sets its "
                      "CUDA_VISIBLE_DEVICES).", kind="int", default=0, metavar="N"),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ray: Any = None
        self._pg: Any = None
        self._connected = False
        self._bundle_ref: Any = None
        self._groups: list[Any] = []  # the replacements' own placement groups (a lost node's)

    # -- what the rest of the launcher asks of the class ------------------------------------------

    @classmethod
    def where(cls, spec: JobSpec, plan: Plan) -> str:
        return f"the Ray cluster at {cluster_address(spec.options or RayOptions(), spec.environ_dict())}"

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        opts: RayOptions = spec.options or RayOptions()
        wanted = bundles(spec, plan.procs)
        shapes = sorted({_shape(b) for b in wanted})
        out = [f"Ray: a driver of the cluster at {cluster_address(opts, spec.environ_dict())}; one placement group of "
               f"{len(wanted)} bundles ({', '.join(shapes)}), {STRATEGIES[opts.spread]}, removed at the end;",
               "one actor per bundle, reserving it, runs the task wrapper (launcher.node.task, sent as the node "
               "bundle) with the node's Python:"]
        doc = build_task_file(spec, plan.procs)
        for role, r in doc["roles"].items():
            out.append(f"  {role}: DMLC_TASK_ID = {r['first_task_id']} + the actor's index, {len(r['env'])} variables")
        out.append(f"the task document (with the job secret) goes to each actor as an argument and to the wrapper in "
                   f"{TASK_ENV}: never on a command line")
        out.append(agent_line())
        return out

    @classmethod
    def doctor(cls, environ: Mapping[str, str], *, queue: Optional[str] = None,
               options: Optional[RayOptions] = None, job: Optional[Mapping[str, Any]] = None,
               ) -> list[tuple[str, bool, str]]:
        """``pslaunch doctor --launcher ray``: ray importable, the cluster reachable, its nodes and
        free resources, and whether the job's bundles fit them now (:func:`fits`)."""
        opts = options or RayOptions()
        rows: list[tuple[str, bool, str]] = []
        try:
            ray = load_ray()
        except BackendUnavailableError as e:
            return [("ray package", False, str(e))]
        rows.append(("ray package", True, f"ray {ray.__version__}"))
        address = cluster_address(opts, environ)
        try:
            _connect(ray, address)
        except LaunchError as e:
            return [*rows, ("Ray cluster", False, str(e))]
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            free = _free_per_node(ray, nodes)
            rows.append(("Ray cluster", True, f"{address}: {len(nodes)} alive node{'s' if len(nodes) != 1 else ''}"))
            for n in nodes:
                total = n.get("Resources") or {}
                avail = free.get(n["NodeID"], {})
                rows.append((f"node {n.get('NodeManagerAddress')}", True,
                             f"CPU {_number(avail.get('CPU', 0))}/{_number(total.get('CPU', 0))} free, "
                             f"GPU {_number(avail.get('GPU', 0))}/{_number(total.get('GPU', 0))} free"))
            wanted = asked_bundles(job or {}, opts)
            if wanted:
                strategy = STRATEGIES[opts.spread]
                spare = [free.get(n["NodeID"], {}) for n in nodes]
                ok = fits(wanted, strategy, spare)
                rows.append(("job fits", ok, f"{len(wanted)} bundles ({', '.join(sorted({_shape(b) for b in wanted}))},"
                             f" {strategy}) fit the free resources now" if ok else
                             describe_unplaced(wanted, strategy, spare, 0).split(": ", 1)[1]))
        finally:
            ray.shutdown()
        return rows

    # -- set-up ------------------------------------------------------------------------------------

    def check(self) -> None:
        self._ray = load_ray()

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        ray = self._ray or load_ray()
        self._ray = ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: RayOptions = self.spec.options or RayOptions()
        if not self._connected:
            _connect(ray, cluster_address(opts, self.spec.environ_dict()))
            self._connected = True
        wanted = bundles(self.spec, procs)
        strategy = STRATEGIES[opts.spread]
        job_id = procs[0].env.get(pc.JOB_ID, "job")
        timeout = max(self.spec.start_timeout, 1.0)
        pg = placement_group(wanted, strategy=strategy, name=f"pslaunch-{job_id}")
        self._pg = pg
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            try:
                nodes = [n for n in ray.nodes() if n.get("Alive")]
                free = list(_free_per_node(ray, nodes).values())
            finally:
                remove_placement_group(pg)
                self._pg = None
            raise LaunchError(describe_unplaced(wanted, strategy, free, timeout))
        log.info("Ray placed %d bundles (%s)", len(wanted), strategy)
        placed = _bundle_nodes(ray, pg)

        doc = build_task_file(self.spec, procs, hub=hub)
        env_doc = task_wrapper.task_env_chunks(TASK_ENV, json.dumps(doc, separators=(",", ":")))
        bundle_ref = self._bundle_ref = ray.put(node.bundle("task"))
        cls = ray.remote(actor_class())
        cwd = self.spec.workdir or os.getcwd()
        first = {str(r): min((p.rank for p in procs if p.role is r), default=0) for r in (Role.SERVER, Role.WORKER)}
        for i, (p, b) in enumerate(zip(procs, wanted)):
            actor = cls.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_concurrency=2,
                                name=f"pslaunch-{job_id}-{p.name}", namespace=NAMESPACE,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
            index = p.rank - first[str(p.role)]
            args = ["--task-env", TASK_ENV, "--role", str(p.role), "--index", "ray",
                    *(("--no-tee",) if hub else ())]
            env = {**env_doc, task_wrapper.RAY_INDEX: str(index)}
            ref = actor.run.remote(bundle_ref, args, env, cwd)
            t = RayTask(p, self.console.proc(p.name, p.label, str(p.role)), self, i, actor, ref)
            t.node_id, t.node_addr, t.raylet_port = placed.get(i, ("", "", 0))
            self.add_task(t)
        log.info("started %d Ray actors", len(procs))
        return self.tasks

    def submit_replacement(self, proc: ProcSpec, lost: BatchTask, ident: int) -> BatchTask:
        """``--restart-scope process``: the lost worker's replacement, its agent connecting as
        ``ident``. Where the lost process's actor lives (its process died, not its node), the
        actor runs the wrapper again: the same bundle, the same node, its resources still held.
        Where Ray lost the node, a new actor in a placement group of one bundle of its own, on a
        node that has room (the group is removed at the end like the job's)."""
        ray = self._ray
        assert isinstance(lost, RayTask) and self.hub is not None and ray is not None
        roles = task_roles([proc])
        part = roles[str(proc.role)]
        part["idents"] = [ident]
        if pc.PROCESS in proc.env:
            part["processes"] = [proc.env[pc.PROCESS]]
        doc = build_task_file(self.spec, [proc], hub=self.hub.address, roles=roles)
        env = {**task_wrapper.task_env_chunks(TASK_ENV, json.dumps(doc, separators=(",", ":"))),
               task_wrapper.RAY_INDEX: "0"}
        args = ["--task-env", TASK_ENV, "--role", str(proc.role), "--index", "ray", "--no-tee"]
        cwd = self.spec.workdir or os.getcwd()
        actor, index, where = lost.actor, lost.index, (lost.node_id, lost.node_addr, lost.raylet_port)
        if lost.node_gone:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            (wanted,) = bundles(self.spec, [proc])
            pg = placement_group([wanted], strategy="PACK", name=f"pslaunch-{proc.env.get(pc.JOB_ID, 'job')}-"
                                 f"{proc.name}-{ident}")
            self._groups.append(pg)
            ready, _ = ray.wait([pg.ready()], timeout=max(self.spec.start_timeout, 1.0))
            if not ready:
                raise LaunchError(f"{proc.label}'s replacement: Ray could not place a bundle of {_shape(wanted)} on "
                                  f"the nodes left within --start-timeout {self.spec.start_timeout:g}s")
            actor = ray.remote(actor_class()).options(
                num_cpus=wanted["CPU"], num_gpus=wanted.get("GPU", 0), max_concurrency=2, namespace=NAMESPACE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
            index, where = 0, _bundle_nodes(ray, pg).get(0, ("", "", 0))
        ref = actor.run.remote(self._bundle_ref, args, env, cwd)
        t = RayTask(proc, self.console.proc(proc.name, proc.label, str(proc.role)), self, index, actor, ref,
                    ident=ident)
        t.node_id, t.node_addr, t.raylet_port = where
        self.add_task(t)
        return t

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        names = ", ".join(t.label for t in pending)
        return (f"{len(pending)} of {len(self.tasks)} Ray actors placed but not running after --start-timeout "
                f"{timeout:g}s ({names}): is the nodes' Python able to start them (ray status, the raylet logs)?")

    # -- following the tasks -------------------------------------------------------------------------

    def poll_once(self) -> None:
        ray = self._ray
        open_ = [t for t in self.tasks if isinstance(t, RayTask) and not t.resolved]
        if not open_ or ray is None:
            return
        ready, _ = ray.wait([t.ref for t in open_], num_returns=len(open_), timeout=0)
        done = set(ready)
        for t in open_:
            if t.ref not in done:
                continue
            t.resolved = True
            try:
                code, reason = int(ray.get(t.ref)), ""
            except Exception as e:  # noqa: BLE001 - RayActorError, WorkerCrashedError, ...: the actor died
                code = 128 + int(signal.SIGKILL)
                reason = ("its Ray actor was killed by the launcher" if t.terminated else
                          f"its Ray actor died ({type(e).__name__})")
                if not t.terminated and t.node_addr and node_lost(ray, t.node_id, t.node_addr, t.raylet_port):
                    # as slurm does for a node it lost: exit code 1, the node named (its processes
                    # never said anything: the node is gone), before those stopped because of it
                    log.error("Ray lost node %s (its raylet at %s:%d stopped answering)", t.node_addr,
                              t.node_addr, t.raylet_port)
                    # (a reason, not a failure: a failure means "could not start", which no restart helps)
                    code, reason = 1, (f"Ray lost its node {t.node_addr}: its raylet at {t.node_addr}:{t.raylet_port} "
                                       "stopped answering, and the actor with it (ray status; the raylet's log there)")
                    t.node_gone = True
            self.set_code(t, code, reason)

    def settled(self) -> bool:
        return all(isinstance(t, RayTask) and t.resolved for t in self.tasks)

    # -- stopping ----------------------------------------------------------------------------------------

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """Kill the actors of ``tasks`` (their wrappers get SIGTERM: the parent-death signal)."""
        ray = self._ray
        for t in tasks:
            assert isinstance(t, RayTask)
            if t.terminated or ray is None:
                continue
            t.terminated = True
            if any(o is not t and o.actor is t.actor and not o.resolved for o in self.tasks
                   if isinstance(o, RayTask) and o not in tasks):
                continue  # (a replacement runs in the lost task's actor: it is stopped through its agent)
            try:
                ray.kill(t.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("ray.kill(%s): %s", t.label, e)

    def release(self) -> None:
        """Kill every actor, remove the placement group, end the driver."""
        ray = self._ray
        if ray is None or not self._connected:
            return
        from ray.util.placement_group import remove_placement_group

        for t in self.tasks:
            assert isinstance(t, RayTask)
            try:
                ray.kill(t.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("ray.kill(%s): %s", t.label, e)
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as e:  # noqa: BLE001 - the driver's end removes it too
                log.debug("remove_placement_group: %s", e)
            self._pg = None
        for pg in self._groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - the driver's end removes it too
                log.debug("remove_placement_group: %s", e)
        self._groups = []
        ray.shutdown()
        self._connected = False


def _connect(ray: Any, address: str) -> None:
    """``ray.init`` as a quiet driver (no log monitor: the output comes through pslaunch's hub),
    keeping pslaunch's own signal handlers (ray.init sets one for SIGTERM)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        from ray._private import worker as ray_worker

        # Ray prints the errors it publishes to every driver (a raylet's death: its last 20 log
        # lines) on the launcher's own stdout; one line of it in pslaunch's log instead
        ray_worker.print_to_stdstream = _ray_said
    except Exception as e:  # noqa: BLE001 - a private API: Ray then prints them itself
        log.debug("Ray's error printer: %s", e)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False, include_dashboard=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError: one line
        text = " ".join(str(e).split())
        text = (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)
        raise LaunchError(f"cannot connect to the Ray cluster at {address}: {text} (a Ray driver needs a raylet on "
                          "its own machine: run pslaunch on a node of the cluster, the head usually, with "
                          "--ray-address HOST:PORT of the head's GCS or auto; Ray Client, ray://, is not supported)"
                          ) from None
    finally:
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)
    ip = ray.util.get_node_ip_address()
    if not owns_address(ip):
        ray.shutdown()
        raise LaunchError(f"this machine is not a node of the Ray cluster at {address}: Ray takes it for node {ip}, "
                          "an address it does not have, and actors could not reach the driver (a Ray driver needs a "
                          "raylet on its own machine: run pslaunch on a node of the cluster, the head usually; Ray "
                          "Client, ray://, is not supported)")


def _ray_said(data: Mapping[str, Any], ignore_prefix: bool = False) -> None:
    """An error Ray published to the drivers: its first line as a warning, the rest in the debug log."""
    lines = [ln for item in data.get("lines") or [] for ln in str(item).splitlines() if ln.strip()]
    if lines:
        log.warning("Ray says: %s", " ".join(lines[0].split())[:300])
        log.debug("Ray says:\n%s", "\n".join(lines[1:]))


def owns_address(ip: str) -> bool:
    """Whether this machine (its network namespace) has address ``ip``: a socket binds to it.
    Only a clear "not here" (EADDRNOTAVAIL) says no."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
    except OSError as e:
        return e.errno != errno.EADDRNOTAVAIL
    return True


def _bundle_nodes(ray: Any, pg: Any) -> dict[int, tuple[str, str, int]]:
    """Each bundle's node: ``{index: (node id, node address, raylet port)}`` (Ray's view once the
    group is placed; {} where Ray does not say: a lost node is then not told apart)."""
    try:
        by_bundle = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
        nodes = {n["NodeID"]: n for n in ray.nodes()}
    except Exception as e:  # noqa: BLE001 - only the wording of a lost node depends on it
        log.debug("placement_group_table: %s", e)
        return {}
    out = {}
    for index, node_id in by_bundle.items():
        n = nodes.get(node_id) or {}
        out[int(index)] = (node_id, str(n.get("NodeManagerAddress") or ""), int(n.get("NodeManagerPort") or 0))
    return out


def node_lost(ray: Any, node_id: str, addr: str, port: int, timeout: float = 3.0) -> bool:
    """Whether the node of a dead actor is lost: Ray has marked it dead, or its raylet takes no
    connection. Ray marks a node dead only after its health checks fail for a while (tens of
    seconds), while the actors on it fail at once: the raylet's port says it sooner."""
    import socket

    try:
        for n in ray.nodes():
            if n.get("NodeID") == node_id and not n.get("Alive"):
                return True
    except Exception as e:  # noqa: BLE001 - the GCS may be what is lost: ask the raylet
        log.debug("ray.nodes(): %s", e)
    if not port:
        return False
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return False
    except OSError:
        return True


def _free_per_node(ray: Any, nodes: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each alive node's free resources, by node id (Ray's own view; total where it has none)."""
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception as e:  # noqa: BLE001 - a private API: fall back to the totals
        log.debug("available_resources_per_node: %s", e)
        free = {}
    return {n["NodeID"]: dict(free.get(n["NodeID"], n.get("Resources") or {})) for n in nodes}
