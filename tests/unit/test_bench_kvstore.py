"""scripts/bench_kvstore.py: raw TCP does the KVStore's dist_sync round, with the KVStore's
placement, and the table shows the median of the interleaved runs."""

from __future__ import annotations

from support.helpers import load_script

from trainer.kv.placement import Placement

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def test_raw_tcp_sends_each_server_the_share_the_kvstore_places_there() -> None:
    b = load_script("bench_kvstore")
    for servers in (1, 2, 4):
        shares = b.round_shares(SIZES, servers)
        placement = Placement(servers)
        for size, share in zip(SIZES, shares):
            expected = [0] * servers
            for part in placement.assign([(size // 4, 4)])[0]:
                expected[part.server] += (part.hi - part.lo) * 4
            assert share == expected and sum(share) == size
    # one key per size, each small one on the least loaded server; 16 MB split across all
    assert b.round_shares(SIZES, 2) == [[4096, 0], [0, 65536], [1 << 20, 0], [8 << 20, 8 << 20]]


def test_the_raw_tcp_round_runs_for_every_client() -> None:
    b = load_script("bench_kvstore")
    times = b.raw_tcp([4 << 10, 1 << 20], 8 << 20, workers=3, servers=2)
    assert sorted(times) == [4 << 10, 1 << 20]
    assert all(0 < t < 5 for t in times.values())


def test_the_table_shows_the_median_of_the_runs_or_the_best() -> None:
    b = load_script("bench_kvstore")
    runs = [{1: 3.0, 2: 9.0}, None, {1: 1.0, 2: 7.0}, {1: 2.0, 2: 8.0}]
    assert b.summarize(runs) == {1: 2.0, 2: 8.0}
    assert b.summarize(runs, "best") == {1: 1.0, 2: 7.0}
