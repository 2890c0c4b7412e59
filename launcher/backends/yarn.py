"""The yarn backend: servers and workers as the two services of one skein application.

Why skein rather than Hadoop's distributed shell (``yarn jar
hadoop-yarn-applications-distributedshell.jar``): a job needs two kinds of
containers (servers and workers) with their own resources and environment,
per-container states and exit messages, localized files and archives, and a
kill that takes everything down. skein gives all of that through a declarative
``ApplicationSpec`` and a Python client; the distributed shell runs one
command in N identical containers and reports only the application's final
status. skein is what Python users of YARN already have (pip or conda; it is
what dask-yarn uses), and unlike dmlc's launcher it needs no Java code of our
own to build. It needs Java, ``HADOOP_HOME`` (skein runs ``yarn classpath``)
and the cluster's configuration (``HADOOP_CONF_DIR``) on the launching host.

How a job runs:

* the scheduler runs on this machine, as on every backend, so the containers
  must reach it: ``DMLC_INTERFACE`` or ``--host-ip`` is required;
* services ``server`` (``-s``) and ``worker`` (``-n``) get ``--server-*`` and
  ``--worker-*`` cores and memory (default 1 vcore, 1024 MB), ``--queue``
  (default ``default``), ``--jobname`` as the application name, no restarts
  (ps-lite cannot take a node back), ``max_attempts`` 1;
* localized files: ``--files`` (by base name), ``--archives`` (unpacked by
  YARN into a directory named after the archive), every later argument of the
  command that is a file here (shipped and rewritten to ``./name``, as dmlc's
  yarn launcher did), the node bundle (``launcher.node.bundle``: the task
  wrapper as a runnable zip, standard library only, so any ``python3`` on the
  nodes runs it) and the task file;
* the environment contract travels in each service's ``env``, except what
  must not: the job secret and any value YARN's launch script would mangle
  (YARN writes ``export NAME="VALUE"`` lines into a bash script, so ``"``,
  ``$``, a backquote, a backslash or a newline would be interpreted). Those go
  in the task file (mode 0600 here, private to the application there);
* each container runs ``exec python3 pslaunch-task.zip ... -- COMMAND``: the
  wrapper turns skein's ``SKEIN_CONTAINER_ID`` (``worker_3``) into
  ``DMLC_TASK_ID``, resolves ``DMLC_NODE_HOST`` on the node, and runs the
  command under the node agent, which connects back to the launcher's hub
  (``launcher.backends.batch``): the container's output reaches the console as
  it is printed, its exit code and the moment it ended arrive at once (so the
  first container to fail is the one reported), and the launcher can stop it
  gracefully or make it dump its stacks;
* one thread follows the application report and the containers; a container
  whose agent could not connect fails the job with the exit code YARN reports
  (parsed from its diagnostics); failure, Ctrl-C or the launcher's exit kill
  the application; if the launcher is killed with SIGKILL its watchdog runs
  ``yarn application -kill``.

The output also stays in the containers' own logs (``yarn logs -applicationId
ID``, printed at the end).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..runtime.output import ProcOutput
from ..runtime.spawn import spawn_guard
from ..spec import env as jobenv
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan, ProcSpec
from .base import BackendOption
from .batch import BatchBackend, BatchTask, agent_line, build_task_file, task_roles, write_private_json

log = logging.getLogger(__name__)

DEFAULT_MEMORY_MB = 1024
NODE_PYTHON = "python3"
WRAPPER_ZIP = "pslaunch-task.zip"
TASK_FILE = "pslaunch-task.json"
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar", ".jar")
POLL = 1.0
CLOSE_WAIT = 15.0
# What the launching host needs for skein.
JAVA_HOME = "JAVA_HOME"
HADOOP_HOME = "HADOOP_HOME"
HADOOP_CONF_DIR = "HADOOP_CONF_DIR"
# YARN writes `export NAME="VALUE"` into a bash launch script: these would be interpreted
_SHELL_SPECIAL = re.compile(r'["$`\\\n]')
_EXIT_CODE = re.compile(r"(?:exit code(?: is|:)?|exitCode=)\s*(-?\d+)", re.IGNORECASE)

# Application and container states, as YARN (and skein's enums) name them
APP_RUNNING_STATES = ("NEW", "NEW_SAVING", "SUBMITTED", "ACCEPTED", "RUNNING")
APP_FINAL_STATES = ("FINISHED", "FAILED", "KILLED")
CONTAINER_STATES = ("WAITING", "REQUESTED", "RUNNING", "SUCCEEDED", "FAILED", "KILLED")


# --- options and pure builders ---------------------------------------------------------


@dataclass(frozen=True)
class YarnOptions:
    """``--files`` and ``--archives``: what the containers get besides the command's own files."""

    files: tuple[str, ...] = ()
    archives: tuple[str, ...] = ()



def split_env(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(spec_env, file_env)``: what goes in the service's env, and what in the task file.

    Secrets (by name, see :func:`launcher.spec.env.is_secret`) and values
    that bash would interpret in YARN's ``export NAME="VALUE"`` go to the file.
    """
    spec_env: dict[str, str] = {}
    file_env: dict[str, str] = {}
    for k, v in env.items():
        (file_env if jobenv.is_secret(k) or _SHELL_SPECIAL.search(v) else spec_env)[k] = v
    return spec_env, file_env


def ship_command(command: Sequence[str], workdir: str,
                 isfile: Callable[[str], bool] = os.path.isfile) -> tuple[list[str], dict[str, str]]:
    """The command as the containers run it, and the files it needs shipped.

    Every argument after the program that names a file here is shipped and
    rewritten to ``./<name>`` (dmlc's rule). The program itself is left
    alone: ``python`` or ``/opt/venv/bin/python`` must exist on the nodes.
    """
    argv = [command[0]]
    files: dict[str, str] = {}
    for arg in command[1:]:
        path = os.path.join(workdir, arg)
        if arg and not arg.startswith("-") and isfile(path):
            name = os.path.basename(arg)
            if name in files and files[name] != os.path.abspath(path):
                raise ConfigError(f"the command names two files called {name} ({files[name]} and {path}); "
                                  "YARN localizes files by name")
            files[name] = os.path.abspath(path)
            argv.append(f"./{name}")
        else:
            argv.append(arg)
    return argv, files


def build_localized_files(spec: JobSpec, command_files: Mapping[str, str], *, wrapper_zip: str,
                          task_file: str, isfile: Callable[[str], bool] = os.path.isfile) -> dict[str, dict[str, str]]:
    """skein ``files`` (the same for both services): name -> ``{"source", "type"}``.

    Raises:
        ConfigError: a ``--files``/``--archives`` path is missing, an archive is
            not .zip/.tar.gz/.tgz/.tar/.jar, or two files share a name.
    """
    workdir = spec.workdir or os.getcwd()
    out: dict[str, dict[str, str]] = {
        WRAPPER_ZIP: {"source": wrapper_zip, "type": "file"},
        TASK_FILE: {"source": task_file, "type": "file"},
    }
    origin = {WRAPPER_ZIP: "the task wrapper", TASK_FILE: "the task file"}

    def add(name: str, source: str, kind: str, what: str) -> None:
        if name in out:
            raise ConfigError(f"{what} and {origin[name]} would both be localized as {name!r}; "
                              "YARN localizes files by name: rename one")
        out[name] = {"source": source, "type": kind}
        origin[name] = what

    opts = spec.options or YarnOptions()
    for option, paths, kind in (("--files", opts.files, "file"), ("--archives", opts.archives, "archive")):
        for p in paths:
            path = os.path.abspath(os.path.join(workdir, os.path.expanduser(p)))
            if not isfile(path):
                raise ConfigError(f"{option} {p}: no such file")
            if kind == "archive" and not path.endswith(ARCHIVE_SUFFIXES):
                raise ConfigError(f"--archives {p}: YARN unpacks only {', '.join(ARCHIVE_SUFFIXES)} archives")
            add(os.path.basename(path), path, kind, f"{option} {p}")
    for name, path in sorted(command_files.items()):
        if name in out and out[name]["source"] == path:
            continue  # also given with --files
        add(name, path, "file", f"the command's {name}")
    return out


def build_service_script(role: str, argv: Sequence[str]) -> str:
    """The bash script skein runs in each container of ``role``."""
    return (f"exec {NODE_PYTHON} {WRAPPER_ZIP} --task-file {TASK_FILE} --role {role} --index skein -- "
            + shlex.join(argv))


@dataclass(frozen=True)
class YarnPlan:
    """Everything a submission needs: the app spec (skein's dict form) and the task file."""

    app_spec: dict[str, Any]
    task_file: dict[str, Any]


def build_yarn_plan(spec: JobSpec, procs: Sequence[ProcSpec], *, wrapper_zip: str, task_file: str,
                    hub: Optional[tuple[str, int]] = None,
                    isfile: Callable[[str], bool] = os.path.isfile) -> YarnPlan:
    """The skein ``ApplicationSpec`` (as ``ApplicationSpec.from_dict`` takes it) and the task file.

    Args:
        wrapper_zip: local path of the node bundle (``launcher.node.bundle("task")``).
        task_file: local path of the task file (written with mode 0600).
        hub: where the containers' agents connect.
    """
    workdir = spec.workdir or os.getcwd()
    argv, command_files = ship_command(spec.command, workdir, isfile)
    files = build_localized_files(spec, command_files, wrapper_zip=wrapper_zip, task_file=task_file,
                                  isfile=isfile)
    roles = task_roles(procs)
    services: dict[str, Any] = {}
    file_roles: dict[str, Any] = {}
    for role, cores, memory in ((Role.SERVER, spec.server_cores, spec.server_memory_mb),
                                (Role.WORKER, spec.worker_cores, spec.worker_memory_mb)):
        r = roles.get(str(role))
        if r is None:
            continue
        spec_env, file_env = split_env(r["env"])
        services[str(role)] = {
            "instances": r["count"],
            "max_restarts": 0,         # ps-lite cannot take a restarted node back
            "allow_failures": False,
            "resources": {"memory": memory or DEFAULT_MEMORY_MB, "vcores": cores},
            "env": spec_env,
            "files": files,
            "script": build_service_script(str(role), argv),
        }
        file_roles[str(role)] = {"first_task_id": r["first_task_id"], "count": r["count"], "env": file_env}
    queue = spec.queue or "default"
    if re.search(r"\s", queue):
        raise ConfigError(f"--queue {queue!r}: a queue name has no spaces")
    app = {"name": spec.name, "queue": queue, "max_attempts": 1, "tags": ["pslaunch"], "services": services}
    return YarnPlan(app_spec=app, task_file=build_task_file(spec, procs, hub=hub, roles=file_roles, with_path=False))


def kill_command(app_id: str, yarn: str = "yarn") -> list[str]:
    """What the watchdog runs if the launcher is killed: the YARN CLI's kill."""
    return [yarn, "application", "-kill", app_id]


def yarn_program(environ: Mapping[str, str]) -> str:
    """The absolute path of the ``yarn`` CLI for the watchdog, which has its own ``PATH``.

    The watchdog starts before :meth:`YarnBackend.prepare` puts ``$HADOOP_HOME/bin``
    on the launcher's ``PATH``; a bare ``yarn`` could then not be found when it matters.
    """
    found = shutil.which("yarn", path=environ.get(pc.PATH))
    if found:
        return os.path.abspath(found)
    hadoop = environ.get(HADOOP_HOME, "")
    candidate = os.path.join(hadoop, "bin", "yarn") if hadoop else ""
    return candidate if candidate and os.access(candidate, os.X_OK) else "yarn"


# --- status parsing ---------------------------------------------------------------------


def parse_exit_code(diagnostics: str) -> Optional[int]:
    """The exit code in a YARN container diagnostic (``... Exit code: 3``,
    ``Container killed on request. Exit code is 143``, ``... non-zero exit code 1``)."""
    m = _EXIT_CODE.search(diagnostics or "")
    return int(m.group(1)) if m else None


def container_exit_code(state: str, exit_message: str) -> Optional[int]:
    """A container's exit code from its skein state; ``None`` while it is waiting or running.

    FAILED and KILLED take the code from YARN's diagnostics, else 1 (failed)
    or 143 (killed: YARN stops containers with SIGTERM). Negative YARN codes
    (-100 aborted, -102 preempted, -104 over its memory, ...) become 1.
    """
    state = state.upper()
    if state in ("WAITING", "REQUESTED", "RUNNING"):
        return None
    if state == "SUCCEEDED":
        return 0
    code = parse_exit_code(exit_message)
    if state == "KILLED":
        return code if code is not None and code > 0 else 143
    if state == "FAILED":
        return code if code is not None and code > 0 else 1
    raise ValueError(f"unknown container state {state!r} (expected one of {', '.join(CONTAINER_STATES)})")


def app_outcome(state: str, final_status: str) -> Optional[int]:
    """The application's result: ``None`` while it runs, 0 if it succeeded, else 1 (143 if killed)."""
    state, final_status = state.upper(), final_status.upper()
    if state in APP_RUNNING_STATES:
        return None
    if state == "FINISHED":
        return 0 if final_status == "SUCCEEDED" else (143 if final_status == "KILLED" else 1)
    if state == "KILLED":
        return 143
    if state == "FAILED":
        return 1
    raise ValueError(f"unknown application state {state!r}")


def dependency_problem(environ: Mapping[str, str], *, has_skein: bool,
                       which: Optional[Callable[[str], Optional[str]]] = None,
                       exists: Callable[[str], bool] = os.path.exists) -> Optional[str]:
    """What the launching host lacks for skein, as one line; ``None`` if nothing."""
    which = which or shutil.which
    if not has_skein:
        return "the yarn backend needs skein: pip install '.[yarn]' in your clone of pslaunch (skein>=0.8)"
    java_home = environ.get(JAVA_HOME, "")
    if java_home:
        if not exists(os.path.join(java_home, "bin", "java")):
            return f"{JAVA_HOME}={java_home} has no bin/java; point it at a JDK or unset it"
    elif not which("java"):
        return (f"skein's driver needs Java: install a JDK (the one your Hadoop supports) "
                f"and put java on PATH or set {JAVA_HOME}")
    hadoop = environ.get(HADOOP_HOME, "")
    if not hadoop:
        return (f"{HADOOP_HOME} is not set: export {HADOOP_HOME}=<your Hadoop installation> "
                f"(skein runs its bin/yarn; {HADOOP_CONF_DIR} names the cluster)")
    if not exists(os.path.join(hadoop, "bin", "yarn")):
        return f"{HADOOP_HOME}={hadoop} has no bin/yarn; point it at a Hadoop installation"
    return None


# --- the handle --------------------------------------------------------------------------------


class YarnTask(BatchTask):
    """One container (service instance)."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: YarnBackend) -> None:
        super().__init__(proc, output, backend, host="(yarn)")
        self.state = "WAITING"
        self.container_id = ""

    @property
    def key(self) -> str:
        return f"{self.proc.role}_{self.proc.rank}"

    def where(self) -> str:
        return f"YARN container {self.container_id or self.key}"


# --- the backend --------------------------------------------------------------------------------


class YarnBackend(BatchBackend):
    """YARN through skein. See the module docstring."""

    name = "yarn"
    index_source = "skein"
    poll_every = POLL
    close_wait = CLOSE_WAIT
    Options = YarnOptions
    options = (
        BackendOption(("--files",), "files", "extra files to ship. Repeatable.", kind="multiple", metavar="FILE"),
        BackendOption(("--archives",), "archives", "archives to ship and unpack. Repeatable.", kind="multiple",
                      metavar="FILE"),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skein: Any = None
        self._client: Any = None
        self._app: Any = None          # skein.ApplicationClient, once the app master runs
        self.app_id: Optional[str] = None
        self.app_state = "NEW"
        self.diagnostics = ""
        self._killed = False
        self._finished = False
        self._tmp: Optional[str] = None

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        import yaml

        yp = build_yarn_plan(spec, plan.procs, wrapper_zip=f"<temporary>/{WRAPPER_ZIP}",
                             task_file=f"<temporary>/{TASK_FILE}")
        out = ["YARN (skein): this application spec is submitted (skein.ApplicationSpec.from_dict):"]

        class Dumper(yaml.SafeDumper):
            def ignore_aliases(self, data: Any) -> bool:  # both services share `files`: print it twice
                return True

        text = yaml.dump(yp.app_spec, Dumper=Dumper, sort_keys=False, width=1000)
        out += ["  " + line for line in text.splitlines()]
        out.append(f"{TASK_FILE} (mode 0600; secrets and values YARN's launch script would mangle):")
        for role, r in yp.task_file["roles"].items():
            names = ", ".join(sorted(r["env"])) or "nothing"
            out.append(f"  {role}: DMLC_TASK_ID = {r['first_task_id']} + the container's instance; {names}")
        out.append(agent_line("container"))
        out.append("on failure, Ctrl-C or exit: skein kill_application; if pslaunch is killed: "
                   + shlex.join(kill_command("<application id>")))
        return out

    # -- set-up -----------------------------------------------------------------------------

    def check(self) -> None:
        problem = dependency_problem(os.environ, has_skein=importlib.util.find_spec("skein") is not None)
        if problem:
            raise BackendUnavailableError(problem)

    def prepare(self) -> Mapping[Any, str]:
        """Connect to skein's global driver when one runs (``skein driver start``), else start a
        driver of our own (Java: seconds). Node addresses are resolved by the wrapper on each node."""
        if self._skein is None:
            self._skein = importlib.import_module("skein")
        hadoop = os.environ.get(HADOOP_HOME, "")
        hadoop_bin = os.path.join(hadoop, "bin") if hadoop else ""
        if hadoop_bin and not shutil.which("yarn") and os.path.isdir(hadoop_bin):
            # skein runs `yarn classpath`; HADOOP_HOME/bin is where it lives
            os.environ[pc.PATH] = hadoop_bin + os.pathsep + os.environ.get(pc.PATH, "")
        try:
            self._client = self._skein.Client.from_global_driver()
            log.debug("using skein's global driver at %s", self._client.address)
        except Exception as e:  # noqa: BLE001 - none running, or a stale one: start our own
            log.debug("no global skein driver (%s); starting one", " ".join(str(e).split()) or type(e).__name__)
            self._client = self._start_driver()
        return {}

    def _start_driver(self) -> Any:
        try:
            return self._skein.Client(log=False)
        except Exception as e:  # noqa: BLE001 - skein raises several kinds; all mean "no driver"
            raise LaunchError(f"cannot start skein's driver (Java, HADOOP_HOME, HADOOP_CONF_DIR): "
                              f"{' '.join(str(e).split())}") from None

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        self._tmp = tempfile.mkdtemp(prefix="pslaunch-yarn-")  # mode 0700
        if self.watchdog is not None:  # the task file holds the job's secret: not left behind by kill -9
            self.watchdog.on_abandon(["rm", "-rf", "--", self._tmp])
        wrapper = os.path.join(self._tmp, WRAPPER_ZIP)
        task_file = os.path.join(self._tmp, TASK_FILE)
        yp = build_yarn_plan(self.spec, procs, wrapper_zip=wrapper, task_file=task_file, hub=hub)
        with open(wrapper, "wb") as f:
            f.write(node.bundle("task"))
        write_private_json(task_file, yp.task_file)
        try:
            app_spec = self._skein.ApplicationSpec.from_dict(yp.app_spec)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"skein refused the application spec: {e}") from None
        with spawn_guard():
            try:
                self.app_id = str(self._client.submit(app_spec))
            except Exception as e:  # noqa: BLE001
                raise LaunchError(f"YARN refused the application: {' '.join(str(e).split())}") from None
            if self.watchdog is not None:
                self.watchdog.on_abandon(kill_command(self.app_id, yarn_program(os.environ)))
            for p in sorted(procs, key=lambda p: (p.role is not Role.SERVER, p.rank)):
                self.add_task(YarnTask(p, self.console.proc(p.name, p.label, str(p.role)), self))
        log.info("submitted YARN application %s (%s, queue %s)", self.app_id, yp.app_spec["name"],
                 yp.app_spec["queue"])
        return self.tasks

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        states = ", ".join(f"{t.label}: {t.state}" for t in pending)
        diag = f"; YARN says: {' '.join(self.diagnostics.split())}" if self.diagnostics else ""
        return (f"{len(pending)} of {len(self.tasks)} containers not running after --start-timeout {timeout:g}s "
                f"(application {self.app_id} {self.app_state}; {states}){diag}")

    # -- following -----------------------------------------------------------------------------

    def settled(self) -> bool:
        return self._finished or self.app_id is None

    def poll_once(self) -> None:
        """One round: the application report, then every container's state."""
        if self.app_id is None or self._finished:
            return
        report = self._client.application_report(self.app_id)
        state, final = str(report.state), str(report.final_status)
        with self.lock:
            if state != self.app_state:
                log.debug("YARN application %s: %s -> %s", self.app_id, self.app_state, state)
            self.app_state = state
            self.diagnostics = str(report.diagnostics or "")
        try:
            if state == "RUNNING" and self._app is None:
                self._app = self._client.connect(self.app_id, wait=False)
            containers = (self._app.get_containers(states=list(CONTAINER_STATES))
                          if self._app is not None and state == "RUNNING" else [])
        except ConnectionError as e:  # (skein's is one)
            # The application master ended between the report and this call: it does once its
            # containers have (a program missing on every node ends it at once). The next report
            # says how; logged as an error, it was a second error line beside the real one.
            log.debug("YARN application %s: its master is gone (%s); asking the report again",
                      self.app_id, " ".join(str(e).split()))
            self._app = None
            return
        for c in containers:
            self._update(str(c.service_name), int(c.instance), str(c.state), str(c.exit_message or ""),
                         str(c.yarn_container_id or ""), str(c.yarn_node_http_address or ""))
        outcome = app_outcome(state, final)
        if outcome is not None:
            with self.lock:
                for t in self.tasks:
                    if t.code is None and t.gone_at is not None and not t.terminated:
                        self.agent_killed(t)  # (what failed the application: skein ends it at once)
                    elif t.code is None:
                        self.set_code(t, 0 if outcome == 0 else outcome, f"application {state}/{final}")
                self._finished = True

    def _update(self, service: str, instance: int, state: str, message: str, container_id: str,
                node_address: str) -> None:
        t = next((t for t in self.tasks if str(t.proc.role) == service and t.proc.rank == instance), None)
        if not isinstance(t, YarnTask) or t.code is not None:
            return
        if state != t.state:
            log.debug("%s (%s_%d): %s -> %s", t.label, service, instance, t.state, state)
        t.state = state
        t.container_id = container_id or t.container_id
        if node_address and t.host.startswith("("):
            t.host = node_address.rsplit(":", 1)[0]
        if state == "RUNNING":
            t.ran = True
        code = container_exit_code(state, message)
        if code is not None:
            self.set_code(t, code, message.strip().splitlines()[0] if message.strip() else "")

    # -- stopping ---------------------------------------------------------------------------------

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """YARN removes containers as a whole application: ps-lite cannot go on without one anyway."""
        if tasks:
            self.kill_application()

    def kill_application(self) -> None:
        """Kill the whole application (every container); idempotent."""
        with self.lock:
            if self._killed or self.app_id is None or self._finished:
                return
            self._killed = True
            for t in self.tasks:
                t.terminated = True
        try:
            self._client.kill_application(self.app_id)
            log.debug("killed YARN application %s", self.app_id)
        except Exception as e:  # noqa: BLE001
            log.warning("could not kill YARN application %s: %s; run: %s", self.app_id,
                        " ".join(str(e).split()), shlex.join(kill_command(self.app_id)))

    def helper_pids(self) -> set[int]:
        proc = getattr(self._client, "_proc", None)  # skein's driver (a Java process), when this client started it
        return {proc.pid} if proc is not None and getattr(proc, "pid", None) else set()

    def release(self) -> None:
        """Stop skein's driver; remove the local copies of the bundle and the task file."""
        if self.app_id is not None:
            if not self._finished:
                self.kill_application()
            log.info("container logs: yarn logs -applicationId %s", self.app_id)
        for obj in (self._app, self._client):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001
                    pass
        self._app = self._client = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


__all__ = ["YarnBackend", "YarnOptions", "YarnTask", "build_yarn_plan"]
