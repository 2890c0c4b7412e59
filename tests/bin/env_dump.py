"""Writes its whole environment to ``<out>/env-<RANK>.json`` (``env-none.json`` without ``RANK``), for the
test that holds pslaunch's torch workers to torchrun's (tests/integration/test_torch_libraries.py).
Standard library only: it runs under any launcher and any Python."""

import json
import os
import sys

if __name__ == "__main__":
    out = sys.argv[1]
    with open(os.path.join(out, f"env-{os.environ.get('RANK', 'none')}.json"), "w") as f:
        json.dump(dict(os.environ), f, indent=1, sort_keys=True)
