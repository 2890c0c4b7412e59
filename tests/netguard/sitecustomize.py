"""Loaded by every Python child of the test suite (see _pslaunch_netguard)."""

import os

if os.environ.get("PSLAUNCH_NETGUARD_LOG"):
    import _pslaunch_netguard

    _pslaunch_netguard.install()
