"""ssh connections for the ssh backend and ``pslaunch doctor`` (paramiko).

One :class:`HostSession` per host: a paramiko ``Transport``, authenticated
and host-key checked, reused for every exec and for the long-lived channel of
the host's wrapper. If the server
refuses another channel (sshd's ``MaxSessions``, 10 by default), the session
opens one more connection to the same host and continues there.

How a hostfile line becomes a connection (:func:`resolve_target`, pure):

* user: the line's ``user@``, else ``--ssh-user``, else ``User`` from
  ``~/.ssh/config`` (``Host`` patterns honoured), else the local user;
* port: the line's ``:port``, else ``--ssh-port``, else ``Port``, else 22;
* address: ``HostName`` from the config, else the name as written;
* keys: ``--ssh-key`` and the config's ``IdentityFile`` entries, then the
  ssh-agent's keys, then (if no key file was named) ``~/.ssh/id_*``;
* known hosts: the config's ``UserKnownHostsFile``, else
  ``~/.ssh/known_hosts``, plus ``/etc/ssh/ssh_known_hosts``.

Host keys are strict: an unknown key is refused with the ``ssh-keyscan``
command that adds it (unless ``--accept-new-host-keys``: then it is appended
to the first known_hosts file), and a changed key is always refused.
Connecting retries refused connections and dropped banners (sshd starting,
``MaxStartups``) until ``--ssh-connect-timeout``; a timeout, an unknown or
changed key, and an authentication failure are not retried.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import errno
import getpass
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from ..errors import BackendUnavailableError, LaunchError
from ..spec.job import Host
from .options import SSHOptions

if TYPE_CHECKING:  # (an optional dependency, imported where it is used)
    import paramiko

log = logging.getLogger(__name__)
# paramiko logs channel refusals and dropped connections as warnings; we report those ourselves,
# in one line. Without a handler of its own, Python's last-resort handler would print them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_PORT = 22
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")
MAX_FANOUT = 32
RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0)
# sshd refuses a session beyond MaxSessions with "administratively prohibited" (1) or, OpenSSH,
# "connect failed" (2): open another connection to the host then.
_SESSION_REFUSED = (1, 2)
#: The most output (stdout and stderr together) a short command may print (``pslaunch doctor``'s
#: probe prints one line of JSON after what the login shell prints): more fails it.
EXEC_MAX = 16 << 20

_known_hosts_lock = threading.Lock()


def require_paramiko() -> None:
    """Raise a one-line error when paramiko is missing."""
    try:
        import paramiko  # noqa: F401
    except ImportError:
        raise BackendUnavailableError(
            "the ssh backend needs paramiko: pip install '.[ssh]' in your clone of pslaunch "
            "(or pip install paramiko)") from None


class SSHConnectError(LaunchError):
    """A host could not be connected to; the message names the host, the problem and the fix.
    ``unreachable_targets``: of the hosts that failed (:func:`connect_all`), the idents of those
    that did not answer at all (:class:`SSHUnreachable`)."""

    unreachable_targets: tuple = ()


class SSHUnreachable(SSHConnectError):
    """The host did not answer, or refused or reset the connection: it is down, unplugged or has
    no sshd (not a key, user or configuration problem)."""


class HostKeyError(SSHConnectError):
    """A host key is unknown or has changed."""


# --- targets ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how to connect for one hostfile line, after ``~/.ssh/config``."""

    host: Host
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    host_key_alias: Optional[str] = None
    config_file: Optional[str] = None

    @property
    def label(self) -> str:
        """The host as the hostfile names it (messages, output prefixes)."""
        return self.host.name

    @property
    def ident(self) -> tuple[str, str, int]:
        """Lines that resolve to the same user, address and port share one connection."""
        return (self.user, self.hostname, self.port)

    @property
    def key_name(self) -> str:
        """The name known_hosts files list this host under (OpenSSH's rule).

        ``HostKeyAlias`` is used exactly as written, without the port: OpenSSH
        brackets only the host name (``[host]:2222``), never the alias.
        """
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"

    @property
    def address(self) -> str:
        """``user@hostname:port`` for messages."""
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.user}@{host}:{self.port}"


def home_dir() -> str:
    return os.path.expanduser("~")


def ssh_config_path(home: Optional[str] = None) -> str:
    return os.path.join(home or home_dir(), ".ssh", "config")


def load_ssh_config(path: Optional[str] = None) -> Optional[paramiko.SSHConfig]:
    """``~/.ssh/config`` parsed (``None`` when there is none); a bad file is a one-line error."""
    import paramiko

    path = path or ssh_config_path()
    if not os.path.isfile(path):
        return None
    try:
        return paramiko.SSHConfig.from_path(path)
    except (OSError, paramiko.ConfigParseError, ValueError) as e:
        raise SSHConnectError(f"cannot read ssh config {path}: {e}; fix the file or move it away") from None


def resolve_target(host: Host, opts: SSHOptions, config: Optional[paramiko.SSHConfig] = None,
                   config_file: Optional[str] = None, local_user: Optional[str] = None,
                   home: Optional[str] = None) -> Target:
    """Apply the hostfile line, the ``--ssh-*`` options and ``~/.ssh/config`` (pure but for the
    existence of default files)."""
    home = home or home_dir()
    cfg: dict = dict(config.lookup(host.name)) if config is not None else {}
    for option in ("proxyjump", "proxycommand"):
        value = cfg.get(option)
        if value and str(value).strip().lower() != "none":
            # Connecting straight to the host instead would bypass the jump host the config names.
            name = "ProxyJump" if option == "proxyjump" else "ProxyCommand"
            raise SSHConnectError(
                f"{host.name}: ~/.ssh/config sets {name} {value} for it, which the ssh backend does not "
                "support; list hosts it can reach directly, or use --launcher mpi with your own ssh")
    hostname = cfg.get("hostname") or host.name
    user = host.user or opts.user or cfg.get("user") or local_user or getpass.getuser()
    port = host.port or opts.port or int(cfg.get("port") or DEFAULT_PORT)
    keys: list[str] = []
    if opts.key:
        keys.append(os.path.expanduser(opts.key))
    for f in cfg.get("identityfile") or ():
        f = os.path.expanduser(f)
        if f not in keys and os.path.isfile(f):
            keys.append(f)
    known = cfg.get("userknownhostsfile")
    if opts.known_hosts:
        known_files = [opts.known_hosts]
    elif known:
        known_files = [os.path.expanduser(k) for k in str(known).split()]
    else:
        known_files = [os.path.join(home, ".ssh", "known_hosts"), os.path.join(home, ".ssh", "known_hosts2")]
    return Target(host=host, hostname=hostname, port=port, user=user, key_files=tuple(keys),
                  known_hosts=tuple(known_files), host_key_alias=cfg.get("hostkeyalias"),
                  config_file=config_file if config is not None else None)


def resolve_targets(hosts: Iterable[Host], opts: SSHOptions) -> list[Target]:
    path = ssh_config_path()
    config = load_ssh_config(path)
    return [resolve_target(h, opts, config, path if config is not None else None) for h in hosts]


# --- host keys ---------------------------------------------------------------------------------


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def key_type_label(key: paramiko.PKey) -> str:
    """``ED25519``, ``RSA``, ``ECDSA``: as ssh prints key types."""
    name = key.get_name()
    if "ed25519" in name:
        return "ED25519"
    if "ecdsa" in name:
        return "ECDSA"
    if "rsa" in name:
        return "RSA"
    return name


def keyscan_type(key: paramiko.PKey) -> str:
    return {"ED25519": "ed25519", "ECDSA": "ecdsa", "RSA": "rsa"}.get(key_type_label(key), key.get_name())


def keyscan_command(target: Target, key: paramiko.PKey) -> str:
    """The command that records ``target``'s key in its first known_hosts file."""
    port = f"-p {target.port} " if target.port != DEFAULT_PORT else ""
    dest = shlex.quote(target.known_hosts[0]) if target.known_hosts else "~/.ssh/known_hosts"
    scan = f"ssh-keyscan {port}-t {keyscan_type(key)} {shlex.quote(target.hostname)}"
    if target.host_key_alias:  # scan the real address, record the key under the alias
        return f"{scan} | sed 's/^[^ ]*/{target.host_key_alias}/' >> {dest}"
    return f"{scan} >> {dest}"


def read_known_hosts(path: str) -> paramiko.HostKeys:
    """One known_hosts file, read as OpenSSH reads it.

    paramiko's own ``HostKeys.load`` raises on the first line it cannot parse,
    among them OpenSSH's ``@cert-authority`` and ``@revoked`` lines: here a line
    that cannot be parsed is skipped (as OpenSSH does), ``@cert-authority`` is
    ignored (host certificates are not supported), and ``@revoked`` keys are
    kept in the result's ``revoked`` list and refused by :func:`check_host_key`.

    Raises:
        OSError: the file cannot be read.
    """
    import paramiko
    from paramiko.hostkeys import HostKeyEntry

    keys = paramiko.HostKeys()
    revoked: list[paramiko.PKey] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            marker = ""
            if line.startswith("@"):
                marker, _, line = line.partition(" ")
                line = line.strip()
            try:
                entry = HostKeyEntry.from_line(line, lineno)
            except Exception as e:  # noqa: BLE001 - paramiko's InvalidHostKey is no SSHException
                log.debug("%s:%d: skipping a line paramiko cannot read: %s", path, lineno, type(e).__name__)
                continue
            if entry is None or entry.key is None:
                continue
            if marker == "@revoked":
                revoked.append(entry.key)
            elif not marker:
                keys._entries.append(entry)  # (HostKeys.add would merge lines: all are kept, as OpenSSH does)
    keys.revoked = revoked  # (an attribute of our own, read by check_host_key)
    return keys


def _load_known(paths: Sequence[str]) -> list[tuple[str, paramiko.HostKeys]]:
    out = []
    for path in list(paths) + [GLOBAL_KNOWN_HOSTS]:
        if os.path.isfile(path):
            try:
                keys = read_known_hosts(path)
            except OSError as e:
                log.warning("cannot read known_hosts file %s: %s", path, e)
                continue
            out.append((path, keys))
    return out


def _family(keytype: str) -> str:
    return "ssh-rsa" if keytype.startswith("rsa-sha2") else keytype.replace("-cert-v01@openssh.com", "")


def _listed_keys(keys: paramiko.HostKeys, name: str) -> list[paramiko.PKey]:
    """Every key the file lists for ``name``, in file order (paramiko's mapping shows one per type)."""
    entry = keys.lookup(name)
    if entry is None:
        return []
    entries = getattr(entry, "_entries", None)
    if entries is None:  # pragma: no cover - another paramiko: its first key per type
        return list(entry.values())
    return [e.key for e in entries if e.key is not None]


def check_host_key(target: Target, key: paramiko.PKey, known: list[tuple[str, paramiko.HostKeys]],
                   accept_new: bool) -> None:
    """Accept ``key`` for ``target`` or raise :class:`HostKeyError` (one line, with the fix)."""
    name = target.key_name
    for path, keys in known:
        if any(bad.asbytes() == key.asbytes() for bad in getattr(keys, "revoked", ())):
            raise HostKeyError(f"{target.label}: the host key of {name} ({key_type_label(key)} {fingerprint(key)}) "
                               f"is marked @revoked in {path}; refusing to connect")
    other_types = False
    changed: list[tuple[str, paramiko.PKey]] = []
    # As OpenSSH: the key is good if *any* line of any known_hosts file lists it (a stale line in
    # ~/.ssh/known_hosts does not hide the right one below it or in /etc/ssh/ssh_known_hosts).
    for path, keys in known:
        for old in _listed_keys(keys, name):
            if old.get_name() != key.get_name():
                other_types = True
            elif old.asbytes() == key.asbytes():
                return
            else:
                changed.append((path, old))
    if changed:
        path, old = changed[0]
        raise HostKeyError(
            f"{target.label}: the host key of {name} has CHANGED: the server sent {key_type_label(key)} "
            f"{fingerprint(key)}, {path} lists {fingerprint(old)}; refusing to connect (this can be a "
            f"man-in-the-middle attack); if the host was reinstalled, remove the old key with: "
            f"ssh-keygen -R '{name}' -f {path}")
    if accept_new:
        dest = target.known_hosts[0] if target.known_hosts else os.path.join(home_dir(), ".ssh", "known_hosts")
        _append_known_host(dest, name, key)
        log.warning("%s: added the new %s host key %s of %s to %s (--accept-new-host-keys)", target.label,
                    key_type_label(key), fingerprint(key), name, dest)
        return
    known_list = ", ".join(p for p, _ in known) or (target.known_hosts[0] if target.known_hosts else "known_hosts")
    extra = " (it has keys of other types only)" if other_types else ""
    raise HostKeyError(
        f"{target.label}: host key of {name} is not known{extra}: {key_type_label(key)} {fingerprint(key)} "
        f"not in {known_list}; check the fingerprint, then add it with: {keyscan_command(target, key)} "
        f"(or pass --accept-new-host-keys to trust new hosts on first use)")


def _append_known_host(path: str, name: str, key: paramiko.PKey) -> None:
    with _known_hosts_lock:
        directory = os.path.dirname(path)
        if directory and not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            needs_newline = os.path.getsize(path) > 0 and open(path, "rb").read()[-1:] != b"\n"
        except OSError:
            needs_newline = False
        with open(path, "a", encoding="ascii") as f:
            f.write(("\n" if needs_newline else "") + f"{name} {key.get_name()} {key.get_base64()}\n")


# --- connecting -----------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure worth another try (refused, reset, banner dropped)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _open_socket(target: Target, timeout: float) -> socket.socket:
    where = f"{target.hostname}:{target.port}"
    try:
        infos = socket.getaddrinfo(target.hostname, target.port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SSHConnectError(f"{target.label}: cannot resolve {target.hostname!r}: {e.strerror}; check the "
                              "hostfile or the HostName in ~/.ssh/config") from None
    # prefer IPv4: ps-lite advertises IPv4 addresses
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.settimeout(max(0.1, timeout))
    try:
        sock.connect(addr)
    except socket.timeout:
        sock.close()
        raise SSHUnreachable(f"{target.label}: cannot reach {where}: no answer within {timeout:.3g}s "
                              "(--ssh-connect-timeout); is the host up and the address right?") from None
    except ConnectionRefusedError:
        sock.close()
        raise _Transient(f"{target.label}: connection to {where} refused: is sshd running there, "
                         "and is the port right (host:port in the hostfile, or --ssh-port)?") from None
    except OSError as e:
        sock.close()
        if e.errno in (errno.ECONNRESET, errno.ECONNABORTED):
            raise _Transient(f"{target.label}: connection to {where} was reset: {e.strerror}") from None
        raise SSHUnreachable(f"{target.label}: cannot reach {where}: {e.strerror or e}; is the host up "
                             "and the address right?") from None
    return sock


def _prefer_known_key_types(transport: paramiko.Transport, target: Target,
                            known: list[tuple[str, paramiko.HostKeys]]) -> None:
    """Ask the server first for a key type we already know, as OpenSSH does."""
    types: set[str] = set()
    for _, keys in known:
        entry = keys.lookup(target.key_name)
        if entry is not None:
            types.update(entry.keys())
    if not types:
        return
    opts = transport.get_security_options()
    current = list(opts.key_types)
    first = [t for t in current if _family(t) in types]
    opts.key_types = tuple(first + [t for t in current if t not in first])


def _authenticate(transport: paramiko.Transport, target: Target, timeout: float) -> None:
    import paramiko

    user = target.user
    tried: list[str] = []
    locked: list[str] = []

    def attempt(key: paramiko.PKey, what: str) -> bool:
        try:
            transport.auth_publickey(user, key)
            return transport.is_authenticated()
        except paramiko.AuthenticationException:
            tried.append(what)
            return False

    def from_file(path: str, explicit: bool) -> bool:
        try:
            key = paramiko.PKey.from_path(path)
        except paramiko.PasswordRequiredException:
            locked.append(path)
            return False
        except (paramiko.SSHException, OSError, ValueError, TypeError) as e:
            if isinstance(e, TypeError) and "password" in str(e).lower():
                locked.append(path)  # cryptography's word for an encrypted OpenSSH key
                return False
            if explicit:
                raise SSHConnectError(f"{target.label}: cannot use the key {path}: {e}; give a private key "
                                      "file (not the .pub)") from None
            log.debug("skipping key %s: %s", path, e)
            return False
        return attempt(key, f"key {path}")

    for path in target.key_files:
        if from_file(path, explicit=True):
            return
    agent = paramiko.Agent()
    try:
        for key in agent.get_keys():
            if attempt(key, "an agent key"):
                return
    except paramiko.SSHException as e:
        log.debug("ssh-agent: %s", e)
    finally:
        agent.close()
    if not target.key_files:
        for name in DEFAULT_KEYS:
            path = os.path.join(home_dir(), ".ssh", name)
            if os.path.isfile(path) and from_file(path, explicit=False):
                return
    if locked:
        raise SSHConnectError(
            f"{target.label}: the key {locked[0]} needs a passphrase and no ssh-agent holds it: run "
            f"eval \"$(ssh-agent)\" && ssh-add {locked[0]} (pslaunch never prompts)")
    what = (", ".join(dict.fromkeys(tried)) if tried
            else "no key found (no --ssh-key, IdentityFile, agent or ~/.ssh/id_*)")
    raise SSHConnectError(
        f"{target.label}: ssh authentication as {user} on {target.hostname}:{target.port} failed (tried: {what}); "
        "check the user (user@host in the hostfile, --ssh-user) and the key (--ssh-key, ssh-add), and that "
        f"its public key is in ~{user}/.ssh/authorized_keys there")


def _connect_once(target: Target, opts: SSHOptions, deadline: float) -> paramiko.Transport:
    import paramiko

    remaining = max(0.1, deadline - time.monotonic())
    sock = _open_socket(target, remaining)
    transport = paramiko.Transport(sock)
    ok = False
    try:
        remaining = max(0.1, deadline - time.monotonic())
        transport.banner_timeout = remaining
        transport.handshake_timeout = remaining
        transport.auth_timeout = remaining
        known = _load_known(target.known_hosts)
        _prefer_known_key_types(transport, target, known)
        try:
            transport.start_client(timeout=remaining)
        except (paramiko.SSHException, EOFError, OSError) as e:
            text = str(e) or type(e).__name__
            if "banner" in text.lower() or isinstance(e, (EOFError, ConnectionResetError)):
                raise _Transient(f"{target.label}: {target.hostname}:{target.port} closed the connection "
                                 f"during the ssh handshake ({text}); is it an sshd?") from None
            raise SSHConnectError(f"{target.label}: ssh handshake with {target.hostname}:{target.port} "
                                  f"failed: {text}") from None
        key = transport.get_remote_server_key()
        check_host_key(target, key, known, opts.accept_new_host_keys)
        _authenticate(transport, target, remaining)
        transport.set_keepalive(max(1, int(opts.keepalive)))
        ok = True
        return transport
    finally:
        if not ok:
            transport.close()


def connect(target: Target, opts: SSHOptions, timeout: Optional[float] = None) -> paramiko.Transport:
    """An authenticated, host-key checked transport to ``target``, with retries on transient errors.

    Raises :class:`SSHConnectError` (one line) within ``timeout`` (``--ssh-connect-timeout``).
    """
    timeout = opts.connect_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        try:
            return _connect_once(target, opts, deadline)
        except _Transient as e:
            delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
            attempt += 1
            if attempt >= len(RETRY_DELAYS) + 1 or time.monotonic() + delay >= deadline:
                raise SSHUnreachable(e.message) from None
            log.debug("%s (retrying in %.1fs)", e.message, delay)
            time.sleep(delay)


# --- a host's session ----------------------------------------------------------------------------


@dataclasses.dataclass
class ExecResult:
    code: int
    stdout: bytes
    stderr: bytes

    @property
    def err_line(self) -> str:
        """The last non-empty line of stderr (or stdout), for one-line messages."""
        for stream in (self.stderr, self.stdout):
            lines = [x.strip() for x in stream.decode(errors="replace").splitlines() if x.strip()]
            if lines:
                return lines[-1]
        return f"exit code {self.code}"


def send_patiently(chan: paramiko.Channel, data: bytes, stall_limit: float,
                   closed: Callable[[], bool] = lambda: False) -> None:
    """``chan.sendall(data)`` through a channel whose timeout is short (a reader's poll): a host that
    takes a large frame slowly (a busy machine, a long file list, a window that paramiko only
    reopens when the host has read) is waited for while it takes some of it every ``stall_limit``
    seconds. Paramiko's ``sendall`` gives up at the first timeout, with an empty message."""
    sent, stalled = 0, time.monotonic()
    while sent < len(data):
        try:
            n = chan.send(data[sent:sent + 65536])
        except socket.timeout:
            waited = time.monotonic() - stalled
            if closed() or waited > stall_limit:
                raise EOFError(f"the host took no data for {waited:.0f}s") from None
            continue
        if n == 0:
            raise EOFError("the channel is closed")
        sent += n
        stalled = time.monotonic()


class HostSession:
    """The connection(s) to one host, shared by everything the launcher does there."""

    def __init__(self, target: Target, opts: SSHOptions, transport: paramiko.Transport) -> None:
        self.target = target
        self.opts = opts
        self.transports = [transport]
        self._full: set[int] = set()
        self._lock = threading.Lock()
        self.closed = False

    @property
    def label(self) -> str:
        return self.target.label

    @property
    def peer_address(self) -> str:
        """The IP address the connection reached (the hostfile name resolved)."""
        return str(self.transports[0].getpeername()[0])

    @property
    def active(self) -> bool:
        return not self.closed and any(t.is_active() for t in self.transports)

    def open_channel(self, timeout: Optional[float] = None) -> paramiko.Channel:
        """A new session channel; opens another connection when sshd's MaxSessions is reached.

        sshd may still count a session whose channel we have just closed: a refusal on a
        connection that carries none of our channels is retried for a moment first.
        """
        import paramiko

        timeout = self.opts.connect_timeout if timeout is None else timeout
        deadline = time.monotonic() + min(timeout, 5.0)
        with self._lock:
            if self.closed:
                raise LaunchError(f"{self.label}: the connection is closed")
            while True:
                refused_idle = False
                for i, t in enumerate(self.transports):
                    if i in self._full:
                        continue
                    try:
                        return t.open_session(timeout=timeout)
                    except paramiko.ChannelException as e:
                        if e.code not in _SESSION_REFUSED:
                            raise LaunchError(f"{self.label}: cannot open an ssh channel: {e.text}") from None
                        if self._has_open_channels(t):
                            self._full.add(i)
                        else:
                            refused_idle = True
                    except (paramiko.SSHException, EOFError, OSError) as e:
                        raise LaunchError(f"{self.label}: the ssh connection failed: {e or type(e).__name__}") from None
                if not refused_idle or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            log.debug("%s: sshd refused another session (MaxSessions); opening connection %d",
                      self.label, len(self.transports) + 1)
            transport = connect(self.target, self.opts)
            self.transports.append(transport)
            try:
                return transport.open_session(timeout=timeout)
            except paramiko.SSHException as e:
                raise LaunchError(f"{self.label}: cannot open an ssh channel: {e}") from None

    @staticmethod
    def _has_open_channels(transport: paramiko.Transport) -> bool:
        """Whether a refusal can be sshd's session limit (the connection already carries sessions)."""
        channels = getattr(transport, "_channels", None)
        return channels is None or len(channels) > 0  # paramiko keeps no public count

    def channel_closed(self) -> None:
        """A channel ended: its connection may take another one."""
        with self._lock:
            self._full.clear()

    def exec(self, command: str, stdin: bytes = b"", timeout: Optional[float] = None) -> ExecResult:
        """Run a short ``command`` (a shell string) and collect its output."""
        import paramiko

        timeout = max(self.opts.connect_timeout, 10.0) if timeout is None else timeout
        chan = self.open_channel()
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                if time.monotonic() > deadline:
                    raise LaunchError(f"{self.label}: {command.split()[0]} did not finish within {timeout:g}s")
                if len(out) + len(err) > EXEC_MAX:
                    raise LaunchError(f"{self.label}: {command.split()[0]} printed more than {EXEC_MAX >> 20} MiB; "
                                      "dropped that connection (is the login shell there printing without end?)")
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    continue
                try:
                    chunk = chan.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                out += chunk
            while (chan.recv_stderr_ready() or not chan.exit_status_ready()) and len(err) <= EXEC_MAX:
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                elif time.monotonic() > deadline:
                    break
                else:
                    time.sleep(0.005)
            while chan.recv_stderr_ready() and len(err) <= EXEC_MAX:
                err += chan.recv_stderr(65536)
            code = chan.recv_exit_status() if chan.exit_status_ready() else 255
            return ExecResult(code, bytes(out), bytes(err))
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise LaunchError(f"{self.label}: the ssh connection failed: {e or type(e).__name__}") from None
        finally:
            chan.close()
            self.channel_closed()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            transports, self.transports = self.transports, self.transports[:1]
        for t in transports:
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not fail teardown
                pass


def connect_all(targets: Sequence[Target], opts: SSHOptions,
                fanout: int = MAX_FANOUT,
                on_connect: Optional[Callable[[HostSession], None]] = None) -> dict[tuple, HostSession]:
    """Connect to every distinct target in parallel (at most ``fanout`` at once).

    Returns sessions by :attr:`Target.ident`. If any host fails, the others
    are closed and the first failure (in hostfile order) is raised, naming how
    many more failed.
    """
    unique: dict[tuple, Target] = {}
    for t in targets:
        unique.setdefault(t.ident, t)
    sessions: dict[tuple, HostSession] = {}
    errors: dict[tuple, BaseException] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(fanout, len(unique))),
                                                 thread_name_prefix="pslaunch-connect")
    abandoned = threading.Event()

    def connect_or_drop(t: Target) -> paramiko.Transport:
        transport = connect(t, opts)
        if abandoned.is_set():  # the launcher gave up (Ctrl-C) while this one connected
            transport.close()
            raise LaunchError(f"{t.label}: abandoned")
        return transport

    try:
        futures = {pool.submit(connect_or_drop, t): ident for ident, t in unique.items()}
        for fut in concurrent.futures.as_completed(futures):
            ident = futures[fut]
            try:
                sessions[ident] = HostSession(unique[ident], opts, fut.result())
                if on_connect is not None:
                    on_connect(sessions[ident])
            except Exception as e:  # noqa: BLE001 - collected, re-raised below as one line
                errors[ident] = e
    except BaseException:
        abandoned.set()
        for s in sessions.values():
            s.close()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=False)
    if errors:
        for s in sessions.values():
            s.close()
        first_ident = next(i for i in unique if i in errors)
        first = errors[first_ident]
        more = [unique[i].label for i in unique if i in errors and i != first_ident]
        message = str(first) if isinstance(first, LaunchError) else f"{unique[first_ident].label}: {first}"
        if more:
            message += f" ({len(more)} more host{'s' if len(more) > 1 else ''} failed: {', '.join(more)})"
        error = SSHConnectError(message)
        #: the targets (idents) that did not answer at all; the backend names their hostfile lines
        error.unreachable_targets = tuple(i for i, e in errors.items() if isinstance(e, SSHUnreachable))
        raise error
    return sessions
