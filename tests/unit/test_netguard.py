"""The suite's network guard must really refuse traffic outside loopback (or it proves nothing)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def test_guard_refuses_outside_addresses_in_process(tmp_path, monkeypatch) -> None:
    log = tmp_path / "guard.log"
    monkeypatch.setenv("PSLAUNCH_NETGUARD_LOG", str(log))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(PermissionError, match="outside loopback"):
            s.connect(("192.0.2.200", 9))  # TEST-NET-1, never reached
        with pytest.raises(PermissionError):
            s.sendto(b"x", ("198.51.100.1", 9))
        s.connect(("127.0.0.1", 9))  # loopback is fine
    finally:
        s.close()
    assert log.read_text().count("\n") == 2


def test_guard_is_active_in_python_children(tmp_path) -> None:
    log = tmp_path / "guard.log"
    env = dict(os.environ, PSLAUNCH_NETGUARD_LOG=str(log))
    code = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.9', 9))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "test network guard" in r.stderr
    assert "203.0.113.9" in log.read_text()
