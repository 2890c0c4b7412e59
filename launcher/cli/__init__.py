"""The face of pslaunch: ``pslaunch [OPTIONS] COMMAND...`` (:mod:`.run`) and ``pslaunch doctor``
(:mod:`.doctor`). Options go in, a validated spec comes out, and an exit code goes back; the
work is done below (``launcher.run``).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None, prog_name: str = "pslaunch") -> int:
    """Console entry point. With ``argv=None`` it reads ``sys.argv`` and exits with the job's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "doctor":
        from .doctor import main as doctor_main
        code = doctor_main(args[1:])
    else:
        from .clickutil import invoke
        from .run import command_for

        code = invoke(command_for(args), args, prog_name, "pslaunch --help")
    if argv is None:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Exit with ``code`` without tearing the interpreter down (6 ms of freeing modules that a
    finished job's launcher no longer needs): the ``atexit`` functions run (logging's flush,
    a client library's own clean-up), the standard streams are flushed, then ``os._exit``.

    A normal exit instead while another non-daemon thread runs (it would be joined first).
    """
    import atexit
    import threading

    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # (CPython's; else a normal exit)
    main_thread = threading.main_thread()
    if run_exitfuncs is None or any(t is not main_thread and not t.daemon and t.is_alive()
                                    for t in threading.enumerate()):
        sys.stdout.flush()
        sys.exit(code)
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe: nothing more can be said)
            pass
    os._exit(code)
