"""Run the scheduler or server role of this process, then exit (as ``import mxnet`` does)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

from pscontract import ClusterEnv, ClusterEnvError

from .errors import KVAbortedByScheduler, KVConfigError, KVStoreError, own_rank, report_cause
from .transport import check_dist_env, setup_logging

logger = logging.getLogger(__name__)

USAGE = "usage: python -m trainer.kv [--insecure]  (DMLC_ROLE=scheduler or server)"


def run_role(argv: Sequence[str] = ()) -> NoReturn:
    """Run the scheduler or server role named by ``DMLC_ROLE`` and exit the process.

    Exits 0 when the job ends cleanly, 1 when it fails (one line on stderr
    saying why), 2 on a usage or environment error.

    Args:
        argv: command-line arguments; only ``--insecure`` is understood.
    """
    setup_logging(0, force=True)
    args = list(argv)
    insecure = "--insecure" in args
    rest = [a for a in args if a != "--insecure"]
    if rest:
        logger.error("trainer.kv: unexpected arguments %s; %s", " ".join(rest), USAGE)
        sys.exit(2)
    try:
        env = ClusterEnv.from_environ(os.environ)
    except ClusterEnvError as e:
        logger.error("trainer.kv: %s", e)
        sys.exit(2)
    if insecure:
        env = replace(env, insecure=True)
    setup_logging(env.verbose, force=True)
    if env.role not in ("scheduler", "server"):
        logger.error("trainer.kv runs the scheduler and server roles, but DMLC_ROLE=%s: a worker "
                     "runs your training program, which creates the kvstore", env.role)
        sys.exit(2)
    who = "scheduler" if env.role == "scheduler" else "server"
    try:
        secret = check_dist_env(env)
        if env.role == "scheduler":
            from .scheduler import run
        else:
            from .server import run
        run(env, secret)
    except KVStoreError as e:
        # A usage error says everything in its one line; an abort the scheduler sent
        # repeats the cause it named.
        if not isinstance(e, (KVAbortedByScheduler, KVConfigError)):
            report_cause(str(e), env.role, own_rank(env.role, env.task_id, env.num_workers))
        logger.error("%s: error: %s", who, e)
        sys.exit(1)
    except KeyboardInterrupt:
        logger.error("%s: interrupted", who)
        sys.exit(130)
    except Exception as e:  # a bug: show the traceback
        logger.exception("%s: internal error: %s: %s", who, type(e).__name__, e)
        sys.exit(1)
    sys.exit(0)
