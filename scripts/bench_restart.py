#!/usr/bin/env python3
"""From the ``kill -9`` of a worker to every process of the next attempt running: pslaunch
``--max-restarts 1`` beside torchrun ``--max-restarts 1``, on the same program, in one run.

Each run starts a job of N processes whose every process, when it is up, appends one line
``<stage> <attempt> <rank> <pid> <time.time()>`` to a file, then sleeps. Once all N are up in
attempt 0 (and a settling second has passed) the bench ``kill -9``\\ s the last rank and waits
until all N processes of attempt 1 have written their ``up`` line; the cell is that last
``up`` time minus the time of the kill (one clock: the testbed's hosts share this machine's).
Two programs:

* **torch**: this file with ``--worker``: ``import torch.distributed``, then
  ``init_process_group("gloo")`` (env://): "running" means the process group formed again;
  under pslaunch ``--tracker torch``, under ``torchrun --standalone --nproc-per-node N``;
* **plain**: the same file without torch: ``up`` at once, under pslaunch ``-s 0`` (its rabit
  tracker's stand-in) and under torchrun: the launchers' own cost, without torch's import and
  rendezvous.

Every process also writes a ``start`` line when Python has started (before ``import torch``), so
the table can say where the time goes: for pslaunch, from ``--summary-json``, the kill to the end
of attempt 0 (noticed, every other process stopped), the delay it drew, and the rest (spawn, and
torch's import and rendezvous); and, for scale, attempt 0's own start: from its first process's
``start`` line to its last ``up`` line (what any start of the program costs, restart or not).

Cells: local and ssh (``--launcher ssh`` on the namespace testbed of ``tests/support/testbed.py``,
N processes over min(N, 4) hosts; needs root, and ``flock -o /tmp/pslaunch-it.lock``), each with
the default ``--restart-delay`` (1 s, +-10 % jitter) and with ``--restart-delay 0``; torchrun
local only. The runs of one N and program are interleaved, and each cell is the median of
``--repeat`` runs.

    flock -o /tmp/pslaunch-it.lock .venv/bin/python scripts/bench_restart.py          # N = 2, 8, 32
    .venv/bin/python scripts/bench_restart.py --sizes 2,8 --repeat 1 --no-ssh           # quick, no root
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
ME = str(Path(__file__).resolve())
UP_FILE = "up.txt"
MAX_HOSTS = 4


# --- the job's program ---------------------------------------------------------------------------------


def _record(out: str, stage: str) -> None:
    """One line in the shared file, in one ``write`` (O_APPEND: the lines of many processes stay whole)."""
    env = os.environ
    attempt = env.get("PSLAUNCH_ATTEMPT", env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = env.get("RANK", env.get("DMLC_TASK_ID", "0"))
    line = f"{stage} {attempt} {rank} {os.getpid()} {time.time():.6f}\n".encode()
    fd = os.open(os.path.join(out, UP_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def worker(out: str, use_torch: bool) -> int:
    """Up (after the process group formed, with ``use_torch``), then wait to be killed."""
    _record(out, "start")
    if use_torch:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    _record(out, "up")
    while True:
        time.sleep(60)


# --- reading the file ----------------------------------------------------------------------------------


def parse_lines(text: str) -> dict[tuple[str, int], dict[int, tuple[int, float]]]:
    """``(stage, attempt) -> {rank: (pid, time)}`` from the file's lines; an incomplete last line (a
    write in progress) is skipped, and a rank that wrote twice keeps its first line."""
    out: dict[tuple[str, int], dict[int, tuple[int, float]]] = {}
    for line in text.splitlines(keepends=True):
        fields = line.split()
        if not line.endswith("\n") or len(fields) != 5:
            continue
        stage, attempt, rank, pid, when = fields
        out.setdefault((stage, int(attempt)), {}).setdefault(int(rank), (int(pid), float(when)))
    return out


def all_in(seen: dict[tuple[str, int], dict[int, tuple[int, float]]], stage: str, attempt: int,
           n: int) -> Optional[tuple[float, float]]:
    """``(first, last)`` time of ``stage`` in ``attempt`` once all ``n`` ranks wrote it, else None."""
    ranks = seen.get((stage, attempt), {})
    if len(ranks) < n:
        return None
    times = [t for _, t in ranks.values()]
    return min(times), max(times)


def spread(n: int, max_hosts: int = MAX_HOSTS) -> tuple[int, int]:
    """``(hosts, slots per host)`` for ``n`` processes over at most ``max_hosts`` testbed hosts."""
    hosts = max(1, min(n, max_hosts))
    while n % hosts:
        hosts -= 1
    return hosts, n // hosts


# --- one run ---------------------------------------------------------------------------------------------


class Run:
    """One job: start it, wait for attempt 0, kill a worker, wait for attempt 1, stop it."""

    def __init__(self, argv: list[str], out: Path, n: int, env: dict, log: Path, timeout: float) -> None:
        self.argv, self.out, self.n, self.env, self.log, self.timeout = argv, out, n, env, log, timeout

    def _wait(self, stage: str, attempt: int, proc: subprocess.Popen) -> tuple[dict, tuple[float, float]]:
        end = time.monotonic() + self.timeout
        path = self.out / UP_FILE
        while True:
            seen = parse_lines(path.read_text() if path.exists() else "")
            got = all_in(seen, stage, attempt, self.n)
            if got is not None:
                return seen, got
            if proc.poll() is not None:
                raise RuntimeError(f"the launcher exited {proc.returncode} before attempt {attempt} was {stage} "
                                   f"(see {self.log})")
            if time.monotonic() > end:
                raise RuntimeError(f"attempt {attempt} not {stage} after {self.timeout:.0f}s (see {self.log})")
            time.sleep(0.01)

    def __call__(self) -> dict:
        with open(self.log, "wb") as log:
            proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            seen, (_, up0) = self._wait("up", 0, proc)
            cold = up0 - min(t for _, t in seen[("start", 0)].values())
            time.sleep(1.0)  # settled: attempt 0's processes sleep, the launcher watches
            victim = seen[("up", 0)][self.n - 1][0]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            seen, (_, up) = self._wait("up", 1, proc)
            first_start = all_in(seen, "start", 1, self.n)
            started = min(t for _, t in seen[("start", 1)].values()) if ("start", 1) in seen else up
            return {"all": up - killed, "first_start": started - killed, "cold": cold,
                    "all_start": (first_start[1] - killed) if first_start else None, "killed": killed}
        finally:
            self._stop(proc)

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the launcher (it stops its job); SIGKILL to what is left after 30 s."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        path = self.out / UP_FILE
        for _, ranks in parse_lines(path.read_text() if path.exists() else "").items():
            for pid, _ in ranks.values():
                try:
                    if ME.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():  # (not a reused pid)
                        os.kill(pid, signal.SIGKILL)  # a process of this run that its launcher left
                except (OSError, ProcessLookupError):
                    pass


def summary_phases(path: Path, killed: float) -> dict[str, float]:
    """From pslaunch's ``--summary-json``: seconds from the kill to the end of attempt 0 (every
    process of it stopped), and the delay it drew."""
    doc = json.loads(path.read_text())
    first = doc["attempts"][0]
    return {"teardown": first["end_time"] - killed, "delay": first["delay"] or 0.0}


# --- the table -----------------------------------------------------------------------------------------


def pslaunch_argv(n: int, program: str, out: Path, delay: Optional[float], summary: Path,
                  hostfile: Optional[Path], interface: Optional[str]) -> list[str]:
    argv = [sys.executable, "-m", "launcher", "-n", str(n), "--max-restarts", "1", "--kill-grace", "5",
            "--log-level", "debug", "--summary-json", str(summary)]
    if delay is not None:
        argv += ["--restart-delay", str(delay)]
    if hostfile is not None:
        argv += ["--launcher", "ssh", "-H", str(hostfile)]
        if interface:
            argv += ["--env", f"DMLC_INTERFACE={interface}"]
    argv += ["--tracker", "torch"] if program == "torch" else ["-s", "0"]
    return argv + [sys.executable, ME, "--worker", str(out)] + (["--torch"] if program == "torch" else [])


def torchrun_argv(n: int, program: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "--max-restarts", "1", ME, "--worker", str(out)] + (["--torch"] if program == "torch" else [])


def fmt(values: list[dict], key: str = "all") -> str:
    """The median of ``key`` over the runs that came up, and how many did not."""
    xs = [v[key] for v in values if v.get(key) is not None]
    failed = sum(1 for v in values if "failed" in v)
    text = f"{statistics.median(xs):.2f}" if xs else "-"
    return text + (f" ({failed} of {len(values)} failed)" if failed else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,8,32")
    ap.add_argument("--programs", default="plain,torch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds one attempt may take to come up")
    ap.add_argument("--no-ssh", dest="ssh", action="store_false", help="skip the ssh cells (they need root)")
    ap.add_argument("--cells", default=None, help="only these cells, e.g. 'local:torchrun,ssh:0' (local or ssh, "
                    "then 1s, 0, torchrun or torchrun-noshare)")
    ap.add_argument("--json", default=None, help="also write every run's numbers here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.torch)
    sizes = [int(s) for s in a.sizes.split(",")]
    programs = a.programs.split(",")
    sys.path.insert(0, str(REPO / "tests"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    tb = None
    if a.ssh:
        if os.geteuid() != 0:
            print("the ssh cells need root (network namespaces); --no-ssh skips them", file=sys.stderr)
            return 2
        from support import testbed as testbed_mod

        tb = testbed_mod.build(MAX_HOSTS)
    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict[tuple, list[dict]] = {}
    try:
        cells: list[tuple] = [("local", "1s"), ("local", "0"), ("local", "torchrun"), ("local", "torchrun-noshare")]
        if tb is not None:
            cells += [("ssh", "1s"), ("ssh", "0")]
        if a.cells:
            cells = [c for c in cells if ":".join(c) in a.cells.split(",")]
        for program in programs:
            for n in sizes:
                for rep in range(a.repeat):
                    for backend, what in cells:
                        base = tb.shared if backend == "ssh" else tmp
                        out = base / f"{program}-{n}-{backend}-{what}-{rep}-{uuid.uuid4().hex[:6]}"
                        out.mkdir(mode=0o777)
                        out.chmod(0o777)
                        log = tmp / f"{out.name}.log"
                        summary = tmp / f"{out.name}.json"
                        run_env = env
                        if what.startswith("torchrun"):
                            argv = torchrun_argv(n, program, out)
                            if what == "torchrun-noshare":  # (pytorch/pytorch#135712: a fresh store per attempt)
                                run_env = dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
                        else:
                            hostfile = None
                            if tb is not None and backend == "ssh":
                                hosts, slots = spread(n)
                                hostfile = tb.write_hostfile(tmp / f"hosts-{n}", tb.hosts[:hosts],
                                                             f"{{addr_a}} slots={slots}")
                                run_env = tb.env(env)
                            argv = pslaunch_argv(n, program, out, None if what == "1s" else 0.0, summary,
                                                 hostfile, tb.subnet_b if tb is not None else None)
                        try:
                            r = Run(argv, out, n, run_env, log, a.timeout)()
                        except RuntimeError as e:  # (counted in the cell: a restart that did not come up)
                            results.setdefault((program, n, backend, what), []).append({"failed": str(e)})
                            print(f"[{rep + 1}/{a.repeat}] {program} N={n} {backend} {what}: FAILED: {e}",
                                  file=sys.stderr, flush=True)
                            continue
                        if not what.startswith("torchrun"):
                            r.update(summary_phases(summary, r["killed"]))
                            r["rest"] = r["all"] - r["teardown"] - r["delay"]
                        results.setdefault((program, n, backend, what), []).append(r)
                        extra = (f" (teardown {r['teardown']:.2f}, delay {r['delay']:.2f}, rest {r['rest']:.2f})"
                                 if "rest" in r else "")
                        print(f"[{rep + 1}/{a.repeat}] {program} N={n} {backend} {what}: all running "
                              f"{r['all']:.2f}s after the kill, first started {r['first_start']:.2f}s{extra}",
                              file=sys.stderr, flush=True)
    finally:
        if tb is not None:
            tb.close()
    print(f"\nkill -9 of the last rank to every process of attempt 1 running, seconds, median of {a.repeat}; "
          f"{os.cpu_count()} cores; torch: after init_process_group(gloo), plain: at its start\n")
    print("| program | N | backend | pslaunch, default delay (1 s) | pslaunch --restart-delay 0 "
          "| torchrun --max-restarts 1 | torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
          "| pslaunch delay 0: teardown / first process started | attempt 0: first start to all up |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for program in programs:
        for n in sizes:
            for backend in ("local", "ssh") if tb is not None else ("local",):
                got = {what: results.get((program, n, backend, what), [])
                       for what in ("1s", "0", "torchrun", "torchrun-noshare")}
                if not any(got.values()):
                    continue  # (a cell that --cells left out)
                cols = [fmt(v) if v else "-" for v in got.values()]
                print(f"| {program} | {n} | {backend} | {' | '.join(cols)} | "
                      f"{fmt(got['0'], 'teardown')} / {fmt(got['0'], 'first_start')} | {fmt(got['0'], 'cold')} |")
    print(f"\nload average before/after: {load0} / {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"logs in {tmp}")
    if a.json:
        Path(a.json).write_text(json.dumps({" ".join(map(str, k)): v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
