"""Key placement: balanced by bytes, big arrays split as MXNet splits them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.kv.placement import Part, Placement, split_bounds

# LeNet (MXNet's example): weights and biases alternate, float32
LENET = [(20, 1, 5, 5), (20,), (50, 20, 5, 5), (50,), (500, 800), (500,), (10, 500), (10,)]
SIZES = [(int(np.prod(s)), 4) for s in LENET]


def mxnet_loads(num_servers: int) -> list[int]:
    loads = [0] * num_servers
    for key, (n, itemsize) in enumerate(SIZES):
        loads[(key * 9973) % num_servers] += n * itemsize
    return loads


@pytest.mark.parametrize("servers", [2, 3, 4])
def test_lenet_is_balanced_where_mxnet_is_not(servers: int) -> None:
    p = Placement(servers)
    parts = p.assign(SIZES)
    # nothing reaches the 1,000,000-element bound: every key on one server (fc1's weight,
    # 1.6 MB, travels in two chunks)
    assert all(len({x.server for x in key}) == 1 for key in parts)
    assert [len(key) for key in parts] == [1, 1, 1, 1, 2, 1, 1, 1]
    assert sum(p.loads) == sum(n * i for n, i in SIZES)
    # fc1's weight (1.6 MB) dominates: the best possible max load is that array alone
    assert max(p.loads) == 400_000 * 4
    if servers == 2:
        assert mxnet_loads(2) == [1_722_000, 2_320]  # every weight on server 0
        assert min(p.loads) > 100_000
    assert max(p.loads) <= max(mxnet_loads(servers))


def test_greedy_balances_equal_arrays() -> None:
    p = Placement(3)
    parts = p.assign([(100, 4)] * 6)
    assert sorted(x[0].server for x in parts) == [0, 0, 1, 1, 2, 2]
    assert p.loads == [800, 800, 800]


def test_big_arrays_split_across_all_servers_with_mxnet_sizes() -> None:
    p = Placement(3, bigarray_bound=10)
    (parts,) = p.assign([(10, 8)])
    assert [(x.server, x.index, x.lo, x.hi) for x in parts] == [(0, 0, 0, 3), (1, 1, 3, 7), (2, 2, 7, 10)]
    assert p.loads == [24, 32, 24]
    # below the bound: one server; with one server: never split
    assert len(Placement(3, bigarray_bound=11).assign([(10, 8)])[0]) == 1
    assert len(Placement(1, bigarray_bound=1).assign([(10, 8)])[0]) == 1


def test_parts_are_cut_into_chunks_on_the_same_server() -> None:
    p = Placement(2, bigarray_bound=100, chunk_bytes=40)  # 10 float32 per chunk
    (small, big) = p.assign([(25, 4), (300, 4)])
    assert [(x.server, x.index, x.lo, x.hi) for x in small] == [(0, 0, 0, 10), (0, 1, 10, 20),
                                                               (0, 2, 20, 25)]
    # split across the servers first (150 + 150), then each half in chunks of 10
    assert len(big) == 30 and [x.index for x in big] == list(range(30))
    assert {x.server for x in big[:15]} == {0} and {x.server for x in big[15:]} == {1}
    assert big[14].hi == big[15].lo == 150 and big[-1].hi == 300
    assert p.loads == [600 + 100, 600]
    assert Placement(1, chunk_bytes=40).assign([(0, 4)]) == [[Part(0, 0, 0, 0)]]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10**7), s=st.integers(1, 16))
def test_split_bounds_cover_the_array(n: int, s: int) -> None:
    b = split_bounds(n, s)
    assert b[0][0] == 0 and b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(s - 1))
    # MXNet: part i has round(n/S*(i+1)) - round(n/S*i) elements
    assert [hi - lo for lo, hi in b] == [round(n / s * (i + 1)) - round(n / s * i) for i in range(s)]


def test_placement_is_deterministic_across_workers() -> None:
    a, b = Placement(4), Placement(4)
    assert a.assign(SIZES) == b.assign(SIZES)
    assert a.assign([(7, 4), (9, 2)]) == b.assign([(7, 4), (9, 2)])
