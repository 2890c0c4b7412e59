"""Placement over the node agents' channel (``launcher.node.protocol``, *Placement*): where a batch
system decides where the tasks of a torch job run, each agent says which host it is on and waits;
once every task has said so, the launcher sends each its ``RANK``, ``LOCAL_RANK``, ... numbered
host by host. Real sockets, a real hub, real agents, and real task wrappers as processes (a
"batch system" of local processes: the wrapper takes its index from ``SGE_TASK_ID``)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest
from support.helpers import wait_for

import pscontract as pc
from launcher import node
from launcher.backends.batch import BatchBackend, BatchTask
from launcher.errors import LaunchError
from launcher.node import protocol
from launcher.node.agent import Agent, AgentError, Channel, connect
from launcher.node.protocol import HERE
from launcher.runtime.hub import Hub
from launcher.runtime.output import Console, PipePump
from launcher.spec.job import JobSpec
from launcher.spec.plan import ProcSpec, build_plan, placement_env

SECRET = "7a" * 32


# --- the wire ---------------------------------------------------------------------------------------


def test_env_frame_round_trip_and_limits() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "NAME": "é ü"}
    data = protocol.env_frame(4, env)
    ((kind, ident, payload),) = protocol.Decoder().feed(data)
    assert (kind, ident) == (protocol.PLACE, 4) and payload.isascii()
    assert protocol.parse_env(payload) == env
    for bad in (b"", b"{", b"[1]", b'{"A": 1}', b"TERM", "{\"A\": \"é\"}".encode()):
        assert protocol.parse_env(bad) is None, bad
    with pytest.raises(ValueError, match="at most"):
        protocol.env_frame(0, {"BIG": "x" * protocol.ENV_MAX})


# --- the launcher's side: a batch backend whose tasks the test plays ----------------------------------


class Tasks(BatchBackend):
    """A batch backend over nothing: each task is a record here; ``run_wrappers`` makes them real
    task wrapper processes (what Grid Engine would start), else the test plays their agents."""

    name = "tasks"
    index_source = "sge"
    close_wait = 5.0

    def __init__(self, spec: JobSpec, console: Console, task_file: Path, run_wrappers: bool) -> None:
        super().__init__(spec, console, None)
        self.task_file = str(task_file)
        self.run_wrappers = run_wrappers
        self.procs: list[subprocess.Popen] = []

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        from launcher.backends.batch import build_task_file, write_private_json

        write_private_json(self.task_file, build_task_file(self.spec, procs, hub=hub))
        tasks = []
        for p in procs:
            t = BatchTask(p, self.console.proc(p.name, p.label, str(p.role)), self, "(pending)")
            self.add_task(t)
            tasks.append(t)
            if self.run_wrappers:
                argv = [*node.command("task"), "--task-file", self.task_file, "--role", "worker", "--index", "sge"]
                env = {**os.environ, "SGE_TASK_ID": str(p.task_id + 1)}
                self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        return tasks

    def poll_once(self) -> None:
        for t, p in zip(self.tasks, self.procs):
            code = p.poll()
            if code is not None and t.code is None and t.channel != "open":
                self.set_code(t, code, "")

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        for t in tasks:
            if t.code is None:
                self.set_code(t, 143, "cancelled")
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def release(self) -> None:
        for p in self.procs:
            p.wait(10)


def torch_procs(n: int, command: Sequence[str] = ("true",), start_timeout: float = 20.0) -> tuple[JobSpec, list]:
    spec = JobSpec(command=tuple(command), num_workers=n, num_servers=0, launcher="sge", tracker="torch",
                   start_timeout=start_timeout, kill_grace=1.0, environ=tuple(os.environ.items()))
    plan = build_plan(spec, root_uri="127.0.0.1", root_port=29999, secret=SECRET, job_id="job1", here=None,
                      inherit_environ=False)
    return spec, list(plan.procs)


def test_a_batch_plan_of_a_torch_job_awaits_placement() -> None:
    _, procs = torch_procs(3)
    assert all(p.awaits_placement for p in procs)
    for p in procs:
        assert pc.TORCH_RANK not in p.env and pc.LOCAL_RANK not in p.env and pc.LOCAL_PROCS not in p.env
        assert p.env[pc.WORLD_SIZE] == "3" and p.env[pc.MASTER_ADDR] == "127.0.0.1"


def test_placement_env_numbers_host_by_host() -> None:
    _, procs = torch_procs(4)
    envs = placement_env(procs, {0: "n2", 1: "n1", 2: "n2", 3: "n1"})
    got = {t: (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"],
               e["ROLE_RANK"], e["PSLAUNCH_LOCAL_PROCS"]) for t, e in envs.items()}
    assert got == {0: ("0", "0", "2", "0", "2", "0", "2"), 2: ("1", "1", "2", "0", "2", "1", "2"),
                   1: ("2", "0", "2", "1", "2", "2", "2"), 3: ("3", "1", "2", "1", "2", "3", "2")}
    with pytest.raises(ValueError, match="no host reported for worker 3"):
        placement_env(procs, {0: "a", 1: "a", 2: "a"})


class Played:
    """A Tasks backend started in a thread (``start`` waits until every task has started)."""

    def __init__(self, tmp_path: Path, n: int, run_wrappers: bool = False, command: Sequence[str] = ("true",),
                 start_timeout: float = 20.0) -> None:
        self.out, self.err = io.BytesIO(), io.BytesIO()
        self.console = Console(self.out, self.err, color=False)
        self.spec, self.procs = torch_procs(n, command, start_timeout)
        self.backend = Tasks(self.spec, self.console, tmp_path / "task.json", run_wrappers)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._start, daemon=True)
        self.thread.start()
        wait_for(lambda: self.backend.hub is not None and len(self.backend.tasks) == n, 10, what="the hub")

    def _start(self) -> None:
        try:
            self.backend.start(self.procs)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def agent(self, ident: int) -> Channel:
        assert self.backend.hub is not None
        return connect(self.backend.hub.address, ident, SECRET)

    def close(self) -> None:
        self.backend.close()
        self.thread.join(10)


def read_env(channel: Channel, timeout: float) -> Optional[dict]:
    """The placement a played agent received within ``timeout``, or None."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            frames = channel.wait(0.05)
        except EOFError:
            break
        for kind, _, payload in frames:
            if kind == protocol.PLACE:
                return protocol.parse_env(payload)
    return None


def here(channel: Channel, ident: int, host: str) -> None:
    channel.send(HERE, ident, json.dumps({"host": host}).encode())


def test_the_launcher_answers_once_every_task_said_where_it_runs(tmp_path: Path) -> None:
    job = Played(tmp_path, 4)
    try:
        agents = [job.agent(i) for i in range(4)]
        for i, host in zip(range(3), ("n2", "n1", "n2")):
            here(agents[i], i, host)
        assert read_env(agents[0], 0.5) is None  # nobody is answered before the last one spoke
        here(agents[3], 3, "n1")
        envs = {i: read_env(a, 10) for i, a in enumerate(agents)}
        assert {i: (e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for i, e in envs.items() if e} == \
            {0: ("0", "0", "0"), 1: ("2", "0", "1"), 2: ("1", "1", "0"), 3: ("3", "1", "1")}
        assert {e["LOCAL_WORLD_SIZE"] for e in envs.values() if e} == {"2"}
        job.thread.join(10)
        assert job.error is None and not job.thread.is_alive()  # every task counts as started
        assert [t.host for t in job.backend.tasks] == ["n2", "n1", "n2", "n1"]
        for a in agents:
            a.close()
    finally:
        job.close()


def test_tasks_still_unplaced_after_start_timeout_fail_the_launch(tmp_path: Path) -> None:
    job = Played(tmp_path, 2, start_timeout=1.0)
    try:
        a = job.agent(0)
        here(a, 0, "n1")
        job.thread.join(15)
        assert isinstance(job.error, LaunchError) and "1 of 2 tasks not running" in str(job.error), job.error
        assert read_env(a, 0.3) is None
        a.close()
    finally:
        job.close()


def test_a_task_whose_agent_is_killed_fails_at_once(tmp_path: Path) -> None:
    """Issue 30, 11: a task's agent killed with SIGKILL (its connection ends without an exit frame)
    fails the task, killed (137), when no exit code came AGENT_GONE_WAIT later (from the batch system,
    or in-band), not when the batch system gets round to it (61 s on Slurm)."""
    job = Played(tmp_path, 2)
    try:
        agents = [job.agent(i) for i in range(2)]
        for i, a in enumerate(agents):
            here(a, i, "n1")
        assert all(read_env(a, 10) for a in agents)
        job.thread.join(10)
        assert job.error is None
        agents[0].send(protocol.STARTED, 0, json.dumps({"pid": 4242, "host": "n1"}).encode())
        assert agents[0].sock is not None
        agents[0].sock.close()  # (what the kernel does for a killed agent: no exit frame)
        killed, other = job.backend.tasks
        wait_for(lambda: killed.channel == "closed", 10, what="task 0's connection to end")
        closed = time.time()
        wait_for(lambda: killed.code is not None, 30, what="task 0's end")
        assert killed.ended_at is not None and killed.ended_at <= closed  # (when its connection ended)
        assert killed.code == 137 and "its task wrapper was killed" in killed.describe(), killed.describe()
        assert other.code is None
        agents[1].close()
    finally:
        job.close()


def test_real_task_wrappers_start_their_commands_with_their_placement(tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    code = ("import json, os, sys; keys = ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', "
            "'PSLAUNCH_LOCAL_PROCS', 'DMLC_TASK_ID', 'DMLC_NODE_HOST'); "
            f"open(os.path.join({str(out)!r}, os.environ['DMLC_TASK_ID']), 'w').write("
            "json.dumps({k: os.environ.get(k) for k in keys}))")
    job = Played(tmp_path, 3, run_wrappers=True, command=(sys.executable, "-c", code))
    try:
        job.thread.join(30)
        assert job.error is None
        wait_for(lambda: all(t.code is not None for t in job.backend.tasks), 30, what="the tasks to end")
        assert [t.code for t in job.backend.tasks] == [0, 0, 0], job.err.getvalue().decode()
        got = {int(f.name): json.loads(f.read_text()) for f in out.iterdir()}
        for task in range(3):  # one host: ranks follow the task ids
            assert got[task] == {"RANK": str(task), "LOCAL_RANK": str(task), "LOCAL_WORLD_SIZE": "3",
                                 "GROUP_RANK": "0", "PSLAUNCH_LOCAL_PROCS": "3", "DMLC_TASK_ID": str(task),
                                 "DMLC_NODE_HOST": "127.0.0.1"}
    finally:
        job.close()


# --- the agent's side ------------------------------------------------------------------------------------


class Heard:
    """A process as the hub sees it, that keeps every frame."""

    def __init__(self, ident: int, frames: list) -> None:
        self.ident, self.frames = ident, frames

    def frame(self, kind: bytes, payload: bytes) -> None:
        self.frames.append((self.ident, kind, payload))

    def channel_opened(self) -> None:
        pass

    def channel_closed(self) -> None:
        pass


class Launcher:
    """A hub that records what agents say, and answers a placement when told to."""

    def __init__(self, idents: Sequence[int]) -> None:
        self.records: list[tuple[int, bytes, bytes]] = []
        self.pump = PipePump()
        self.hub = Hub(self.pump, SECRET, socket.create_server(("127.0.0.1", 0)), idents,
                       {i: Heard(i, self.records) for i in idents})  # type: ignore[misc]

    def close(self) -> None:
        self.hub.stop()
        self.pump.stop()


@pytest.fixture
def launcher():
    la = Launcher([0])
    yield la
    la.close()


def agent_for(launcher: Launcher) -> Agent:
    return Agent(1.0, connect(launcher.hub.address, 0, SECRET), prefix="test agent")


def test_an_agent_says_where_it_is_and_gets_its_variables(launcher: Launcher) -> None:
    agent = agent_for(launcher)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(env=agent.placement(0, 10.0)), daemon=True)
    t.start()
    wait_for(lambda: any(k == HERE for _, k, _ in launcher.records), 10, what="the agent's h frame")
    (payload,) = [p for _, k, p in launcher.records if k == HERE]
    assert json.loads(payload)["host"] == os.uname().nodename
    assert t.is_alive()  # it waits
    assert launcher.hub.send_env(0, {"RANK": "5", "LOCAL_RANK": "1"})
    t.join(10)
    assert result["env"] == {"RANK": "5", "LOCAL_RANK": "1"}
    agent.channel.close()


def test_an_agent_gives_up_on_a_placement_that_never_comes(launcher: Launcher) -> None:
    agent = agent_for(launcher)
    t0 = time.monotonic()
    with pytest.raises(AgentError, match="sent no placement within 0.5s") as e:
        agent.placement(0, 0.5)
    assert e.value.code == 1 and time.monotonic() - t0 < 5
    agent.channel.close()


def test_an_agent_stopped_while_it_waits_does_not_start_the_command(launcher: Launcher) -> None:
    agent = agent_for(launcher)
    threading.Timer(0.3, lambda: launcher.hub.send(0, "TERM")).start()
    with pytest.raises(AgentError, match="stopped by the launcher") as e:
        agent.placement(0, 10.0)
    assert e.value.code == 143
    agent.channel.close()


def test_an_agent_whose_launcher_is_gone_stops_waiting(launcher: Launcher) -> None:
    agent = agent_for(launcher)
    threading.Timer(0.3, launcher.hub.stop).start()
    with pytest.raises(AgentError, match="closed the connection before it sent the placement"):
        agent.placement(0, 10.0)


def test_an_agent_without_a_connection_cannot_wait_for_a_placement() -> None:
    with pytest.raises(AgentError, match="without a connection to the launcher"):
        Agent(1.0, None, prefix="test agent").placement(0, 1.0)


def test_a_stop_that_comes_with_the_placement_is_not_lost() -> None:
    """The launcher's ``E`` and ``X TERM`` in one read: the command does not start (it started, and was
    killed only after the grace)."""
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        os.write(w, protocol.env_frame(0, {"LOCAL_RANK": "0"}) + protocol.signal_frame(0, "TERM"))
        agent = Agent(1.0, Channel(r, out_w), prefix="test agent")
        with pytest.raises(AgentError, match="stopped by the launcher") as e:
            agent.placement(0, 5.0)
        assert e.value.code == 143
    finally:
        for fd in (r, w, out_r, out_w):
            os.close(fd)


def test_what_comes_after_the_placement_is_kept_for_run() -> None:
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        ping = protocol.frame(protocol.PING, protocol.NODE)
        os.write(w, protocol.env_frame(0, {"LOCAL_RANK": "0"}) + ping)
        agent = Agent(1.0, Channel(r, out_w), prefix="test agent")
        assert agent.placement(0, 5.0) == {"LOCAL_RANK": "0"}
        assert agent.unread == [(protocol.PING, protocol.NODE, b"")]
    finally:
        for fd in (r, w, out_r, out_w):
            os.close(fd)
