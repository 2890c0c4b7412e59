"""Trackers: the service a collective job's workers find each other through (``--tracker``).

A parameter-server job (``--tracker ps``) has its scheduler, a process of the job, not a
:class:`Tracker`: the job's own command (``--scheduler command``) or pslaunch's ps-lite
scheduler, :mod:`.pslite` (``--scheduler builtin``: ps-lite's rules over pyzmq, run with the
launcher's Python as ``node.command("pslite")``; it lives here because it needs pyzmq). The other
trackers are services the launcher runs for one job, where the ps scheduler would run: on this
machine, on the scheduler's address (:mod:`launcher.run.addresses`) and a free port of
``--port-range``. Each is a child process run with the tracker Python (``--tracker-python``;
default: the command's interpreter when the command is a Python, else ``python3``): the
workers' own library serves them, in the version the workers have. Workers learn where it is
from their variables (:func:`pscontract.rabit_contract`, :func:`pscontract.torch_contract`).

* ``rabit``: dmlc's rabit tracker as XGBoost 2.0 and older ship it (``xgboost/tracker.py``,
  pure Python), run by :mod:`.xgboost_child` (``--tracker rabit``). Its workers' ``print``
  messages are labelled ``[rabit tracker]``.
* ``xgboost``: XGBoost 2.1+'s own tracker, run by :mod:`.xgboost_child`.
* ``torch``: a ``torch.distributed.TCPStore`` hosted by :mod:`.torch_store`, on a socket the
  launcher bound itself; every rank connects to it as torchrun's workers connect to their
  agent's store. The program lives as long as the job: each later attempt gets a new store in
  it, on a new port (:meth:`Tracker.restart`), and pays no second ``import torch``.

rabit and xgboost start a new program for each attempt: XGBoost's trackers serve one
rendezvous of N workers each (their loop ends when those workers have), and the program starts
in tenths of a second, where the torch store's ``import torch`` costs about 1.8 s of CPU.

The interface the supervisor drives (:class:`Tracker`, wrapped for it by :class:`TrackerHandle`)::

    tracker = create(spec, console, watchdog)  # None for ps
    port = tracker.start(address)              # serving, or on its way (LaunchError: one line)
    tracker.variables()                        # what every worker gets to find it
    tracker.failure()                          # None while all is well; else why it failed
    port = tracker.restart(address)            # where tracker.restarts: the next attempt, afresh
    tracker.close()                            # after every worker has ended; never blocks long

The launcher never imports xgboost or torch: the children run with the tracker Python, as
files (``launcher.node.tracker_command``), and import nothing of pslaunch.
"""

from __future__ import annotations

from typing import Optional

from ..node.watchdog import Client as Watchdog
from ..runtime.output import Console
from ..spec.job import JobSpec
from ..spec.plan import Plan
from . import service
from .interface import FAILURE_GRACE, Tracker, TrackerHandle, python_for, resolve_python

__all__ = ["FAILURE_GRACE", "Tracker", "TrackerHandle", "classes", "create", "describe", "python_for",
           "resolve_python"]


def classes() -> dict[str, type[Tracker]]:
    """``--tracker`` value -> its class (``ps`` has none: the scheduler is a process of the job)."""
    return {"rabit": service.RabitService, "xgboost": service.XGBoostService, "torch": service.TorchService}


def create(spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> Optional[Tracker]:
    """The tracker of ``spec``, not started yet; None for ``ps``."""
    if not spec.collective:
        return None
    return classes()[spec.tracker or ""](spec, console, watchdog)


def describe(spec: JobSpec, plan: Plan) -> list[str]:
    """What a dry run says about the job's tracker (nothing for ``ps``)."""
    if not spec.collective:
        return []
    return classes()[spec.tracker or ""].describe(spec, plan)
