"""Files on a shared machine (issue 30, items 8-10): links and files that another user plants in
``--sync-dst-dir``, ``--log-dir`` and beside ``--summary-json`` are never followed, and a full
``--log-dir`` disk is said at once.

"Another user" is uid 65534 (nobody): the directories and links it would have made are chowned
to it. The tests run as root, which passes every permission check: what stops root from
writing through a planted link is ``O_NOFOLLOW``, ``O_EXCL``, unpredictable names and the
ownership checks, which is what these tests hold. One test runs the host's half of the sync as
nobody itself (``setpriv``). Every directory is made ``0o777`` without the sticky bit, so the
kernel's ``fs.protected_symlinks`` (which guards only sticky world-writable directories such as
``/tmp``) plays no part: the launcher's own checks must hold on any machine.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher import node
from launcher.errors import ConfigError, LaunchError
from launcher.node import treesync as ts
from launcher.runtime.output import Console
from launcher.transport.wiresync import TreeSync

OTHER = 65534  # nobody: the other user on the machine
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files another user owns")


class Sink(io.BytesIO):
    def fileno(self) -> int:  # not a tty
        raise OSError


def theirs(path: Path, mode: int = 0o777) -> Path:
    """``path`` as the other user made it (a directory, a file or a link)."""
    os.lchown(path, OTHER, OTHER)
    if not path.is_symlink():
        os.chmod(path, mode)
    return path


def victim_dir(root: Path) -> Path:
    """A directory of ours (mode 0700) with 3 files, which a planted link points at."""
    d = root / "victim"
    d.mkdir(mode=0o700)
    for name in ("a", "b", "c"):
        (d / name).write_text(f"precious {name}\n")
    return d


def rows_for(src: Path) -> list:
    return ts.manifest(ts.scan(str(src)))


def make_src(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    (src / "train.py").write_text("print('train')\n")
    (src / "pkg").mkdir()
    (src / "pkg" / "model.py").write_text("MODEL = 1\n")
    return src


def receive(src: Path, dst: str, delete: bool = False) -> dict:
    """The host's half of a sync of ``src`` to ``dst``, all in this process."""
    r = ts.Receiver(dst, rows_for(src), delete=delete)
    for rel in r.need():
        r.write(rel, (src / rel).read_bytes(), True)
    return r.finish()


# --- item 8: --sync-dst-dir, the host's half -----------------------------------------------------------------


@root_only
def test_a_destination_that_is_a_link_another_user_planted_is_refused(tmp_path: Path) -> None:
    victim = victim_dir(tmp_path)
    src = make_src(tmp_path)
    shared = theirs(_mkdir(tmp_path / "shared"))
    os.symlink(victim, shared / "job")
    theirs(shared / "job")
    with pytest.raises(ValueError, match=r"is a symbolic link .*choose a directory of your own"):
        receive(src, str(shared / "job"), delete=True)
    assert sorted(p.name for p in victim.iterdir()) == ["a", "b", "c"]  # nothing deleted, nothing written


@root_only
def test_a_destination_another_user_owns_is_refused(tmp_path: Path) -> None:
    src = make_src(tmp_path)
    dst = tmp_path / "job"
    dst.mkdir()
    (dst / "keep").write_text("theirs\n")
    theirs(dst)
    with pytest.raises(ValueError, match=r"is owned by uid 65534, not by you \(uid 0\)"):
        receive(src, str(dst), delete=True)
    assert sorted(p.name for p in dst.iterdir()) == ["keep"]


@root_only
def test_a_destination_created_under_another_users_directory_is_ours(tmp_path: Path) -> None:
    """A missing destination is created (and is ours); one another user creates first is refused."""
    src = make_src(tmp_path)
    shared = theirs(_mkdir(tmp_path / "shared"))
    stats = receive(src, str(shared / "job"))
    assert stats["files"] == 2 and (shared / "job" / "pkg" / "model.py").read_text() == "MODEL = 1\n"
    assert (shared / "job").stat().st_uid == os.geteuid()


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


@root_only
def test_links_planted_at_the_temporary_names_are_not_followed(tmp_path: Path) -> None:
    """The attack of issue 30: links at ``.train.py.pslaunch-PID`` for the next pids, in a
    destination others can write to, overwrote a 0600 file and changed its mode."""
    src = make_src(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    os.chmod(secret, 0o600)
    dst = _mkdir(tmp_path / "job")
    os.chmod(dst, 0o777)  # ours, but others can write in it
    for pid in range(os.getpid() - 50, os.getpid() + 50):
        for name in ("train.py", "model.py"):
            link = (dst / "pkg" if name == "model.py" else dst)
            link.mkdir(exist_ok=True)
            os.chmod(link, 0o777)
            os.symlink(secret, link / f".{name}.pslaunch-{pid}")
            theirs(link / f".{name}.pslaunch-{pid}")
    receive(src, str(dst))
    assert secret.read_text() == "root's secret\n" and secret.stat().st_mode & 0o777 == 0o600
    assert (dst / "train.py").read_text() == "print('train')\n" and not (dst / "train.py").is_symlink()
    assert (dst / "pkg" / "model.py").read_text() == "MODEL = 1\n"


def test_deleting_never_follows_a_link_in_the_destination(tmp_path: Path) -> None:
    """``--sync-delete`` removes a link planted in the destination, not what it points at."""
    victim = victim_dir(tmp_path)
    src = make_src(tmp_path)
    dst = tmp_path / "job"
    receive(src, str(dst))
    os.symlink(victim, dst / "gone")
    os.symlink(victim, dst / "pkg" / "gone")
    stats = receive(src, str(dst), delete=True)
    assert stats["deleted"] == 2 and not os.path.lexists(dst / "gone")
    assert sorted(p.name for p in victim.iterdir()) == ["a", "b", "c"]


SETPRIV = shutil.which("setpriv")


@root_only
@pytest.mark.skipif(SETPRIV is None, reason="needs setpriv to run as another user")
def test_the_hosts_half_as_an_unprivileged_user_refuses_a_planted_link() -> None:
    """The same refusal with the host's half running as nobody, and root (the other user now)
    having planted the link at nobody's destination to a directory nobody owns."""
    base = Path(tempfile.mkdtemp(prefix="pslaunch-test-"))  # (pytest's tmp_path is closed to nobody)
    try:
        os.chmod(base, 0o755)
        victim = victim_dir(base)
        for p in (victim, *victim.iterdir()):
            os.chown(p, OTHER, OTHER)
        src = make_src(base)
        os.symlink(victim, base / "job")  # planted by root, beside where nobody's destination goes
        code = ("import json, sys; from launcher.node import treesync as ts\n"
                "r = ts.Receiver(sys.argv[1], json.loads(sys.argv[2]), delete=True)\n"
                "print(r.need()); print(r.finish())\n")
        lib = base / "lib"  # the host's half as a host gets it (this checkout may be closed to nobody)
        for name, data in node.bundle_files("ssh_wrapper").items():
            (lib / name).parent.mkdir(parents=True, exist_ok=True)
            (lib / name).write_bytes(data)
        as_nobody = [SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", sys.executable, "-S"]
        if subprocess.run([*as_nobody, "-c", "pass"], capture_output=True, timeout=60).returncode != 0:
            pytest.skip(f"nobody cannot run {sys.executable} here")
        p = subprocess.run([*as_nobody, "-c", code, str(base / "job"), json.dumps(rows_for(src))],
                           capture_output=True, text=True, timeout=60, cwd=lib, env={"PYTHONPATH": str(lib)})
        assert p.returncode != 0 and "is a symbolic link" in p.stderr, (p.stdout, p.stderr)
        assert sorted(x.name for x in victim.iterdir()) == ["a", "b", "c"]
    finally:
        shutil.rmtree(base)


# --- item 8: --sync-dst-dir, the launcher's half -------------------------------------------------------------


def _replace_with_link(src: Path, secret: Path) -> None:
    (src / "train.py").unlink()
    os.symlink(secret, src / "train.py")


def _replace_with_hard_link(src: Path, secret: Path) -> None:
    (src / "train.py").unlink()
    os.link(secret, src / "train.py")


def _replace_directory_with_link(src: Path, secret: Path) -> None:
    other = secret.parent / "otherpkg"
    other.mkdir()
    os.link(secret, other / "model.py")
    shutil.rmtree(src / "pkg")
    os.symlink(other, src / "pkg")


@pytest.mark.parametrize("replace", [_replace_with_link, _replace_with_hard_link, _replace_directory_with_link])
def test_a_file_replaced_during_the_sync_is_not_sent(tmp_path: Path, replace) -> None:
    """A file listed, then replaced (by a link, by another file, or a directory on its path by a
    link) before its content is read: the sync fails, and not one byte of what replaced it goes."""
    src = make_src(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("the shadow file\n")
    sync = TreeSync(str(src), "/dst", [])
    replace(src, secret)
    sent: list[bytes] = []

    def request(kind: bytes, payload: bytes, reply: bytes) -> dict:
        return {"dir": "/dst", "need": ["pkg/model.py", "train.py"]} if payload else {}

    with pytest.raises(LaunchError, match="changed while it was sent|replaced"):
        sync.sync("h", request, lambda kind, payload: sent.append(payload))
    assert not any(b"shadow" in p for p in sent)


# --- item 9: --log-dir and --summary-json ----------------------------------------------------------------------


@root_only
def test_links_planted_in_the_log_dir_are_not_followed(tmp_path: Path, caplog) -> None:
    """Issue 30: 3 job lines appended to a root-owned 0600 file, a new file created outside."""
    secret = tmp_path / "shadow"
    secret.write_text("root:x:0\n")
    os.chmod(secret, 0o600)
    logs = _mkdir(tmp_path / "logs")
    os.chmod(logs, 0o777)  # ours, others can write in it
    os.symlink(secret, logs / "worker-0.log")
    os.symlink(tmp_path / "outside.log", logs / "worker-1.log")
    for link in ("worker-0.log", "worker-1.log"):
        theirs(logs / link)
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(logs), color=False)
    for i in range(2):
        p = console.proc(f"worker-{i}", f"worker {i}", "worker")
        p.stdout.feed(b"line 1\nline 2\nline 3\n")
        p.close()
    assert secret.read_text() == "root:x:0\n" and secret.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "outside.log").exists()
    assert out.getvalue().count(b"line ") == 6  # the console has every line
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker-0.log is a symbolic link (not followed)" in warnings[0], warnings
    errors = console.log_errors()
    assert errors is not None and errors["lines_not_logged"] == 6 and "worker-0.log" in errors["first_error"]


@root_only
@pytest.mark.parametrize("how", ["link", "theirs"])
def test_a_log_dir_that_is_a_link_or_another_users_is_refused_before_anything_starts(tmp_path: Path, how: str) -> None:
    victim = victim_dir(tmp_path)
    logs = tmp_path / "logs"
    if how == "link":
        os.symlink(victim, logs)
        theirs(logs)
        message = f"--log-dir {logs} is a symbolic link"
    else:
        theirs(_mkdir(logs))
        message = f"--log-dir {logs} is owned by uid 65534, not by you (uid 0)"
    for dry in ([], ["--dry-run"]):
        p = subprocess.run([sys.executable, "-m", "launcher", "-n", "1", "-s", "0", "--log-dir", str(logs), *dry,
                            "touch", "started"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.startswith(f"pslaunch: error: {message}"), p.stderr
        assert p.stderr.count("\n") == 1 and not (tmp_path / "started").exists()
    assert sorted(x.name for x in victim.iterdir()) == ["a", "b", "c"]


@root_only
def test_a_log_file_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    """``--log-file`` (the launcher's own log) at a name another user planted as a link: one line,
    rc 2, nothing written through it, nothing started."""
    victim = tmp_path / "victim.log"
    victim.write_text("precious\n")
    os.chmod(victim, 0o600)
    shared = theirs(_mkdir(tmp_path / "shared"))
    link = shared / "launcher.log"
    os.symlink(victim, link)
    theirs(link)
    p = subprocess.run([sys.executable, "-m", "launcher", "-n", "1", "-s", "0", "--log-file", str(link),
                        "touch", "started"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr == f"pslaunch: error: cannot open --log-file: {link} is a symbolic link (not followed); " \
                       "name a file of your own\n"
    assert victim.read_text() == "precious\n" and not (tmp_path / "started").exists()


def test_the_log_dir_check_refuses_a_link_also_in_the_api(tmp_path: Path) -> None:
    from launcher.cli.job import check_outputs
    from launcher.spec.job import JobSpec

    os.symlink(_mkdir(tmp_path / "real"), tmp_path / "logs")
    spec = JobSpec(command=("true",), num_workers=1, num_servers=0, log_dir=str(tmp_path / "logs"))
    with pytest.raises(ConfigError, match="is a symbolic link"):
        check_outputs(spec, create=True)


def test_summary_json_does_not_write_through_a_planted_temporary_link(tmp_path: Path) -> None:
    """Issue 30: ``<path>.tmp<PID>`` planted during the job was written through."""
    from launcher.run import report

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "summary.json"
    for pid in range(os.getpid() - 50, os.getpid() + 50):
        os.symlink(victim, f"{path}.tmp{pid}")
    result = report.JobResult(exit_code=0, reason="success", first_failure=None, records=(), start_time=1.0,
                              end_time=2.0)
    from launcher.spec.job import JobSpec

    report.write_summary(str(path), JobSpec(command=("true",), num_workers=1, num_servers=0), None, result)
    assert victim.read_text() == "precious\n"
    assert json.loads(path.read_text())["exit_code"] == 0 and not path.is_symlink()


# --- item 10: a full --log-dir disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 256 KiB tmpfs (root, and a machine that lets us mount; else the test is skipped)."""
    mnt = _mkdir(tmp_path / "small")
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a small tmpfs")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_full_log_disk_is_said_at_once_and_the_console_keeps_every_line(small_disk: Path, tmp_path: Path,
                                                                         caplog) -> None:
    """Issue 30: 5,447 of 40,000 lines logged, rc 0, nothing said. Now: one warning line as soon as
    a line is lost, every line on the console, and the count in ``--summary-json``."""
    from launcher.run import report
    from launcher.spec.job import JobSpec

    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(small_disk), color=False)
    p = console.proc("worker-0", "worker 0", "worker")
    lines = 40_000
    seen_warning_at = None
    for i in range(lines):
        p.stdout.feed(b"%06d a log line of forty bytes or so\n" % i)
        if seen_warning_at is None and caplog.records:
            seen_warning_at = i
    p.close()
    logged = (small_disk / "worker-0.log").read_bytes().count(b"\n")
    assert 0 < logged < lines
    assert out.getvalue().count(b"\n") == lines  # the console kept every line
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker-0.log: No space left on device" in warnings[0], warnings
    assert seen_warning_at == logged  # at once: with the first line lost (the one after the last whole line logged)
    errors = console.log_errors()
    assert errors is not None and errors["lines_not_logged"] == lines - logged
    result = report.JobResult(exit_code=0, reason="success", first_failure=None, records=(), start_time=1.0,
                              end_time=2.0, log_errors=errors)
    spec = JobSpec(command=("true",), num_workers=1, num_servers=0)
    report.write_summary(str(tmp_path / "s.json"), spec, None, result)
    assert json.loads((tmp_path / "s.json").read_text())["log_errors"]["lines_not_logged"] == lines - logged


def test_a_job_on_a_full_log_disk_says_it_once_and_records_it(small_disk: Path, tmp_path: Path) -> None:
    """The whole job (the measurement of issue 30): rc 0 as the job's, every line on the console,
    one warning at once and one count at the end, and the count in --summary-json."""
    lines = 40_000
    code = f"for i in range({lines}): print('%06d a log line of forty bytes or so' % i)"
    p = subprocess.run([sys.executable, "-m", "launcher", "-n", "1", "-s", "0", "--no-progress", "--log-dir",
                        str(small_disk), "--summary-json", str(tmp_path / "s.json"), sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    logged = (small_disk / "worker-0.log").read_bytes().count(b"\n")
    warnings = [x for x in p.stderr.splitlines() if x.startswith("pslaunch: warning: ")]
    assert p.returncode == 0 and p.stdout.count("\n") == lines and 0 < logged < lines, p.stderr
    assert len(warnings) == 2, warnings
    assert f"--log-dir {small_disk}: worker-0.log: No space left on device; the console still shows" in warnings[0]
    errors = json.loads((tmp_path / "s.json").read_text())["log_errors"]
    assert errors["first_error"] == "worker-0.log: No space left on device"
    # (the tracker's own log is in the same directory: what it printed after the disk filled counts too)
    assert errors["lines_not_logged"] >= lines - logged
    assert f"{errors['lines_not_logged']:,} lines of output did not reach --log-dir" in warnings[1]
