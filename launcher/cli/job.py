"""A job's options (as click parsed them) to a validated, frozen JobSpec, and the spec to a run
or a dry run.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from typing import Any, Mapping, Optional

import click

import pscontract as pc

from .. import backends, trackers
from ..errors import ConfigError
from ..node import safefiles
from ..run import hosthealth
from ..run.report import format_dry_run
from ..run.supervisor import dry_run_plan, run_job
from ..spec.job import JobSpec, parse_memory_mb
from ..spec.only import parse_only
from ..spec.plan import worker_gpus
from .clickutil import DURATION
from .common import (
    check_variable_sizes,
    configure_logging,
    job_env,
    parse_env_item,
    parse_port_range_option,
    read_hosts_option,
    unmatched_globs,
)

log = logging.getLogger("launcher")


def run(kw: Mapping[str, Any], environ: Mapping[str, str]) -> int:
    """Build the spec from parsed options, then run it (or its dry run): the exit code."""
    spec = build_spec(kw, environ)
    configure_logging(spec.log_level, spec.log_file)
    for glob in unmatched_globs(kw.get("env") or (), environ):
        log.warning("--env %s matches no variable of this shell; nothing is forwarded for it", glob)
    if not spec.dry_run:  # (the dry run lists them with the plan)
        for note in backends.get(spec.launcher).notes(spec):
            log.warning("%s", note)
    return execute(spec)


def build_spec(kw: Mapping[str, Any], environ: Mapping[str, str]) -> JobSpec:
    """Turn parsed option values into a validated, frozen :class:`JobSpec`."""
    command = tuple(kw.get("command") or ())
    if command and command[0] == "--":
        command = command[1:]
    n, least = worker_range(kw["num_workers"])
    tracker = kw.get("tracker")
    s = kw["num_servers"] if kw.get("num_servers") is not None else (n if tracker in (None, "ps") else 0)
    hostfile = kw.get("hostfile")
    listed = read_hosts_option(hostfile) if hostfile else ()
    hosts = tuple(h for h in listed if not h.spare)
    spares = tuple(h for h in listed if h.spare)
    launcher = kw.get("launcher") or ("ssh" if hostfile else "local")
    backend = backends.get(launcher)
    env = job_env(kw.get("env") or (), kw.get("env_file") or (), environ)
    env_server = tuple(parse_env_item(e, "--env-server", environ, False) for e in kw.get("env_server") or ())
    env_worker = tuple(parse_env_item(e, "--env-worker", environ, False) for e in kw.get("env_worker") or ())
    check_variable_sizes((*env_server, *env_worker))
    for role_env in (env_server, env_worker):
        try:  # what the processes would refuse at start is refused before anything starts
            pc.heartbeat_settings({**environ, **dict(env), **dict(role_env)})
        except pc.ClusterEnvError as e:
            raise ConfigError(str(e)) from None
    spec = JobSpec(
        command=command, num_workers=n, num_servers=s, launcher=launcher, hosts=hosts, hostfile=hostfile,
        sync_dst_dir=kw.get("sync_dst_dir"), env=env, env_server=env_server, env_worker=env_worker,
        environ=tuple(sorted(environ.items())), host_ip=kw.get("host_ip"),
        log_level=str(kw.get("log_level") or "INFO").upper(), log_file=kw.get("log_file"),
        queue=kw.get("queue"), jobname=kw.get("jobname"),
        worker_cores=kw.get("worker_cores", 1), server_cores=kw.get("server_cores", 1),
        worker_memory_mb=parse_memory_mb(kw["worker_memory"], "--worker-memory") if kw.get("worker_memory") else None,
        server_memory_mb=parse_memory_mb(kw["server_memory"], "--server-memory") if kw.get("server_memory") else None,
        dry_run=bool(kw.get("dry_run")), log_dir=kw.get("log_dir"), log_raw=bool(kw.get("log_raw")),
        summary_json=kw.get("summary_json"),
        port_range=parse_port_range_option("9091-9998" if kw.get("port_range") is None else kw["port_range"]),
        start_timeout=kw.get("start_timeout", 60.0), kill_grace=kw.get("kill_grace", 10.0),
        timeout=kw.get("timeout"), workdir=os.getcwd(), p3=bool(kw.get("p3")), progress=not kw.get("no_progress"),
        options=backend.make_options(kw), tracker=tracker, tracker_python=kw.get("tracker_python"),
        scheduler=kw.get("scheduler") or "command", max_restarts=kw.get("max_restarts") or 0,
        restart_delay=1.0 if kw.get("restart_delay") is None else kw["restart_delay"],
        restart_window=kw.get("restart_window"), restart_scope=kw.get("restart_scope") or "job",
        only=parse_only(kw.get("only") or ()),
        gpus_per_process=kw.get("gpus_per_process"),
        ui=None if kw.get("ui") is None else _ui_address(ui_value(kw["ui"])),
        ui_linger=kw.get("ui_linger") or 0.0, report=kw.get("report"),
        spares=spares, min_workers=least, host_cooldown=parse_cooldown(kw.get("host_cooldown")),
    )
    backend.check_spec(spec)
    worker_gpus(spec)  # (a host with too few GPUs for its workers: one line now, not at the start)
    return spec


def worker_range(value: Any) -> tuple[Any, Optional[int]]:
    """``-n``'s value (``WorkerCount``: N, or ``(MIN, MAX)``) as ``(MAX, MIN or None)``."""
    if isinstance(value, tuple):
        return value[1], value[0]
    return value, None


def parse_cooldown(value: Optional[str]) -> tuple[float, float]:
    """``--host-cooldown LOWER[:UPPER]`` (durations: ``90``, ``1m``, ``1h``) as seconds; UPPER
    defaults to 1h (LOWER when that is longer). ``0``: a host is never left out."""
    if value is None:
        return hosthealth.DEFAULT_COOLDOWN
    text = str(value).strip()
    lo, colon, hi = text.partition(":")
    try:
        lower = DURATION.convert(lo, None, None)
        upper = DURATION.convert(hi, None, None) if colon else max(hosthealth.DEFAULT_COOLDOWN[1], lower)
    except click.BadParameter:
        raise ConfigError(f"--host-cooldown {text[:40]!r}: give LOWER[:UPPER] as durations, e.g. 1m:1h or "
                          "30s") from None
    if lower > upper:
        raise ConfigError(f"--host-cooldown {text[:40]}: LOWER is longer than UPPER; e.g. 1m:1h")
    return (lower, upper)


#: what ``--ui`` takes as its value when it follows: ``8080``, ``HOST:8080``, ``[::1]:8080``
_ADDRESS = re.compile(r"(?:\S*:)?\d{1,5}")


def looks_like_address(arg: str) -> bool:
    """``arg``, after a bare ``--ui``, is its ``[HOST:]PORT`` (else it is the job's command)."""
    return bool(_ADDRESS.fullmatch(arg))


def ui_value(value: str) -> str:
    """``--ui``'s value, refused in one line where it is no address at all (``--ui=python``,
    YAML ``ui: python``): the server's parser would say less."""
    text = str(value).strip()
    if text and not any(c.isdigit() for c in text.rpartition(":")[2]):
        raise ConfigError(f"--ui {text[:40]}: not [HOST:]PORT; write --ui alone (a free port), --ui 8080 or "
                          "--ui HOST:PORT")
    return text


def _probe_write(directory: str, name: str) -> Optional[str]:
    """Create and remove a file beside ``name`` in ``directory`` (an unpredictable name, created
    exclusively): None if that worked, else why not."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        return e.strerror or str(e)
    try:
        fd, tmp = safefiles.temporary(dfd, name)
        os.close(fd)
        os.unlink(tmp, dir_fd=dfd)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(dfd)
    return None


def check_log_dir(d: str, create: bool) -> None:
    """``--log-dir`` is the user's own directory, not a link (and, with ``create``, it exists)."""
    what = f"--log-dir {d}"
    try:
        fd = safefiles.open_dir(d, what, create=create)
    except safefiles.Refused as e:
        if "is not a directory" in str(e):
            raise ConfigError(f"{what} is a file, not a directory; give a directory (it is created)") from None
        raise ConfigError(str(e)) from None
    except FileNotFoundError as e:
        if create:
            raise ConfigError(f"{what}: cannot create it: {e.strerror or e}") from None
        parent = os.path.abspath(d)  # a dry run: could it be created?
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{what}: cannot create or write it ({parent} is not a writable directory)") from None
        return
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise ConfigError(f"{what}: cannot create it: a path above it is a file") from None
        raise ConfigError(f"{what}: cannot create it: {e.strerror or e}") from None
    os.close(fd)
    if create:
        why = _probe_write(d, "probe")
        if why:
            raise ConfigError(f"{what}: cannot write there: {why}")


def check_outputs(spec: JobSpec, create: bool) -> None:
    """``--log-dir`` and ``--summary-json`` can be written, checked before anything starts.

    The log directory must be the user's own and not a symbolic link (``launcher.node.safefiles``:
    on a shared machine another user may have made it first). With ``create`` (a real run) it is
    created and a file is written in each place and removed again (the only proof that works for
    root, read-only mounts and /proc); a dry run only looks.
    """
    if spec.log_dir:
        check_log_dir(spec.log_dir, create)
    for option, path in (("--summary-json", spec.summary_json), ("--report", spec.report)):
        if path:
            check_output_file(option, path, create)


def check_output_file(option: str, path: str, create: bool) -> None:
    """``path`` (``--summary-json``, ``--report``) can be written when the job ends: a file name in
    a directory that exists and is writable (checked by writing beside it, for a real run)."""
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{option} {path}: the directory {parent} does not exist")
    why = _probe_write(parent, os.path.basename(path)) if create else (
        None if os.access(parent, os.W_OK | os.X_OK) else "permission denied")
    if why:
        raise ConfigError(f"{option} {path}: cannot write there: {why}")


def _ui_address(text: str) -> tuple[str, int]:
    from ..ui.server import parse_address  # (imported on use: see execute)
    return parse_address(text)


def execute(spec: JobSpec) -> int:
    """Run (or dry-run) the job; return the exit code."""
    # launcher.ui (its HTTP server, the report renderer and their standard modules: http.server,
    # email, ssl, statistics) is imported only by a job that asks for its page or report: it is
    # about a fifth of the CLI's import time, paid before the first process starts
    check_outputs(spec, create=not spec.dry_run)
    if spec.dry_run:
        from ..ui.page import dry_run_lines
        backend = backends.get(spec.launcher)
        plan = dry_run_plan(spec, backend)
        extra = [f"warning: {note}" for note in backend.notes(spec)] + backend.dry_run(spec, plan) + \
            backend.dry_run_sockets(spec) + dry_run_lines(spec)
        sys.stdout.write(format_dry_run(spec, plan, extra, inherits=not backend.remote,
                                        tracker=trackers.describe(spec, plan)) + "\n")
        return 0
    if spec.ui is None and spec.report is None:
        return run_job(spec, adopt_orphans=True).exit_code
    from ..ui.page import open_page
    page = open_page(spec, spec.launcher)
    assert page is not None
    try:
        return run_job(spec, adopt_orphans=True, view=page.view).exit_code
    except BaseException as e:
        page.start_failed(e)
        raise
    finally:
        page.close()
