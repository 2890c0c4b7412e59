"""``bench_launch.py --launcher ssh``: ssh launch latency on the network-namespace testbed.

For H hosts and P processes per host (workers, ``-s 0``), from the start until
every process is running, split into the backend's phases:

* **connect**: one ssh connection per host, in parallel (TCP, key exchange,
  host key check, authentication);
* **prepare**: per host, the wrapper channel (sshd session, login shell,
  ``python3``, the node bundle), then through it the address lookup and
  ``--sync-dst-dir`` of a small project: to a fresh target (every file sent),
  then again to the same target (nothing changed: nothing sent), and, for
  comparison in the same run, without ``--sync-dst-dir`` at all;
* **sync** (part of prepare): the slowest host's sync as the backend times it,
  from its first request; that includes waiting for the wrapper to start, which
  a job without a sync pays in spawn instead, so the sync's own cost is the
  difference of the totals, printed under each group, and the files sent to all
  hosts together;
* **spawn**: every process handed to its host's waiting wrapper, started, and
  its pid reported back;
* **first output**: until the first line of every process has arrived.

Drives :class:`launcher.backends.ssh.SSHBackend` directly (the scheduler is
not part of an ssh launch). Needs root: it builds a testbed of max(H) hosts
with ``tests/support/testbed.py``, and removes it afterwards.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from launcher.backends.ssh import SSHBackend  # noqa: E402
from launcher.runtime.output import Console  # noqa: E402
from launcher.spec.job import Host, JobSpec  # noqa: E402
from launcher.spec.plan import build_plan  # noqa: E402
from launcher.transport.ssh import SSHOptions  # noqa: E402

# Every process: this Python (the hosts share the file system) printing one line, then waiting.
PROGRAM = (sys.executable, "-S", "-c", "import time; print('running', flush=True); time.sleep(60)")
PHASES = ("connect", "prepare", "sync", "spawn", "first output", "total")


def _project(root: Path, files: int = 40) -> Path:
    """A small code tree to sync: ``files`` files of 4 KiB in a few directories."""
    src = root / "project"
    for i in range(files):
        d = src / f"pkg{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_bytes(os.urandom(2048).hex().encode())
    return src


def one_launch(tb, hosts: int, per_host: int, src: Path, dst: str | None) -> dict[str, float]:
    """One launch (``dst``: the --sync-dst-dir, or None); returns seconds per phase."""
    lines = tuple(Host(h.addr_a, origin=f"bench:{h.index}") for h in tb.hosts[:hosts])
    spec = JobSpec(command=PROGRAM, num_workers=hosts * per_host, num_servers=0, launcher="ssh", hosts=lines,
                   # (no sync: a directory every host has)
                   workdir=str(src) if dst else "/", kill_grace=1.0, sync_dst_dir=dst,
                   options=SSHOptions(connect_timeout=20.0))
    console = Console(stdout=io.BytesIO(), stderr=io.BytesIO(), color=False)  # type: ignore[arg-type]
    backend = SSHBackend(spec, console, None)
    try:
        t0 = time.monotonic()
        addresses = backend.prepare()
        t1 = time.monotonic()
        plan = build_plan(spec, root_uri=tb.root_a, root_port=9, secret="0" * 64, job_id="bench",
                          addresses=addresses, inherit_environ=False)
        handles = backend.start(plan.procs).handles
        t2 = time.monotonic()
        end = t2 + 120
        while any(h.first_output is None for h in handles):  # type: ignore[attr-defined]
            if time.monotonic() > end or any(h.poll() is not None for h in handles):
                raise RuntimeError("a process ended or stayed silent")
            time.sleep(0.002)
        t3 = max(h.first_output for h in handles)  # type: ignore[attr-defined]
        for h in handles:
            h.kill()
        end = time.monotonic() + 20
        while any(h.poll() is None for h in handles) and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        backend.close()
    stats = backend.sync_stats.values()
    return {"connect": backend.timings["connect"], "prepare": t1 - t0 - backend.timings["connect"],
            "sync": max((st.seconds for st in stats), default=0.0), "sent": sum(st.files for st in stats),
            "spawn": t2 - t1, "first output": t3 - t2, "total": t3 - t0}


def shell_baseline(tb, runs: int = 5) -> float:
    """Median seconds of ``true`` over an open connection to the first host."""
    from launcher.transport.ssh import HostSession, connect, resolve_targets

    opts = SSHOptions(connect_timeout=20.0)
    target = resolve_targets([Host(tb.hosts[0].addr_a)], opts)[0]
    session = HostSession(target, opts, connect(target, opts))
    try:
        times = []
        for _ in range(runs):
            t0 = time.monotonic()
            session.exec("true")
            times.append(time.monotonic() - t0)
        return statistics.median(times)
    finally:
        session.close()


def bench_ssh_main(host_counts: list[int], per_host: list[int], repeats: int, sync: bool) -> int:
    from support import testbed as testbed_mod

    if os.geteuid() != 0:
        print("bench_launch.py --launcher ssh needs root (it builds network namespaces)", file=sys.stderr)
        return 2
    tb = testbed_mod.build(max(host_counts))
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = str(tb.home)  # the testbed's key, known_hosts and ssh config
    os.environ.pop("SSH_AUTH_SOCK", None)
    root = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    try:
        src = _project(root)
        print(f"ssh launch latency on the namespace testbed ({os.cpu_count()} cores, shared by the hosts' sshd "
              f"and processes); median of {repeats} runs; sync: {'a 40-file tree' if sync else 'off'}")
        print("seconds from the start until every process runs, by phase (prepare: per host the wrapper's channel, "
              "login shell and python3, then through it the address and the sync; spawn: every process started "
              "and its pid reported)")
        print(f"baseline: one command ('true') on an open connection (sshd session + the user's login shell) "
              f"takes {shell_baseline(tb):.2f}s here; prepare includes one per host")
        head = (f"{'hosts':>5} {'per host':>8} {'procs':>5} {'sync':>9} | " + " ".join(f"{p:>12}" for p in PHASES)
                + f" | {'files sent':>10}")
        print(head)
        print("-" * len(head))
        for h in host_counts:
            for p in per_host:
                rows: dict[str, list[dict[str, float]]] = {"fresh": [], "unchanged": [], "none": []} if sync \
                    else {"none": []}
                for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every row
                    if sync:
                        dst = f"{tb.sync_root}/bench-{time.monotonic_ns()}"
                        rows["fresh"].append(one_launch(tb, h, p, src, dst))
                        rows["unchanged"].append(one_launch(tb, h, p, src, dst))  # the same target: nothing changed
                    rows["none"].append(one_launch(tb, h, p, src, None))
                totals = {}
                for what, runs in rows.items():
                    row = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "sent")}
                    totals[what] = row["total"]
                    print(f"{h:>5} {p:>8} {h * p:>5} {what:>9} | " + " ".join(f"{row[k]:>11.2f}s" for k in PHASES)
                          + f" | {row['sent']:>10.0f}", flush=True)
                if sync:
                    print(f"{'':>21} the sync's cost, total minus none: "
                          f"fresh {totals['fresh'] - totals['none']:+.2f}s, "
                          f"unchanged {totals['unchanged'] - totals['none']:+.2f}s", flush=True)
    finally:
        if old_home is not None:
            os.environ["HOME"] = old_home
        tb.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    a = ap.parse_args(argv)
    return bench_ssh_main(a.hosts, a.per_host, a.repeats, a.sync)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ssh benchmark's options (also offered by bench_launch.py)."""
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="ssh: host counts (at most 8)")
    ap.add_argument("--per-host", type=int, nargs="+", default=[1, 4, 16], help="ssh: processes per host")
    ap.add_argument("--no-sync", dest="sync", action="store_false", help="ssh: skip --sync-dst-dir")
    if not any(a.dest == "repeats" for a in ap._actions):
        ap.add_argument("-r", "--repeats", type=int, default=3)


if __name__ == "__main__":
    sys.exit(main())
