#!/usr/bin/env python3
"""Launch and teardown across 8 to 64 ssh hosts, beside mpirun, pdsh and torchrun-by-pdsh.

Every host is a network namespace of ``tests/support/testbed.py`` with its own sshd and
addresses (one testbed of max(--hosts) hosts; a size of H uses its first H hosts). On each host
4 processes run ``job.sh``: it writes the time it started running into a shared directory and
sleeps; once every process of the job runs, one of them (the first to claim it, never a
scheduler) waits 1 s and exits with code 1. For every launcher, in one run (interleaved:
a slow spell of the machine hits every launcher):

* **all running**: from the launcher's start (Enter) until the last process wrote its time;
* **stopped**: from the failing process's exit until no process of the job is left on any
  host (``/proc``: the hosts share this machine's process ids), capped at ``--stop-cap``
  seconds (a launcher that leaves the others running gets ">cap");
* the launcher's own cost: CPU-seconds (its own and its children's: ssh clients included,
  the job's processes excluded: they run on the hosts), and the peak sum over its process tree
  here of RSS, threads and open files, each divided by the number of hosts.

Launchers:

* **pslaunch**: ``--launcher ssh -n 4H -s 0 --tracker torch --sync-dst-dir`` of a 40-file tree (``job.sh``
  is one of the files: every process runs the synced copy), to a fresh directory each run;
* **mpirun**: Open MPI's ``mpirun --host a:4,b:4,...`` with the ssh launch agent (its default
  tree spawn); no file copy (``job.sh`` from a directory every host sees);
* **pdsh**: Debian's pdsh, ssh rcmd, ``-f H`` (the default fan-out of 32 would hold hosts
  past the 32nd until the first ones end, which these never do); on each host a shell starts the
  4 processes and waits; no file copy;
* **torchrun/pdsh**: pdsh starts ``torchrun --nnodes H --nproc-per-node 4 --no-python``
  (static rendezvous on host 0, ``--node-rank`` from the host's address, ``--max-restarts 0``)
  on every host; no file copy. (c10d rendezvous finds no store host here: torchrun picks the
  agent whose host name resolves to the endpoint, and the namespace hosts share one name.)

Needs root (network namespaces), ``pdsh`` (``apt-get install pdsh``), Open MPI's
``mpirun.openmpi`` and torch in ``.venv``::

    sudo .venv/bin/python scripts/bench_launch_hosts.py --hosts 8 16 32 64 -r 3
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

PER_HOST = 4
FILES = 40

JOB_SH = r"""#!/bin/sh
# $1: the shared output directory, $2: the job's processes (schedulers not counted), $3: fail
out=$1 expected=$2
if [ "$DMLC_ROLE" = scheduler ]; then date +%s.%N > "$out/s.$$"; exec sleep 600; fi
date +%s.%N > "$out/r.$$"
if [ "$3" = fail ] && mkdir "$out/failer" 2>/dev/null; then
    while [ "$(ls "$out" | grep -c '^r\.')" -lt "$expected" ]; do sleep 0.05; done
    sleep 1
    date +%s.%N > "$out/failed"
    exit 1
fi
exec sleep 600
"""


# --- the launchers' command lines ------------------------------------------------------------

class Launchers:
    """Command lines for each launcher on the first ``h`` hosts of testbed ``tb``."""

    def __init__(self, tb: object, root: Path, tree: Path, torchrun: str) -> None:
        self.tb = tb
        self.root = root
        self.tree = tree
        self.torchrun = torchrun
        self.job = root / "job.sh"  # (the peers' copy: under /var/tmp, every host sees it)
        self.job.write_text(JOB_SH)
        self.runs = 0

    def hosts(self, h: int) -> list:
        return self.tb.hosts[:h]  # type: ignore[attr-defined]

    def env(self) -> dict[str, str]:
        return self.tb.env(PYTHONPATH=str(REPO))  # type: ignore[attr-defined]

    def pslaunch(self, h: int, out: Path) -> tuple[list[str], str]:
        hostfile = self.root / f"hosts-{h}"
        self.tb.write_hostfile(hostfile, self.hosts(h))  # type: ignore[attr-defined]
        self.runs += 1
        dst = f"{self.tb.sync_root}/bench-{self.runs}-{time.monotonic_ns()}"  # type: ignore[attr-defined]
        n = PER_HOST * h
        return ([sys.executable, "-m", "launcher", "--launcher", "ssh", "-H", str(hostfile), "-n", str(n),
                 "-s", "0", "--tracker", "torch", "--log-level", "debug", "--sync-dst-dir", dst, "--kill-grace", "2",
                 "sh", "job.sh", str(out), str(n), "fail"],
                str(self.tree))

    def mpirun(self, h: int, out: Path) -> tuple[list[str], str]:
        n = PER_HOST * h
        agent = f"ssh -F {self.tb.ssh_config} -o BatchMode=yes"  # type: ignore[attr-defined]
        return (["mpirun.openmpi", "--allow-run-as-root", "-np", str(n),
                 "--host", ",".join(f"{x.addr_a}:{PER_HOST}" for x in self.hosts(h)),
                 "--mca", "plm_rsh_agent", agent, "--mca", "oob_tcp_if_include", self.tb.subnet_a,  # type: ignore
                 "--mca", "btl_tcp_if_include", self.tb.subnet_a,  # type: ignore[attr-defined]
                 "sh", str(self.job), str(out), str(n), "fail"], str(self.root))

    def _pdsh(self, h: int, command: str) -> list[str]:
        return ["pdsh", "-f", str(h), "-w", ",".join(x.addr_a for x in self.hosts(h)), command]

    def pdsh(self, h: int, out: Path) -> tuple[list[str], str]:
        n = PER_HOST * h
        one = f"sh {shlex.quote(str(self.job))} {shlex.quote(str(out))} {n} fail"
        return self._pdsh(h, f"for i in {' '.join(str(i) for i in range(PER_HOST))}; do {one} & done; wait"), \
            str(self.root)

    def torchrun_pdsh(self, h: int, out: Path) -> tuple[list[str], str]:
        n = PER_HOST * h
        # (static rendezvous on host 0, each host's node rank from its A address: c10d's store host
        # is the agent whose host name resolves to the endpoint, and the hosts share this one's name)
        prefix = self.tb.root_a.rsplit(".", 1)[0].replace(".", r"\.")  # type: ignore[attr-defined]
        cmd = (f'r=$(hostname -I | tr " " "\\n" | grep "^{prefix}\\." | cut -d. -f4); '
               f"exec {shlex.quote(self.torchrun)} --nnodes {h} --nproc-per-node {PER_HOST} --node-rank $((r - 10)) "
               f"--master-addr {self.hosts(h)[0].addr_a} --master-port 29500 --max-restarts 0 --no-python "
               f"sh {shlex.quote(str(self.job))} {shlex.quote(str(out))} {n} fail")
        return self._pdsh(h, cmd), str(self.root)

    def pdsh_env(self) -> dict[str, str]:
        return {"PDSH_RCMD_TYPE": "ssh",
                "PDSH_SSH_ARGS_APPEND": f"-F {self.tb.ssh_config} -o BatchMode=yes"}  # type: ignore[attr-defined]


# --- one run ------------------------------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


_OWN_NET = os.readlink("/proc/self/ns/net")


def _is_job(pid: int) -> bool:
    """A process on a host (a namespace of the testbed: the job's, sshd's), not the launcher's here."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") != _OWN_NET
    except OSError:
        return True


def _tree_usage(root: int) -> tuple[int, int, int]:
    """(RSS kB, threads, open files) summed over ``root`` and its descendants that are not the job."""
    kids = _children()
    rss = threads = fds = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, ()))
        if pid != root and _is_job(pid):
            continue
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return rss, threads, fds


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X")


def _stamps(out: Path, prefix: str) -> dict[int, float]:
    got = {}
    for p in out.glob(prefix + ".*"):
        try:
            got[int(p.name.split(".", 1)[1])] = float(p.read_text())
        except (OSError, ValueError):
            continue
    return got


def one_run(argv: list[str], cwd: str, env: dict[str, str], out: Path, n: int, hosts: int,
            start_cap: float, stop_cap: float, cleanup: Callable[[], None]) -> dict[str, Optional[float]]:
    """One job: seconds to all running and to all stopped after the failure, and the launcher's cost."""
    cpu0 = _children_cpu()
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(out / "launcher.err", "wb"), start_new_session=True)
    peak = [0, 0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for i, v in enumerate(_tree_usage(proc.pid)):
                peak[i] = max(peak[i], v)
            done.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    row: dict[str, Optional[float]] = {"running": None, "stopped": None, "exit": None}
    try:
        end = t0 + start_cap
        while len(_stamps(out, "r")) < n and time.time() < end and proc.poll() is None:
            time.sleep(0.05)
        running = _stamps(out, "r")
        if len(running) < n:
            err = (out / "launcher.err").read_text(errors="replace")[-600:]
            raise RuntimeError(f"{argv[0]}: {len(running)} of {n} processes ran within {start_cap:g}s "
                               f"(exit {proc.poll()}): {err}")
        row["running"] = max(running.values()) - t0
        end = time.time() + 30
        failed_at = None
        while failed_at is None and time.time() < end:
            try:
                failed_at = float((out / "failed").read_text())  # (empty while it is being written)
            except (OSError, ValueError):
                time.sleep(0.02)
        if failed_at is None:
            raise RuntimeError(f"{argv[0]}: no process failed within 30s of all running")
        pids = list(running) + list(_stamps(out, "s"))
        end = failed_at + stop_cap
        while time.time() < end:
            if not any(_alive(p) for p in pids):
                row["stopped"] = time.time() - failed_at
                break
            time.sleep(0.02)
        if proc.poll() is None:
            try:
                proc.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode is not None:
            row["exit"] = float(proc.returncode)
        row.update(pslaunch_phases((out / "launcher.err").read_bytes()))
    finally:
        done.set()
        if proc.poll() is None:
            # its children first (pdsh's ssh clients): the launcher reaps them and ends, so their
            # CPU time is counted
            for pid in _children().get(proc.pid, []):
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        sampler.join()
        row["cpu"] = _children_cpu() - cpu0  # (the launcher and what it reaped; before cleanup's commands)
        for p in list(_stamps(out, "r")) + list(_stamps(out, "s")):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        cleanup()
    row["rss"], row["threads"], row["fds"] = peak[0] / 1024 / hosts, peak[1] / hosts, peak[2] / hosts
    return row


PHASES = (("connect", re.compile(rb"connected to \d+ hosts? in ([\d.]+)s")),
          ("ready", re.compile(rb"backend ready after (\d+) ms")),
          ("spawn", re.compile(rb"started \d+ process(?:es)? in ([\d.]+)s")))


def pslaunch_phases(err: bytes) -> dict[str, float]:
    """pslaunch's own timings from its debug log: connect (every host), ready (connected, wrappers
    started, synced: from the launcher's start), spawn (every process started and its pid back)."""
    got = {}
    for name, rx in PHASES:
        m = rx.search(err)
        if m:
            got[name] = float(m.group(1)) / (1000 if name == "ready" else 1)
    return got


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _project(root: Path, files: int) -> Path:
    """The tree to sync: ``files`` files (``job.sh`` and 4 KiB modules in 4 directories)."""
    src = root / "project"
    src.mkdir()
    (src / "job.sh").write_text(JOB_SH)
    for i in range(files - 1):
        d = src / f"pkg{i % 4}"
        d.mkdir(exist_ok=True)
        (d / f"mod{i}.py").write_bytes(os.urandom(2048).hex().encode())
    return src


def host_cost(tb: object) -> tuple[float, float]:
    """(mean sshd RSS in MB, sum of sshd RSS in MB) over the testbed's idle hosts."""
    rss = []
    for h in tb.hosts:  # type: ignore[attr-defined]
        for line in Path(f"/proc/{h.sshd_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss.append(int(line.split()[1]) / 1024)
    return statistics.mean(rss), sum(rss)


def _fmt(values: list[Optional[float]], cap: float, unit: str = "s") -> str:
    if not values:
        return "-"
    if any(v is None for v in values):
        done = [v for v in values if v is not None]
        return f">{cap:g}{unit}" if not done else f">{cap:g}{unit} ({len(done)}/{len(values)})"
    m = statistics.median(values)  # type: ignore[type-var]
    return f"{m:.2f}{unit}" if unit == "s" else f"{m:.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--repeats-at-64", type=int, default=None, help="fewer runs at 64 hosts (slow)")
    ap.add_argument("--launchers", nargs="+", default=["pslaunch", "mpirun", "pdsh", "torchrun/pdsh"])
    ap.add_argument("--start-cap", type=float, default=180.0)
    ap.add_argument("--stop-cap", type=float, default=10.0)
    ap.add_argument("--base", help="another checkout of pslaunch (the code before a change): adds the launcher "
                    "pslaunch@base, the same job run with that checkout's code")
    ap.add_argument("--torchrun", default=str(REPO / ".venv" / "bin" / "torchrun"))
    a = ap.parse_args(argv)
    if a.base and "pslaunch@base" not in a.launchers:
        a.launchers.insert(1, "pslaunch@base")
    from support import testbed as testbed_mod

    if os.geteuid() != 0:
        print("bench_launch_hosts.py needs root (it builds network namespaces)", file=sys.stderr)
        return 2
    t_build = time.monotonic()
    tb = testbed_mod.build(max(a.hosts))
    t_build = time.monotonic() - t_build
    root = Path(tempfile.mkdtemp(prefix="bench-hosts-", dir=str(tb.shared)))
    root.chmod(0o755)
    try:
        tree = _project(root, FILES)
        launchers = Launchers(tb, root, tree, a.torchrun)
        env = launchers.env()
        makers = {"pslaunch": (launchers.pslaunch, {}), "mpirun": (launchers.mpirun, {}),
                  "pslaunch@base": (launchers.pslaunch, {"PYTHONPATH": a.base or ""}),  # (the same job, that code)
                  "pdsh": (launchers.pdsh, launchers.pdsh_env()),
                  "torchrun/pdsh": (launchers.torchrun_pdsh, launchers.pdsh_env())}
        rss_mean, rss_sum = host_cost(tb)
        print(f"testbed: {len(tb.hosts)} hosts built in {t_build:.1f}s ({t_build / len(tb.hosts):.2f}s a host: "
              f"namespace, 2 veth pairs, host key, sshd); an idle host's sshd: {rss_mean:.1f} MB RSS "
              f"({rss_sum:.0f} MB for all)")
        print(f"{os.cpu_count()} cores shared by the launchers, every host's sshd and the job's processes; "
              f"{PER_HOST} processes a host; load before: {os.getloadavg()[0]:.2f}")

        def cleanup() -> None:
            for h in tb.hosts:
                pids = tb.job_pids(h)
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass

        head = (f"{'hosts':>5} {'procs':>5} {'launcher':>14} | {'all running':>11} {'stopped':>9} | "
                f"{'CPU-s':>6} {'CPU-s/host':>10} {'RSS MB/host':>11} {'threads/host':>12} {'files/host':>10} | runs")
        for h in a.hosts:
            reps = a.repeats_at_64 if (h >= 64 and a.repeats_at_64) else a.repeats
            rows: dict[str, list[dict]] = {name: [] for name in a.launchers}
            for _ in range(reps):
                for name in a.launchers:
                    make, extra = makers[name]
                    out = Path(tempfile.mkdtemp(dir=str(root)))
                    out.chmod(0o777)
                    cmd, cwd = make(h, out)
                    try:
                        row = one_run(cmd, cwd, {**env, **extra}, out, PER_HOST * h, h, a.start_cap, a.stop_cap,
                                      cleanup)
                    except RuntimeError as e:
                        print(f"  {name} at {h} hosts failed: {e}", flush=True)
                        cleanup()
                        continue
                    rows[name].append(row)
                    print(f"  ({h} hosts, {name}: running {row['running']:.2f}s, stopped "
                          f"{row['stopped'] if row['stopped'] is None else round(row['stopped'], 2)}, "
                          f"cpu {row['cpu']:.2f}s, exit {row['exit']})", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
            print(f"\nload {os.getloadavg()[0]:.2f} (1 min) after {h} hosts")
            print(head)
            print("-" * len(head))
            for name, runs in rows.items():
                if not runs:
                    print(f"{h:>5} {PER_HOST * h:>5} {name:>14} | failed")
                    continue
                med = {k: statistics.median(r[k] for r in runs) for k in ("cpu", "rss", "threads", "fds")}
                print(f"{h:>5} {PER_HOST * h:>5} {name:>14} | {_fmt([r['running'] for r in runs], a.start_cap):>11} "
                      f"{_fmt([r['stopped'] for r in runs], a.stop_cap):>9} | {med['cpu']:>6.2f} "
                      f"{med['cpu'] / h:>10.3f} {med['rss']:>11.1f} {med['threads']:>12.2f} {med['fds']:>10.2f} | "
                      f"{len(runs)}", flush=True)
                if all("ready" in r for r in runs):
                    print(f"{'':>27}(its phases: connect {statistics.median(r['connect'] for r in runs):.2f}s, "
                          f"connected to ready (wrappers, sync) "
                          f"{statistics.median(r['ready'] - r['connect'] for r in runs):.2f}s, "
                          f"spawn {statistics.median(r['spawn'] for r in runs):.2f}s)", flush=True)
            print()
    finally:
        tb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
