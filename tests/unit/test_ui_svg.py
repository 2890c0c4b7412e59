"""The throughput chart (``launcher/ui/svg.py``): golden SVG of the sample job, the total of series
sampled at different times, the bounds (points, legend), the edge cases, escaping."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from support.uisample import big_snapshot, check_golden, sample_snapshot

from launcher.ui import svg
from launcher.ui.svg import downsample, format_rate, format_time, throughput_svg, total_series


def parse(text: str) -> ET.Element:
    """The chart as XML (it is well-formed SVG: the namespace is added only for parsing)."""
    return ET.fromstring(text.replace("<svg ", '<svg xmlns="s" ', 1))


def points_drawn(text: str) -> int:
    return int(re.search(r'data-points="(\d+)"', text).group(1))


def test_the_sample_chart_golden() -> None:
    snap = sample_snapshot()
    labels = {p["name"]: p["label"] for p in snap["processes"]}
    text = throughput_svg(snap["throughput"], attempts=[64.0], labels=labels)
    check_golden("ui_throughput.svg", text + "\n")
    parse(text)
    assert 'stroke-dasharray="4 3"' in text and "restart 1" in text
    assert text.count("<path ") == 5  # 4 workers and the total
    assert points_drawn(text) == sum(len(v) for v in snap["throughput"].values()) + len(
        total_series(snap["throughput"]))


def test_the_total_is_the_sum_of_the_last_reports_on_the_union_of_times() -> None:
    series = {"worker-0": [(0, 10), (2, 12), (4, 14)], "worker-1": [(1, 100), (3, 200), (5, 300)]}
    assert total_series(series) == [(0, 10), (1, 110), (2, 112), (3, 212), (4, 214), (5, 314)]


def test_a_worker_that_stops_reporting_drops_out_of_the_total() -> None:
    # worker-1 reports every 1 s until 3 s, then dies; worker-0 goes on to 10 s: held for 2 intervals
    series = {"worker-0": [(float(t), 10.0) for t in range(11)],
              "worker-1": [(float(t), 100.0) for t in range(4)]}
    total = dict(total_series(series))
    assert total[3.0] == 110 and total[5.0] == 10 and total[10.0] == 10
    # during a restart (a gap of 10 intervals) every worker drops to 0, and the lines break
    gap = {"worker-0": [(0.0, 5.0), (1.0, 5.0), (2.0, 5.0), (12.0, 5.0), (13.0, 5.0)],
           "worker-1": [(0.5, 5.0), (1.5, 5.0), (2.5, 5.0), (12.5, 5.0), (13.5, 5.0)]}
    total = dict(total_series(gap))
    assert total[2.5] == 10 and total[4.5] == 0 and total[12.5] == 10
    text = throughput_svg(gap)
    assert all(d.count("M") == 2 for d in re.findall(r' d="([^"]*)"', text))


def test_at_the_end_every_worker_is_held() -> None:
    series = {"worker-0": [(0.0, 1.0), (10.0, 1.0)], "worker-1": [(3.0, 2.0), (13.0, 2.0)]}
    assert total_series(series)[-1] == (13.0, 3.0)


def test_no_data_and_one_point() -> None:
    for series in ({}, {"worker-0": []}):
        text = throughput_svg(series)
        parse(text)
        assert points_drawn(text) == 0 and "no throughput reported yet" in text
    text = throughput_svg({"worker-0": [(5.0, 1500.0)]})
    parse(text)
    assert points_drawn(text) == 1 and "<circle " in text and "1.5k" in text
    two = throughput_svg({"worker-0": [(5.0, 1500.0)], "worker-1": [(5.0, 500.0)]})
    assert two.count("<circle ") == 3 and "2k" in two  # one point each and the total


def test_a_series_is_drawn_with_at_most_max_points() -> None:
    pts = [(i * 0.1, 1000.0 + i % 50) for i in range(20000)]
    assert len(downsample(pts, 600)) == 600
    text = throughput_svg({"worker-0": pts})
    assert points_drawn(text) <= svg.MAX_POINTS
    assert downsample(pts[:10], 600) == pts[:10]


def test_256_workers_collapse_the_legend_and_keep_the_chart_small() -> None:
    snap = big_snapshot(workers=256, points=1000)
    text = throughput_svg(snap["throughput"])
    parse(text)
    legend = re.findall(r'fill="#111827">([^<]*)</text>', text)
    names = [x for x in legend if x.startswith("worker-")]
    # worker r runs at about 1000 + r samples/s: the 5 slowest are 0-4, the fastest 255-251
    assert names == [f"worker-{r}" for r in (0, 1, 2, 3, 4, 255, 254, 253, 252, 251)]
    assert "246 other workers in grey" in text and "5 slowest" in text and "5 fastest" in text
    assert points_drawn(text) <= svg.POINT_BUDGET + 11 * svg.MAX_POINTS
    assert len(text) < 300_000, len(text)


def test_a_few_workers_are_all_named() -> None:
    series = {f"worker-{r}": [(1.0, 1.0), (2.0, 2.0)] for r in range(12)}
    text = throughput_svg(series)
    assert "other workers" not in text and "worker-11" in text and "worker-2<" in text
    assert text.index("worker-2<") < text.index("worker-10<")  # natural order


def test_every_text_is_escaped() -> None:
    hostile = '<script>alert("x")</script>&'
    text = throughput_svg({hostile: [(1.0, 2.0), (2.0, 3.0)], "w": [(1.0, 1.0)]}, labels={"w": hostile})
    assert "<script" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in text
    parse(text)


def test_the_output_is_deterministic() -> None:
    snap = sample_snapshot()
    reordered = dict(reversed(list(snap["throughput"].items())))
    assert throughput_svg(snap["throughput"]) == throughput_svg(reordered)


def test_labels() -> None:
    assert [format_rate(v) for v in (0, 2.5, 950, 1000, 1500, 12500, 2e6, 3.5e9)] == \
        ["0", "2.5", "950", "1k", "1.5k", "12.5k", "2M", "3.5G"]
    assert [format_time(s) for s in (0, 59.6, 61, 3599, 3600, 7322)] == \
        ["0:00", "1:00", "1:01", "59:59", "1:00:00", "2:02:02"]


def test_the_binned_total_follows_the_exact_one() -> None:
    data = {k: [tuple(p) for p in v] for k, v in big_snapshot(workers=20, points=300)["throughput"].items()}
    data["worker-3"] = data["worker-3"][:150]  # dies half-way: out of both totals from then on
    exact = total_series(data)
    binned = total_series(data, bins=100)
    assert len(exact) > 5000 and len(binned) == 100
    for (t, v) in binned[5:-5]:
        near = [e for s, e in exact if abs(s - t) < 3]
        assert min(near) - 1 <= v <= max(near) + 1, (t, v, near)
    assert 19 * 1000 < binned[-1][1] < 19 * 1030 and 20 * 1000 < binned[0][1] < 20 * 1030
