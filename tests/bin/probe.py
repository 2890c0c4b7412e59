"""Test helper run under the launcher: records what it sees, then behaves as told.

Writes ``OUT/<scheduler|server-R|worker-R>.json`` with its environment, argv,
cwd, pid, pgid and host, then (by flags) listens as a scheduler, spawns a
grandchild, ignores SIGTERM, fails with a code, or sleeps. With ``--notices``, each SIGUSR1 or
SIGUSR2 it gets (a batch system's notice, passed on by the launcher) adds a line
``USR1 PID TIME`` to ``OUT/<name>.notices``, and it goes on (with ``--exit-on-notice``: it
exits with ``--exit``'s code at its next look, as a program that checkpointed); the handler is set before the
record is written, so a record means that a notice is safe to send.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

# The contract's names, spelled here on purpose: this program stands for any user program,
# which reads the variables without importing anything of pslaunch.
ROLE, TASK_ID, NUM_WORKER = "DMLC_ROLE", "DMLC_TASK_ID", "DMLC_NUM_WORKER"
ROOT_URI, ROOT_PORT = "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"
TRACKERS = (("DMLC_TRACKER_URI", "DMLC_TRACKER_PORT"), ("MASTER_ADDR", "MASTER_PORT"))
ATTEMPT = "PSLAUNCH_ATTEMPT"
REPLACEMENT = "PSLAUNCH_REPLACEMENT"


def name_of(env: dict) -> str:
    role = env.get(ROLE, "worker")
    if role == "scheduler":
        return "scheduler"
    task = int(env.get(TASK_ID, "0"))
    nw = int(env.get(NUM_WORKER, "0"))
    return f"server-{task - nw}" if role == "server" else f"worker-{task}"


def _netns() -> str:
    """``net:[INODE]``: which network namespace (testbed host) the process ran in."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _reach(env: dict) -> str:
    """``"ok"`` when this process can connect to its tracker (or torch store), else why not."""
    for host, port in TRACKERS:
        if env.get(host):
            try:
                socket.create_connection((env[host], int(env[port])), timeout=10).close()
                return "ok"
            except (OSError, ValueError) as e:
                return f"{env[host]}:{env.get(port)}: {e}"
    return "no tracker in the environment"


def _wait_for_the_others(out: str, env: dict, timeout: float = 30.0) -> None:
    """Until every server and worker of this attempt (same root port) wrote its record, then a
    moment for the launcher to read what each printed after it."""
    want = int(env.get("DMLC_NUM_SERVER", 0)) + int(env.get("DMLC_NUM_WORKER", 0))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        n = 0
        for name in os.listdir(out):
            if name.endswith(".json") and name != "scheduler.json":
                try:
                    with open(os.path.join(out, name)) as f:
                        n += json.load(f)["env"].get(ROOT_PORT) == env[ROOT_PORT]
                except (OSError, ValueError, KeyError):
                    pass
        if n >= want:
            break
        time.sleep(0.05)
    time.sleep(1.0)


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None: gone, or a zombie.
    From /proc/<pid>/stat, which any user may read (another user's environment is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _previous_alive(out: str, attempt: int) -> list:
    """The processes of the job's previous attempt still alive now, as ``[(name, pid)]``: those
    whose records the previous attempt wrote (with their grandchildren), found running and
    started before their record was written (not a reused pid)."""
    if attempt == 0:
        return []
    history = os.path.join(out, "history")
    alive = []
    for name in sorted(os.listdir(history)) if os.path.isdir(history) else []:
        if not name.endswith(f".{attempt - 1}.json"):
            continue
        with open(os.path.join(history, name)) as f:
            rec = json.load(f)
        for pid in [rec["pid"], rec.get("child"), *rec.get("escaped", [])]:
            started = _started_at(pid) if pid else None
            if started is not None and started <= rec["time"] + 1.0:  # (boot time has 1 s steps)
                alive.append((rec["name"], pid))
    return alive


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--listen", action="store_true", help="as scheduler: listen on the root port")
    ap.add_argument("--listen-after", type=float, default=None, metavar="SECONDS",
                    help="as scheduler: listen on the root port after SECONDS (as a ps-lite program "
                         "binds after its imports)")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--fail", default=None, help="ROLE-RANK:CODE[:DELAY], e.g. worker-1:3:0.5")
    ap.add_argument("--kill-self", default=None, metavar="ROLE-RANK:SIGNAL[:DELAY]",
                    help="after writing the record, kill this process with SIGNAL, e.g. worker-0:SEGV")
    ap.add_argument("--child", action="store_true", help="spawn a sleeping grandchild")
    ap.add_argument("--escape", action="store_true",
                    help="spawn two grandchildren that leave the process group: one calls setsid(), one "
                         "double-forks into a daemon; their pids go in the record (escaped)")
    ap.add_argument("--stop-self", default=None, metavar="ROLE-RANK",
                    help="after writing the record, stop this process with SIGSTOP (a hung process)")
    ap.add_argument("--cause", default=None, metavar="ROLE-RANK:REASON",
                    help="as the scheduler: print a pslaunch-cause line naming ROLE-RANK, then exit 1")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--notices", action="store_true",
                    help="record each SIGUSR1/SIGUSR2 in OUT/<name>.notices and go on")
    ap.add_argument("--exit-on-notice", action="store_true", help="with --notices: then end the sleep")
    ap.add_argument("--take-port-once", default=None, metavar="FLAGFILE")
    ap.add_argument("--print", action="append", default=[])
    ap.add_argument("--reach-tracker", action="store_true",
                    help="open (and close) a TCP connection to DMLC_TRACKER_URI or MASTER_ADDR; record how it went")
    ap.add_argument("--on-attempts", default=None, metavar="K[,K...]",
                    help="--fail, --kill-self and --exit only in these attempts (PSLAUNCH_ATTEMPT); "
                         "in the others, exit 0")
    ap.add_argument("--sleep-on-attempts", default=None, metavar="K[,K...]",
                    help="--sleep only in these attempts (PSLAUNCH_ATTEMPT); in the others, no sleep")
    ap.add_argument("--on-replacements", default=None, metavar="K[,K...]",
                    help="--fail and --kill-self only as these replacements of a lost worker "
                         "(PSLAUNCH_REPLACEMENT; 0: the first process of its place)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    attempt = int(os.environ.get(ATTEMPT, "0"))
    replacement = int(os.environ.get(REPLACEMENT, "0"))
    if a.on_attempts is not None and str(attempt) not in a.on_attempts.split(","):
        a.fail = a.kill_self = None
        a.exit = 0
    if a.on_replacements is not None and str(replacement) not in a.on_replacements.split(","):
        a.fail = a.kill_self = None
    if a.sleep_on_attempts is not None and str(attempt) not in a.sleep_on_attempts.split(","):
        a.sleep = 0.0
    # No core file in the working directory (the repository) when a test kills this process with
    # SIGSEGV or SIGABRT: batch systems start tasks with an unlimited core size.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    env = dict(os.environ)
    me = name_of(env)
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    noticed = []
    if a.notices:
        path = os.path.join(a.out, f"{me}.notices")

        def note(signum: int, frame: object) -> None:
            with open(path, "a") as f:  # (one short write: whole even if two arrive at once)
                f.write(f"{signal.Signals(signum).name[3:]} {os.getpid()} {time.time():.3f}\n")
            noticed.append(signum)

        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, note)
    listener = None
    if me == "scheduler" and a.take_port_once and not os.path.exists(a.take_port_once):
        # Simulate losing the port between the launcher's probe and our bind:
        # a detached helper grabs it, and we die as ps-lite does ("bind failed"). First the
        # attempt's other processes have printed (their output must never be shown).
        open(a.take_port_once, "w").close()
        _wait_for_the_others(a.out, env)
        holder = subprocess.Popen([sys.executable, "-c", (
            "import socket,sys,time; s=socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); "
            "s.listen(); print('held', flush=True); time.sleep(8)"),
            env[ROOT_URI], env[ROOT_PORT]], stdout=subprocess.PIPE, start_new_session=True)
        holder.stdout.readline()
        print("bind failed", file=sys.stderr)
        return 1
    if me == "scheduler" and a.listen_after is not None:
        time.sleep(a.listen_after)
    if me == "scheduler" and (a.listen or a.listen_after is not None):
        listener = socket.socket()
        listener.bind((env[ROOT_URI], int(env[ROOT_PORT])))
        listener.listen(64)
    escaped = []
    if a.escape:
        setsid = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
        daemon = subprocess.Popen([sys.executable, "-c", (
            "import os, sys, time\n"
            "if os.fork(): sys.exit(0)\n"
            "os.setsid()\n"
            "if os.fork(): sys.exit(0)\n"
            "print(os.getpid(), flush=True)\n"
            "time.sleep(300)\n")], stdout=subprocess.PIPE)
        escaped = [setsid.pid, int(daemon.stdout.readline())]
        daemon.wait()
    child_pid = None
    if a.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        child_pid = child.pid
    record = {
        "name": me, "env": env, "argv": sys.argv[1:], "rest": a.rest, "cwd": os.getcwd(), "pid": os.getpid(),
        "pgid": os.getpgid(0), "sid": os.getsid(0), "host": socket.gethostname(), "child": child_pid,
        "time": time.time(), "netns": _netns(), "escaped": escaped, "attempt": attempt,
        "previous_alive": _previous_alive(a.out, attempt), "replacement": replacement,
    }
    if a.reach_tracker:
        record["tracker"] = _reach(env)
    history = os.path.join(a.out, "history")  # every attempt's records (OUT/<name>.json: the latest)
    os.makedirs(history, exist_ok=True)
    try:
        os.chmod(history, 0o777)  # (the testbed's hosts may run the probes as other users)
    except OSError:
        pass
    kept = f"{me}~{replacement}" if replacement else me  # (a replacement's record beside its lost one's)
    for target in (os.path.join(history, f"{kept}.{attempt}.json"), os.path.join(a.out, f"{me}.json")):
        tmp = os.path.join(a.out, f".{me}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, target)
    for line in a.print:
        print(line, flush=True)
    if a.take_port_once and me != "scheduler":
        print(f"{me} started on port {env[ROOT_PORT]}", flush=True)
    if a.stop_self == me:
        os.kill(os.getpid(), signal.SIGSTOP)
    if a.cause and me == "scheduler":
        culprit, reason = a.cause.split(":", 1)
        role, rank = culprit.rsplit("-", 1)
        time.sleep(0.5)
        print(f"pslaunch-cause: {role} {rank}: {reason}", file=sys.stderr, flush=True)
        return 1
    if a.kill_self:
        target, signame, *delay = a.kill_self.split(":")
        if target == me:
            time.sleep(float(delay[0]) if delay else 0.0)
            os.kill(os.getpid(), getattr(signal, f"SIG{signame}"))
            time.sleep(5)  # (a handled signal would return here)
    if a.fail:
        target, code, *delay = a.fail.split(":")
        if target == me:
            time.sleep(float(delay[0]) if delay else 0.0)
            print(f"{me} failing with code {code}", file=sys.stderr, flush=True)
            return int(code)
    end = time.monotonic() + a.sleep
    while time.monotonic() < end and not (a.exit_on_notice and noticed):
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    if listener is not None:
        listener.close()
    return a.exit


if __name__ == "__main__":
    sys.exit(main())
