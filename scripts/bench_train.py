#!/usr/bin/env python3
"""Benchmark train_mnist: samples/s per worker beside MXNet 1.9.1, the start-up, and the step.

Three tables, each measured side by side in one run (``--before DIR`` adds another checkout's
trainer, for example the commit before a change, as a column of its own):

1. **Training**: samples/s per worker (the mean over the workers, from each epoch's time)
   and the final validation accuracy, for each network, batch size and kv-store:
   ``local`` (one process, all cores) and ``dist_sync``/``dist_async`` (two workers and one
   server on the local launcher, ``python -m launcher -n 2 -s 1``), ``dist_allreduce`` (two
   workers and no server, the gradients summed with torch.distributed's allreduce:
   ``python -m launcher -n 2 --tracker torch``; MXNet has no such store: ours only); ours
   (``scripts/train_mnist.py``) and MXNet's own training (``scripts/bench_train_mxnet.py``)
   with the same settings. By default one full epoch (60,000 examples). Each contender keeps
   its best of several settings, which the table names: in one process one thread and all the
   cores (``--threads`` for ours, ``OMP_NUM_THREADS`` for MXNet); under the launcher every
   process gets one thread; MXNet also runs with its naive engine, everywhere (see
   ``settings``). ``pair`` runs two workers
   that never talk (``--kv-store local``, half the examples each, under the launcher): the
   most that any two-worker job reaches on this machine. With ``local``, ``dist_sync`` and
   ``pair`` a second table sets the lead over MXNet in one process (at each one's best, and
   with one thread each, as a worker of the two-worker job has) beside the lead under
   dist_sync, and each trainer's dist_sync speed as a share of its pair's.
2. **Enter to first batch** (``--first-batch N``): ``pslaunch -n 2 -s 1 ... --kv-store
   dist_sync``, from starting the command until every worker has logged its first
   Speedometer line (``--disp-batches 1``, after batch 1 in both trainers), median of N runs,
   interleaved.
3. **The step** (``--step``): in one process, the trainer's whole step after backward
   (gradients out of the model, ``kv.pushpull``, weights back, gradients cleared) against a
   fused multi-tensor SGD step with momentum and weight decay (``torch.optim.SGD(foreach=True)``
   and its ``zero_grad``) on the same model, ``local`` and ``device`` stores, mlp and lenet at
   batch 64: the median over rounds of the mean of 300 steps, interleaved.

Examples::

    python scripts/bench_train.py                                 # training table, full epochs
    python scripts/bench_train.py --first-batch 5 --step --no-training
    python scripts/bench_train.py --before /tmp/old-checkout --repeat 2
    python scripts/bench_train.py --mxnet none                    # ours only
    python scripts/bench_train.py --modes dist_sync,dist_allreduce --networks lenet
    python scripts/bench_train.py --modes local,dist_sync,pair --repeat 3    # the dist_sync lead

Close other work first: the numbers are only as quiet as the machine (``--repeat 3`` keeps
the fastest of three runs of each case; every table ends with the load average).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pscontract as pc  # noqa: E402
from trainer.summary import read_summaries  # noqa: E402

MODES = ("local", "dist_sync", "dist_async", "dist_allreduce", "pair")
MXNET_CANDIDATES = ("/opt/mxnet-venv/bin/python", str(REPO / ".venv-mxnet" / "bin" / "python"))


def find_mxnet(choice: str | None) -> str | None:
    """The Python of an MXNet venv: ``--mxnet``, ``$PSLAUNCH_MXNET_PYTHON``, or a known place."""
    if choice == "none":
        return None
    for cand in (choice, os.environ.get("PSLAUNCH_MXNET_PYTHON"), *MXNET_CANDIDATES):
        if cand and os.path.exists(cand):
            return cand
    return None


def run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[list[dict[str, Any]], float, str]:
    """Run a command; return its JSON summary lines, its wall time and its output tail."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - t0
    out = read_summaries(proc.stdout)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{tail}")
    return out, wall, tail


def command(python: str, script: Path, mode: str, args: list[str]) -> list[str]:
    inner = [python, str(script), "--kv-store", "local" if mode == "pair" else mode, *args]
    if mode == "local":
        return inner
    if mode == "pair":  # two workers that never talk: no kvstore traffic, no server, no waiting
        return [sys.executable, "-m", "launcher", "-n", "2", "-s", "0", "--launcher", "local", *inner]
    if mode == "dist_allreduce":  # no servers: the torch tracker's rendezvous, gloo's allreduce
        return [sys.executable, "-m", "launcher", "-n", "2", "--tracker", "torch", "--launcher", "local", *inner]
    return [sys.executable, "-m", "launcher", "-n", "2", "-s", "1", "--launcher", "local", *inner]


def contenders(a: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """``(name, python, script)`` of each trainer in the comparison."""
    out = [("ours", sys.executable, REPO / "scripts" / "train_mnist.py")]
    if a.before:
        out.append(("before", sys.executable, Path(a.before).resolve() / "scripts" / "train_mnist.py"))
    mxnet = find_mxnet(a.mxnet)
    if mxnet:
        out.append(("mxnet", mxnet, REPO / "scripts" / "bench_train_mxnet.py"))
    return out


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env[pc.PYTHONPATH] = os.pathsep.join([str(REPO)] + [x for x in env.get(pc.PYTHONPATH, "").split(os.pathsep) if x])
    env.pop(pc.OMP_NUM_THREADS, None)
    return env


# --- 1. training ------------------------------------------------------------------------------


class Setting(NamedTuple):
    """One way to run a contender: its thread count (None: the launcher's one per process) and
    extra environment."""

    threads: int | None
    env: dict[str, str]

    @property
    def label(self) -> str:
        parts = [] if self.threads is None else [f"{self.threads} thread{'s' if self.threads > 1 else ''}"]
        if self.env.get("MXNET_ENGINE_TYPE") == "NaiveEngine":
            parts.append("naive engine")
        return ", ".join(parts)


def settings(name: str, mode: str, cores: int) -> list[Setting]:
    """Every setting a contender is tried with; the table keeps its best. In one process each
    runs with one thread and with all the cores; under the launcher every process gets one.
    MXNet also runs with its ``NaiveEngine`` (each operator run at once on the caller's thread):
    its default threaded engine adds a thread that fights the OpenMP threads for the cores, so
    its lenet in one process is fastest on both cores with the naive engine, and on one core
    otherwise. Under dist_sync the threaded engine is the faster (it overlaps the kvstore's
    traffic with computation), so both are tried there too."""
    threads: tuple[int | None, ...] = (1, cores) if mode == "local" and cores > 1 else (None,)
    out = [Setting(t, {}) for t in threads]
    if name == "mxnet":
        naive = {"MXNET_ENGINE_TYPE": "NaiveEngine"}
        out += [Setting(t, naive) for t in threads if t != 1]
    return out


def training(a: argparse.Namespace, who: list[tuple[str, str, Path]], cores: int) -> list[dict[str, Any]]:
    rows = []
    env = base_env()
    for network in a.networks.split(","):
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            for mode in a.modes.split(","):
                # a pair's workers each take half the examples, as those of a two-worker job do
                examples = a.num_examples // 2 if mode == "pair" else a.num_examples
                common = ["--network", network, "--batch-size", str(batch), "--num-epochs", str(a.num_epochs),
                          "--num-examples", str(examples), "--disp-batches", "100000"]
                if a.data_dir:
                    common += ["--data-dir", a.data_dir]
                row: dict[str, Any] = {"network": network, "batch": batch, "mode": mode}
                case_stat = _stat()
                best: dict[str, tuple[list[dict[str, Any]], Setting]] = {}
                for _ in range(a.repeat):  # interleaved: each contender once per round
                    for name, python, script in who:
                        if name == "mxnet" and mode == "dist_allreduce":
                            continue
                        for setting in settings(name, mode, cores):
                            if f"{name}_error" in row:
                                break
                            run_env, argv = dict(env), command(python, script, mode, common)
                            run_env.update(setting.env)
                            if setting.threads is not None and name == "mxnet":
                                run_env[pc.OMP_NUM_THREADS] = str(setting.threads)
                            elif setting.threads is not None:
                                argv += ["--threads", str(setting.threads)]
                            try:
                                summaries, _, _ = run(argv, run_env, a.timeout)
                            except (RuntimeError, subprocess.TimeoutExpired) as e:
                                print(f"# {network} batch {batch} {mode} ({name}) FAILED: {e}", flush=True)
                                row[f"{name}_error"] = str(e)
                                continue
                            if name not in best or _speed(summaries) > _speed(best[name][0]):
                                best[name] = (summaries, setting)
                            if setting.threads is not None:
                                by = row.setdefault(f"{name}_by_threads", {})
                                by[setting.threads] = max(by.get(setting.threads, 0.0), _speed(summaries))
                for name, (summaries, setting) in best.items():
                    row[name] = _speed(summaries)
                    row[f"{name}_acc"] = _mean(s["validation_accuracy"] for s in summaries)
                    row[f"{name}_setting"] = setting.label
                row["steal"] = _steal(case_stat)
                rows.append(row)
                print(f"# {network} batch {batch} {mode}: "
                      + ", ".join(f"{n} {_fmt(row.get(n), '.0f')}/s" + _setting(row, n) for n, _, _ in who)
                      + f" (steal {row['steal']})", flush=True)
    names = [n for n, _, _ in who]
    print()
    print(f"Training: samples/s per worker, {a.num_epochs} epoch(s) of {a.num_examples} examples, best of {a.repeat}")
    head = "| network | batch | kv-store (workers) | " + " | ".join(_label(n) for n in names)
    ratios = [n for n in names if n != "mxnet"] if "mxnet" in names else []
    head += "".join(f" | {_label(n)} / MXNet" for n in ratios)
    head += "".join(f" | {_label(n)} val. acc." for n in names) + " |"
    print(head)
    print("| --- | ---: | --- |" + " ---: |" * (2 * len(names) + len(ratios)))
    for r in rows:
        who_ = {"local": "local (1)", "dist_allreduce": "dist_allreduce (2, --tracker torch)",
                "pair": "pair: 2 x local, half each"}.get(r["mode"], f"{r['mode']} (2 + 1 server)")
        cells = [_fmt(r.get(n), ",.0f", f"{n}_error" in r) + _setting(r, n) for n in names]
        cells += [_fmt(r[n] / r["mxnet"] if r.get(n) and r.get("mxnet") else None, ".2f") for n in ratios]
        cells += [_fmt(r.get(f"{n}_acc"), ".4f", f"{n}_error" in r) for n in names]
        print(f"| {r['network']} | {r['batch']} | {who_} | " + " | ".join(cells) + " |")
    if ratios:
        leads(rows, ratios, cores)
    return rows


def leads(rows: list[dict[str, Any]], names: list[str], cores: int) -> None:
    """The lead over MXNet in one process (at its best, and with one thread each: what a
    worker of a two-worker job on this machine has) beside the lead under dist_sync; and each
    trainer's dist_sync speed as a share of its pair's (two processes that never talk, each
    half the examples: the most any two-worker job reaches on this machine), which is what is
    left after the kvstore's traffic and waiting."""
    by = {(r["network"], r["batch"], r["mode"]): r for r in rows}
    lines = []
    for (network, batch, mode), r in by.items():
        if mode != "dist_sync" or not r.get("mxnet"):
            continue
        local, pair = by.get((network, batch, "local"), {}), by.get((network, batch, "pair"), {})
        for n in names:
            if not r.get(n):
                continue
            one = (local.get(f"{n}_by_threads", {}).get(1), local.get("mxnet_by_threads", {}).get(1))
            cells = [_fmt(local[n] / local["mxnet"] if local.get(n) and local.get("mxnet") else None, ".2f"),
                     _fmt(one[0] / one[1] if all(one) else None, ".2f"),
                     _fmt(r[n] / r["mxnet"], ".2f"),
                     _fmt(r[n] / pair[n] if pair.get(n) else None, ".2f"),
                     _fmt(r["mxnet"] / pair["mxnet"] if pair.get("mxnet") else None, ".2f")]
            lines.append(f"| {network} | {batch} | {_label(n)} | " + " | ".join(cells) + " |")
    if not lines:
        return
    print()
    print(f"Lead over MXNet 1.9.1, and dist_sync as a share of the pair (2 workers + 1 server on {cores} cores)")
    print("| network | batch | trainer | one process, best | one process, 1 thread each | dist_sync per worker "
          "| dist_sync / pair | MXNet's dist_sync / its pair |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for line in lines:
        print(line)


def _setting(row: dict[str, Any], name: str) -> str:
    """`` (2 threads, naive engine)`` after a speed: the setting that was fastest."""
    label = row.get(f"{name}_setting")
    return f" ({label})" if label else ""


def _speed(summaries: list[dict[str, Any]]) -> float:
    return _mean(s["samples_per_sec"] for s in summaries)


# --- 2. Enter to first batch -----------------------------------------------------------------


def first_batch(a: argparse.Namespace, who: list[tuple[str, str, Path]]) -> dict[str, list[float]]:
    """Seconds from starting ``pslaunch -n 2 -s 1 ... dist_sync`` until every worker has logged
    its first Speedometer line (``--disp-batches 1``: the end of its batch 1 in both trainers)."""
    env = base_env()
    args = ["--network", "lenet", "--num-epochs", "1", "--num-examples", "1280", "--disp-batches", "1"]
    if a.data_dir:
        args += ["--data-dir", a.data_dir]
    pattern = re.compile(r"^\[worker (\d+)\].*Epoch\[0\] Batch \[")
    times: dict[str, list[float]] = {n: [] for n, _, _ in who}
    for _ in range(a.first_batch):
        for name, python, script in who:
            enter = time.perf_counter()
            proc = subprocess.Popen(command(python, script, "dist_sync", args), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
            seen: dict[str, float] = {}
            assert proc.stdout is not None
            for line in proc.stdout:
                m = pattern.match(line)
                if m and m.group(1) not in seen:
                    seen[m.group(1)] = time.perf_counter() - enter
                    if len(seen) == 2:
                        times[name].append(max(seen.values()))
            if proc.wait(a.timeout) != 0 or len(seen) != 2:
                print(f"# first batch ({name}) FAILED: exit {proc.returncode}", flush=True)
    print()
    print(f"Enter to first batch: pslaunch -n 2 -s 1 ... --kv-store dist_sync (lenet), until both "
          f"workers logged their first batch line; median of {a.first_batch} (min - max)")
    print("| trainer | Enter to first batch |")
    print("| --- | ---: |")
    for name, vals in times.items():
        if vals:
            print(f"| {_label(name)} | {statistics.median(vals):.2f} s ({min(vals):.2f} - {max(vals):.2f}) |")
    return times


# --- 3. the step -------------------------------------------------------------------------------


def step_child(repo: str, network: str, kvtype: str, rounds: int) -> None:
    """Measure one (network, kv-store) pair in this process with the trainer in ``repo``."""
    sys.path.insert(0, repo)
    import torch

    from trainer import kvstore
    from trainer.fit import Replicas, TrainConfig, optimizer_spec

    torch.set_num_threads(1)
    rep = Replicas(network, [torch.device("cpu")], 0, None)
    kv = kvstore.create(kvtype)
    keys = list(range(len(rep.names)))
    kv.init(keys, rep.weights[0])
    kv.pull(keys, rep.outs())
    kv.set_optimizer(optimizer_spec(TrainConfig(network=network), kvtype, 1, 938, rep.names))
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    rep.forward_backward(x, y, [slice(0, 64)])
    params = list(rep.model.parameters())
    grads = [p.grad.clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4, foreach=True)

    def set_grads() -> None:  # what backward does, in both
        for p, g in zip(params, grads):
            p.grad = g

    def ours() -> None:
        kv.pushpull(keys, rep.grads(), rep.outs())
        rep.zero_grad()
        set_grads()

    def fused() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
        set_grads()

    res: dict[str, list[float]] = {"ours": [], "fused": []}
    for _ in range(rounds):
        for name, f in (("ours", ours), ("fused", fused)):
            for _ in range(20):
                f()
            t = time.perf_counter()
            for _ in range(300):
                f()
            res[name].append((time.perf_counter() - t) / 300 * 1e6)
    print(json.dumps({k: statistics.median(v) for k, v in res.items()}))


def steps(a: argparse.Namespace, who: list[tuple[str, str, Path]]) -> None:
    repos = [(n, script.parent.parent) for n, _, script in who if n != "mxnet"]
    rows = []
    for network in ("mlp", "lenet"):
        for kvtype in ("local", "device"):
            row = [network, kvtype]
            for _, repo in repos:
                out = subprocess.run([sys.executable, __file__, "--step-child", str(repo), network, kvtype,
                                      str(a.step_rounds)], capture_output=True, text=True, timeout=600)
                got = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
                row.append(got)
            rows.append(row)
    print()
    print("The step after backward, batch 64, one thread: microseconds (median of rounds of 300 steps); "
          "fused = torch.optim.SGD(foreach=True) step + zero_grad")
    head = "| network | kv-store |" + "".join(f" {_label(n)}: whole step | fused SGD | ratio |" for n, _ in repos)
    print(head)
    print("| --- | --- |" + " ---: | ---: | ---: |" * len(repos))
    for network, kvtype, *results in rows:
        cells = []
        for got in results:
            if got is None:
                cells += ["failed", "-", "-"]
            else:
                cells += [f"{got['ours']:.0f}", f"{got['fused']:.0f}", f"{got['ours'] / got['fused']:.2f}"]
        print(f"| {network} | {kvtype} | " + " | ".join(cells) + " |")


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--step-child":
        step_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default="lenet,mlp")
    p.add_argument("--batch-sizes", default="64")
    p.add_argument("--modes", default="local,dist_sync", help=f"from {','.join(MODES)}")
    p.add_argument("--num-examples", type=int, default=60000)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--mxnet", default=None, help="MXNet's python, or 'none' (default: found automatically)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="another checkout whose trainer runs beside ours (a column 'before')")
    p.add_argument("--data-dir", default=None, help="train_mnist's --data-dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--repeat", type=int, default=1, help="run each case this many times, keep the fastest")
    p.add_argument("--no-training", action="store_true", help="skip the training table")
    p.add_argument("--first-batch", type=int, default=0, metavar="N",
                   help="also measure Enter to first batch, N runs each")
    p.add_argument("--step", action="store_true", help="also measure the step against fused SGD")
    p.add_argument("--step-rounds", type=int, default=7)
    p.add_argument("--json", default=None, help="also write the training rows to this file")
    p.add_argument("--loopback-rate", default=None, metavar="RATE",
                   help="as root: limit the loopback interface to RATE (tc's form: 1gbit) for the "
                        "run, so that the job's traffic takes the time a real link's would; removed "
                        "at the end (every program on this host shares the limit meanwhile)")
    a = p.parse_args()
    who = contenders(a)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load0, stat0 = _load(), _stat()
    print(f"# bench_train: {cores} cores; " + ", ".join(f"{n}: {py} {s}" for n, py, s in who), flush=True)
    failed = False
    with _loopback_rate(a.loopback_rate):
        if not a.no_training:
            rows = training(a, who, cores)
            failed = any(k.endswith("_error") for r in rows for k in r)
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=1))
        if a.first_batch:
            first_batch(a, who)
        if a.step:
            steps(a, who)
    print(f"\nload average before/after: {load0} / {_load()}; CPU time taken by the hypervisor "
          f"(steal): {_steal(stat0)} (on a VM, rows measured under different steal compare poorly)")
    return 1 if failed else 0


@contextlib.contextmanager
def _loopback_rate(rate: str | None) -> Iterator[None]:
    """Loopback limited to ``rate`` (a tbf qdisc on ``lo``) while the block runs; nothing without."""
    if not rate:
        yield
        return
    add = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "128kb", "latency", "50ms"]
    try:
        proc = subprocess.run(add, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        sys.exit("bench_train: --loopback-rate needs tc (apt-get install iproute2)")
    if proc.returncode != 0:
        sys.exit(f"bench_train: --loopback-rate {rate}: {' '.join(add)} failed ({proc.stderr.strip()}); "
                 "it needs root and a free root qdisc on lo")
    print(f"# loopback limited to {rate} (tbf) for this run", flush=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=30)


def _label(name: str) -> str:
    return {"ours": "ours", "before": "before", "mxnet": "MXNet 1.9.1"}.get(name, name)


def _stat() -> tuple[int, int] | None:
    """``(steal, all)`` CPU ticks so far, from the first line of /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def _steal(since: tuple[int, int] | None) -> str:
    """The share of CPU time the hypervisor took from this VM since ``since`` (``steal``)."""
    now = _stat()
    if since is None or now is None or now[1] <= since[1]:
        return "unknown"
    return f"{100 * (now[0] - since[0]) / (now[1] - since[1]):.0f}%"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _mean(values: Any) -> float:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _fmt(value: float | None, spec: str, failed: bool = False) -> str:
    if value is None:
        return "failed" if failed else "-"
    return format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
