#!/usr/bin/env python3
"""The launcher against N simulated hosts on loopback (issue 36 item 2; docs/scale.md).

What is real: the launcher's own code from the supervisor down, as a batch job runs it: the
``Supervisor`` (start, monitor, first failure, the staged stop, the report), ``BatchBackend``
(tasks, the wait until every task runs, signals through the hub, close), the ``Hub`` (accept,
the HMAC handshake, the pending-connection limits), the ``PipePump`` (one thread reading every
connection), ``RemoteProcess``/``BatchTask`` (frames to output and exit codes) and the
``Console`` (labelled, whole lines). Only the batch system is simulated: ``SimBackend.submit``
starts a few helper processes (``--helpers``) in place of ``qsub``/``srun``, and
``cancel`` marks a task removed, as ``qdel`` would.

What is simulated: each host's node agent is an asyncio task in a helper process, speaking the
real node protocol (``launcher.node.protocol``: transport b, the hub's greeting, the client's
HMAC, the server's proof, then frames) from its own loopback address (``127.1.x.y``: every host
its own source address, as on a cluster). Its process is simulated inside it: a ``p`` frame,
``--lines`` lines of output (one ``o`` frame each), then it waits; one agent (``--fail-host``)
reports ``x 1`` once every line has been merged (the job's first failure), and every other one
answers the launcher's ``X TERM`` with ``x 143`` and closes, as an agent does once its process
has ended. No process is started per host: the simulation measures the launcher, not fork().

It prints one JSON document (``--json FILE`` also writes it): the times (start to all running,
the lines' merge, failure to every agent told and every exit known, the whole job), the
launcher process's CPU seconds, peak RSS, threads and open descriptors, and what went wrong
(agents refused, lines missing, the exit code).

    .venv/bin/python scripts/sim_scale.py --hosts 1000
    .venv/bin/python scripts/sim_scale.py --hosts 64 --lines 200 --json /tmp/sim64.json
    .venv/bin/python scripts/sim_scale.py --hosts 1000 --nofile 1024   # a cluster's usual soft limit
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.backends.batch import BatchBackend, BatchTask  # noqa: E402
from launcher.errors import LaunchError  # noqa: E402
from launcher.node import protocol  # noqa: E402
from launcher.run.supervisor import Supervisor  # noqa: E402
from launcher.runtime.handle import ProcGroup  # noqa: E402
from launcher.runtime.output import Console  # noqa: E402
from launcher.spec.job import JobSpec  # noqa: E402
from launcher.spec.plan import ProcSpec  # noqa: E402

HELPER_FLAG = "--agents-of-helper"


# --- the launcher's side ------------------------------------------------------------------------


class Sink:
    """The launcher's stdout or stderr: counts the labelled lines and keeps them (for the checks)."""

    def __init__(self, keep: bool) -> None:
        self.lines = 0
        self.keep = keep
        self.data: list[bytes] = []
        self.lock = threading.Lock()
        self.first: Optional[float] = None
        self.last: Optional[float] = None

    def write(self, data: bytes) -> int:
        with self.lock:
            n = data.count(b"\n")
            if n:
                now = time.monotonic()
                self.first = self.first or now
                self.last = now
                self.lines += n
            if self.keep:
                self.data.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


class Sampler:
    """Samples the launcher process's threads, descriptors and RSS every 50 ms (their peaks)."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {"threads": 0, "fds": 0, "rss_mb": 0.0}
        self.out_of_fds = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            before = time.thread_time()
            try:
                self.sample()
            except OSError:  # (the launcher has run out of descriptors: the figures say so elsewhere)
                self.out_of_fds = True
            _not_the_launcher(time.thread_time() - before)

    def sample(self) -> None:
        status: dict[str, list[str]] = {}
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                status[name] = value.split()
        now = {"threads": float(int(status["Threads"][0]) - 1),  # (not the sampler itself)
               "fds": float(len(os.listdir("/proc/self/fd"))), "rss_mb": int(status["VmRSS"][0]) / 1024}
        for key, v in now.items():
            self.peak[key] = max(self.peak[key], v)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class SimBackend(BatchBackend):
    """The batch backend whose batch system is a few helper processes of simulated agents."""

    name = "sim"
    remote = True
    needs_scheduler_address = True
    close_wait = 30.0
    cfg: dict[str, Any] = {}  # set by simulate() (the supervisor makes the instance)
    me: Optional[SimBackend] = None

    def check(self) -> None:
        SimBackend.me = self

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        assert hub is not None, "the hub did not listen"
        cfg = self.cfg
        for p in procs:
            assert p.task_id is not None
            self.add_task(BatchTask(p, self.console.proc(p.name, p.label, str(p.role)), self, f"sim-{p.task_id}"))
        idents = [p.task_id for p in procs]
        secret = procs[0].env["PSLAUNCH_SECRET"]
        self.helpers: list[subprocess.Popen] = []
        n = max(1, min(cfg["helpers"], len(idents)))
        cfg["t_submit"] = time.monotonic()
        for k in range(n):
            doc = {"hub": list(hub), "secret": secret, "idents": idents[k::n], "lines": cfg["lines"],
                   "line_bytes": cfg["line_bytes"], "fail": cfg["fail"], "broken": cfg.get("broken", "")}
            h = subprocess.Popen([sys.executable, os.path.abspath(__file__), HELPER_FLAG],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert h.stdin is not None
            h.stdin.write(json.dumps(doc) + "\n")
            h.stdin.flush()
            self.helpers.append(h)
        return self.tasks

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
        group = super().start(procs)
        self.cfg["t_running"] = time.monotonic()
        threading.Thread(target=self._fail_when_merged, name="sim-fail", daemon=True).start()
        return group

    def _tell(self, word: str) -> None:
        for h in self.helpers:
            try:
                assert h.stdin is not None
                h.stdin.write(word + "\n")
                h.stdin.flush()
            except OSError:
                pass

    def _fail_when_merged(self) -> None:
        """Once every task runs: every host prints its lines; once every line reached the console
        (or 120 s passed), the failing host fails."""
        cfg, sink = self.cfg, self.cfg["sink"]
        want = cfg["hosts"] * cfg["lines"]
        cfg["t_lines"], cfg["cpu_lines"] = time.monotonic(), _cpu()
        self._tell("lines")
        deadline = time.monotonic() + 120
        while sink.lines < want and time.monotonic() < deadline:
            time.sleep(0.002)
        cfg["t_merged"], cfg["cpu_merged"] = time.monotonic(), _cpu()
        cfg["merged_by_then"] = sink.lines
        if cfg["hold"]:  # (every agent connected and quiet: what the launcher costs while a job runs)
            time.sleep(cfg["hold"])
            cfg["cpu_held"] = _cpu()
        self._tell("fail")
        cfg["failing"].set()

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        for t in tasks:  # (qdel's part: the task is gone from the batch system)
            self.set_code(t, 137, "removed from the simulated batch system")

    def release(self) -> None:
        reports = []
        for h in getattr(self, "helpers", []):
            try:
                out, _ = h.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                h.kill()
                out, _ = h.communicate()
            reports.append(json.loads(out) if out.strip() else {"agents": {}, "errors": ["no report"]})
        self.cfg["helper_reports"] = reports


#: CPU seconds the simulation's own threads in the launcher's process used (the sampler, the
#: watcher of the exits): taken out of the launcher's figures
_SIM_CPU = [0.0]
_SIM_LOCK = threading.Lock()


def _not_the_launcher(seconds: float) -> None:
    with _SIM_LOCK:
        _SIM_CPU[0] += seconds


def _cpu() -> float:
    """The launcher's CPU seconds so far: its process's, every thread, less the simulation's own."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    with _SIM_LOCK:
        return r.ru_utime + r.ru_stime - _SIM_CPU[0]


def simulate(hosts: int, lines: int = 20, line_bytes: int = 60, helpers: int = 4, fail: Optional[int] = None,
             kill_grace: float = 30.0, broken: str = "", keep: bool = False,
             start_timeout: float = 120.0, hold: float = 0.0) -> dict[str, Any]:
    """Run one job of ``hosts`` simulated hosts through the real supervisor; its figures."""
    fail = hosts // 2 if fail is None else fail
    sink, err = Sink(keep), Sink(keep)
    cfg: dict[str, Any] = {"hosts": hosts, "lines": lines, "line_bytes": line_bytes, "helpers": helpers,
                           "fail": fail, "sink": sink, "broken": broken, "hold": hold,
                           "failing": threading.Event()}
    SimBackend.cfg = cfg
    spec = JobSpec(command=("sim-agent",), num_workers=hosts, num_servers=0, launcher="sim", kill_grace=kill_grace,
                   start_timeout=start_timeout, progress=False, host_ip="127.0.0.1")
    console = Console(stdout=sink, stderr=err, color=False)  # type: ignore[arg-type]
    sampler = Sampler()
    cpu0, t0 = _cpu(), time.monotonic()
    cfg["wall_t0"] = time.time()
    ended: dict[str, float] = {}

    def watch_exits() -> None:  # (when the launcher knows every exit code; from the failure on)
        cfg["failing"].wait()
        start = time.thread_time()
        while "all" not in ended:
            b = SimBackend.me
            if b is not None and b.tasks and len(b.tasks) == hosts and all(t.code is not None for t in b.tasks):
                ended["all"] = time.monotonic()
            time.sleep(0.001)
        _not_the_launcher(time.thread_time() - start)

    watcher = threading.Thread(target=watch_exits, daemon=True)
    watcher.start()
    sup = Supervisor(spec, console, backend=SimBackend, watchdog=False)
    launch_error = None
    try:
        result = sup.run()
    except LaunchError as e:  # (the command line's guard makes it one line and exit 1)
        launch_error, result = str(e), None
    t_end = time.monotonic()
    cfg["failing"].set()  # (a launch that failed: the watcher ends)
    watcher.join(5)
    cpu1, r1 = _cpu(), resource.getrusage(resource.RUSAGE_SELF)
    sampler.stop()
    try:
        sampler.sample()
    except OSError:
        sampler.out_of_fds = True
    ended.setdefault("all", float("nan"))
    reports = cfg.get("helper_reports", [])
    agents = {int(k): v for r in reports for k, v in r["agents"].items()}
    errors = [e for r in reports for e in r["errors"]]
    fail_at = agents.get(fail, {}).get("failed_at")
    told = [a["term_at"] for i, a in agents.items() if i != fail and a.get("term_at")]
    not_told = sorted(i for i, a in agents.items() if i != fail and not a.get("term_at"))
    not_acked = sorted(i for i, a in agents.items() if i != fail and not a.get("acked_at"))
    connect = sorted(a["connected_s"] for a in agents.values() if a.get("connected_s") is not None)
    labels = _labels(sink.data, hosts, lines) if keep else None
    merge_s = cfg.get("t_merged", float("nan")) - cfg.get("t_lines", float("nan"))
    out = {
        "hosts": hosts, "lines_per_host": lines, "helpers": cfg["helpers"],
        "exit_code": 1 if result is None else result.exit_code, "launch_error": launch_error and launch_error[:300],
        "first_failure": result.first_failure.name if result and result.first_failure else None,
        "start_to_all_running_s": cfg.get("t_running", float("nan")) - t0,
        "submit_to_all_running_s": cfg.get("t_running", float("nan")) - cfg.get("t_submit", t0),
        "connect_s_median": connect[len(connect) // 2] if connect else None,
        "connect_s_max": connect[-1] if connect else None,
        "lines_expected": hosts * lines + 1, "lines_merged": sink.lines,
        "merge_s": merge_s, "lines_per_s": (hosts * lines) / merge_s if merge_s and merge_s > 0 else None,
        "failure_to_all_told_s": (max(told) - fail_at) if told and fail_at else None,
        "failure_to_all_exits_known_s": (ended["all"] - t0) - ((fail_at - cfg["wall_t0"]) if fail_at else 0),
        "failure_to_launcher_done_s": (t_end - t0) - ((fail_at - cfg["wall_t0"]) if fail_at else 0),
        "agents_reported": len(agents), "agents_not_told": not_told[:20], "agents_not_told_count": len(not_told),
        "agents_not_acked_count": len(not_acked),
        "agent_errors": errors[:20], "agent_error_count": len(errors),
        "launcher_cpu_s": cpu1 - cpu0,
        "merge_cpu_s": cfg.get("cpu_merged", 0.0) - cfg.get("cpu_lines", 0.0),
        "lines_per_launcher_cpu_s": ((hosts * lines) / (cfg["cpu_merged"] - cfg["cpu_lines"])
                                     if cfg.get("cpu_merged", 0.0) > cfg.get("cpu_lines", 0.0) else None),
        "idle_cpu_per_s": ((cfg["cpu_held"] - cfg["cpu_merged"]) / hold) if "cpu_held" in cfg else None,
        "launcher_peak_rss_mb": round(max(sampler.peak["rss_mb"], r1.ru_maxrss / 1024), 1),
        "launcher_peak_threads": int(sampler.peak["threads"]), "launcher_peak_fds": int(sampler.peak["fds"]),
        "sampler_ran_out_of_fds": sampler.out_of_fds,
        "job_s": t_end - t0,
    }
    if labels is not None:
        out["labels"] = labels
    return out


def _labels(chunks: list[bytes], hosts: int, lines: int) -> dict[str, Any]:
    """Each merged line checked against its label: the host a line says it came from must be the
    one its label names, and every host's lines 0..L-1 must each be there once, whole."""
    seen: dict[int, list[int]] = {}
    bad: list[str] = []
    for line in b"".join(chunks).decode().splitlines():
        label, _, text = line.partition("] ")
        if not label.startswith("[worker "):
            bad.append(line[:80])
            continue
        ident = int(label[len("[worker "):].split(" ")[0])
        if text == "simulated failure":
            continue
        words = text.split(" ")
        if len(words) != 5 or words[:2] != ["host", str(ident)] or words[2] != "line":
            bad.append(line[:80])
            continue
        seen.setdefault(ident, []).append(int(words[3]))
    whole = sum(1 for i in range(hosts) if sorted(seen.get(i, [])) == list(range(lines)))
    return {"hosts_with_every_line_once": whole, "mislabelled": len(bad), "mislabelled_lines": bad[:5]}


# --- the simulated agents (one helper process holds many) ----------------------------------------


async def _agent(ident: int, doc: dict, go: dict, report: dict, errors: list) -> None:
    """One host's node agent on transport b, its process simulated (see the module docstring)."""
    mine: dict[str, Any] = {}
    report[str(ident)] = mine
    secret, (host, port) = doc["secret"], doc["hub"]
    source = f"127.1.{ident // 250}.{1 + ident % 250}"
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=(source, 0)), 60)
        hello = await asyncio.wait_for(reader.readline(), 60)
        if not hello.startswith(protocol.HELLO):
            raise ConnectionError(f"not a hub: {hello[:40]!r}")
        server_nonce = bytes.fromhex(hello[len(protocol.HELLO):].decode().strip())
        client_nonce = os.urandom(16)
        mac = protocol.channel_mac(secret, "client", server_nonce, client_nonce, ident)
        writer.write(f"{ident} {client_nonce.hex()} {mac}\n".encode())
        answer = (await asyncio.wait_for(reader.readline(), 60)).decode().strip()
        if not hmac.compare_digest(answer, "ok " + protocol.channel_mac(secret, "server", server_nonce,
                                                                         client_nonce, ident)):
            raise ConnectionError(f"the hub's proof is wrong or missing ({answer[:20]!r})")
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        errors.append(f"agent {ident}: {type(e).__name__}: {e}")
        return
    mine["connected_s"] = time.monotonic() - t0
    info = {"pid": 100000 + ident, "agent": os.getpid(), "host": f"sim-{ident}"}
    writer.write(protocol.frame(protocol.STARTED, ident, json.dumps(info).encode()))
    await writer.drain()
    await go["lines"].wait()
    pad = "." * max(0, doc["line_bytes"] - 24)
    for k in range(doc["lines"]):
        line = f"host {ident} line {k} {pad}\n"
        if doc["broken"] == "mislabel" and ident == 3 and k == 0:
            line = f"host {ident + 1} line {k} {pad}\n"
        writer.write(protocol.frame(protocol.STDOUT, ident, line.encode()))
        if k % 16 == 15:
            await writer.drain()
    await writer.drain()
    if ident == doc["fail"]:
        await go["fail"].wait()
        writer.write(protocol.frame(protocol.STDOUT, ident, b"simulated failure\n"))
        mine["failed_at"] = time.time()
        writer.write(protocol.frame(protocol.EXIT, ident, protocol.exit_payload(1, time.time())))
        await writer.drain()
        writer.close()
        return
    decoder = protocol.Decoder(protocol.MAX_TO_NODE)
    while True:
        data = await reader.read(65536)
        if not data:
            mine["closed_at"] = time.time()
            break
        for kind, _ident, payload in decoder.feed(data):
            if kind == protocol.SIGNAL and payload in (b"TERM", b"KILL", b"INT"):
                mine.setdefault("term_at", time.time())
                if doc["broken"] == "deaf" and ident % 7 == 0:
                    continue  # (a broken agent: the check must see it)
                code = 143 if payload == b"TERM" else 137
                writer.write(protocol.frame(protocol.EXIT, ident, protocol.exit_payload(code, time.time())))
                await writer.drain()
                mine["acked_at"] = time.time()
                writer.close()
                return


async def _helper(doc: dict) -> dict:
    report: dict[str, Any] = {}
    errors: list[str] = []
    go = {"lines": asyncio.Event(), "fail": asyncio.Event()}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def control() -> None:
        while True:
            line = (await reader.readline()).strip().decode()
            if line in go:
                go[line].set()
            if not line:
                for event in go.values():
                    event.set()
                return

    ctl = asyncio.ensure_future(control())
    await asyncio.gather(*(_agent(i, doc, go, report, errors) for i in doc["idents"]))
    ctl.cancel()
    return {"agents": report, "errors": errors}


def helper_main() -> int:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # (a write after the hub closed: counted, not said)
    doc = json.loads(sys.stdin.readline())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = asyncio.run(_helper(doc))
    sys.stdout.write(json.dumps(out))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000, help="simulated hosts, one agent each (default 1000)")
    ap.add_argument("--lines", type=int, default=20, help="lines of output per host (default 20)")
    ap.add_argument("--line-bytes", type=int, default=60, help="bytes per line (default 60)")
    ap.add_argument("--helpers", type=int, default=4, help="helper processes holding the agents (default 4)")
    ap.add_argument("--fail-host", type=int, default=None, help="the host whose process fails (default N/2)")
    ap.add_argument("--nofile", type=int, default=None, help="the launcher's soft open-file limit (ulimit -n)")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="--start-timeout of the job (default 120)")
    ap.add_argument("--check-lines", action="store_true", help="keep the merged lines and check each one's label")
    ap.add_argument("--kill-grace", type=float, default=30.0, help="--kill-grace of the job (default 30)")
    ap.add_argument("--broken", default="", choices=("", "mislabel", "deaf"),
                    help="break the simulated agents on purpose (the integration test's own check)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="seconds every agent stays connected and quiet before the failure (idle cost)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    figures = simulate(args.hosts, args.lines, args.line_bytes, args.helpers, args.fail_host,
                       kill_grace=args.kill_grace, broken=args.broken, keep=args.check_lines,
                       start_timeout=args.start_timeout, hold=args.hold)
    text = json.dumps(figures, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = (figures["exit_code"] == 1 and figures["launch_error"] is None and figures["agent_error_count"] == 0
          and figures["agents_not_acked_count"] == 0 and figures["lines_merged"] == figures["lines_expected"]
          and figures.get("labels", {}).get("mislabelled", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == [HELPER_FLAG]:
        sys.exit(helper_main())
    sys.exit(main())
