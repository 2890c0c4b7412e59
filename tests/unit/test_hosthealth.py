"""The pure policy of hosts that fail (launcher/run/hosthealth.py): who is left out, for how long,
which spare takes whose place, and how many workers the next attempt runs."""

from __future__ import annotations

import pytest

from launcher.errors import ConfigError
from launcher.run import hosthealth as hh
from launcher.spec.hosts import parse_lines
from launcher.spec.job import Host, JobSpec

H1, H2, H3, H4 = (Host(f"h{i}") for i in range(1, 5))
S1, S2 = Host("s1", spare=True), Host("s2", spare=True, slots=2)


def policy(hosts=(H1, H2, H3), spares=(), n=3, least=None, servers=0, cooldown=(60.0, 3600.0), first=None):
    return hh.Policy(hosts=tuple(hosts), spares=tuple(spares), num_workers=n, min_workers=least,
                     num_servers=servers, cooldown=cooldown, seed="run1",
                     first=first if first is not None else {h: 1 for h in hosts})


def attempt(k, hosts=(H1, H2, H3), failed=None, lost=(), end=None):
    return hh.AttemptHosts(k, 1000.0 + 10 * k if end is None else end, tuple(hosts), failed, tuple(lost))


def test_the_cooldown_is_horovods_doubling_clamped_with_jitter() -> None:
    assert [hh.cooldown(1, 3600, n, 0.0) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert hh.cooldown(1, 3600, 0, 0.99) == pytest.approx(1.99)
    assert hh.cooldown(60, 100, 3, 0.5) == 100.0  # clamped to the upper bound
    assert hh.cooldown(60, 3600, 10_000, 0.5) == 3600.0  # (no overflow)
    assert hh.cooldown(0, 3600, 5, 0.7) == 0.0  # --host-cooldown 0: never out
    # the jitter is stable for a run, a host and a count, and differs between them
    assert hh.jitter("run1", H2, 0) == hh.jitter("run1", H2, 0)
    assert len({hh.jitter("run1", H2, 0), hh.jitter("run1", H2, 1), hh.jitter("run2", H2, 0)}) == 3


def test_nothing_happened_the_hosts_are_the_spec_s() -> None:
    layout = hh.next_layout(policy(spares=(S1,)), [attempt(0, failed=H2)], 1001.0)
    assert layout == hh.Layout((H1, H2, H3), 3)


def test_a_lost_host_is_left_out_at_once_and_the_first_spare_takes_its_place() -> None:
    p = policy(spares=(S1, S2))
    layout = hh.next_layout(p, [attempt(0, failed=H2, lost=[(H2, "no reply to keep-alives for 4s")])], 1011.0)
    assert layout.hosts == (H1, S1, H3) and layout.num_workers == 3
    assert layout.replaced == ((H2, S1),) and layout.dropped == ()
    (out,) = layout.out
    assert out.host == H2 and out.reason == "lost in attempt 0: no reply to keep-alives for 4s"
    wait = hh.cooldown(60, 3600, 0, hh.jitter("run1", H2, 0))
    assert out.since == 1000.0 and out.until == pytest.approx(1000.0 + wait)
    assert layout.to_dict() == {
        "used": ["h1", "s1", "h3"], "workers": 3, "dropped": [], "back": [],
        "excluded": [{"host": "h2", "reason": out.reason, "after_attempt": 0, "since": 1000.0, "until": out.until,
                      "cooldown": round(out.until - 1000.0, 3), "times": 1}],
        "spares": [{"spare": "s1", "replaces": "h2"}]}
    assert hh.describe(layout, 1011.0) == [
        f"leaving out host h2 for {out.until - 1011.0:.0f}s more: lost in attempt 0: no reply to keep-alives for 4s",
        "spare s1 takes the place of h2"]


def test_a_host_whose_processes_fail_first_twice_in_a_row_is_left_out() -> None:
    p = policy(spares=(S1,))
    once = [attempt(0, failed=H3)]
    assert hh.next_layout(p, once, 1001.0).hosts == (H1, H2, H3)
    twice = once + [attempt(1, failed=H3)]
    layout = hh.next_layout(p, twice, 1011.0)
    assert layout.hosts == (H1, H2, S1)
    assert layout.out[0].reason == "its processes failed first in 2 attempts in a row (the last: 1)"
    # not in a row: another host's failure in between starts the count again
    apart = [attempt(0, failed=H3), attempt(1, failed=H1), attempt(2, failed=H3)]
    assert hh.next_layout(p, apart, 1021.0).hosts == (H1, H2, H3)
    # an attempt whose failure was no host's (None: a tracker, a process that could not start) breaks the run
    assert hh.next_layout(p, [attempt(0, failed=H3), attempt(1), attempt(2, failed=H3)], 1021.0).out == ()


def test_the_host_comes_back_after_its_cooldown_and_the_spare_waits_again() -> None:
    p = policy(spares=(S1,), cooldown=(5.0, 100.0))
    history = [attempt(0, lost=[(H2, "gone")], end=1000.0)]
    until = hh.next_layout(p, history, 1001.0).out[0].until
    assert 1005.0 <= until < 1010.0
    history.append(attempt(1, hosts=(H1, S1, H3), failed=H1, end=1002.0))  # (out still: the spare stays)
    assert hh.next_layout(p, history, 1003.0).hosts == (H1, S1, H3)
    back = hh.next_layout(p, history, until + 0.1)
    assert back.hosts == (H1, H2, H3) and back.out == () and back.back == (H2,)
    assert "host h2 is back (its cooldown is over)" in hh.describe(back, until + 0.1)
    # lost again later: the second time out lasts twice as long (from the lower bound)
    history.append(attempt(2, lost=[(H2, "gone")], end=2000.0))
    again = hh.next_layout(p, history, 2000.0)
    assert again.out[0].count == 1 and 10.0 <= again.out[0].until - 2000.0 < 15.0
    assert again.back == ()


def test_a_spare_that_fails_is_left_out_too_and_the_next_spare_takes_the_place() -> None:
    p = policy(spares=(S1, S2))
    history = [attempt(0, lost=[(H2, "gone")]), attempt(1, hosts=(H1, S1, H3), lost=[(S1, "gone")])]
    layout = hh.next_layout(p, history, 1011.0)
    assert layout.hosts == (H1, S2, H3) and layout.replaced == ((H2, S2),)
    assert [e.host for e in layout.out] == [H2, S1]


def test_min_max_runs_as_many_workers_as_the_hosts_left_hold() -> None:
    hosts = (H1, H2, H3, H4)
    p = policy(hosts=hosts, n=4, least=2)
    layout = hh.next_layout(p, [attempt(0, hosts=hosts, lost=[(H3, "gone")])], 1001.0)
    assert layout.hosts == (H1, H2, H4) and layout.num_workers == 3 and layout.dropped == (H3,)
    # slots count where the hostfile gives them; else what the host held in the first attempt
    slotted = (Host("a", slots=2), Host("b", slots=2), Host("c", slots=2))
    p = policy(hosts=slotted, n=6, least=2, first={})
    layout = hh.next_layout(p, [attempt(0, hosts=slotted, lost=[(slotted[0], "x"), (slotted[1], "y")])], 1001.0)
    assert layout.hosts == (slotted[2],) and layout.num_workers == 2
    # never more than MAX, even when the spares hold more
    p = policy(hosts=hosts, spares=(S2,), n=4, least=2)
    layout = hh.next_layout(p, [attempt(0, hosts=hosts, lost=[(H3, "gone")])], 1001.0)
    assert layout.hosts == (H1, H2, S2, H4) and layout.num_workers == 4


def test_too_few_left_is_one_line() -> None:
    hosts = (H1, H2, H3, H4)
    lost = [attempt(0, hosts=hosts, lost=[(H2, "no reply to keep-alives for 4s"), (H3, "gone"), (H4, "gone")])]
    with pytest.raises(hh.CannotContinue) as e:
        hh.next_layout(policy(hosts=hosts, n=4, least=2), lost, 1001.0)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("cannot go on: the hosts left hold 1 worker, fewer than -n 2:4's minimum, and the "
                           "hostfile has no spare; left out: h2 (lost in attempt 0: no reply to keep-alives for 4s; "
                           "out until ")
    # -n N: N is the least; a parameter-server job's servers need room as well
    with pytest.raises(hh.CannotContinue, match="fewer than -n 3, and no spare is left"):
        hh.next_layout(policy(spares=(S1,)), [attempt(0, lost=[(H1, "x")]),
                                               attempt(1, hosts=(S1, H2, H3), lost=[(S1, "y")])], 1011.0)
    p = policy(hosts=(H1, H2), n=2, servers=2, first={H1: 2, H2: 2})
    with pytest.raises(hh.CannotContinue, match="hold 0 workers"):
        hh.next_layout(p, [attempt(0, hosts=(H1, H2), lost=[(H2, "x")])], 1001.0)


def test_hostfile_spares_parse_with_slots_in_either_order() -> None:
    hosts = parse_lines(["h1", "h2 slots=2", "h3 spare", "h4 spare slots=2", "h5 slots=3 spare  # late"], "f")
    assert [(h.name, h.spare, h.slots) for h in hosts] == [("h1", False, None), ("h2", False, 2), ("h3", True, None),
                                                           ("h4", True, 2), ("h5", True, 3)]
    with pytest.raises(ConfigError, match="f:1: spare given twice"):
        parse_lines(["h1 spare spare"], "f")
    with pytest.raises(ConfigError, match="only spare and key=value"):
        parse_lines(["h1 spar"], "f")


@pytest.mark.parametrize("kw, message", [
    (dict(num_workers=4, num_servers=0, min_workers=5), "-n 5:4: MIN must be a whole number from 1 to MAX"),
    (dict(num_workers=4, num_servers=2, min_workers=2), "-n 2:4: a parameter-server job runs a fixed number"),
    (dict(num_workers=2, num_servers=0, spares=(S1,)), "every host is a spare"),
    (dict(num_workers=2, num_servers=0, host_cooldown=(10.0, 5.0)), "--host-cooldown"),
])
def test_the_spec_refuses_what_cannot_work(kw, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        JobSpec(command=("prog",), **kw)
