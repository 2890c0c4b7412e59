#!/usr/bin/env python3
"""KVStore push+pull throughput and latency: our parameter server against ps-lite and raw TCP.

Every configuration is a real job started through the launcher on this machine
(``python -m launcher -n W -s S --launcher local ...``): a scheduler, S servers and W
workers on loopback. Each worker pushes a float32 array and pulls the result,
``dist_sync``, after a warm-up; the time is rank 0's (the workers run in lock-step).

    MB/s per worker = (bytes pushed + bytes pulled) / time

and the round-trip latency of a 4 KB push+pull in microseconds. Configurations: W workers
x S servers (``--grid``, default W = 2, 4, 8 and S = 1, 2, 4), ours and, with
``--compare-mxnet``, the same loop with ``mx.kv.create('dist_sync')`` in an MXNet 1.9.1
venv (ps-lite). The raw TCP column is the same dist_sync round without any parameter server:
W client processes, each with one stream to each of S server processes; each client pushes its
array (each server its share, placed as the KVStore places the key), and a server answers every
client once all of them have pushed. Its MB/s per client is what this machine moves in that
round (on a 2-core machine, W + S busy processes share two cores); ``ours / raw TCP`` is the
ratio in the same run. With
``--allreduce on`` (the default) the same loop also runs with
``kvstore.create('dist_allreduce')`` under ``--tracker torch`` for each W: no servers, one
gloo allreduce per push (trainer/collective.py), counted the same way, in a table beside
push+pull with one server; the sizes gain LeNet's gradient (431,080 float32, what the trainer
pushes per batch). Each configuration runs ``--repeat`` times (3), interleaved (every system of a row, raw TCP
included, once per pass), and the median is shown (``--stat best``: the best run).

Examples:
    python scripts/bench_kvstore.py --compare-mxnet             # the grid, beside ps-lite
    python scripts/bench_kvstore.py --grid 2x1,2x2 --sizes 4K,1M,16M,64M
    python scripts/bench_kvstore.py --grid 2x1 --mac on         # with the payload MAC
    python scripts/bench_kvstore.py --grid 2x1 --sizes lenet    # push+pull beside allreduce

This file is also the worker program of each job (``--worker``); in that mode it imports
only the KVStore under test (``trainer.kvstore`` or ``mxnet``), which turns the scheduler
and server processes into their roles.
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
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "4K,64K,1M,16M"
DEFAULT_GRID = "2x1,2x2,2x4,4x1,4x2,4x4,8x1,8x2,8x4"
LATENCY_SIZE = 4 << 10
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
    return max(5, min(int(os.environ.get("KVBENCH_MAX_ITERS", 1000)), budget // size))


def parse_grid(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        w, _, s = item.strip().partition("x")
        out.append((int(w), int(s)))
    return out


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
        cpus: list[tuple[int, float]] = []
        for i, size in enumerate(sizes):
            n = size // 4
            a = torch.ones(n)
            out = torch.zeros(n)
            kv.init(i, a)
            iters = iterations(size, args.budget)
            both = args.op == "pushpull"
            for _ in range(WARMUP):
                _step(kv, i, a, out, both)
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(iters):
                _step(kv, i, a, out, both)
            results.append((size, (time.perf_counter() - t) / iters))
            cpus.append((size, (time.process_time() - cpu) / iters))
            expected = float(kv.num_workers)
            if float(out[0]) != expected or float(out[-1]) != expected:
                raise SystemExit(f"bench: wrong sum {float(out[0])} != {expected}")
        kv.close()
        if os.environ.get("KVBENCH_CPU_FILE"):  # this worker's CPU (all its threads) per round
            with open(os.environ["KVBENCH_CPU_FILE"], "a") as f:
                f.write(json.dumps({"rank": rank, "cpu": cpus}) + "\n")
    if rank == 0:
        Path(args.result).write_text(json.dumps([[s, t] for s, t in results]))


# --- raw TCP -------------------------------------------------------------------------------------


def round_shares(sizes: list[int], servers: int) -> list[list[int]]:
    """Bytes of each size's array that each server holds, as the KVStore places them.

    The worker inits one key per size, in order, so :class:`trainer.kv.placement.Placement`
    run over the same sizes gives the same servers: a small array on the least loaded one, a
    big one (``MXNET_KVSTORE_BIGARRAY_BOUND``) split across all of them.
    """
    from trainer.kv.placement import Placement

    bound = int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND") or 1_000_000)
    placement = Placement(servers, bound)
    out = []
    for size in sizes:
        share = [0] * servers
        for part in placement.assign([(size // 4, 4)])[0]:
            share[part.server] += (part.hi - part.lo) * 4
        out.append(share)
    return out


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    got, size = 0, len(view)
    while got < size:
        n = conn.recv_into(view[got:], size - got)
        if not n:
            return False
        got += n
    return True


def _round_server(listener: socket.socket, clients: int, shares: list[int], budget: int,
                  sizes: list[int]) -> None:
    """One server of the raw TCP round: for every size it holds a share of, each client
    pushes its share over its stream, and once all have, every client gets its share back.
    One thread, blocking sockets (the kernel buffers what a client sends while the server
    reads another): no thread hand-offs, no GIL, only the copies in and out."""
    conns = [listener.accept()[0] for _ in range(clients)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for size, share in zip(sizes, shares):
        if not share:
            continue
        views = [memoryview(bytearray(share)) for _ in conns]
        for _ in range(WARMUP + iterations(size, budget)):
            for conn, view in zip(conns, views):
                if not _recv_exactly(conn, view):
                    return
            for conn, view in zip(conns, views):
                conn.sendall(view)
    for conn in conns:
        conn.close()


def _round_client(addresses: list[tuple[str, int]], sizes: list[int], shares: list[list[int]],
                  budget: int, barrier: Any, results: Any, index: int) -> None:
    """One worker of the raw TCP round: push each server's share of the array, then take
    the answers; seconds per round for each size."""
    socks = [socket.create_connection(a) for a in addresses]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    for size, share in zip(sizes, shares):
        data = bytearray(size)
        back = memoryview(bytearray(size))
        used = [(socks[s], memoryview(data)[:n], back[:n]) for s, n in enumerate(share) if n]
        iters = iterations(size, budget)
        barrier.wait()
        for i in range(WARMUP + iters):
            if i == WARMUP:
                t = time.perf_counter()
            for sock, pushed, _ in used:
                sock.sendall(pushed)
            for sock, _, answer in used:
                if not _recv_exactly(sock, answer):
                    return
        out[size] = (time.perf_counter() - t) / iters
    for s in socks:
        s.close()
    results[index] = out


def raw_tcp(sizes: list[int], budget: int, workers: int, servers: int) -> dict[int, float]:
    """Seconds per round of the KVStore's dist_sync push+pull done with plain sockets on
    loopback: W client processes, S server processes, every client one stream to every
    server; each pushes its array (each server its share of it, placed as the KVStore
    places it), and a server answers every client once all have pushed. No ZeroMQ, no
    Python per part, no summing: what this machine moves in that round. The mean over the
    clients."""
    ctx = mp.get_context("fork")
    shares = round_shares(sizes, servers)
    listeners = []
    procs = []
    for s in range(servers):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(workers)
        procs.append(ctx.Process(target=_round_server,
                                 args=(listener, workers, [sh[s] for sh in shares], budget, sizes)))
        listeners.append(listener)
    barrier = ctx.Barrier(workers)
    manager = ctx.Manager()
    results = manager.dict()
    addresses = [listener.getsockname() for listener in listeners]
    for w in range(workers):
        procs.append(ctx.Process(target=_round_client,
                                 args=(addresses, sizes, shares, budget, barrier, results, w)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for listener in listeners:
        listener.close()
    got = [results[w] for w in range(workers) if w in results]
    manager.shutdown()
    return {size: sum(r[size] for r in got) / len(got) for size in sizes} if got else {}


# --- driver --------------------------------------------------------------------------------------


def run_job(python: str, servers: int, workers: int, mac: bool, mxnet: bool,
            args: argparse.Namespace, workdir: Path, repo: Path = REPO,
            allreduce: bool = False) -> dict[int, float] | None:
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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
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


def summarize(runs: list[dict[int, float] | None], stat: str = "median") -> dict[int, float]:
    """Each size's median (or best) time over the runs that finished."""
    times: dict[int, list[float]] = {}
    for r in runs:
        for size, t in (r or {}).items():
            times.setdefault(size, []).append(t)
    if stat == "best":
        return {size: min(ts) for size, ts in times.items()}
    return {size: statistics.median(ts) for size, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help="comma-separated, e.g. 4K,64K,1M,16M (4K is shown as a latency)")
    ap.add_argument("--grid", default=DEFAULT_GRID, help="WxS configurations: workers x servers")
    ap.add_argument("--mac", default="off", help="payload MAC settings of ours to run: off, on, off,on")
    ap.add_argument("--op", choices=("push+pull", "pushpull"), default="push+pull",
                    help="ours: push then pull (as MXNet), or one pushpull call")
    ap.add_argument("--compare-mxnet", action="store_true",
                    help="also run the same loop with MXNet 1.9.1's dist_sync (ps-lite)")
    ap.add_argument("--mxnet-python", default=os.environ.get("PSLAUNCH_MXNET_PYTHON", MXNET_PYTHON))
    ap.add_argument("--before", metavar="[NAME=]DIR", action="append", default=[],
                    help="also run another checkout's KVStore (under this launcher), for example "
                    "the commit before a change, as a column NAME ('before'); repeatable")
    ap.add_argument("--no-raw-tcp", action="store_true", help="skip the raw TCP column")
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration, interleaved")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="what the table shows of the --repeat runs")
    ap.add_argument("--budget", type=parse_size, default=parse_size("128M"),
                    help="bytes per worker and size to time (iterations = budget / size, 5..1000)")
    ap.add_argument("--timeout", type=float, default=900)
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
    grid = parse_grid(args.grid)
    macs = [m.strip() == "on" for m in args.mac.split(",")]
    if args.compare_mxnet and not os.path.exists(args.mxnet_python):
        sys.exit(f"bench: no MXNet python at {args.mxnet_python}; pass --mxnet-python")
    systems: list[tuple[str, bool, bool]] = [("ours" + (" MAC" if mac else ""), mac, False) for mac in macs]
    others: dict[str, Path] = {}
    for item in args.before:
        name, _, where = item.rpartition("=")
        others[name or "before"] = Path(where).resolve()
    systems += [(name, False, False) for name in others]
    if args.compare_mxnet:
        systems.append(("MXNet", False, True))
    runs: dict[tuple[str, int, int], list[dict[int, float] | None]] = {}
    tcp_runs: dict[tuple[int, int], list[dict[int, float] | None]] = {}
    started = time.time()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        for rep in range(args.repeat):
            for w, s in grid:
                if not args.no_raw_tcp:
                    tcp_runs.setdefault((w, s), []).append(raw_tcp(sizes, args.budget, w, s))
                for name, mac, mx in systems:
                    python = args.mxnet_python if mx else sys.executable
                    print(f"[{rep + 1}/{args.repeat}] W={w} S={s} {name} ...", file=sys.stderr, flush=True)
                    repo = others.get(name, REPO)
                    runs.setdefault((name, w, s), []).append(
                        run_job(python, s, w, mac, mx, args, Path(tmp), repo))
            if args.allreduce == "on":
                for w in sorted({w for w, _ in grid}):
                    print(f"[{rep + 1}/{args.repeat}] W={w} allreduce ...", file=sys.stderr, flush=True)
                    runs.setdefault(("allreduce", w, 0), []).append(
                        run_job(sys.executable, 0, w, False, False, args, Path(tmp), allreduce=True))
    table = {k: summarize(v, args.stat) for k, v in runs.items()}
    tcp = {k: summarize(v, args.stat) for k, v in tcp_runs.items()}
    names = [n for n, _, _ in systems]

    def mbs(size: int, t: float | None) -> str:
        return "-" if t is None else f"{2 * size / t / 1e6:,.0f}"

    print(f"\nKVStore push+pull, dist_sync, float32, op={args.op}, {args.stat} of {args.repeat} "
          "interleaved runs; "
          "MB/s per worker = (pushed + pulled) / time")
    print(f"load average at start: {load0[0]:.2f}, at the end: {os.getloadavg()[0]:.2f}; "
          f"cores: {os.cpu_count()}; {time.time() - started:.0f} s in all")
    for size in sizes:
        if size == LATENCY_SIZE:
            continue
        print(f"\n{show_size(size)}: MB/s per worker")
        head = "| W | S |" + ("" if args.no_raw_tcp else " raw TCP |") + "".join(f" {n} |" for n in names)
        if not args.no_raw_tcp:
            head += " ours / raw TCP |"
        if args.compare_mxnet:
            head += " ours / MXNet |"
        print(head)
        print("| ---: | ---: |" + " ---: |" * (head.count("|") - 3))
        for w, s in grid:
            row = f"| {w} | {s} |"
            if not args.no_raw_tcp:
                row += f" {mbs(size, tcp.get((w, s), {}).get(size))} |"
            for n in names:
                row += f" {mbs(size, table[(n, w, s)].get(size))} |"
            if not args.no_raw_tcp:
                ours, raw = table[(names[0], w, s)].get(size), tcp.get((w, s), {}).get(size)
                row += f" {raw / ours:.2f}x |" if ours and raw else " - |"
            if args.compare_mxnet:
                ours, theirs = table[(names[0], w, s)].get(size), table[("MXNet", w, s)].get(size)
                row += f" {theirs / ours:.2f}x |" if ours and theirs else " - |"
            print(row)
    if LATENCY_SIZE in sizes:
        print("\n4 KB push+pull: round trip in microseconds (lower is better)")
        head = "| W | S |" + ("" if args.no_raw_tcp else " raw TCP |") + "".join(f" {n} |" for n in names)
        if args.compare_mxnet:
            head += " MXNet / ours |"
        print(head)
        print("| ---: | ---: |" + " ---: |" * (head.count("|") - 3))

        def us(t: float | None) -> str:
            return "-" if t is None else f"{t * 1e6:,.0f}"

        for w, s in grid:
            row = f"| {w} | {s} |"
            if not args.no_raw_tcp:
                row += f" {us(tcp.get((w, s), {}).get(LATENCY_SIZE))} |"
            for n in names:
                row += f" {us(table[(n, w, s)].get(LATENCY_SIZE))} |"
            if args.compare_mxnet:
                ours, theirs = table[(names[0], w, s)].get(LATENCY_SIZE), table[("MXNet", w, s)].get(LATENCY_SIZE)
                row += f" {theirs / ours:.2f}x |" if ours and theirs else " - |"
            print(row)
    if any(k[0] == "allreduce" for k in table):
        print(f"\nNo servers: dist_allreduce under --tracker torch (gloo), beside push+pull with one server "
              f"({names[0]}); MB/s per worker")
        print("| size | W | push+pull, S=1 | allreduce |\n| ---: | ---: | ---: | ---: |")
        for size in sizes:
            for w in sorted({w for w, _ in grid}):
                ps = table.get((names[0], w, 1), {}).get(size)
                ar = table[("allreduce", w, 0)].get(size)
                print(f"| {show_size(size)} | {w} | {mbs(size, ps)} | {mbs(size, ar)} |")
    print("\nraw TCP: the same dist_sync round with plain sockets (W client processes, one stream "
          "to each of S server processes, each server answers every client once all have pushed; "
          "no ZeroMQ, no summing): what this machine moves in that round")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "sizes": sizes, "grid": grid, "raw_tcp": {f"{w}x{s}": v for (w, s), v in tcp.items()},
            "runs": {f"{n} {w}x{s}": v for (n, w, s), v in table.items()},
            "op": args.op, "repeat": args.repeat}, indent=1))


if __name__ == "__main__":
    main()
