"""Shared test helpers (importable as ``support``: ``tests/`` is on pytest's ``pythonpath``).

* :mod:`support.helpers`: waiting, processes, probes and running pslaunch;
* :mod:`support.testbed`: the network-namespace hosts with their own sshd;
* :mod:`support.clusters`: one :class:`~support.clusters.Cluster` per backend, for the
  backend conformance suite (``tests/integration/contract/``);
* :mod:`support.fakes`: stand-ins where no real part can run here (labelled as such).

``tests/bin/`` holds helper *programs* only; nothing imports them.
"""
