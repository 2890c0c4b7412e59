"""Frozen descriptions of a job: :class:`Host` and :class:`JobSpec`.

The CLI builds exactly one :class:`JobSpec` from options and YAML; nothing after that mutates
it. Every field is validated here, with messages that name the option and the fix, so a
backend never sees an impossible value. A backend's own options are its own frozen record
(``JobSpec.options``), validated by that backend's class.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional

import pscontract as pc

from ..errors import ConfigError
from .only import Selector, check_only

#: The most servers plus workers one job may have, on any backend: a bound that keeps a typo
#: (``-n 1000000``) from planning or forking without end. A backend may allow fewer (the local
#: backend: what this machine's process and open-file limits allow).
MAX_PROCESSES = 20_000
#: cores per process (--worker-cores, --server-cores)
MAX_CORES = 4096
#: the most restarts one job may ask for: a bound on a typo, not on a real job
MAX_RESTARTS = 10_000
#: the most GPUs per process (--gpus-per-process): a bound on a typo
MAX_GPUS_PER_PROCESS = 1024
#: the launchers that know before the start which processes share a host (--gpus-per-process, gpus=)
GPU_LAUNCHERS = ("local", "ssh")
#: what may run as a ps job's scheduler (``--scheduler``): the command itself, or pslaunch's own
SCHEDULERS = ("command", "builtin")
#: what a failure restarts (``--restart-scope``): the whole job, or a lost parameter-server worker alone
RESTART_SCOPES = ("job", "process")


class Role(str, Enum):
    """A process's role: :attr:`SCHEDULER`, :attr:`SERVER`, :attr:`WORKER` or :attr:`TRACKER` (the
    launcher's tracker of a collective job). Each is also the ``str`` it prints (``"worker"``)."""

    SCHEDULER = "scheduler"
    SERVER = "server"
    WORKER = "worker"
    TRACKER = "tracker"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Host:
    """One hostfile line: ``[user@]name[:port] [spare] [slots=N] [gpus=0,2]``.

    ``slots`` is ``None`` when the line gives none (no limit, as dmlc). ``gpus`` are the host's
    GPUs that its workers may use (``CUDA_VISIBLE_DEVICES`` indices; None: the line names none,
    and the host's count is not known). ``origin`` is ``"FILE:LINE"`` for messages. ``spare``:
    the line is a spare, used only in the place of a host that was left out
    (:mod:`launcher.run.hosthealth`); the CLI puts spares in :attr:`JobSpec.spares`.
    """

    name: str
    port: Optional[int] = None
    user: Optional[str] = None
    slots: Optional[int] = None
    origin: str = ""
    gpus: Optional[tuple[int, ...]] = None
    spare: bool = False

    def __str__(self) -> str:
        return self.display

    @property
    def display(self) -> str:
        """``user@name:port`` as written (IPv6 in brackets when a port follows)."""
        name = f"[{self.name}]" if ":" in self.name and self.port else self.name
        text = f"{self.user}@{name}" if self.user else name
        return f"{text}:{self.port}" if self.port else text


@dataclass(frozen=True)
class JobSpec:
    """Everything the launcher needs to run one job. Frozen and validated.

    Example:
        >>> JobSpec(command=("python", "train.py"), num_workers=2, num_servers=1)
        JobSpec(command=('python', 'train.py'), num_workers=2, ...)

    ``env`` holds ``--env`` values already resolved against the launcher's
    environment; ``environ`` is the snapshot of that environment the job uses
    for forwarding, so planning stays a pure function of the spec.
    """

    command: tuple[str, ...]
    num_workers: int
    num_servers: int
    launcher: str = "local"
    hosts: tuple[Host, ...] = ()
    hostfile: Optional[str] = None
    sync_dst_dir: Optional[str] = None
    env: tuple[tuple[str, str], ...] = ()
    env_server: tuple[tuple[str, str], ...] = ()
    env_worker: tuple[tuple[str, str], ...] = ()
    environ: tuple[tuple[str, str], ...] = ()
    host_ip: Optional[str] = None
    log_level: str = "INFO"
    log_file: Optional[str] = None
    #: --queue (slurm: the partition); the CLI gives None when it is not set
    queue: Optional[str] = "default"
    jobname: Optional[str] = None
    worker_cores: int = 1
    # None: the backend's default (yarn asks for 1024 MB; sge sets no h_vmem limit)
    worker_memory_mb: Optional[int] = None
    server_cores: int = 1
    server_memory_mb: Optional[int] = None
    dry_run: bool = False
    log_dir: Optional[str] = None
    #: --log-raw: the log files get the processes' output as written (control characters and all)
    log_raw: bool = False
    summary_json: Optional[str] = None
    port_range: tuple[int, int] = (9091, 9998)
    start_timeout: float = 60.0
    kill_grace: float = 10.0
    timeout: Optional[float] = None
    workdir: Optional[str] = None
    p3: bool = False
    #: the live status line on a terminal (``--no-progress`` turns it off)
    progress: bool = True
    #: the backend's own options (its ``Options`` record; None: the backend's defaults)
    options: Any = None
    #: what the workers find each other through (:data:`pscontract.TRACKERS`): ``ps`` (the
    #: scheduler and servers), ``rabit``, ``xgboost`` or ``torch`` (workers only). None: ``ps``
    #: when there are servers, else ``rabit``, as launch.py decides.
    tracker: Optional[str] = None
    #: the Python that runs the rabit, xgboost or torch tracker (None: see ``launcher.trackers``)
    tracker_python: Optional[str] = None
    #: what runs as a ps job's scheduler (:data:`SCHEDULERS`): ``command``, the job's own command
    #: with ``DMLC_ROLE=scheduler``, as launch.py does; ``builtin``, pslaunch's ps-lite scheduler
    #: (:mod:`launcher.trackers.pslite`), which spares a ps-lite program one start-up of itself
    scheduler: str = "command"
    #: restarts of the whole job after a process fails (``--max-restarts``), counted for the job
    max_restarts: int = 0
    #: the wait before the first restart; each next one waits twice as long (``--restart-delay``)
    restart_delay: float = 1.0
    #: an attempt that runs this long without failing gives the budget back (``--restart-window``)
    restart_window: Optional[float] = None
    #: what a failure restarts (:data:`RESTART_SCOPES`): ``job``, every process; ``process``, a lost
    #: worker of a parameter-server job alone, in place (a server or the scheduler: the job)
    restart_scope: str = "job"
    #: ``--only``: whose lines reach the console (empty: everyone's); the log files get all
    only: tuple[Selector, ...] = ()
    #: ``--gpus-per-process``: each worker's share of its host's GPUs, as ``CUDA_VISIBLE_DEVICES``
    #: (None: not set, unless the hostfile names a host's ``gpus=``); see ``launcher.spec.plan``
    gpus_per_process: Optional[int] = None
    #: ``--ui``: serve the live job page on (host, port) (port 0: a free one); None: no page
    ui: Optional[tuple[str, int]] = None
    #: ``--ui-linger``: seconds the page is still served after the job ended
    ui_linger: float = 0.0
    #: ``--report``: the static HTML file written when the job ends, however it ends
    report: Optional[str] = None
    #: the hostfile's spares (``h4 spare``): not used at first; each takes the place of a host that
    #: was left out (:mod:`launcher.run.hosthealth`). ``hosts`` holds the others.
    spares: tuple[Host, ...] = ()
    #: ``-n MIN:MAX``'s MIN (a collective job may go on with as few workers after hosts were left
    #: out; ``num_workers`` is MAX); None: ``-n N``, always N workers
    min_workers: Optional[int] = None
    #: ``--host-cooldown LOWER[:UPPER]``: how long a host that was left out stays out, in seconds
    #: (the first time LOWER, then doubling, at most UPPER, with jitter)
    host_cooldown: tuple[float, float] = (60.0, 3600.0)

    @property
    def wants_usage(self) -> bool:
        """Whether the nodes report each process's CPU and RSS (``u`` frames): only for a job page
        or report, so that a job without one pays nothing for it."""
        return self.ui is not None or bool(self.report)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no command given: put the program to run after the options, "
                              "e.g. pslaunch -n 2 python train.py")
        for name, value in (("-n/--num-workers", self.num_workers), ("-s/--num-servers", self.num_servers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {_short(value)}")
        if self.num_workers < 1:
            raise ConfigError(f"-n/--num-workers must be at least 1, got {_short(self.num_workers)}")
        if self.num_servers < 0:
            raise ConfigError(f"-s/--num-servers must be 0 or more, got {_short(self.num_servers)}")
        if self.num_workers + self.num_servers > MAX_PROCESSES:
            raise ConfigError(f"{_short(self.num_workers)} workers and {_short(self.num_servers)} servers: a job has "
                              f"at most {MAX_PROCESSES:,} servers and workers together")
        if not self.launcher:
            raise ConfigError("no launcher given: choose one with --launcher")
        lo, hi = self.port_range
        try:
            pc.check_port_range(lo, hi)
        except ValueError as e:
            raise ConfigError(f"--port-range {lo}-{hi}: {e}") from None
        for name, seconds in (("--start-timeout", self.start_timeout), ("--kill-grace", self.kill_grace),
                              ("--timeout", self.timeout)):
            if seconds is not None and not math.isfinite(seconds):
                raise ConfigError(f"{name} must be a finite number of seconds, got {seconds}")
        for name, seconds in (("--start-timeout", self.start_timeout), ("--kill-grace", self.kill_grace)):
            if seconds < 0:
                raise ConfigError(f"{name} must not be negative, got {seconds}")
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout}")
        for name, value in (("--worker-cores", self.worker_cores), ("--server-cores", self.server_cores)):
            if not 1 <= value <= MAX_CORES:
                raise ConfigError(f"{name} must be from 1 to {MAX_CORES}, got {_short(value)}")
        # (a YAML string can hold "\0"; no argv or environment can: Popen would raise)
        if any("\0" in arg for arg in self.command):
            raise ConfigError("the command contains a NUL byte (\\0), which no program can receive as an argument")
        for option, pairs in (("--env", self.env), ("--env-server", self.env_server),
                              ("--env-worker", self.env_worker)):
            for var, val in pairs:
                if "\0" in var or "\0" in val:
                    raise ConfigError(f"{option} {var.replace(chr(0), '?')}: contains a NUL byte (\\0), which "
                                      "no environment variable can hold")
        if self.tracker is None:
            object.__setattr__(self, "tracker", "ps" if self.num_servers > 0 else "rabit")
        if self.tracker not in pc.TRACKERS:
            raise ConfigError(f"--tracker {self.tracker}: choose one of {', '.join(pc.TRACKERS)}")
        if self.tracker != "ps" and self.num_servers > 0:
            raise ConfigError(f"--tracker {self.tracker} runs workers only; drop -s {self.num_servers} "
                              "(servers belong to --tracker ps)")
        if self.tracker == "ps" and self.num_servers == 0:
            raise ConfigError("--tracker ps needs servers (-s 1 or more); a job of workers only (-s 0) uses "
                              "--tracker rabit (the default), xgboost or torch")
        if self.tracker_python is not None and self.tracker not in ("rabit", "xgboost", "torch"):
            raise ConfigError(f"--tracker-python is the Python of --tracker rabit, xgboost or torch; --tracker "
                              f"{self.tracker} runs none (drop --tracker-python)")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"--scheduler {_short(self.scheduler)}: choose one of {', '.join(SCHEDULERS)}")
        if self.scheduler == "builtin":
            if self.tracker != "ps":
                raise ConfigError(f"--scheduler builtin is a ps-lite scheduler; --tracker {self.tracker} runs "
                                  "none (drop --scheduler)")
            why = builtin_scheduler_refusal({**self.environ_dict(), **dict(self.env)}, who="--scheduler builtin")
            if why:
                raise ConfigError(why)
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or \
                not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts must be a whole number from 0 to {MAX_RESTARTS}, got "
                              f"{_short(self.max_restarts)}")
        for name, seconds in (("--restart-delay", self.restart_delay), ("--restart-window", self.restart_window)):
            if seconds is not None and (not math.isfinite(seconds) or seconds < 0):
                raise ConfigError(f"{name} must be 0 or more seconds, got {seconds}")
        if self.restart_window is not None and self.restart_window <= 0:
            raise ConfigError("--restart-window must be longer than 0s (leave it out to never give the budget back)")
        self._check_scope()
        check_only(self.only, self.num_workers, self.num_servers)
        self._check_elastic()
        self._check_gpus()
        self._check_page()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"--log-level {self.log_level}: choose DEBUG, INFO, WARNING or ERROR")

    def _check_scope(self) -> None:
        """``--restart-scope process`` replaces parameter-server workers, out of ``--max-restarts``."""
        if self.restart_scope not in RESTART_SCOPES:
            raise ConfigError(f"--restart-scope {_short(self.restart_scope)}: choose one of "
                              f"{', '.join(RESTART_SCOPES)}")
        if self.restart_scope == "job":
            return
        if self.collective:
            raise ConfigError(f"--restart-scope process replaces a lost worker of a parameter-server job; a "
                              f"--tracker {self.tracker} job's workers form one group, so it restarts whole: drop "
                              "--restart-scope (a lost host can leave the job smaller: -n MIN:MAX)")
        if not self.max_restarts:
            raise ConfigError("--restart-scope process replaces lost workers out of the restart budget; give it "
                              "one: --max-restarts N")

    def _check_elastic(self) -> None:
        """``-n MIN:MAX`` (collective jobs only), spares and ``--host-cooldown``."""
        lo = self.min_workers
        if lo is not None:
            if isinstance(lo, bool) or not isinstance(lo, int) or not 1 <= lo <= self.num_workers:
                raise ConfigError(f"-n {_short(lo)}:{self.num_workers}: MIN must be a whole number from 1 to MAX")
            if self.tracker == "ps":
                raise ConfigError(f"-n {lo}:{self.num_workers}: a parameter-server job runs a fixed number of "
                                  f"workers; give -n {self.num_workers}, or run a collective job (--tracker torch, "
                                  "rabit or xgboost, -s 0)")
        if self.spares and not self.hosts:
            raise ConfigError(f"every host is a spare ({self.spares[0].origin}); mark only the extra hosts as spare")
        cool = self.host_cooldown
        if len(cool) != 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in cool) \
                or cool[0] > cool[1]:
            raise ConfigError(f"--host-cooldown {_short(cool)}: give LOWER[:UPPER], durations with LOWER <= UPPER, "
                              "e.g. 1m:1h")

    def _check_page(self) -> None:
        """``--ui``, ``--ui-linger`` and ``--report`` make sense together (the address itself is
        parsed, and bound, by the CLI)."""
        if self.ui is not None and not 0 <= self.ui[1] <= 65535:
            raise ConfigError(f"--ui {self.ui[0]}:{self.ui[1]}: the port must be from 0 to 65535")
        linger = self.ui_linger
        if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not math.isfinite(linger) or \
                linger < 0:
            raise ConfigError(f"--ui-linger must be 0 or more seconds, got {_short(linger)}")
        if linger and self.ui is None:
            raise ConfigError("--ui-linger keeps the job page up after the job; it needs --ui as well")
        if self.report is not None and (not self.report or "\0" in self.report):
            raise ConfigError("--report needs a file name, e.g. --report job.html")

    def _check_gpus(self) -> None:
        """``--gpus-per-process`` and hostfile ``gpus=``: a sane count, a launcher that knows which
        workers share a host, and no ``--env`` that chooses the workers' GPUs as well."""
        n = self.gpus_per_process
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GPUS_PER_PROCESS):
            raise ConfigError(f"--gpus-per-process must be a whole number from 1 to {MAX_GPUS_PER_PROCESS}, got "
                              f"{_short(n)}")
        listed = next((h for h in self.hosts if h.gpus is not None), None)
        if n is None and listed is None:
            return
        if n is not None:
            what = f"--gpus-per-process {n}"
        else:
            assert listed is not None
            what = f"the hostfile's gpus= ({listed.origin})"
        if self.launcher not in GPU_LAUNCHERS:
            raise ConfigError(f"{what}: --launcher {self.launcher} decides where the workers run, so pslaunch cannot "
                              "give them disjoint GPUs; ask the batch system (slurm: --gpus-per-task), or use "
                              f"--launcher {' or '.join(GPU_LAUNCHERS)}")
        for option, pairs in (("--env", self.env), ("--env-worker", self.env_worker)):
            value = dict(pairs).get(pc.CUDA_VISIBLE_DEVICES)
            if value is not None:
                raise ConfigError(f"{option} {pc.CUDA_VISIBLE_DEVICES}={_short(value)} and {what} both choose the "
                                  "workers' GPUs; keep one")

    @property
    def gpus_chosen(self) -> bool:
        """pslaunch sets each worker's ``CUDA_VISIBLE_DEVICES`` (``--gpus-per-process`` or ``gpus=``)."""
        return self.gpus_per_process is not None or any(h.gpus is not None for h in self.hosts)

    @property
    def num_procs(self) -> int:
        """Servers plus workers (the scheduler not counted)."""
        return self.num_workers + self.num_servers

    @property
    def has_scheduler(self) -> bool:
        """dmlc starts a scheduler only when there are servers (``-s 0`` is a rabit job)."""
        return self.num_servers > 0

    @property
    def replaces_workers(self) -> bool:
        """A lost worker is replaced in place (``--restart-scope process``)."""
        return self.restart_scope == "process"

    @property
    def collective(self) -> bool:
        """Workers only, which find each other through a tracker the launcher runs (not ``ps``)."""
        return self.tracker != "ps"

    @property
    def first_attempt(self) -> int:
        """``PSLAUNCH_ATTEMPT`` of the job's first attempt: 0, or inside a Slurm job that Slurm
        requeued (``sbatch --requeue``), its ``SLURM_RESTART_COUNT``, so that the count goes on."""
        value = self.environ_dict().get(SLURM_RESTART_COUNT, "").strip()
        return int(value) if value.isdigit() and len(value) < 7 else 0

    def environ_dict(self) -> dict[str, str]:
        return dict(self.environ)

    @property
    def interface(self) -> str:
        """``DMLC_INTERFACE`` as the job's processes get it (``--env`` wins over the environment)."""
        return (dict(self.env).get(pc.INTERFACE) or self.environ_dict().get(pc.INTERFACE) or "").strip()

    @property
    def name(self) -> str:
        """The job name: ``--jobname`` or ``pslaunch-<program>``."""
        if self.jobname:
            return self.jobname

        prog = re.sub(r"[^A-Za-z0-9_.-]", "_", self.command[0].rsplit("/", 1)[-1])
        return f"pslaunch-{prog}"


#: how many times Slurm requeued the batch job this launcher runs in
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"

#: the host names or addresses whose connections the builtin scheduler accepts, comma-separated
#: (pslaunch sets it when it knows the job's hosts); unset or ``*``: anyone's
SCHEDULER_PEERS = "PSLAUNCH_SCHEDULER_PEERS"


def builtin_scheduler_refusal(env: Mapping[str, str], who: str = "the builtin scheduler") -> Optional[str]:
    """Why the builtin ps-lite scheduler (:mod:`launcher.trackers.pslite`) cannot serve a job whose
    processes get ``env``, or None: the spec (``who`` is then the option) and the scheduler itself
    ask the same. It speaks ps-lite's zmq van over TCP and acknowledges no message."""
    def setting(name: str, default: str) -> str:
        return _short((env.get(name) or default).strip() or default)

    van, local, resend = setting(pc.PS_VAN_TYPE, "zmq"), setting("DMLC_LOCAL", "0"), setting("PS_RESEND", "0")
    if van not in ("zmq", "p3"):
        return f"{pc.PS_VAN_TYPE}={van}: {who} speaks ps-lite's zmq van only; use --scheduler command"
    if local != "0":
        return (f"DMLC_LOCAL={local} (ipc sockets): {who} speaks TCP only; unset DMLC_LOCAL or use "
                "--scheduler command")
    if resend != "0":
        return (f"PS_RESEND={resend}: {who} does not acknowledge messages (ps-lite would send them again); "
                "unset PS_RESEND or use --scheduler command")
    return None


def _short(value: object, limit: int = 30) -> str:
    """A value for a message, cut short (a 10 MB argument must not become a 10 MB message)."""
    if isinstance(value, int) and abs(value) >= 10 ** limit:  # (str() of a 5,000-digit int raises)
        return f"a number of {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


#: the most memory per process (--worker-memory, --server-memory), in MB: 1 PiB
MAX_MEMORY_MB = 1 << 30


def parse_memory_mb(text: str, option: str) -> int:
    """dmlc's memory strings: ``"1g"`` -> 1024, ``"512m"`` -> 512 (also ``"1.5G"``)."""
    m = re.fullmatch(r"\s*(\d{1,12}(?:\.\d{1,6})?)\s*([gGmM])[bB]?\s*", str(text)[:100])
    if not m:
        raise ConfigError(f"{option} {_short(text)!r}: give a size ending in g or m, for example 2g or 512m")
    value, unit = float(m.group(1)), m.group(2).lower()
    mb = int(round(value * 1024)) if unit == "g" else int(round(value))
    if mb < 1:
        raise ConfigError(f"{option} {text!r}: must be at least 1m")
    if mb > MAX_MEMORY_MB:
        raise ConfigError(f"{option} {text!r}: more than {MAX_MEMORY_MB // 1024:,}g (1 PiB) per process")
    return mb
