"""A lost worker replaced in place (``--restart-scope process``): the rules, free of I/O.

With ``PSLAUNCH_RESTART_SCOPE=process`` on every process of a job, the
launcher replaces a worker that died: it starts a new process with the lost
one's whole environment plus ``PSLAUNCH_REPLACEMENT=k`` (k >= 1), once it has
seen the old process end. The pieces of the KV store then do this:

* **The scheduler** (:mod:`trainer.kv.scheduler`) does not abort when a
  worker's connection closes (or it reports a failure): it says one line
  naming the worker and that it waits for its replacement, at most
  ``PS_START_TIMEOUT``, then aborts naming it, as it does today for any lost
  node. A lost server or the scheduler still ends the job. A ``REGISTER``
  with ``replacement`` >= 1 takes the worker's rank (its task id) at once: the
  launcher starts a replacement only after the old process ended, so the
  registration is the proof that the old one is gone, even before its closed
  connection is seen. The replacement's ``READY`` says ``recovery``.
* **The servers** (:mod:`trainer.kv.server`) count per ``(worker rank, key
  part)`` the pushes they took (the rank comes with the worker's
  ``REGISTER``). Every ``PUSH`` carries the worker's step of its items
  (:data:`~trainer.kv.protocol.F_STEP`): a push of a step the server already
  has from that rank is a repeat (:func:`push_kind`) and only answered, never
  summed or applied again. So a step the lost worker half-pushed (one bucket
  sent, the other not) counts once. ``STEPS`` answers with the rank's step:
  the fewest pushes of it on any part of this server that was pushed at all.
* **The replacement** (:mod:`trainer.kv.client`) skips the start's
  collectives (``init`` sends no values and waits at no barrier,
  ``set_optimizer`` and ``set_optimizer_states`` send nothing, as MXNet's
  ``is_recovery`` skips the start barrier), pulls the current weights, asks
  every server for its step (the smallest answer is where the lost worker
  was), counts its pushes from there, and :func:`resume_position` turns that
  into the epoch and batch where training goes on. The job makes as many
  updates as an uninterrupted run.

**What the other workers see under dist_sync** while one is missing: they
train on until the next step that needs the missing worker's gradients, and
wait there, in the pull (or pushpull) of that step, for the round to
complete. Nothing else times out meanwhile. The wait ends when the
replacement pushes that step (the round completes, everyone goes on), or when
the scheduler aborts the job ``PS_START_TIMEOUT`` after the loss because no
replacement registered (every process then exits with the line naming the
worker), or when the launcher stops the job because its restart budget is used
up. Under dist_async they do not wait; the servers apply their pushes as
they come, and the final barrier waits for the replacement.

**Heartbeats.** pslaunch sets ``PS_HEARTBEAT_TIMEOUT=2`` for such jobs (ps-lite's
recovery needs it). On a loaded machine a live worker can be silent that long
(its control thread waits for the GIL). So heartbeat silence alone never takes
a worker out of the job here: the scheduler says once that it is silent, keeps
its place, and aborts only if it stays silent ``PS_HEARTBEAT_TIMEOUT +
PS_START_TIMEOUT`` (a hung worker, which no launcher replaces). A closed
connection, a worker's ``FAIL`` and a replacement's ``REGISTER`` are the
signals acted on at once. For servers and the scheduler, whose loss ends the
job, silence counts only after :func:`silence_limit` (at least
:data:`HEARTBEAT_FLOOR` seconds); their closed connections are seen at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import pscontract as pc

RESTART_SCOPE = pc.RESTART_SCOPE  # ``process``: a lost worker is replaced in place
REPLACEMENT = pc.REPLACEMENT  # ``k`` on the k-th replacement of a worker
#: Under scope process, a server or the scheduler counts as lost through heartbeat silence only
#: after this many seconds at least (a closed connection counts at once).
HEARTBEAT_FLOOR = 10.0

#: :func:`push_kind`: a push of a new step, a repeat of the step in the current round, a repeat
#: of a step whose round is over.
NEW, REPEAT_IN_ROUND, REPEAT_DONE = 0, 1, 2


def replaces_workers(environ: Mapping[str, str]) -> bool:
    """True when a lost worker of this job will be replaced (``PSLAUNCH_RESTART_SCOPE=process``)."""
    return environ.get(RESTART_SCOPE, "").strip().lower() == "process"


def replacement_number(environ: Mapping[str, str]) -> int:
    """``k`` of ``PSLAUNCH_REPLACEMENT=k`` (k >= 1); 0 for an original process or a value that
    is not a positive whole number."""
    text = environ.get(REPLACEMENT, "").strip()
    if not text.isdecimal():
        return 0
    return int(text)


def silence_limit(timeout: float, replacing: bool) -> float:
    """The heartbeat silence after which a server or the scheduler counts as lost: the timeout,
    or under scope process at least :data:`HEARTBEAT_FLOOR` (0 stays off)."""
    if timeout <= 0 or not replacing:
        return timeout
    return max(timeout, HEARTBEAT_FLOOR)


def push_kind(step: int, taken: int, in_round: bool) -> int:
    """What a server does with a worker's push of ``step`` (0-based) on one key part.

    Args:
        step: the step the push carries.
        taken: how many pushes of this worker rank the part has taken (its next step).
        in_round: this rank's latest push is in the part's current, unfinished sync round.

    Returns:
        :data:`NEW` (take it), :data:`REPEAT_IN_ROUND` (already summed into the round under
        way: answer with that round's value) or :data:`REPEAT_DONE` (already applied: answer
        with the value now).
    """
    if step >= taken:
        return NEW
    if in_round and step == taken - 1:
        return REPEAT_IN_ROUND
    return REPEAT_DONE


def resume_step(answers: list[int | None]) -> int:
    """Where a replacement starts counting: the smallest step the servers report for its rank
    (a half-pushed step is pushed again, its repeats ignored); 0 when none was pushed."""
    steps = [s for s in answers if s is not None]
    return min(steps) if steps else 0


def resume_position(start: tuple[int, int], steps: int, epoch_size: int) -> tuple[int, int]:
    """``(epoch, batch)`` ``steps`` batches after ``start`` (where this attempt began)."""
    if epoch_size <= 0:
        return start
    done = start[0] * epoch_size + start[1] + steps
    return divmod(done, epoch_size)
