"""The face of pslaunch: ``pslaunch [OPTIONS] COMMAND...`` (:mod:`.run`), ``pslaunch doctor``
(:mod:`.doctor`) and ``pslaunch manifest`` (:mod:`.manifest`). Options go in, a validated spec
comes out, and an exit code goes back; the work is done below (``launcher.run``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .clickutil import invoke
from .run import command_for


def main(argv: Optional[Sequence[str]] = None, prog_name: str = "pslaunch") -> int:
    """Console entry point. With ``argv=None`` it reads ``sys.argv`` and exits with the job's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "doctor":
        # (here: the doctor's commands take every backend's options, so they import every
        # backend module; a job's command line imports those it may name: run.command_for)
        from .doctor import main as doctor_main

        code = doctor_main(args[1:])
    elif args and args[0] == "manifest":  # (the same: a job's options, every backend's)
        from .manifest import main as manifest_main

        code = manifest_main(args[1:])
    else:
        code = invoke(command_for(args), args, prog_name, "pslaunch --help")
    if argv is None:
        sys.exit(code)
    return code

