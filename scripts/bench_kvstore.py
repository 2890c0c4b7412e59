#!/usr/bin/env python3
"""KVStore push+pull throughput: our parameter server against raw TCP and MXNet's ps-lite.

Every configuration is a real job started through the launcher on this
machine (``python -m launcher -n W -s S --launcher local ...``): a scheduler,
S servers and W workers on loopback. Each worker pushes a float32 array and
pulls the result, ``dist_sync``, after a warm-up; the time is rank 0's.

    MB/s per worker = (bytes pushed + bytes pulled) / time

Configurations: S = 1 and 2 servers (``--servers``), W = 2 workers, the
payload MAC off and on (``PS_MAC_PAYLOAD``), and with ``--compare-mxnet``
the same loop with ``mx.kv.create('dist_sync')`` in an MXNet 1.9.1 venv.
The raw loopback TCP row is a two-process echo (send N bytes, get N bytes
back) with plain sockets: the physical limit of this machine at that size.
With ``--allreduce on`` (the default) the same loop also runs with
``kvstore.create('dist_allreduce')`` under ``--tracker torch``: no servers, one
gloo allreduce per push (trainer/collective.py), counted the same way; and the
sizes gain LeNet's gradient (431,080 float32, what the trainer pushes per batch).
Each configuration runs ``--repeat`` times, interleaved, and the best run per
size is shown, because other load on a small machine only ever slows a run.

Examples:
    python scripts/bench_kvstore.py                     # ours, S=1,2, MAC off/on, raw TCP
    python scripts/bench_kvstore.py --compare-mxnet --repeat 3
    python scripts/bench_kvstore.py --sizes 4K,1M --servers 1 --mac off
    python scripts/bench_kvstore.py --servers 1 --mac off --sizes lenet   # push+pull beside allreduce

This file is also the worker program of each job (``--worker``); in that mode
it imports only the KVStore under test (``trainer.kvstore`` or ``mxnet``),
which turns the scheduler and server processes into their roles.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    # The first import decides the role: servers and the scheduler never return.
    if "--mxnet" in sys.argv:
        import mxnet  # noqa: F401
    else:
        from trainer import kvstore  # noqa: F401

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
#: LeNet's parameters (trainer/models.py; train_mnist's summary reports them): one gradient's floats
LENET_PARAMS = 431_080
MXNET_PYTHON = "/opt/mxnet-venv/bin/python"
WARMUP = 5


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text == "LENET":
        return 4 * LENET_PARAMS
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def show_size(n: int) -> str:
    if n == 4 * LENET_PARAMS:
        return "LeNet"
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def iterations(size: int, budget: int) -> int:
    """Timed iterations for one size: the same on every worker (sync jobs run in lock-step)."""
    return max(5, min(1000, budget // size))


# --- worker mode -------------------------------------------------------------------------------


def _step(kv: Any, key: int, value: Any, out: Any, pushpull: bool) -> None:
    if pushpull:
        kv.pushpull(key, value, out)
    else:
        kv.push(key, value)
        kv.pull(key, out)


def worker_main(args: argparse.Namespace) -> None:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results = []
    if args.mxnet:
        import mxnet as mx

        kv = mx.kv.create("dist_sync")
        rank = kv.rank
        for i, size in enumerate(sizes):
            n = size // 4
            a = mx.nd.ones((n,))
            out = mx.nd.zeros((n,))
            kv.init(i, a)
            iters = iterations(size, args.budget)
            for _ in range(WARMUP):
                kv.push(i, a)
                kv.pull(i, out=out)
            out.wait_to_read()
            t = time.perf_counter()
            for _ in range(iters):
                kv.push(i, a)
                kv.pull(i, out=out)
            out.wait_to_read()
            results.append((size, (time.perf_counter() - t) / iters))
    else:
        import torch

        from trainer import kvstore

        kv = kvstore.create(args.kv)
        rank = kv.rank
        for i, size in enumerate(sizes):
            n = size // 4
            a = torch.ones(n)
            out = torch.zeros(n)
            kv.init(i, a)
            iters = iterations(size, args.budget)
            both = args.op == "pushpull"
            for _ in range(WARMUP):
                _step(kv, i, a, out, both)
            t = time.perf_counter()
            for _ in range(iters):
                _step(kv, i, a, out, both)
            results.append((size, (time.perf_counter() - t) / iters))
            expected = float(kv.num_workers)
            if float(out[0]) != expected or float(out[-1]) != expected:
                raise SystemExit(f"bench: wrong sum {float(out[0])} != {expected}")
        kv.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps([[s, t] for s, t in results]))


# --- raw TCP -------------------------------------------------------------------------------------


def _echo_server(listener: socket.socket, sizes: list[int], budget: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for size in sizes:
        buf = bytearray(size)
        view = memoryview(buf)
        for _ in range(WARMUP + iterations(size, budget)):
            got = 0
            while got < size:
                got += conn.recv_into(view[got:], size - got)
            conn.sendall(view)
    conn.close()


def raw_tcp(sizes: list[int], budget: int) -> dict[int, float]:
    """Seconds per echo (send ``size`` bytes, receive them back) over loopback TCP."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    proc = mp.get_context("fork").Process(target=_echo_server, args=(listener, sizes, budget))
    proc.start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    try:
        for size in sizes:
            data = bytearray(size)
            back = bytearray(size)
            view = memoryview(back)
            iters = iterations(size, budget)
            for i in range(WARMUP + iters):
                if i == WARMUP:
                    t = time.perf_counter()
                sock.sendall(data)
                got = 0
                while got < size:
                    got += sock.recv_into(view[got:], size - got)
            out[size] = (time.perf_counter() - t) / iters
    finally:
        sock.close()
        listener.close()
        proc.join(30)
    return out


# --- driver --------------------------------------------------------------------------------------


def run_job(python: str, servers: int, workers: int, mac: bool, mxnet: bool,
            args: argparse.Namespace, workdir: Path, allreduce: bool = False) -> dict[int, float] | None:
    result = workdir / f"result-{time.monotonic_ns()}.json"
    job = ["--tracker", "torch"] if allreduce else ["-s", str(servers)]
    cmd = [sys.executable, "-m", "launcher", "-n", str(workers), *job,
           "--launcher", "local", "--env", f"PS_MAC_PAYLOAD={int(mac)}",
           python, str(Path(__file__).resolve()), "--worker", "--sizes", args.sizes,
           "--budget", str(args.budget), "--op", args.op, "--result", str(result),
           "--kv", "dist_allreduce" if allreduce else "dist_sync"]
    if mxnet:
        cmd.append("--mxnet")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    log = workdir / "last-job.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not result.exists():
        tail = log.read_text().splitlines()[-15:]
        sys.stderr.write(f"bench: job failed (rc {rc}): {' '.join(cmd)}\n  " + "\n  ".join(tail) + "\n")
        return None
    return {int(s): float(t) for s, t in json.loads(result.read_text())}


def best(runs: list[dict[int, float] | None]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in runs:
        for size, t in (r or {}).items():
            out[size] = min(out.get(size, t), t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated: 4K,64K,1M,16M,64M")
    ap.add_argument("--servers", default="1,2", help="server counts to run (default 1,2)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mac", default="off,on", help="payload MAC settings to run (off,on)")
    ap.add_argument("--op", choices=("push+pull", "pushpull"), default="push+pull",
                    help="ours: push then pull (as MXNet), or one pushpull call")
    ap.add_argument("--compare-mxnet", action="store_true",
                    help="also run the same loop with MXNet 1.9.1's dist_sync (ps-lite)")
    ap.add_argument("--mxnet-python", default=os.environ.get("PSLAUNCH_MXNET_PYTHON", MXNET_PYTHON))
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; best shown")
    ap.add_argument("--budget", type=parse_size, default=parse_size("256M"),
                    help="bytes per worker and size to time (iterations = budget / size, 5..1000)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--allreduce", choices=("on", "off"), default="on",
                    help="also run dist_allreduce (torch.distributed, no servers) under --tracker torch")
    ap.add_argument("--json", help="also write the numbers to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="dist_sync", help=argparse.SUPPRESS)
    ap.add_argument("--mxnet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return

    if args.allreduce == "on" and "lenet" not in args.sizes.lower():
        args.sizes += ",lenet"
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    servers = [int(s) for s in args.servers.split(",")]
    macs = [m.strip() == "on" for m in args.mac.split(",")]
    if args.compare_mxnet and not os.path.exists(args.mxnet_python):
        sys.exit(f"bench: no MXNet python at {args.mxnet_python}; pass --mxnet-python")
    configs: list[tuple[str, int, bool, bool]] = []
    for s in servers:
        for mac in macs:
            configs.append((f"ours S={s}" + (" MAC" if mac else ""), s, mac, False))
        if args.compare_mxnet:
            configs.append((f"mxnet S={s}", s, False, True))
    runs: dict[str, list[dict[int, float] | None]] = {name: [] for name, *_ in configs}
    tcp_runs = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        for rep in range(args.repeat):
            tcp_runs.append(raw_tcp(sizes, args.budget))
            for name, s, mac, mx in configs:
                python = args.mxnet_python if mx else sys.executable
                print(f"[{rep + 1}/{args.repeat}] {name} ...", file=sys.stderr, flush=True)
                runs[name].append(run_job(python, s, args.workers, mac, mx, args, Path(tmp)))
            if args.allreduce == "on":
                print(f"[{rep + 1}/{args.repeat}] allreduce ...", file=sys.stderr, flush=True)
                runs.setdefault("allreduce", []).append(
                    run_job(sys.executable, 0, args.workers, False, False, args, Path(tmp), allreduce=True))
    tcp = best(tcp_runs)
    table = {name: best(r) for name, r in runs.items()}

    def mbs(size: int, t: float | None) -> str:
        return "-" if t is None else f"{2 * size / t / 1e6:8.0f}"

    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:8.3f}"

    print(f"\nKVStore push+pull, dist_sync, {args.workers} workers, float32, "
          f"op={args.op}, best of {args.repeat}; MB/s per worker = (pushed + pulled) / time")
    print(f"load average at start: {os.getloadavg()[0]:.2f}, cores: {os.cpu_count()}")
    for s in servers:
        names = [n for n, srv, *_ in configs if srv == s]
        head = f"{'size':>6} | {'raw TCP':>8}"
        for n in names:
            head += f" | {n + ' MB/s':>17} {'ms/it':>8}"
        if args.compare_mxnet:
            head += " | ours/mxnet"
        print(f"\nS = {s}\n{head}\n{'-' * len(head)}")
        for size in sizes:
            row = f"{show_size(size):>6} | {mbs(size, tcp.get(size)):>8}"
            for n in names:
                t = table[n].get(size)
                row += f" | {mbs(size, t):>17} {ms(t):>8}"
            if args.compare_mxnet:
                ours, theirs = table[f"ours S={s}"].get(size), table[f"mxnet S={s}"].get(size)
                row += f" | {theirs / ours:9.2f}x" if ours and theirs else " |         -"
            print(row)
    if "allreduce" in table:
        ps = f"ours S={servers[0]}"
        head = f"{'size':>6} | {'raw TCP':>8} | {ps + ' MB/s':>17} {'ms/it':>8} | {'allreduce MB/s':>17} {'ms/it':>8}"
        print(f"\nNo servers: dist_allreduce under --tracker torch (gloo), {args.workers} workers, the same loop "
              f"beside push+pull with {servers[0]} server(s)\n{head}\n{'-' * len(head)}")
        for size in sizes:
            t_ps, t_ar = table[ps].get(size), table["allreduce"].get(size)
            print(f"{show_size(size):>6} | {mbs(size, tcp.get(size)):>8} | {mbs(size, t_ps):>17} {ms(t_ps):>8} "
                  f"| {mbs(size, t_ar):>17} {ms(t_ar):>8}")
    print(f"\nraw TCP: one client echoing over loopback with plain sockets (no ZeroMQ, no server "
          f"work); {time.time() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "sizes": sizes, "raw_tcp": tcp, "runs": {k: v for k, v in table.items()},
            "workers": args.workers, "op": args.op, "repeat": args.repeat}, indent=1))


if __name__ == "__main__":
    main()
