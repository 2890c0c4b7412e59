"""The parameter-server KVStore: scheduler, servers and workers over ZeroMQ.

Modules: :mod:`.protocol` (wire format, MACs, handshake), :mod:`.transport`
(sockets), :mod:`.scheduler`, :mod:`.server` (numpy), :mod:`.client` (the
worker side), :mod:`.optim` (optimizers from a JSON spec), :mod:`.placement`
(keys to servers), :mod:`.recovery` (a lost worker replaced in place) and
:mod:`.role` (run the scheduler or server role of this process). Nothing here
imports torch; ``trainer.kvstore`` is the torch-facing API.
"""
