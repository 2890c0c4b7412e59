"""pslaunch doctor's remote checks, run here as a host would run them (no ssh)."""

from __future__ import annotations

import json
import subprocess
import sys

from launcher.run.doctor import remote_script


def _run_checks(tmp_path, cwd: str) -> dict:
    home = tmp_path / "home"
    (home / "job").mkdir(parents=True, exist_ok=True)
    args = {"cwd": cwd, "env": {}, "iface": "", "peer": "127.0.0.1", "root": "127.0.0.1", "root_port": 9,
            "timeout": 0.5}
    r = subprocess.run([sys.executable, "-"], input=remote_script(args), capture_output=True, timeout=60,
                       cwd=home, env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    line = next(x for x in r.stdout.decode().splitlines() if x.startswith("PSLAUNCH-DOCTOR "))
    return json.loads(line.split(" ", 1)[1])


def test_sync_dst_dir_with_a_tilde_is_the_remote_home(tmp_path) -> None:
    """--sync-dst-dir '~/job' (from YAML, or quoted) is looked up below the host's home, as the
    ssh backend's sync and launch use it."""
    res = _run_checks(tmp_path, "~/job")
    assert "cwd" not in res["imports"], res["imports"]
    res = _run_checks(tmp_path, "job")  # relative: below the login's home too
    assert "cwd" not in res["imports"], res["imports"]
    res = _run_checks(tmp_path, "~/missing")
    assert res["imports"]["cwd"].startswith("cannot change to ~/missing")
