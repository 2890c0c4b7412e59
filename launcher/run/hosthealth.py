"""Which hosts the next attempt of a job runs on (``--max-restarts``): hosts that fail are left
out for a while, spares take their place, and a collective job run with ``-n MIN:MAX`` goes on
with fewer workers when no spare is left. Pure: a function of the spec's hosts and spares, what
happened on them in the attempts so far, and the time; the supervisor builds each attempt's spec
from the answer (``dataclasses.replace``), so no backend knows of any of this.

The policy (docs/restarts.md, "Hosts that fail"):

- A host is **left out** after an attempt in which pslaunch lost it (no answer to keep-alives,
  the connection gone), or after the second attempt in a row whose failure was one of its
  processes (the attempt's root cause, the first process to fail: the others of a collective job
  fail *because* of it, on hosts that did nothing wrong).
- It stays out for a **cooldown**, Horovod's: ``lower * 2**n + U(0, 1) * lower`` for its n-th
  time out (n from 0), clamped to ``[lower, upper]`` (``--host-cooldown LOWER[:UPPER]``). The
  jitter comes from a seed (the run's id), the host and n, so the answer stays a pure function.
  After it, the host is back in the next attempt that starts; its failures count afresh.
- **Spares** (hostfile lines marked ``spare``) are not used at first; the first spare that is not
  itself out takes the place of a host that is out, at its position (so ranks move as little as
  possible); when the host comes back, the spare goes back to waiting.
- **Capacity**: a host holds its ``slots``, else as many processes as it held in the first attempt;
  a spare in a host's place holds its own slots, else the host's. With ``-n MIN:MAX`` the next
  attempt runs as many workers as the hosts in use hold (at most MAX); fewer than MIN, or for
  ``-n N`` fewer than N, and the job cannot go on (:class:`CannotContinue`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..spec.job import Host

#: a host whose processes fail in this many attempts in a row is left out
FAILS_IN_A_ROW = 2
#: ``--host-cooldown``'s default: 1 minute the first time, doubling, at most an hour
DEFAULT_COOLDOWN = (60.0, 3600.0)


@dataclass(frozen=True)
class AttemptHosts:
    """What one finished attempt tells about its hosts: the hosts it ran on (in place order), the
    host of the process that failed first (its root cause; None: none failed, or it ran nowhere
    the hostfile names), and the hosts pslaunch lost during it, each with why."""

    attempt: int
    end_time: float
    hosts: tuple[Host, ...]
    failed: Optional[Host] = None
    lost: tuple[tuple[Host, str], ...] = ()


@dataclass(frozen=True)
class Exclusion:
    """A host left out after ``attempt`` (its ``PSLAUNCH_ATTEMPT``) at ``since``, until ``until``;
    ``count`` is how many times it was left out before (the cooldown doubles with it)."""

    host: Host
    reason: str
    attempt: int
    since: float
    until: float
    count: int

    def to_dict(self) -> dict:
        return {"host": self.host.display, "reason": self.reason, "after_attempt": self.attempt,
                "since": self.since, "until": self.until, "cooldown": round(self.until - self.since, 3),
                "times": self.count + 1}


@dataclass(frozen=True)
class Layout:
    """The next attempt: its hosts (in place order, spares in their places) and its workers;
    ``out``: the hosts left out now; ``replaced``: (host, spare) pairs; ``dropped``: hosts out
    with no spare for them; ``back``: hosts whose cooldown ended since they were left out."""

    hosts: tuple[Host, ...]
    num_workers: int
    out: tuple[Exclusion, ...] = ()
    replaced: tuple[tuple[Host, Host], ...] = ()
    dropped: tuple[Host, ...] = ()
    back: tuple[Host, ...] = ()

    def to_dict(self) -> dict:
        """``--summary-json``'s view of it (an attempt's ``hosts``)."""
        return {"used": [h.display for h in self.hosts], "workers": self.num_workers,
                "excluded": [e.to_dict() for e in self.out],
                "spares": [{"spare": s.display, "replaces": h.display} for h, s in self.replaced],
                "dropped": [h.display for h in self.dropped], "back": [h.display for h in self.back]}


class CannotContinue(Exception):
    """The hosts left are too few for the job (fewer workers than ``-n``'s MIN, or than N)."""


@dataclass(frozen=True)
class Policy:
    """The spec's side: its hosts and spares, ``-n MIN:MAX`` (``min_workers`` None: fixed), the
    servers (placed first, they need room too), the cooldown's bounds and the jitter's seed."""

    hosts: tuple[Host, ...]
    spares: tuple[Host, ...] = ()
    num_workers: int = 1
    min_workers: Optional[int] = None
    num_servers: int = 0
    cooldown: tuple[float, float] = DEFAULT_COOLDOWN
    seed: str = ""
    #: what each host held in the first attempt (its capacity where it has no slots)
    first: Mapping[Host, int] = field(default_factory=dict)


def cooldown(lower: float, upper: float, count: int, jitter: float) -> float:
    """Horovod's cooldown of a host's ``count``-th time out (from 0): ``lower * 2**count + jitter *
    lower``, clamped to ``[lower, upper]``; ``jitter`` in [0, 1).

    >>> cooldown(60, 3600, 0, 0.5), cooldown(60, 3600, 2, 0.0), cooldown(60, 3600, 9, 0.9)
    (90.0, 240.0, 3600.0)
    """
    value = lower * 2 ** min(count, 64) + jitter * lower
    return float(min(upper, max(lower, value)))


def jitter(seed: str, host: Host, count: int) -> float:
    """The cooldown's random part for ``host``'s ``count``-th time out: the same for the same run
    (``seed``), so that working the exclusions out again gives the same answer."""
    return random.Random(f"{seed}/{host.display}/{count}").random()


def exclusions(policy: Policy, history: Sequence[AttemptHosts]) -> dict[Host, Exclusion]:
    """Every host's latest time out, from the attempts so far (in order). A lost host is out at
    once; one whose process was the root cause of :data:`FAILS_IN_A_ROW` attempts in a row (of
    those it ran in) is out too; its count starts again after each time out."""
    lower, upper = policy.cooldown
    latest: dict[Host, Exclusion] = {}
    times: dict[Host, int] = {}
    streak: dict[Host, int] = {}
    for rec in history:
        lost = dict(rec.lost)
        for host in rec.hosts:
            if host in lost:
                why = f"lost in attempt {rec.attempt}: {lost[host]}"
            elif host == rec.failed:
                streak[host] = streak.get(host, 0) + 1
                if streak[host] < FAILS_IN_A_ROW:
                    continue
                why = f"its processes failed first in {FAILS_IN_A_ROW} attempts in a row (the last: {rec.attempt})"
            else:
                streak[host] = 0
                continue
            n = times.get(host, 0)
            times[host] = n + 1
            streak[host] = 0
            wait = cooldown(lower, upper, n, jitter(policy.seed, host, n))
            latest[host] = Exclusion(host, why, rec.attempt, rec.end_time, rec.end_time + wait, n)
    return latest


def capacity(policy: Policy, host: Host, place_of: Optional[Host] = None) -> int:
    """How many processes ``host`` holds: its slots, else what it (or the host whose place it
    takes, ``place_of``) held in the first attempt."""
    if host.slots is not None:
        return host.slots
    if place_of is not None and place_of is not host:
        return capacity(policy, place_of)
    return policy.first.get(host, 0)


def next_layout(policy: Policy, history: Sequence[AttemptHosts], now: float) -> Layout:
    """The hosts and the number of workers of the attempt that starts at ``now``, after the
    attempts of ``history``; raises :class:`CannotContinue` (one line) when too few are left."""
    latest = exclusions(policy, history)
    out = {h: e for h, e in latest.items() if e.until > now}
    back = tuple(h for h, e in latest.items() if e.until <= now and history and e.attempt == _last_out(history, h))
    free = [s for s in policy.spares if s not in out]
    hosts: list[Host] = []
    places: list[tuple[Host, Host]] = []  # (what is used, whose place it holds)
    replaced: list[tuple[Host, Host]] = []
    dropped: list[Host] = []
    for h in policy.hosts:
        if h not in out:
            hosts.append(h)
            places.append((h, h))
        elif free:
            spare = free.pop(0)
            hosts.append(spare)
            places.append((spare, h))
            replaced.append((h, spare))
        else:
            dropped.append(h)
    ordered = tuple(sorted(out.values(), key=lambda e: (e.since, e.host.display)))
    workers = policy.num_workers
    if dropped:
        room = sum(capacity(policy, used, place) for used, place in places) - policy.num_servers
        least = policy.num_workers if policy.min_workers is None else policy.min_workers
        if not hosts or room < least:
            why = "; ".join(f"{e.host.display} ({e.reason}; out until {e.until - now:.0f}s from now)"
                            for e in ordered)
            want = (f"-n {policy.num_workers}" if policy.min_workers is None else
                    f"-n {policy.min_workers}:{policy.num_workers}'s minimum")
            spares = "no spare is left" if policy.spares else "the hostfile has no spare"
            raise CannotContinue(f"cannot go on: the hosts left hold {max(0, room)} worker"
                                 f"{'' if room == 1 else 's'}, fewer than {want}, and {spares}; left out: {why}")
        workers = min(policy.num_workers, room)
    return Layout(tuple(hosts), workers, ordered, tuple(replaced), tuple(dropped), back)


def _last_out(history: Sequence[AttemptHosts], host: Host) -> Optional[int]:
    """The attempt after which ``host`` was last left out, if it ran in none since (it is back
    in the next one for the first time)."""
    for rec in reversed(history):
        if host in rec.hosts:
            return rec.attempt
    return None


def first_counts(hosts: Sequence[Optional[Host]]) -> dict[Host, int]:
    """How many processes each host held in the first attempt (from its processes' hosts)."""
    counts: dict[Host, int] = {}
    for h in hosts:
        if h is not None:
            counts[h] = counts.get(h, 0) + 1
    return counts


def describe(layout: Layout, now: float) -> list[str]:
    """The terminal's lines about the next attempt's hosts: who is out and why, and for how long
    still; which spare takes whose place; who is back."""
    lines = [f"leaving out host {e.host.display} for {max(0.0, e.until - now):.0f}s more: {e.reason}"
             for e in layout.out]
    lines += [f"spare {s.display} takes the place of {h.display}" for h, s in layout.replaced]
    lines += [f"host {h.display} is back (its cooldown is over)" for h in layout.back]
    return lines
