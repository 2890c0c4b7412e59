"""A real MXNet (ps-lite) job whose worker can be replaced mid-run (ps-lite's recovery).

Every role runs this file under MXNet 1.9.1 (import mxnet turns the scheduler and server
processes into their roles). Each worker does STEPS steps on one key; a replacement
(PSLAUNCH_REPLACEMENT >= 1, the lost worker's environment) learns from the servers how far the
lost worker got and does the rest, so the result is that of an uninterrupted run:

* dist_sync, no optimizer: the server sums one push of every worker per round and stores the
  sum; at step t each worker pushes t, so after round t the key holds nw * t and a replacement
  resumes at the first round not complete;
* dist_async, SGD with learning rate 1: every push is applied at once; the key is the weights
  followed by one step counter per rank (in the same push: one message), so a replacement
  resumes after its rank's last applied step.

A replacement does not call kv.init (the key is on the servers: a rank-0 worker's init is a
push, which a dist_sync server would count as this round's) nor set_optimizer (the servers
have it; it would reset their updater). MXNet skips the start barrier when ps-lite says
is_recovery (KVStoreDist's constructor and Init). Output lines start with "rank R:" and, on a
replacement, "recovery"; timings are time.time() for the test.
"""

import os
import signal
import sys
import time

import mxnet as mx

KV = os.environ.get("KV_TYPE", "dist_sync")
STEPS = int(os.environ.get("STEPS", "40"))
PAUSE = float(os.environ.get("STEP_PAUSE", "0.1"))
WIDTH = 4
replacement = int(os.environ.get("PSLAUNCH_REPLACEMENT", "0") or 0)
#: "TASK:STEP": the worker of that DMLC_TASK_ID kills itself (SIGKILL) after that step, unless it
#: is a replacement (for a job run by pslaunch --restart-scope process)
LOSE_AT = os.environ.get("LOSE_AT")
started = time.time()

kv = mx.kv.create(KV)
rank, nw = kv.rank, kv.num_workers
sync = "async" not in KV
size = WIDTH if sync else WIDTH + nw
KEY = 3


def pull() -> mx.nd.NDArray:
    out = mx.nd.zeros((size,))
    kv.pull(KEY, out=out)
    return out.asnumpy()


if replacement:
    now = pull()
    done = int(round(now[0] / nw)) if sync else int(round(now[WIDTH + rank]))
    print(f"rank {rank}: recovery (replacement {replacement}): connected at {time.time():.3f} "
          f"({time.time() - started:.2f} s after start), resumes at step {done + 1}", flush=True)
else:
    kv.init(KEY, mx.nd.zeros((size,)))
    if not sync:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0, wd=0.0))
    done = 0

for step in range(done + 1, STEPS + 1):
    if sync:
        grad = mx.nd.ones((size,)) * step
    else:
        g = [-(rank + 1.0)] * WIDTH + [0.0] * nw
        g[WIDTH + rank] = -1.0
        grad = mx.nd.array(g)
    kv.push(KEY, grad)
    got = pull()  # (waits for the push: under dist_sync, for the round to complete)
    print(f"rank {rank}: step {step} at {time.time():.3f}", flush=True)
    if LOSE_AT and not replacement and LOSE_AT == f"{os.environ.get('DMLC_TASK_ID')}:{step}":
        print(f"rank {rank}: lost at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(PAUSE)

if sync:
    expected = [float(nw * STEPS)] * WIDTH
else:
    kv._barrier()  # every worker's last push is applied (MXNet 1.x names it _barrier)
    got = pull()
    expected = [STEPS * nw * (nw + 1) / 2] * WIDTH + [float(STEPS)] * nw
print(f"rank {rank} of {nw}: pulled {got.tolist()}, expected {expected}", flush=True)
if got.tolist() != expected:
    sys.exit(f"rank {rank}: wrong result {got.tolist()} != {expected}")
