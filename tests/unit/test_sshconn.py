"""ssh connection set-up without a server: ~/.ssh/config resolution and host-key decisions."""

from __future__ import annotations

import subprocess
import sys

import paramiko
import pytest
from support.helpers import PipeChannel

from launcher.spec.job import Host
from launcher.transport.ssh import (
    HostKeyError,
    SSHOptions,
    Target,
    _load_known,
    check_host_key,
    fingerprint,
    keyscan_command,
    resolve_target,
)

CONFIG = """
Host gpu-*
    User trainer
    Port 2200
    IdentityFile {key}
    UserKnownHostsFile {kh} /etc/other_known_hosts

Host gpu-3
    HostName 10.9.0.3
    HostKeyAlias gpu3-key

Host *
    User fallback
"""


@pytest.fixture
def config(tmp_path) -> paramiko.SSHConfig:
    key = tmp_path / "k"
    key.write_text("not really a key")
    return paramiko.SSHConfig.from_text(CONFIG.format(key=key, kh=tmp_path / "kh"))


def test_config_patterns_hostname_user_port_keys(config, tmp_path) -> None:
    t = resolve_target(Host("gpu-3"), SSHOptions(), config, "/cfg", local_user="me", home=str(tmp_path))
    assert (t.hostname, t.user, t.port) == ("10.9.0.3", "trainer", 2200)
    assert t.key_files == (str(tmp_path / "k"),)
    assert t.known_hosts == (str(tmp_path / "kh"), "/etc/other_known_hosts")
    # OpenSSH records and looks up a HostKeyAlias as written, without the port
    assert t.host_key_alias == "gpu3-key" and t.key_name == "gpu3-key"
    assert t.config_file == "/cfg" and t.label == "gpu-3" and t.address == "trainer@10.9.0.3:2200"


def test_hostfile_line_beats_options_beat_config(config, tmp_path) -> None:
    (tmp_path / "explicit").write_text("a key file")  # (the options refuse a key that does not exist)
    opts = SSHOptions(user="opt", port=2300, key=str(tmp_path / "explicit"))
    t = resolve_target(Host("gpu-1"), opts, config, local_user="me", home=str(tmp_path))
    assert (t.hostname, t.user, t.port) == ("gpu-1", "opt", 2300)
    assert t.key_files[0] == str(tmp_path / "explicit")  # --ssh-key first, then IdentityFile
    t = resolve_target(Host("gpu-1", port=22, user="line"), opts, config, local_user="me", home=str(tmp_path))
    assert (t.user, t.port, t.key_name) == ("line", 22, "gpu-1")


def test_defaults_without_config(tmp_path) -> None:
    t = resolve_target(Host("node"), SSHOptions(), None, local_user="me", home=str(tmp_path))
    assert (t.hostname, t.user, t.port, t.key_files) == ("node", "me", 22, ())
    assert t.known_hosts == (str(tmp_path / ".ssh" / "known_hosts"), str(tmp_path / ".ssh" / "known_hosts2"))
    assert t.ident == ("me", "node", 22)


@pytest.fixture(scope="module")
def keys() -> tuple[paramiko.PKey, paramiko.PKey]:
    return paramiko.RSAKey.generate(1024), paramiko.RSAKey.generate(1024)


def _known(tmp_path, line: str) -> list[tuple[str, paramiko.HostKeys]]:
    path = tmp_path / "known_hosts"
    path.write_text(line)
    hk = paramiko.HostKeys()
    hk.load(str(path))
    return [(str(path), hk)]


def test_known_key_is_accepted(keys, tmp_path) -> None:
    key, _ = keys
    t = Target(Host("n"), "10.0.0.1", 22, "u", known_hosts=(str(tmp_path / "known_hosts"),))
    check_host_key(t, key, _known(tmp_path, f"10.0.0.1 {key.get_name()} {key.get_base64()}\n"), accept_new=False)


def test_changed_key_is_refused_even_with_accept_new(keys, tmp_path) -> None:
    key, other = keys
    t = Target(Host("n"), "10.0.0.1", 2222, "u", known_hosts=(str(tmp_path / "known_hosts"),))
    known = _known(tmp_path, f"[10.0.0.1]:2222 {other.get_name()} {other.get_base64()}\n")
    for accept in (False, True):
        with pytest.raises(HostKeyError) as e:
            check_host_key(t, key, known, accept_new=accept)
        msg = str(e.value)
        assert "has CHANGED" in msg and fingerprint(key) in msg and fingerprint(other) in msg
        assert f"ssh-keygen -R '[10.0.0.1]:2222' -f {tmp_path / 'known_hosts'}" in msg
        assert "\n" not in msg


def test_unknown_key_is_refused_with_the_keyscan_fix(keys, tmp_path) -> None:
    key, _ = keys
    t = Target(Host("n"), "10.0.0.1", 2222, "u", known_hosts=(str(tmp_path / "known_hosts"),))
    with pytest.raises(HostKeyError) as e:
        check_host_key(t, key, _known(tmp_path, ""), accept_new=False)
    msg = str(e.value)
    assert f"ssh-keyscan -p 2222 -t rsa 10.0.0.1 >> {tmp_path / 'known_hosts'}" in msg
    assert keyscan_command(t, key) in msg and "--accept-new-host-keys" in msg and "\n" not in msg


def test_accept_new_records_the_key(keys, tmp_path) -> None:
    key, _ = keys
    kh = tmp_path / "sub" / "known_hosts"
    t = Target(Host("n"), "10.0.0.1", 2222, "u", known_hosts=(str(kh),))
    check_host_key(t, key, [], accept_new=True)
    assert kh.read_text() == f"[10.0.0.1]:2222 {key.get_name()} {key.get_base64()}\n"
    hk = paramiko.HostKeys()
    hk.load(str(kh))
    check_host_key(t, key, [(str(kh), hk)], accept_new=False)  # known now


def test_host_key_alias_is_looked_up_as_openssh_writes_it(keys, tmp_path) -> None:
    """ssh (and rsync over it) file a HostKeyAlias host under the bare alias, whatever the port."""
    key, _ = keys
    t = Target(Host("gpu-3"), "10.9.0.3", 2200, "u", known_hosts=(str(tmp_path / "known_hosts"),),
               host_key_alias="gpu3-key")
    check_host_key(t, key, _known(tmp_path, f"gpu3-key {key.get_name()} {key.get_base64()}\n"), accept_new=False)
    with pytest.raises(HostKeyError) as e:
        check_host_key(t, key, _known(tmp_path, ""), accept_new=False)
    assert (f"ssh-keyscan -p 2200 -t rsa 10.9.0.3 | sed 's/^[^ ]*/gpu3-key/' >> {tmp_path / 'known_hosts'}"
            in str(e.value))
    kh = tmp_path / "new_known_hosts"
    t2 = Target(Host("gpu-3"), "10.9.0.3", 2200, "u", known_hosts=(str(kh),), host_key_alias="gpu3-key")
    check_host_key(t2, key, [], accept_new=True)
    assert kh.read_text() == f"gpu3-key {key.get_name()} {key.get_base64()}\n"


@pytest.mark.parametrize("line", ["ProxyJump bastion", "ProxyCommand ssh -W %h:%p bastion"])
def test_a_proxy_in_the_config_is_refused_not_bypassed(line, tmp_path) -> None:
    """Connecting straight to the host would bypass the jump host the user configured."""
    from launcher.transport.ssh import SSHConnectError

    config = paramiko.SSHConfig.from_text(f"Host gpu-*\n    {line}\nHost *\n    ProxyCommand none\n")
    with pytest.raises(SSHConnectError) as e:
        resolve_target(Host("gpu-1"), SSHOptions(), config, local_user="me", home=str(tmp_path))
    assert str(e.value).startswith("gpu-1: ~/.ssh/config sets Proxy") and "not support" in str(e.value)
    assert "\n" not in str(e.value)
    t = resolve_target(Host("cpu-1"), SSHOptions(), config, local_user="me", home=str(tmp_path))  # "none" is fine
    assert t.hostname == "cpu-1"


def test_any_listed_key_is_accepted_as_openssh_does(keys, tmp_path) -> None:
    """A stale line before the right one, or in another file, is not a changed key."""
    key, other = keys
    t = Target(Host("n"), "10.0.0.1", 22, "u", known_hosts=(str(tmp_path / "known_hosts"),))
    stale = f"10.0.0.1 {other.get_name()} {other.get_base64()}\n"
    right = f"10.0.0.1 {key.get_name()} {key.get_base64()}\n"
    check_host_key(t, key, _known(tmp_path, stale + right), accept_new=False)
    user = _known(tmp_path, stale)
    (tmp_path / "global").write_text(right)
    hk = paramiko.HostKeys()
    hk.load(str(tmp_path / "global"))
    check_host_key(t, key, user + [(str(tmp_path / "global"), hk)], accept_new=False)
    with pytest.raises(HostKeyError, match="has CHANGED"):  # listed only with another key
        check_host_key(t, key, _known(tmp_path, stale), accept_new=False)


def test_known_hosts_with_markers_and_bad_lines_is_read_as_openssh_does(keys, tmp_path) -> None:
    """paramiko's HostKeys.load raises on @cert-authority, @revoked and undecodable lines;
    OpenSSH skips what it cannot use. One such line must not stop every connection."""
    key, other = keys
    kh = tmp_path / "known_hosts"
    kh.write_text(
        "# comment\n"
        f"@cert-authority *.example.org {other.get_name()} {other.get_base64()}\n"
        "10.0.0.9 ssh-rsa AAAAbroken\n"
        f"10.0.0.1 {key.get_name()} {key.get_base64()}\n"
        f"@revoked 10.0.0.2 {other.get_name()} {other.get_base64()}\n"
        f"10.0.0.2 {other.get_name()} {other.get_base64()}\n")
    known = [(p, k) for p, k in _load_known([str(kh)]) if p == str(kh)]
    assert len(known) == 1
    check_host_key(Target(Host("a"), "10.0.0.1", 22, "u", known_hosts=(str(kh),)), key, known, accept_new=False)
    with pytest.raises(HostKeyError, match="@revoked"):  # listed, but revoked: refused, even with accept_new
        check_host_key(Target(Host("b"), "10.0.0.2", 22, "u", known_hosts=(str(kh),)), other, known, accept_new=True)


class _ExecChannel(PipeChannel):
    """What :meth:`HostSession.exec` uses of a paramiko channel, over a local Python ``script``."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = script

    def exec_command(self, command: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)

    def shutdown_write(self) -> None:
        assert self.p is not None and self.p.stdin is not None
        self.p.stdin.close()


class _ExecTransport:
    def __init__(self, script: str) -> None:
        self.script = script

    def open_session(self, timeout: float | None = None) -> _ExecChannel:
        return _ExecChannel(self.script)

    def is_active(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


@pytest.mark.timeout(120)
def test_a_command_whose_output_never_ends_is_cut_not_buffered() -> None:
    """Issue 30, 14 (c): ``pslaunch doctor`` runs its probe with :meth:`HostSession.exec`, which kept
    all a host printed: 300 MB from a hostile host grew the launcher by as much. Now the output is
    bounded (EXEC_MAX) and the command fails with one line."""
    from launcher.errors import LaunchError
    from launcher.transport import ssh as sshmod
    from launcher.transport.options import SSHOptions

    script = ("import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(300):\n    sys.stdout.buffer.write(chunk)\n")
    target = sshmod.Target(host=Host("hostile"), hostname="hostile", port=22, user="u")
    session = sshmod.HostSession(target, SSHOptions(), _ExecTransport(script))  # type: ignore[arg-type]
    before = _rss_mb()
    with pytest.raises(LaunchError, match="printed more than") as e:
        r = session.exec("python3 -c probe", timeout=60.0)
        print(f"exec kept {len(r.stdout):,} bytes; launcher RSS +{_rss_mb() - before:.0f} MB")
    grown = _rss_mb() - before
    print(f"a host printing 300 MB to an exec: {e.value}; launcher RSS +{grown:.0f} MB")
    assert str(e.value).startswith("hostile: ") and grown < 64, grown
