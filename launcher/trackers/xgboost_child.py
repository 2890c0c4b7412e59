"""Runs XGBoost's own tracker (2.1 and later) for the launcher, in a process of its own.

Usage (with a Python that has xgboost >= 2.1; the launcher never imports it)::

    python xgboost_child.py --n-workers N --host-ip ADDR [--port-range LOW-HIGH]
                            [--sortby host|task] [--timeout SECONDS]

It starts ``xgboost.tracker.RabitTracker`` on ``ADDR`` and the first port of
the range it can bind, then writes JSON lines on its stdout, one object each:

* ``{"event": "listening", "worker_args": {...}, "env": {...}, "xgboost": VERSION, "pid": PID}``
  once it listens. ``worker_args`` is ``tracker.worker_args()``, what a worker
  passes to ``xgboost.collective.CommunicatorContext(**worker_args)``
  (``dmlc_tracker_uri``, ``dmlc_tracker_port``); ``env`` is the same as the
  variables ``DMLC_TRACKER_URI`` and ``DMLC_TRACKER_PORT``. XGBoost 2.1+ reads
  no variable itself: a script builds the arguments from them, with the port
  as an int and the task id as a str (XGBoost rejects other types)::

      args = {"dmlc_tracker_uri": os.environ["DMLC_TRACKER_URI"],
              "dmlc_tracker_port": int(os.environ["DMLC_TRACKER_PORT"]),
              "dmlc_task_id": os.environ["DMLC_TASK_ID"]}
      with xgboost.collective.CommunicatorContext(**args):
          rank = xgboost.collective.get_rank()  # shard the data by this
* ``{"event": "done"}`` when every worker has finished (exit code 0), or
  ``{"event": "failed", "error": "..."}`` (exit code 1; 2 when it could not
  start: no xgboost, an xgboost too old, no free port).

Nothing else goes to stdout: the file descriptor is moved aside before xgboost
is imported, and whatever xgboost or the workers' ``communicator_print``
messages write goes to stderr, for the launcher to label.

Stdin is the launcher's leash: when it reaches end of file (the launcher closed
the pipe, or died) the program exits at once with code 0 (``{"event":
"stopped"}``), whatever the tracker is doing. The launcher must therefore give
it a pipe and keep the write end open while the job runs.

Ranks follow the tracker's sort: by host address, then by task id compared as
*strings* (``"10"`` sorts before ``"2"``); ``--sortby task`` sorts by task id
only. From 10 workers on a host, ranks are therefore not ``DMLC_TASK_ID``:
shard the data by ``xgboost.collective.get_rank()``.

Standard library and xgboost only; nothing from the launcher is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading


def _emit(stream, **obj) -> None:
    try:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _first_line(e: BaseException) -> str:
    """XGBoost errors carry a stack trace; keep the lines that say what went wrong."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("Stack trace", "[bt]"))]
    return " ".join(keep)[:500] or type(e).__name__


def _parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise SystemExit(f"bad --port-range {text!r}: expected LOW-HIGH") from None
    if not 0 <= low <= high <= 65535:
        raise SystemExit(f"bad --port-range {text!r}: need 0 <= LOW <= HIGH <= 65535")
    return low, high


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-workers", type=int, required=True)
    ap.add_argument("--host-ip", required=True)
    ap.add_argument("--port-range", default="0", help="LOW-HIGH (default 0: any free port)")
    ap.add_argument("--sortby", choices=["host", "task"], default="host")
    ap.add_argument("--timeout", type=int, default=0,
                    help="XGBoost's own limit on start-up and shut-down, seconds (0: none)")
    a = ap.parse_args(argv)
    low, high = _parse_range(a.port_range)

    # our JSON lines get the real stdout; everything else that writes to fd 1 gets stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    try:
        import xgboost
        from xgboost.tracker import RabitTracker
    except ImportError as e:
        _emit(out, event="failed", error=f"cannot import xgboost with {sys.executable}: {e}; "
                                         "install xgboost>=2.1 there or choose another --tracker-python")
        return 2
    version = xgboost.__version__
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor < (2, 1):
        _emit(out, event="failed", error=f"xgboost {version} at {sys.executable} predates the new tracker "
                                         "(2.1): use --tracker rabit for it")
        return 2

    tracker = None
    last = "empty port range"
    for port in range(low, high + 1):
        try:
            tracker = RabitTracker(n_workers=a.n_workers, host_ip=a.host_ip, port=port, sortby=a.sortby,
                                   timeout=a.timeout)
            break
        except Exception as e:  # XGBoostError; its text names the cause
            last = _first_line(e)
            if "in use" not in last:
                break
    if tracker is None:
        _emit(out, event="failed", error=f"cannot start XGBoost's tracker on {a.host_ip} port {low}-{high}: "
                                         f"{last}")
        return 2
    tracker.start()
    args = tracker.worker_args()
    _emit(out, event="listening", worker_args=args, xgboost=version, pid=os.getpid(),
          env={"DMLC_TRACKER_URI": str(args["dmlc_tracker_uri"]),
               "DMLC_TRACKER_PORT": str(args["dmlc_tracker_port"])})

    result: dict = {}
    finished = threading.Event()

    def wait() -> None:
        try:
            tracker.wait_for()
            result["ok"] = True
        except Exception as e:
            result["error"] = _first_line(e)
        finished.set()

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        result.setdefault("stopped", True)
        finished.set()

    threading.Thread(target=wait, name="xgb-tracker-wait", daemon=True).start()
    threading.Thread(target=watch_stdin, name="xgb-tracker-stdin", daemon=True).start()
    finished.wait()
    if result.get("ok"):
        _emit(out, event="done")
        code = 0
    elif "error" in result:
        _emit(out, event="failed", error=result["error"])
        code = 1
    else:
        _emit(out, event="stopped")
        code = 0
    sys.stderr.flush()
    # os._exit: the tracker's C++ threads and destructor may block, or raise at exit
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
