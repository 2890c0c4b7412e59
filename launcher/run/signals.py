"""Signals while a job runs: the first SIGINT/SIGTERM/SIGHUP stops it gracefully, the second kills;
SIGALRM is ``--timeout``; SIGUSR1 and SIGUSR2 are a batch system's notice (Slurm's ``--signal``,
Grid Engine's ``-notify``), which the supervisor passes on to every process of the job
(:meth:`Signals.notices`) while the job goes on.

:class:`Signals` turns a signal into :class:`Interrupted`, raised on the main thread, so
cleanup is plain ``try``/``finally`` (torch elastic's pattern). A signal that arrives while a
child is being spawned and registered is raised only once that is done (:meth:`Signals.check`),
so no child is ever started without the launcher knowing about it. ``--timeout`` is an alarm
(:meth:`Signals.alarm`), so it also ends a job that is still starting: connecting to hosts,
syncing, waiting for the scheduler to listen or for a batch system to run the tasks.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, Union

from ..runtime.spawn import spawning

log = logging.getLogger(__name__)

#: A handler as signal.signal returns it (None: one set outside Python)
OldHandler = Union[Callable[[int, Optional[FrameType]], Any], int, None]

#: The launcher's exit code per signal (the shell's 128+N).
EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
#: Passed on to the job's processes, by their names in the node protocol (their default action
#: would end the launcher and leave the job to its watchdog).
NOTICES: dict[int, str] = {signal.SIGUSR1: "USR1", signal.SIGUSR2: "USR2"}


class Interrupted(Exception):
    """A signal arrived while the job was starting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """First SIGINT/SIGTERM/SIGHUP: stop gracefully. Second: kill at once."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Optional[int] = None
        self.raise_now = True
        self.deferred: Optional[int] = None
        self.timed_out = False
        self.on_signal: Optional[Callable[[], None]] = None  # called by each handled signal
        self._notices: list[int] = []  # SIGUSR1/SIGUSR2 not yet passed on, oldest first
        self._old: dict[int, OldHandler] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not on the main thread: signals are not handled")
            return
        for signum in EXIT_CODES:
            self._old[signum] = signal.signal(signum, self.handle)
        for signum in NOTICES:
            self._old[signum] = signal.signal(signum, self._on_notice)
        self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)

    def alarm(self, seconds: float) -> None:
        """Raise ``Interrupted(SIGALRM)`` after ``seconds`` (0: cancel); only on the main thread."""
        if signal.SIGALRM in self._old:
            signal.setitimer(signal.ITIMER_REAL, max(0.0, seconds))

    def _on_alarm(self, signum: int, frame: object = None) -> None:
        self.timed_out = True
        if self.raise_now:
            if spawning():
                self.deferred = signum
                return
            self.raise_now = False
            raise Interrupted(signum)

    def _on_notice(self, signum: int, frame: object = None) -> None:
        self._notices.append(signum)  # (passed on by the main loop: sending here could deadlock)
        if self.on_signal is not None:
            self.on_signal()

    def notices(self) -> list[str]:
        """The SIGUSR1/SIGUSR2 that arrived since the last call, oldest first, by protocol name."""
        names = []
        while self._notices:  # (pop by pop: one that arrives meanwhile is not lost)
            names.append(NOTICES[self._notices.pop(0)])
        return names

    def restore(self) -> None:
        self.alarm(0)
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def handle(self, signum: int, frame: object = None) -> None:
        self.count += 1
        if self.on_signal is not None:
            self.on_signal()
        if self.first is None:
            self.first = signum
        if self.count == 1:
            log.warning("%s received: stopping every process (again to kill at once)",
                        signal.Signals(signum).name)
        elif self.count == 2:
            log.warning("%s received again: killing every process", signal.Signals(signum).name)
        if self.raise_now:
            if spawning():
                self.deferred = signum  # raised by check() once the child is registered
                return
            self.raise_now = False
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise a signal that arrived while a child was being spawned."""
        if self.deferred is not None and self.raise_now:
            self.raise_now = False
            raise Interrupted(self.deferred)

    def describe(self) -> str:
        """The first signal by name: ``SIGINT (Ctrl-C)``, ``SIGTERM``, ``SIGHUP (the terminal closed)``."""
        signum = self.first or signal.SIGINT
        name = signal.Signals(signum).name
        hints: dict[int, str] = {signal.SIGINT: " (Ctrl-C)", signal.SIGHUP: " (the terminal closed)"}
        hint = hints.get(signum, "")
        return f"{name}{hint}"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.first or signal.SIGINT, 130)
