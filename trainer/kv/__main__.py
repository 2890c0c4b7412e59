"""``python -m trainer.kv [--insecure]``: run this process's scheduler or server role."""

from __future__ import annotations

import sys

from .role import run_role

if __name__ == "__main__":
    run_role(sys.argv[1:])
