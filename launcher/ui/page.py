"""The job page around one run (``--ui``, ``--ui-linger``, ``--report``): :func:`open_page` makes
the model and binds the server before anything starts (a port in use is a one-line error, exit
2), :meth:`JobPage.close` writes the report and keeps serving ``--ui-linger`` seconds once the job
has ended, however it ended.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from .. import logs
from ..node import safefiles
from ..spec.job import JobSpec
from .model import JobView
from .report import render_report
from .server import PageServer, is_loopback

log = logging.getLogger(__name__)


class JobPage:
    """The model, and the server when ``--ui`` is given, of one job."""

    def __init__(self, spec: JobSpec, view: JobView, server: Optional[PageServer]) -> None:
        self.spec = spec
        self.view = view
        self.server = server

    def start_failed(self, error: BaseException) -> None:
        """The job could not start (or the launcher broke): the page and the report say why."""
        if self.view.job["state"] in ("succeeded", "failed", "stopped"):
            return
        reason = "signal" if isinstance(error, KeyboardInterrupt) else "failure"
        text = logs.printable(str(error) or type(error).__name__)
        if reason == "failure" and self.view.failure is None:
            self.view.set_failure(None, text, [])
        self.view.finish(reason, getattr(error, "exit_code", 130 if reason == "signal" else 1))

    def close(self) -> None:
        """The job has ended: write ``--report``, serve ``--ui-linger`` seconds more, stop."""
        try:
            if self.spec.report:
                write_report(self.spec.report, self.view.snapshot(), self.spec.log_dir)
            if self.server is not None and self.spec.ui_linger > 0:
                log.info("the job page stays up %gs (--ui-linger); Ctrl-C stops it", self.spec.ui_linger)
                time.sleep(self.spec.ui_linger)
        except KeyboardInterrupt:
            pass
        finally:
            if self.server is not None:
                self.server.close()


def open_page(spec: JobSpec, backend: str) -> Optional[JobPage]:
    """The page of ``spec`` when ``--ui`` or ``--report`` asks for one (else None); with ``--ui``
    the server listens when this returns, and its address is said once on the terminal."""
    if spec.ui is None and spec.report is None:
        return None
    view = JobView(spec.command, str(spec.tracker), backend, spec.max_restarts, logs=bool(spec.log_dir))
    server = None
    if spec.ui is not None:
        host, port = spec.ui
        server = PageServer.open(view, host, port, spec.log_dir).start()
        view.address = server.address
        if not is_loopback(host):
            log.warning("the job page listens on %s:%d, not on this machine alone: anyone who reaches it with "
                        "its token sees the job (its command, hosts and output)", host, server.port)
        logs.terminal_only(__name__, "job page %s", server.url)  # (the token: never in --log-file)
    return JobPage(spec, view, server)


def write_report(path: str, snapshot: dict, log_dir: Optional[str] = None) -> None:
    """``--report``: the page as one static file, written atomically, no link followed; a write
    error is one logged line (the job's own exit code stands)."""
    try:
        safefiles.write_atomic(path, render_report(snapshot, _logs_from(path, log_dir)).encode("utf-8", "replace"))
    except OSError as e:
        log.error("cannot write --report %s: %s", path, e.strerror or e)
        return
    log.info("job report written to %s", path)


def dry_run_lines(spec: JobSpec) -> list[str]:
    """What the dry run says of the page: where it would be served, where the report would go."""
    out = []
    if spec.ui is not None:
        host, port = spec.ui
        where = f"{host}:{port}" if port else f"{host} on a free port"
        out.append(f"job page: would be served on {where}, with a new token (--ui)")
    if spec.report:
        out.append(f"job report: would be written to {spec.report} when the job ends (--report)")
    return out


def _logs_from(report: str, log_dir: Optional[str]) -> str:
    """``--log-dir`` relative to the report's directory, for the report's links to the full logs."""
    if not log_dir:
        return "."
    return os.path.relpath(os.path.abspath(log_dir), os.path.dirname(os.path.abspath(report)))
