"""A real MXNet (ps-lite) dist_sync job that holds its sockets open until told to finish.

Every role runs this file (importing mxnet turns schedulers and servers into
their roles). Each worker creates the kvstore, passes a barrier, writes
``$HOLD_DIR/ready-<rank>`` and waits for ``$HOLD_DIR/release`` (at most 120 s),
so a test can inspect the listening sockets of every node meanwhile.
"""

import os
import sys
import time

import mxnet as mx

hold = os.environ["HOLD_DIR"]
kv = mx.kv.create("dist_sync")
kv.init(7, mx.nd.zeros((2,)))
kv._barrier()
with open(os.path.join(hold, f"ready-{kv.rank}"), "w") as f:
    f.write(os.environ.get("DMLC_NODE_HOST", ""))
end = time.monotonic() + 120
while not os.path.exists(os.path.join(hold, "release")):
    if time.monotonic() > end:
        sys.exit("never released")
    time.sleep(0.1)
kv.push(7, mx.nd.ones((2,)))
out = mx.nd.zeros((2,))
kv.pull(7, out=out)
print(f"rank {kv.rank}: pulled {out.asnumpy().tolist()}", flush=True)
kv._barrier()
