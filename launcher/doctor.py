"""``pslaunch doctor -H hosts``: pre-flight checks of every host (ssh backend)."""

from __future__ import annotations

import sys
from typing import Sequence


def main(args: Sequence[str]) -> int:
    print("pslaunch: error: pslaunch doctor checks hosts over ssh, and the ssh backend is not "
          "available yet in this version", file=sys.stderr)
    return 2
