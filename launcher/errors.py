"""The launcher's exceptions. Only ``cli.py`` turns them into messages and exit codes.

* :class:`ConfigError` - a user mistake in options, hostfile or YAML: exit 2.
* :class:`BackendUnavailableError` - the backend cannot run here: exit 2.
* :class:`LaunchError` - something failed while starting the job: exit 1.
* A failed *process* is not an exception: the supervisor reports it as data
  and the launcher exits with that process's code.
"""

from __future__ import annotations


class LauncherError(Exception):
    """Base class; ``str(e)`` is a one-line message that names the problem and the fix."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(LauncherError, ValueError):
    """Bad user input: an option, a hostfile line, a YAML key."""

    exit_code = 2


class BackendUnavailableError(LauncherError):
    """The chosen backend is unknown, not built yet, or missing a dependency."""

    exit_code = 2


class LaunchError(LauncherError):
    """Starting the job failed (a port, a connection, a remote host).

    ``unreachable``: the spec's hosts (``Host`` lines) that did not answer at all (down, no route,
    connection refused or reset): with ``--max-restarts``, a later attempt leaves them out and
    tries again (``launcher.run.hosthealth``); empty when the failure was of another kind."""

    exit_code = 1
    unreachable: tuple = ()
