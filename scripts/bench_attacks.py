#!/usr/bin/env python3
"""What a peer without the job's secret does to a real training job: the attack table.

For each attack of ``tests/bin/kv_attack.py`` (bounded in connections, bytes and seconds;
loopback only), a real job runs: ``python -m launcher -n 2 -s 1 --launcher local``
with ``scripts/train_mnist.py --network mlp --kv-store dist_sync`` over one epoch,
the scheduler on a known port. The attack aims at the scheduler's port: floods
from a second before the job starts, memory attacks once the scheduler listens. Each row
says what the job did (exit code, seconds from start to exit, its last line) and the
scheduler's peak RSS while attacked, sampled every 10 ms from /proc (the row ``none``, the
same job unattacked, is the reference: a scheduler's own growth while it imports and serves).

``--repo DIR`` runs another checkout's launcher and trainer (for example the commit before
the KV protocol's hardening) under the same attacks; the attack speaks that checkout's wire
version (``--wire-version``), so its HELLOs are the ones that KVStore expects.

    .venv/bin/python scripts/bench_attacks.py
    .venv/bin/python scripts/bench_attacks.py --repo /tmp/before --rows null-frame,hello-flood
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ATTACK = REPO / "tests" / "bin" / "kv_attack.py"

#: name -> (kv_attack mode, its arguments, when: "before" the job starts or once it "listens")
ROWS = {
    "none": (None, (), "before"),
    "hello-burst": ("hello-burst", ("--count", "500", "--seconds", "8"), "before"),
    "hello-flood": ("hello-flood", ("--count", "300", "--seconds", "8"), "before"),
    "big-frame": ("big-frame", ("--seconds", "6"), "listens"),
    "null-frame": ("null-frame", ("--seconds", "6"), "listens"),
    "null-stream": ("null-stream", ("--seconds", "6"), "listens"),
    "slow-frames": ("slow-frames", ("--count", "200", "--seconds", "4"), "listens"),
}


def wire_version(repo: Path) -> int:
    text = (repo / "trainer" / "kv" / "protocol.py").read_text()
    for line in text.splitlines():
        if line.startswith("VERSION = "):
            return int(line.split("=")[1].split("#")[0])
    raise SystemExit(f"no VERSION in {repo}/trainer/kv/protocol.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def scheduler_pid(port: int) -> int | None:
    """The process of the job whose environment says DMLC_ROLE=scheduler on ``port``."""
    want = (b"DMLC_ROLE=scheduler", f"DMLC_PS_ROOT_PORT={port}".encode())
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want):
            return int(d)
    return None


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_row(repo: Path, name: str, version: int, timeout: float) -> dict:
    mode, extra, when = ROWS[name]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(repo), PS_VERBOSE="1")
    env.pop("PSLAUNCH_PROCESS", None)
    job = [sys.executable, "-m", "launcher", "-n", "2", "-s", "1", "--launcher", "local",
           "--port-range", f"{port}-{port + 50}", "--kill-grace", "2", "--timeout", str(int(timeout)),
           sys.executable, "scripts/train_mnist.py", "--network", "mlp", "--kv-store", "dist_sync",
           "--num-epochs", "1", "--num-examples", "60000", "--batch-size", "64"]
    attacker = None
    cmd = [sys.executable, str(ATTACK), mode or "", "--port", str(port), "--wire-version", str(version), *extra]
    if mode and when == "before":
        attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
    t0 = time.monotonic()
    proc = subprocess.Popen(job, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    pid = None
    base = peak = 0.0
    deadline = t0 + 60
    while pid is None and proc.poll() is None and time.monotonic() < deadline:
        pid = scheduler_pid(port)
        time.sleep(0.01)
    if pid is not None:
        base = peak = rss_mb(pid)
    if mode and when == "listens":
        while proc.poll() is None and not listening(port) and time.monotonic() < deadline:
            time.sleep(0.02)
        attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None and time.monotonic() - t0 < timeout + 30:
        if pid is not None:
            peak = max(peak, rss_mb(pid))
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    took = time.monotonic() - t0
    if attacker is not None:
        try:
            attacker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            attacker.kill()
    reader.join(5)
    last = next((x.strip() for x in reversed(lines) if x.startswith("pslaunch:")), "")
    said = [x.strip() for x in lines if "refused or dropped" in x or "pslaunch-cause" in x][:1]
    return {"row": name, "code": code, "seconds": took, "rss_peak_mb": peak, "rss_growth_mb": peak - base, "last": last,
            "kv_said": said[0] if said else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose launcher and trainer run")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {','.join(ROWS)}")
    ap.add_argument("--timeout", type=float, default=90, help="the job's --timeout (seconds)")
    a = ap.parse_args()
    repo = a.repo.resolve()
    version = wire_version(repo)
    rows = [run_row(repo, r, version, a.timeout) for r in a.rows.split(",")]
    print(f"\nAttacks on the scheduler's port of a real job ({repo}, KV wire version {version}); load average "
          f"{os.getloadavg()[0]:.2f}")
    print("| attack | exit code | seconds | scheduler peak RSS | the job's last line |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['row']} | {r['code']} | {r['seconds']:.1f} | {r['rss_peak_mb']:.0f} MB | {r['last'][:110]} |")
    for r in rows:
        if r["kv_said"]:
            print(f"  {r['row']}: {r['kv_said'][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
