"""The mpi backend's pure parts: golden mpirun argv for Open MPI and MPICH, placement,
the rank table, implementation detection, DMLC_INTERFACE translation, the wrapper's records."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner
from support.helpers import REPO, pid_alive, wait_for

from launcher import backends, cli, node  # noqa: F401 - cli: the entry point some tests call
from launcher.backends import mpi
from launcher.backends.mpi import command as mc
from launcher.backends.mpi import job as mj
from launcher.backends.mpi.command import MPIImpl, build_mpirun_argv, rank_layout, rank_table
from launcher.cli import run
from launcher.errors import BackendUnavailableError, ConfigError
from launcher.node import mpi_wire, protocol
from launcher.node.agent import Agent, machine
from launcher.node.protocol import EXIT, STARTED, STDERR, STDOUT
from launcher.spec.job import Host, JobSpec, Role
from launcher.spec.plan import ProcSpec, build_plan
from pscontract import netif
from pscontract.netif import Iface

A, B, C = Host("A"), Host("B"), Host("C")
WRAP = ["/venv/bin/python", "-c", "<the rank wrapper>"]
NAMES = ["DMLC_NUM_WORKER", "PSLAUNCH_SECRET", "PSLAUNCH_MPI_TABLE"]


def _procs(n: int, s: int, hosts=()) -> list[ProcSpec]:
    spec = JobSpec(command=("python", "train.py"), num_workers=n, num_servers=s, launcher="mpi", hosts=tuple(hosts))
    plan = build_plan(spec, root_uri="10.0.0.1", root_port=9091, secret="s" * 64, job_id="j",
                      here=None if hosts else "127.0.0.1", inherit_environ=False)
    return list(plan.procs)


# --- golden argv ---------------------------------------------------------------------------


def test_golden_openmpi_on_this_machine() -> None:
    layout = rank_layout(_procs(2, 1))
    argv = build_mpirun_argv(MPIImpl.OPENMPI, "/usr/bin/mpirun.openmpi", nprocs=3, layout=layout,
                             env_names=NAMES, command=["python", "train.py", "--lr", "0.1"],
                             wrapper=WRAP, is_root=True, cores=2)
    assert argv == [
        "/usr/bin/mpirun.openmpi", "--allow-run-as-root", "-n", "3", "--oversubscribe", "--bind-to", "none",
        "-x", "DMLC_NUM_WORKER", "-x", "PSLAUNCH_MPI_TABLE", "-x", "PSLAUNCH_SECRET",
        *WRAP, "--", "python", "train.py", "--lr", "0.1"]


def test_golden_openmpi_not_root_enough_cores_no_oversubscribe() -> None:
    argv = build_mpirun_argv(MPIImpl.OPENMPI, "mpirun", nprocs=3, layout=rank_layout(_procs(2, 1)),
                             env_names=["X"], command=["prog"], wrapper=WRAP, is_root=False, cores=8)
    assert argv == ["mpirun", "-n", "3", "--bind-to", "none", "-x", "X", *WRAP, "--", "prog"]


def test_golden_openmpi_hosts_and_interface() -> None:
    layout = rank_layout(_procs(3, 2, [A, B, C]))
    argv = build_mpirun_argv(MPIImpl.OPENMPI, "mpirun", nprocs=5, layout=layout, env_names=NAMES,
                             command=["python", "train.py"], wrapper=WRAP, hostfile="/tmp/j/hostfile",
                             interface="10.200.0.0/16", is_root=True, cores=1, extra_args=["--mca", "x", "y"])
    assert argv == [
        "mpirun", "--allow-run-as-root", "-n", "5", "--hostfile", "/tmp/j/hostfile", "--map-by", "seq",
        "--bind-to", "none",
        "--mca", "btl_tcp_if_include", "10.200.0.0/16", "--mca", "oob_tcp_if_include", "10.200.0.0/16",
        "-x", "DMLC_NUM_WORKER", "-x", "PSLAUNCH_MPI_TABLE", "-x", "PSLAUNCH_SECRET",
        "--mca", "x", "y", *WRAP, "--", "python", "train.py"]
    assert mc.openmpi_hostfile(layout) == "A\nA\nB\nB\nC\n"


def test_golden_mpich_on_this_machine() -> None:
    argv = build_mpirun_argv(MPIImpl.MPICH, "/usr/bin/mpirun.mpich", nprocs=3, layout=rank_layout(_procs(2, 1)),
                             env_names=NAMES, command=["python", "train.py"], wrapper=WRAP,
                             is_root=True, cores=1)
    assert argv == [
        "/usr/bin/mpirun.mpich", "-n", "3", "-genvlist", "DMLC_NUM_WORKER,PSLAUNCH_MPI_TABLE,PSLAUNCH_SECRET",
        *WRAP, "--", "python", "train.py"]


def test_golden_mpich_hosts_and_interface() -> None:
    layout = rank_layout(_procs(3, 2, [A, B, C]))
    argv = build_mpirun_argv(MPIImpl.MPICH, "mpiexec", nprocs=5, layout=layout, env_names=NAMES,
                             command=["python", "train.py"], wrapper=WRAP, interface="eth1")
    assert argv == [
        "mpiexec", "-n", "5", "-hosts", "A:2,B:2,C:1", "-iface", "eth1",
        "-genvlist", "DMLC_NUM_WORKER,PSLAUNCH_MPI_TABLE,PSLAUNCH_SECRET",
        *WRAP, "--", "python", "train.py"]


def test_openmpi_with_hosts_needs_a_hostfile() -> None:
    with pytest.raises(ValueError):
        build_mpirun_argv(MPIImpl.OPENMPI, "mpirun", nprocs=2, layout=rank_layout(_procs(1, 1, [A, B])),
                          env_names=[], command=["x"], wrapper=WRAP)


# --- placement ---------------------------------------------------------------------------------


def test_layout_keeps_the_plans_placement() -> None:
    # plan: server0->A, server1->B, worker0->C, worker1->A, worker2->B (dmlc round-robin)
    procs = _procs(3, 2, [A, B, C])
    layout = rank_layout(procs)
    assert layout.hosts == (("A", 2), ("B", 2), ("C", 1))
    placed = [(str(procs[i].role), procs[i].rank, host) for i, host in zip(layout.order, layout.rank_hosts)]
    assert placed == [("server", 0, "A"), ("worker", 1, "A"), ("server", 1, "B"), ("worker", 2, "B"),
                      ("worker", 0, "C")]
    # every process placed exactly once, on the host the plan gave it
    assert sorted(layout.order) == list(range(5))
    assert all(procs[i].host.name == h for i, h in zip(layout.order, layout.rank_hosts))


def test_layout_on_this_machine_is_plan_order() -> None:
    layout = rank_layout(_procs(2, 2))
    assert layout.order == (0, 1, 2, 3) and layout.hosts == ()


def test_layout_respects_slots() -> None:
    procs = _procs(3, 1, [Host("a", slots=1), Host("b", slots=3)])
    assert rank_layout(procs).hosts == (("a", 1), ("b", 3))


def test_openmpi_hostfile_names_this_machine_by_its_hostname() -> None:
    layout = rank_layout(_procs(1, 2, [Host("localhost"), Host("10.0.0.7")]))
    text = mc.openmpi_hostfile(layout, frozenset({"localhost"}), "box")
    assert text == "box\nbox\n10.0.0.7\n"


# --- the rank table --------------------------------------------------------------------------------


def test_rank_table_splits_common_role_and_rank_variables() -> None:
    spec = JobSpec(command=("p",), num_workers=2, num_servers=1, launcher="mpi", hosts=(A, B),
                   env=(("FOO", "bar"),), env_server=(("OMP_NUM_THREADS", "3"),), env_worker=(("WHO", "w"),))
    plan = build_plan(spec, root_uri="10.0.0.1", root_port=9091, secret="s" * 64, job_id="j",
                      here=None, inherit_environ=False)
    procs = list(plan.procs)
    layout = rank_layout(procs)
    common, table = rank_table(procs, layout, 2.5)
    assert common["FOO"] == "bar" and common["PSLAUNCH_SECRET"] == "s" * 64
    assert common["DMLC_JOB_CLUSTER"] == "mpi" and "DMLC_NODE_HOST" not in common
    assert "DMLC_ROLE" not in common and "DMLC_TASK_ID" not in common
    assert table["grace"] == 2.5
    assert table["roles"]["server"]["OMP_NUM_THREADS"] == "3" and "WHO" not in table["roles"]["server"]
    assert table["roles"]["worker"]["WHO"] == "w"
    # every rank's environment rebuilt from the table equals the plan's, key by key
    for r, i in enumerate(layout.order):
        role, role_rank, env = mpi_wire.rank_entry(table, r, len(procs))
        assert (role, role_rank) == (str(procs[i].role), procs[i].rank)
        assert {**common, **env} == dict(procs[i].env)


def test_table_round_trip_and_size_check() -> None:
    procs = _procs(3, 2, [A, B])
    common, table = rank_table(procs, rank_layout(procs), 1.0)
    text = mpi_wire.encode_table(table)
    assert text.startswith("z1:") and "PSLAUNCH_SECRET" not in text
    assert mpi_wire.decode_table(text) == table
    with pytest.raises(mpi_wire.TableError, match="mpirun started 4 ranks but the job has 5"):
        mpi_wire.rank_entry(table, 0, 4)
    with pytest.raises(mpi_wire.TableError, match="missing"):
        mpi_wire.decode_table("")
    with pytest.raises(mpi_wire.TableError, match="corrupt"):
        mpi_wire.decode_table("z1:!!!")


@pytest.mark.parametrize("environ, rank", [
    ({"OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3"}, 3),
    ({"PMIX_RANK": "2"}, 2),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, 1),
    ({}, None),
    ({"PMI_RANK": "x"}, None),
])
def test_rank_from_environ(environ: dict, rank) -> None:
    assert mpi_wire.rank_from_environ(environ) == rank


def test_child_environ_drops_the_table_and_overlays_the_job() -> None:
    env = mpi_wire.child_environ({"PATH": "/bin", mpi_wire.TABLE: "z1:x", "DMLC_ROLE": "stale"},
                                {"DMLC_ROLE": "server"})
    assert env == {"PATH": "/bin", "DMLC_ROLE": "server"}


def test_node_address_prefers_given_then_interface_then_route() -> None:
    assert netif.node_address("nope", None, "10.1.1.1") == "10.1.1.1"
    assert netif.node_address("lo", None) == "127.0.0.1"
    assert netif.node_address(None, "127.0.0.1").startswith("127.")
    with pytest.raises(netif.NetifError, match="matches no interface"):
        netif.node_address("nosuchif9", None)


# --- in-band frames (the agent without a channel, under mpirun) ------------------------------------------


def rec(rank: int, kind: bytes, payload: bytes) -> bytes:
    """A rank's frame as its agent writes it to mpirun's output (in-band)."""
    return protocol.envelope(kind, rank, payload)


def test_in_band_frames_round_trip_and_long_output_is_split(tmp_path) -> None:
    r, w = os.pipe()
    saved = os.dup(1)
    os.dup2(w, 1)  # the agent without a channel writes its frames to its own stdout (mpirun's)
    long = b"x" * (protocol.LINE_PAYLOAD * 2 + 10)
    try:
        relay = Agent(1.0, None, fallback="in-band")
        relay.send(STDOUT, 7, b"one\ntw")
        relay.send(STDOUT, 7, b"o\n" + long + b"\npartial")
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    lines = data.split(b"\n")[:-1]
    assert all(len(line) + 1 < 4096 for line in lines)  # one write each, under PIPE_BUF
    parsed = [protocol.unwrap(line) for line in lines]
    assert [(p[0], p[1]) for p in parsed] == [(STDOUT, 7)] * 4  # the second in three pieces
    assert [len(p[2]) for p in parsed[1:]] == [protocol.LINE_PAYLOAD, protocol.LINE_PAYLOAD,
                                               len(long) + 10 - 2 * protocol.LINE_PAYLOAD]
    assert b"".join(p[2] for p in parsed) == b"one\ntwo\n" + long + b"\npartial"
    assert protocol.unwrap(b"[mpirun] something") is None


def test_wrapper_error_after_the_start_takes_the_command_along(tmp_path) -> None:
    """An unexpected error in the rank wrapper once the command runs must not leave the command
    (its own session, unknown to mpirun) behind when the wrapper exits."""
    procs = [ProcSpec(Role.WORKER, 0, 0, None, ("x",), {"DMLC_ROLE": "worker", "DMLC_NODE_HOST": "127.0.0.1"})]
    common, table = mc.rank_table(procs, mc.rank_layout(procs), grace=1.0)
    driver = ("import sys, launcher.node.agent as a, launcher.node.mpirank as m\n"
              "def boom(self): raise RuntimeError('boom')\n"
              "a.Agent._step = boom\n"
              "sys.exit(m.main(sys.argv[1:]))\n")
    env = {**os.environ, **common, "PYTHONPATH": str(REPO), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "PSLAUNCH_MPI_TABLE": mpi_wire.encode_table(table)}
    r = subprocess.run([sys.executable, "-c", driver, "--", "sleep", "30"], capture_output=True, timeout=30,
                       env=env, cwd=tmp_path)
    assert r.returncode != 0 and b"boom" in r.stderr
    starts = [protocol.unwrap(line) for line in r.stdout.splitlines()]
    pid = next(json.loads(p[2])["pid"] for p in starts if p and p[0] == STARTED)
    try:
        wait_for(lambda: not pid_alive(pid), 5, what="the command to be stopped")
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


# --- detection -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, impl", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n", MPIImpl.OPENMPI),
    ("mpirun.openmpi (OpenRTE) 4.1.4\n", MPIImpl.OPENMPI),
    ("mpirun (Open MPI) 5.0.3\n", MPIImpl.OPENMPI),
    ("HYDRA build details:\n    Version:                                 4.0.2\n", MPIImpl.MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n", MPIImpl.MPICH),
])
def test_detect_implementation(text: str, impl: MPIImpl) -> None:
    assert mc.detect_implementation(text) is impl


def test_unknown_implementation_is_one_line_naming_the_output() -> None:
    with pytest.raises(BackendUnavailableError) as e:
        mc.detect_implementation("\nSpectrum Foo MPI 1.0\nmore\n", "/opt/x/mpirun")
    msg = str(e.value)
    assert "\n" not in msg and "'Spectrum Foo MPI 1.0'" in msg and "/opt/x/mpirun" in msg


def _fake_mpirun(tmp_path, text: str) -> str:
    path = tmp_path / "mpirun"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_cli_unknown_mpirun_is_a_one_line_error(tmp_path) -> None:
    fake = _fake_mpirun(tmp_path, "Totally Different MPI 9.9")
    result = CliRunner().invoke(run.with_backend_options(),
                                ["--launcher", "mpi", "--mpirun", fake, "-n", "1", "-s", "0", "true"],
                                standalone_mode=False, catch_exceptions=True)
    assert isinstance(result.exception, BackendUnavailableError)
    assert "'Totally Different MPI 9.9'" in str(result.exception) and result.exception.exit_code == 2


def test_cli_missing_mpirun(tmp_path) -> None:
    code = cli.main(["--launcher", "mpi", "--mpirun", str(tmp_path / "nope"), "-n", "1", "-s", "0", "true"])
    assert code == 2


def test_mpirun_that_exists_but_cannot_run_is_not_called_missing(tmp_path) -> None:
    plain = tmp_path / "mpirun"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    with pytest.raises(BackendUnavailableError, match=r"--mpirun .*/mpirun is not executable"):
        mc.probe_mpirun(str(plain))
    with pytest.raises(BackendUnavailableError, match=r"--mpirun .* is a directory"):
        mc.probe_mpirun(str(tmp_path))
    with pytest.raises(BackendUnavailableError, match=r"nope: no such file"):
        mc.probe_mpirun(str(tmp_path / "nope"))


def test_mpirun_version_lines_stay_whole_when_stdout_lacks_its_last_newline(tmp_path) -> None:
    """stdout and stderr are two streams: stdout's last line is not glued to stderr's first."""
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\nprintf 'HYDRA build details:\\n    Version:   4.0.2'\n"
                    "echo 'Configure options: --prefix=/usr' >&2\n")
    fake.chmod(0o755)
    info = mc.probe_mpirun(str(fake))
    assert (info.impl, info.version) == (MPIImpl.MPICH, "Version: 4.0.2")


def test_hostfile_user_or_port_is_refused_by_line() -> None:
    with pytest.raises(ConfigError, match=r"hosts:3: root@A:2222: .*~/.ssh/config"):
        mc.check_hosts([Host("A", port=2222, user="root", origin="hosts:3")])


# --- DMLC_INTERFACE ----------------------------------------------------------------------------------------

IFACES = [Iface("lo", "127.0.0.1", 8), Iface("eth0", "10.1.2.3", 24), Iface("ib0", "10.200.0.1", 16)]


@pytest.mark.parametrize("value, openmpi, mpich", [
    ("", None, None),
    ("eth0", "eth0", "eth0"),           # exact name: as is
    ("eth", "10.1.2.0/24", "eth0"),      # ps-lite prefix: Open MPI gets the network, MPICH the full name
    ("10.200.0.0/16", "10.200.0.0/16", "ib0"),  # CIDR: Open MPI takes it, MPICH needs the name here
    ("10.200.9.9/16", "10.200.9.9/16", "ib0"),
])
def test_interface_translation(value: str, openmpi, mpich) -> None:
    assert mc.mpi_interface(MPIImpl.OPENMPI, value, IFACES) == openmpi
    assert mc.mpi_interface(MPIImpl.MPICH, value, IFACES) == mpich


def test_interface_that_matches_nothing_here() -> None:
    with pytest.raises(ConfigError, match="matches no interface"):
        mc.mpi_interface(MPIImpl.MPICH, "wlan", IFACES)
    with pytest.raises(ConfigError, match="no IPv4 address in 192.168.0.0/16"):
        mc.mpi_interface(MPIImpl.MPICH, "192.168.0.0/16", IFACES)
    with pytest.raises(ConfigError, match="not a valid IPv4 CIDR"):
        mc.mpi_interface(MPIImpl.OPENMPI, "10.0.0.0/99", IFACES)
    # Open MPI takes any CIDR (hosts may differ from this one)
    assert mc.mpi_interface(MPIImpl.OPENMPI, "192.168.0.0/16", IFACES) == "192.168.0.0/16"


# --- dry run ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, family", [("mpirun (Open MPI) 4.1.4", "Open MPI"),
                                          ("HYDRA build details:\n    Version: 4.0.2", "MPICH")])
def test_dry_run_shows_the_mpirun_command_without_secret_values(tmp_path, text, family) -> None:
    fake = _fake_mpirun(tmp_path, text)
    hosts = tmp_path / "hosts"
    hosts.write_text("A\nB\nC\n")
    runner = CliRunner()
    result = runner.invoke(run.with_backend_options(), [
        "--launcher", "mpi", "--mpirun", fake, "-H", str(hosts), "-n", "3", "-s", "2", "--dry-run",
        "--env", "MY_TOKEN=hunter2", "--env-worker", "DB_PASSWORD=pw", "python", "train.py"],
        standalone_mode=False, env={"DMLC_INTERFACE": "lo"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"mpi: {family}" in out and "hunter2" not in out and "pw " not in out
    cmd = next(line for line in out.splitlines() if line.startswith(f"  {fake}"))
    if family == "Open MPI":
        assert "--hostfile '<tmpdir>/hostfile' --map-by seq" in cmd
        assert "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo" in cmd
        assert "-x MY_TOKEN" in cmd and "-x PSLAUNCH_SECRET" in cmd
        assert "  A\n  A\n  B\n  B\n  C\n" in out
    else:
        assert "-hosts A:2,B:2,C:1 -iface lo -genvlist " in cmd and "MY_TOKEN" in cmd
    assert "DB_PASSWORD" not in cmd  # a worker-only variable travels in the table
    import shlex
    assert cmd.endswith(shlex.join([*node.command("mpirank"), "--", "python", "train.py"]))
    assert "rank 0: server 0 @ A (task id 3)" in out and "rank 4: worker 0 @ C (task id 0)" in out
    assert "rank wrappers: each connects back to 127.0.0.1, on a free port of 9091-9998" in out


def test_dry_run_without_mpi_shows_both_forms(tmp_path) -> None:
    result = CliRunner().invoke(run.with_backend_options(), ["--launcher", "mpi", "--mpirun", str(tmp_path / "none"),
                                                  "-n", "2", "-s", "1", "--dry-run", "prog"],
                                standalone_mode=False)
    assert result.exit_code == 0, result.output
    assert "showing the command for both Open MPI and MPICH" in result.output
    assert "mpirun command (Open MPI)" in result.output and "mpirun command (MPICH)" in result.output


def test_registered() -> None:
    assert backends.get("mpi") is mpi.MPIBackend
    assert Role.SERVER  # the module imports without MPI installed


def test_mpich_listens_on_the_scheduler_address_by_default() -> None:
    assert mc.mpich_default_interface("10.200.0.1", IFACES) == "ib0"
    assert mc.mpich_default_interface("127.0.0.1", IFACES) is None
    assert mc.mpich_default_interface("192.168.9.9", IFACES) is None


# --- the demultiplexer and per-rank exit codes (no MPI needed) -------------------------------------------


class _FakePopen:
    pid = 999999

    def __init__(self) -> None:
        self.code = None

    def poll(self):
        return self.code


def _job(n: int = 2, s: int = 1):
    import io

    from launcher.runtime.output import Console

    out, err = io.BytesIO(), io.BytesIO()
    console = Console(stdout=out, stderr=err, color=False)
    procs = _procs(n, s)
    job = mj.MPIJob([], console.proc("mpirun", "mpirun", "mpirun"), None)
    ranks = [mj.MPIRank(p, console.proc(p.name, p.label, str(p.role)), job, r) for r, p in enumerate(procs)]
    job.attach(ranks)
    job.popen = _FakePopen()
    return job, ranks, out, err


def test_a_rank_runs_here_when_its_agent_reports_this_boot_and_pid_namespace() -> None:
    job = _job()[0]
    here = machine()  # (what each rank's agent sends in its start frame)
    assert job.is_this_machine(here)
    assert not job.is_this_machine({**here, "pidns": here["pidns"] + 1})  # (a container here)
    assert not job.is_this_machine({**here, "boot": "another kernel"})
    assert not job.is_this_machine({"host": here["host"]})  # (an agent that could not read /proc)


def test_demux_routes_records_to_ranks_and_the_rest_to_mpirun() -> None:
    job, ranks, out, err = _job()
    job.feed(False, rec(1, STARTED, b'{"pid": 4242, "host": "h"}') + rec(1, STDOUT, "héllo\n".encode())
             + b"mpirun says hi\n")
    split = rec(0, STDOUT, b"x\n")  # a frame cut in two by the pipe
    job.feed(False, rec(2, STDOUT, b"par") + rec(2, STDOUT, b"tial\n") + split[:3])
    job.feed(False, split[3:])
    job.feed(True, rec(2, STDERR, b"oops\n") + b"[mpiexec@vm] something")
    job.close(False)
    job.close(True)
    text = out.getvalue().decode()
    assert "[worker 0] héllo\n" in text and "[worker 1] partial\n" in text and "[server 0] x\n" in text
    assert "[mpirun] mpirun says hi\n" in text
    said = err.getvalue().decode()
    assert "[worker 1] oops\n" in said and "[mpirun] [mpiexec@vm] something\n" in said
    assert ranks[1].pid == 4242 and "\x1e" not in text


def test_exit_codes_fail_fast_and_wait_for_mpirun_on_zero() -> None:
    job, ranks, _, _ = _job()
    job.feed(False, rec(0, EXIT, b"0") + rec(2, EXIT, b"3"))
    assert ranks[2].poll() == 3  # a failure counts at once
    assert ranks[0].poll() is None  # a zero waits for mpirun
    assert ranks[1].poll() is None
    job.popen.code = 1
    assert ranks[1].poll() is None  # mpirun exited, but its last records may still be in the pipe
    job.feed(False, rec(0, STDOUT, b"late line\n"))
    job.close(False)
    assert ranks[0].poll() == 0
    assert ranks[1].poll() == 1 and "before this rank started" in ranks[1].note


def test_all_zero_but_mpirun_fails_is_blamed_on_rank_0() -> None:
    job, ranks, _, _ = _job()
    job.feed(False, b"".join(rec(r, EXIT, b"0") for r in range(3)))
    job.popen.code = 7
    job.close(False)
    assert [r.poll() for r in ranks] == [7, 0, 0]
    assert "every rank exited 0 but mpirun exited with code 7" in ranks[0].describe()


def test_started_rank_that_never_reports_was_killed() -> None:
    job, ranks, _, _ = _job()
    job.feed(False, rec(1, STARTED, b'{"pid": 5}'))
    job.popen.code = 143
    job.close(False)
    assert ranks[1].poll() == 137 and "without reporting" in ranks[1].note


def test_first_failure_time_is_when_the_record_arrived() -> None:
    job, ranks, _, _ = _job()
    job.clock = types.SimpleNamespace(time=iter([10.0, 20.0]).__next__)  # the two records' arrival
    job.feed(False, rec(2, EXIT, b"3"))
    job.feed(False, rec(1, EXIT, b"143"))
    ranks[1].poll()  # looked at first, but it ended later
    ranks[2].poll()
    assert (ranks[2].end_time, ranks[1].end_time) == (10.0, 20.0)


def test_lingering_mpirun_does_not_hold_a_finished_job(monkeypatch) -> None:
    job, ranks, _, _ = _job()
    job.feed(False, b"".join(rec(r, EXIT, b"0") for r in range(3)))
    assert ranks[0].poll() is None
    monkeypatch.setattr(mj, "MPIRUN_EXIT_WAIT", 0.0)
    assert [r.poll() for r in ranks] == [0, 0, 0]


def test_exit_record_read_after_mpirun_exited_still_counts(monkeypatch) -> None:
    job, ranks, _, _ = _job()
    job.popen.code = 0  # mpirun seen gone ...
    assert [r.poll() for r in ranks] == [None, None, None]
    job.feed(False, b"".join(rec(r, EXIT, b"0") for r in range(3)))  # ... its frames read after
    job.close(False)
    assert [r.poll() for r in ranks] == [0, 0, 0]


def test_a_pipe_held_open_delays_the_verdict_only_briefly(monkeypatch) -> None:
    job, ranks, _, _ = _job()
    job.popen.code = 1
    monkeypatch.setattr(mj, "OUTPUT_DRAIN_WAIT", 0.0)
    assert ranks[0].poll() == 1 and "before this rank started" in ranks[0].note


def test_lost_exit_record_with_mpirun_0_means_0() -> None:
    job, ranks, _, _ = _job()
    job.feed(False, b"".join(rec(r, STARTED, b'{"pid": 7}') for r in range(3)))
    job.feed(True, rec(0, EXIT, b"0") + rec(1, EXIT, b"0"))  # rank 2's never came
    job.feed(False, rec(0, EXIT, b"0"))  # the copy on the other stream is ignored
    job.popen.code = 0
    job.close(False)
    assert [r.poll() for r in ranks] == [0, 0, 0]


def test_openmpi_session_dirs_follow_tmpdir(tmp_path) -> None:
    assert mc.openmpi_session_dirs(42, {"TMPDIR": "/scratch"}, 1000) == (
        "/scratch/ompi.*.1000/pid.42", "/scratch/prte.*.1000/dvm.42")
    assert mc.openmpi_session_dirs(7, {}, 0) == ("/tmp/ompi.*.0/pid.7", "/tmp/prte.*.0/dvm.7")
    # a TMPDIR with glob characters matches only itself
    odd = tmp_path / "a[1]"
    (odd / "ompi.h.0" / "pid.7").mkdir(parents=True)
    (tmp_path / "a1" / "ompi.h.0" / "pid.7").mkdir(parents=True)
    from launcher.node.watchdog import remove_matching

    assert remove_matching(mc.openmpi_session_dirs(7, {"TMPDIR": str(odd)}, 0)) == [str(odd / "ompi.h.0" / "pid.7")]
    assert not (odd / "ompi.h.0").exists() and (tmp_path / "a1" / "ompi.h.0" / "pid.7").exists()
