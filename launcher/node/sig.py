"""The signal module's functions and constants without its enums, and a signal's name on demand.

``signal`` wraps CPython's C module ``_signal`` in ``IntEnum`` classes, so importing it imports
``enum``: 3 ms, a tenth of a small job's start before its first process runs. The launcher's
path to its first process and the node programs use this module instead: the same
``signal()``, ``pthread_sigmask()``, ``SIGTERM``, ``SIG_IGN``, ... (as plain ints), and
:func:`name` (``SIGKILL``) where a message needs one. Python 3.5 syntax: the ssh wrapper
imports it with a host's own ``python3``.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover (type checkers know signal's names)
    from signal import *  # noqa: F401,F403
else:
    try:
        from _signal import *  # noqa: F401,F403
    except ImportError:  # pragma: no cover (a Python without CPython's C module)
        from signal import *  # noqa: F401,F403


def name(signum):
    """``9`` -> ``"SIGKILL"`` (imports ``signal``); ValueError for a number that is no signal."""
    import signal

    return signal.Signals(signum).name
