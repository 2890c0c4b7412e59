"""A real MXNet (ps-lite) dist_sync job: init, push, pull, check the sum on every worker.

Run under the launcher with MXNet 1.9.1; every role runs this file (import
mxnet turns scheduler and server processes into their roles).
"""

import os
import sys

import mxnet as mx

shape = (2, 3)
kv = mx.kv.create(os.environ.get("KV_TYPE", "dist_sync"))
nw = kv.num_workers
kv.init(3, mx.nd.zeros(shape))
kv._barrier()  # MXNet 1.x names it _barrier
kv.push(3, mx.nd.ones(shape) * (kv.rank + 1))
out = mx.nd.zeros(shape)
kv.pull(3, out=out)
expected = nw * (nw + 1) / 2
got = out.asnumpy()
print(f"rank {kv.rank} of {nw}: pulled {got.ravel().tolist()}, expected {expected}", flush=True)
if not (got == expected).all():
    sys.exit(f"rank {kv.rank}: wrong sum {got} != {expected}")
