"""pslaunch: start a scheduler, servers and workers for parameter-server jobs."""

__version__ = "0.1.0"
