#!/usr/bin/env python3
"""Drop-in for MXNet's ``tools/launch.py``: ``python scripts/launch.py -n 2 -s 1 --launcher local python prog.py``.

It is ``pslaunch`` itself; see ``pslaunch --help``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.cli import main  # noqa: E402

if __name__ == "__main__":
    main(prog_name="launch.py")
