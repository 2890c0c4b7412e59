"""What every pslaunch command shares: value parsers, logging, exit codes (click's side is
:mod:`.clickutil`).

Exit codes:

* 0: every process exited 0;
* the first failing process's exit code (128+N for signal N);
* 130 / 143 / 129: stopped by SIGINT / SIGTERM / SIGHUP;
* 124: ``--timeout`` expired;
* 2: a user mistake (bad option, hostfile line, YAML key): one line on stderr;
* 1: the job could not be started (one line on stderr).

Exit codes are mapped only in :func:`guarded` and :func:`.clickutil.invoke`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
from typing import Callable, Mapping, Optional, Sequence

import pscontract as pc

from .. import logs
from ..errors import ConfigError, LauncherError
from ..node import safefiles
from ..spec import env as jobenv
from ..spec import envfile
from ..spec.hosts import is_host_list, read_hosts
from ..spec.job import Host

# --- value parsers ------------------------------------------------------------------------------


def parse_env_item(item: str, option: str, environ: Mapping[str, str], allow_copy: bool) -> tuple[str, str]:
    """``NAME=VALUE``, or launch.py's ``NAME:VALUE`` (a name never holds ``:``, so the forms cannot be
    confused; ``=`` is tried first: ``A=x:y`` sets A to ``x:y``); a bare ``NAME`` copies the launcher's
    value (``--env`` only)."""
    item = str(item)
    for sep in ("=", ":"):
        name, found, value = item.partition(sep)
        if found and jobenv.is_valid_name(name):
            return name, value
    if allow_copy and jobenv.is_valid_name(item):
        if item not in environ:
            raise ConfigError(f"{option} {item}: {item} is not set in this shell; "
                              f"export it or write {option} {item}=VALUE")
        return item, environ[item]
    form = "NAME, NAME=VALUE or NAME:VALUE" if allow_copy else "NAME=VALUE (or NAME:VALUE)"
    shown = item
    for sep in ("=", ":"):
        name, found, _ = item.partition(sep)
        if found and jobenv.is_secret(name):  # a malformed name does not make the value printable
            shown = f"{name}{sep}{jobenv.REDACTED}"
            break
    raise ConfigError(f"{option} {shown!r}: expected {form} with NAME like OMP_NUM_THREADS")


#: The longest ``NAME=VALUE`` string Linux's execve takes (MAX_ARG_STRLEN, 32 pages): a longer
#: variable reaches no process on any backend, so it is refused before anything starts.
MAX_VARIABLE_BYTES = 32 * 4096


def job_env(items: Sequence[str], files: Sequence[str], environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``--env-file`` then ``--env`` as ``(name, value)`` pairs, lowest precedence first (a later pair
    wins): each file's lines in order, then each ``--env`` item, a glob (``WANDB_*``) expanded to the
    matching variables of ``environ`` (:func:`unmatched_globs` says which matched nothing)."""
    pairs: list[tuple[str, str]] = []
    for path in files:
        pairs.extend(envfile.read_env_file(str(path), environ))
    for item in items:
        if envfile.is_glob(str(item)):
            pairs.extend(envfile.expand_glob(str(item), environ))
        else:
            pairs.append(parse_env_item(item, "--env", environ, True))
    check_variable_sizes(pairs)
    return tuple(pairs)


def unmatched_globs(items: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The ``--env`` globs that match no variable of ``environ`` (a warning each, not an error:
    ``--env 'WANDB_*'`` in a shared script must not fail where W&B is not set up)."""
    return [str(i) for i in items if envfile.is_glob(str(i)) and not envfile.expand_glob(str(i), environ)]


def check_variable_sizes(pairs: Sequence[tuple[str, str]]) -> None:
    """Refuse a variable longer than :data:`MAX_VARIABLE_BYTES`: execve would fail with E2BIG
    ("Argument list too long") wherever the process starts, after the job's other processes ran."""
    for name, value in pairs:
        size = len(name.encode()) + 1 + len(value.encode("utf-8", "surrogateescape")) + 1
        if size > MAX_VARIABLE_BYTES:
            raise ConfigError(f"{name} is {size // 1024} KiB; Linux starts no process with a variable over "
                              f"{MAX_VARIABLE_BYTES // 1024} KiB (execve: Argument list too long): put the value "
                              f"in a file and set {name} to its path")


def parse_port_range_option(text: str) -> tuple[int, int]:
    if not str(text).strip():
        raise ConfigError("--port-range is empty: give LOW-HIGH, for example 9091-9998")
    if len(str(text)) > 40:
        raise ConfigError(f"--port-range {str(text)[:40]!r}...: give LOW-HIGH, for example 9091-9998")
    try:
        return pc.parse_port_range(text)
    except ValueError as e:
        raise ConfigError(f"--port-range: {e}") from None


#: how long -H waits for a name to resolve before it takes the name as a host unasked
RESOLVE_WAIT = 3.0


def _ssh_alias(name: str) -> bool:
    """``~/.ssh/config`` names ``name`` (a ``HostName`` for it, or a jump host that may resolve it)."""
    try:
        from ..transport.ssh import load_ssh_config  # (here: only for a name that does not resolve)

        config = load_ssh_config()
    except (ImportError, LauncherError):
        return False
    if config is None:
        return False
    found = config.lookup(name)
    return (found.get("hostname") or name) != name or any(k in found for k in ("proxyjump", "proxycommand"))


def resolves(name: str, wait: float = RESOLVE_WAIT) -> bool:
    """Whether ``name`` is an address, a name that resolves here, or an ssh alias; a lookup that has
    not answered within ``wait`` seconds counts as resolving (a slow resolver is not a mistake)."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    answer: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(name, None)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    thread = threading.Thread(target=lookup, name="pslaunch-resolve", daemon=True)
    thread.start()
    thread.join(wait)
    return (not answer or answer[0]) or _ssh_alias(name)


def read_hosts_option(value: str) -> tuple[Host, ...]:
    """``-H value`` as :func:`launcher.spec.hosts.read_hosts` reads it, but a lone bare name that is
    neither a file here nor a host anywhere (``-H hostsfile`` mistyped) is a usage error that says
    both, at once, rather than an ssh failure later."""
    hosts = read_hosts(value)
    if is_host_list(value) and len(hosts) == 1:
        h = hosts[0]
        if h.port is None and h.user is None and h.slots is None and not resolves(h.name):
            raise ConfigError(f"-H {value}: no such file, and no host by that name resolves; give a hostfile "
                              "path or host names (-H h1,h2)")
    return hosts


# --- logging ----------------------------------------------------------------------------------------


def configure_logging(level: str, log_file: Optional[str] = None) -> None:
    """The launcher's own messages go to stderr (and ``--log-file``), prefixed ``pslaunch:``
    (:mod:`launcher.logs`). The file is opened as ``--log-dir``'s are: a link planted at its
    name is not followed, another user's file is not written."""
    stream = None
    if log_file:
        parent, name = os.path.split(os.path.abspath(log_file))
        try:
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fd = safefiles.open_file(dfd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666, what=log_file)
            finally:
                os.close(dfd)
        except OSError as e:
            raise ConfigError(f"cannot open --log-file {log_file}: {e.strerror or e}") from None
        except safefiles.Refused as e:
            raise ConfigError(f"cannot open --log-file: {e}; name a file of your own") from None
        stream = open(fd, "a", encoding="utf-8")
    logs.configure(level, stream)


# --- running a command --------------------------------------------------------------------------------


MAX_MESSAGE = 2000  # characters: an error about a huge argument must not repeat it whole


def fail(message: str, code: int) -> int:
    """Print ``message`` as pslaunch's one error line (folded, and cut when huge); return ``code``."""
    message = logs.printable(" ".join(message.splitlines()))  # (a host's or a file's words may be in it)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE:,} more characters)"
    sys.stdout.flush()
    sys.stderr.write(f"pslaunch: error: {message}\n")
    sys.stderr.flush()
    return code


def guarded(work: Callable[[], int]) -> int:
    """Run ``work`` and map what it raises to an exit code and at most one line on stderr."""
    try:
        return work()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except LauncherError as e:
        return fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
