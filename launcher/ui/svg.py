"""The throughput chart as inline SVG: pure, deterministic (golden-tested), no script, no style
element or attribute (presentation attributes only, so a page whose CSP forbids inline styles
shows it as well as the static report does).

One line per worker, from the samples/s its Speedometer lines reported, and a bold line for
the total; attempt boundaries are dashed verticals; a legend names the lines with each one's
mean samples/s (the mean of its reports). Beyond :data:`LEGEND_MAX` workers the legend names the
total and the :data:`EXTREMES` slowest and fastest only (the other workers are thin grey lines)
and says so.

**The total.** Workers report at their own times, so their series do not share abscissas. The
total is a step function on the union of their times: each worker contributes its last reported
value, held until its next report but for at most :data:`HOLD` of its own report intervals (the
median gap between its reports), after which it counts 0 until it reports again. So a worker
that died mid-job drops out of the total instead of being held forever, and so does every
worker during a restart; at the job's end, where every worker stops reporting, nothing is
dropped. A worker with one report is held for the others' median interval. A line (a worker's
too) is broken where two reports are further apart than that hold. The total is then
downsampled like any series.

**Bounds.** A series is drawn with at most :data:`MAX_POINTS` points (more are merged in equal
time bins: the mean time and mean value of the reports in a bin), and all series together with
about :data:`POINT_BUDGET` (the grey lines of a large job get fewer points each, at least
:data:`MIN_POINTS`): 256 workers with 1,000 reports each make a chart of 250 kB, in 0.26 s of CPU. The
``data-points`` attribute of the ``<svg>`` is the number of points drawn.

Coordinates are written with one decimal, labels with fixed rules (``m:ss`` or ``h:mm:ss``;
``950``, ``1.5k``, ``12M``), series in natural name order: the same input gives the same bytes.
"""

from __future__ import annotations

import math
import re
from html import escape
from statistics import median
from typing import Mapping, Optional, Sequence

#: most points drawn for one series
MAX_POINTS = 600
#: about the most points drawn for all series together (the grey lines of a large job share it)
POINT_BUDGET = 12000
#: the fewest points a grey line is drawn with
MIN_POINTS = 40
#: a report counts for this many of its series' median intervals (in the total), and a longer
#: gap between two reports breaks the line
HOLD = 2.0
#: the most workers the legend names one by one
LEGEND_MAX = 12
#: how many slowest and fastest workers the legend names beyond LEGEND_MAX
EXTREMES = 5

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
           "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a")
TOTAL_COLOR = "#111827"
OTHER_COLOR = "#cbd2da"
AXIS_COLOR = "#6b7280"
GRID_COLOR = "#e5e7eb"

Point = tuple  # (t seconds since the job's start, samples/s)

_TIME_STEPS = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200, 10800, 21600, 43200,
               86400)


def throughput_svg(series: Mapping[str, Sequence[Sequence[float]]], attempts: Sequence[float] = (),
                   width: int = 960, height: int = 340, labels: Optional[Mapping[str, str]] = None) -> str:
    """The chart of ``series`` (``{"worker-0": [(t, samples_per_s), ...]}``, t in seconds since
    the job's start) as one ``<svg>`` element. ``attempts``: the times (same clock) at which the
    second, third, ... attempt began, drawn as dashed verticals. ``labels``: what the legend
    calls a series (``{"worker-0": "worker 0"}``; default its name)."""
    labels = labels or {}
    data = {name: sorted(map(tuple, pts)) for name, pts in series.items() if len(pts)}
    names = sorted(data, key=natural_key)
    holds = hold_times(data)
    total = total_series(data, bins=MAX_POINTS, holds=holds) if len(names) > 1 else []
    legend_names, note = _legend_names(names, data)
    right = 190 if names else 12
    box = _Box(left=56, top=16, right=width - right, bottom=height - 26)
    xmax = max([1.0] + [p[-1][0] for p in data.values()] + [float(a) for a in attempts])
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'font-family="system-ui,sans-serif" font-size="11" role="img" '
           f'aria-label="throughput, samples/s per worker and in total"']
    body: list = []
    drawn = 0
    worker_box = box
    if total:  # two panels, each its own scale: a total n times a worker's would flatten the workers
        split = box.top + (box.bottom - box.top) * 0.36
        total_scale = _panel(_Box(box.left, box.top, box.right, split), xmax, [v for _, v in total], 3)
        body.extend(_axes(total_scale, "total samples/s", time_labels=False))
        worker_box = _Box(box.left, split + 18, box.right, box.bottom)
    worker_scale = _panel(worker_box, xmax, [v for pts in data.values() for _, v in pts], 4)
    body.extend(_axes(worker_scale, "samples/s per worker" if total else "samples/s", time_labels=True))
    if not names:
        body.append(f'<text x="{_f((box.left + box.right) / 2)}" y="{_f((box.top + box.bottom) / 2)}" '
                    f'text-anchor="middle" fill="{AXIS_COLOR}">no throughput reported yet '
                    f'(Speedometer lines)</text>')
    else:
        others = [n for n in names if n not in legend_names]
        cap = min(MAX_POINTS, max(MIN_POINTS, POINT_BUDGET // max(1, len(names))))
        lines = [(n, cap, OTHER_COLOR, "1") for n in others]
        lines += [(n, MAX_POINTS, PALETTE[i % len(PALETTE)], "1.3") for i, n in enumerate(legend_names)]
        for name, limit, color, stroke in lines:
            d, pts = _line(worker_scale, data[name], holds[name], limit, color, stroke, labels.get(name, name))
            body.append(d)
            drawn += pts
        if total:
            hold = max(holds.values())
            d, pts = _line(total_scale, total, hold, MAX_POINTS, TOTAL_COLOR, "2", "total")
            body.append(d)
            drawn += pts
    body.extend(_attempt_lines(box, worker_scale, attempts))
    if names:
        body.extend(_legend(box, names, legend_names, note, data, total, labels))
    out.append(f' data-points="{drawn}">')
    out.extend(body)
    out.append("</svg>")
    return "\n".join(out)


def natural_key(name: str) -> tuple:
    """``worker-2`` before ``worker-10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p)


def total_series(data: Mapping[str, Sequence[Sequence[float]]], bins: Optional[int] = None,
                 holds: Optional[Mapping[str, float]] = None) -> list:
    """The sum of the workers' series (each sorted by time) on the union of their times (the
    module's docstring says how each is held); one point per distinct time, sorted. With more
    reports than ``bins`` in all, the total is made in ``bins`` equal time bins instead (a point
    at each bin's middle: the sum of each worker's mean report in the bin, or of its held value),
    which costs a few operations per report instead of a sort of them all. ``holds``:
    :func:`hold_times` of ``data``, if the caller has them."""
    holds = holds if holds is not None else hold_times(data)
    if bins is not None and sum(len(p) for p in data.values()) > bins:
        return _binned_total(data, holds, bins)
    events: list = []  # (t, series index, value)
    for i, name in enumerate(sorted(data, key=natural_key)):
        pts = data[name]
        hold = holds[name]
        for k, (t, v) in enumerate(pts):
            events.append((t, i, v))
            if hold > 0 and (k + 1 == len(pts) or pts[k + 1][0] - t > hold):
                events.append((t + hold, i, 0.0))
    last_t = max((p[-1][0] for p in data.values() if len(p)), default=0.0)
    events = [e for e in events if e[0] <= last_t]  # (at the job's end every worker stops at once)
    events.sort(key=lambda e: (e[0], e[1]))
    current: dict = {}
    total = 0.0
    out: list = []
    for k, (t, i, v) in enumerate(events):
        total += v - current.get(i, 0.0)
        current[i] = v
        if k + 1 == len(events) or events[k + 1][0] != t:
            out.append((t, max(0.0, round(total, 6))))
    return out


def _binned_total(data: Mapping[str, Sequence[Sequence[float]]], holds: Mapping[str, float], bins: int) -> list:
    """:func:`total_series` in ``bins`` equal time bins."""
    t0 = min(p[0][0] for p in data.values() if len(p))
    t1 = max(p[-1][0] for p in data.values() if len(p))
    scale = bins / ((t1 - t0) or 1.0)
    width = 1.0 / scale
    total = [0.0] * bins
    for name, pts in data.items():
        sums = [0.0] * bins
        counts = [0] * bins
        lasts = [0.0] * bins
        for t, v in pts:
            b = int((t - t0) * scale)
            if b >= bins:
                b = bins - 1
            sums[b] += v
            counts[b] += 1
            lasts[b] = t
        hold = holds[name]
        cur, last = 0.0, None
        for b in range(bins):
            if counts[b]:
                cur, last = sums[b] / counts[b], lasts[b]
                total[b] += cur
            elif last is not None and (hold <= 0 or t0 + (b + 0.5) * width - last <= hold):
                total[b] += cur
    return [(t0 + (b + 0.5) * width, round(v, 6)) for b, v in enumerate(total)]


def hold_times(data: Mapping[str, Sequence[Sequence[float]]]) -> dict:
    """How long each series' report counts: :data:`HOLD` times its median interval (the median
    of the others' for a series with one report; 0, for ever, when no series has two)."""
    gaps = {}
    for name, pts in data.items():
        if len(pts) > 1:
            ts = [p[0] for p in pts]  # (sorted)
            gaps[name] = median([b - a for a, b in zip(ts, ts[1:])])
    default = median(gaps.values()) if gaps else 0.0
    return {name: HOLD * gaps.get(name, default) for name in data}


def segments(points: Sequence[Sequence[float]], hold: float) -> list:
    """``points`` cut where two reports are more than ``hold`` apart (a restart, a stall): the
    chart draws no line across such a gap."""
    ts = [p[0] for p in points]
    cuts = [0, *(k for k in range(1, len(ts)) if ts[k] - ts[k - 1] > hold), len(ts)]
    return [list(points[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]


def downsample(points: Sequence[Sequence[float]], limit: int) -> list:
    """At most ``limit`` points: the mean time and mean value of the points (sorted by time) in
    each of ``limit`` equal time bins (empty bins give none); ``points`` unchanged when they are
    few enough."""
    if len(points) <= limit:
        return [(t, v) for t, v in points]
    t0 = points[0][0]
    scale = limit / ((points[-1][0] - t0) or 1.0)
    st, sv, n = [0.0] * limit, [0.0] * limit, [0] * limit
    top = limit - 1
    for t, v in points:
        b = int((t - t0) * scale)
        if b > top:
            b = top
        st[b] += t
        sv[b] += v
        n[b] += 1
    return [(st[b] / n[b], sv[b] / n[b]) for b in range(limit) if n[b]]


def format_rate(v: float) -> str:
    """Samples/s for a label: ``0``, ``950``, ``2.5``, ``1.5k``, ``12M``."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


def format_time(s: float) -> str:
    """Seconds for a label: ``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


# --- pieces ------------------------------------------------------------------------------------------


class _Box:
    def __init__(self, left: float, top: float, right: float, bottom: float) -> None:
        self.left, self.top, self.right, self.bottom = left, top, right, bottom


class _Scale:
    def __init__(self, box: _Box, xmax: float, ymax: float, ystep: float) -> None:
        self.box, self.xmax, self.ymax, self.ystep = box, xmax, ymax, ystep

    def x(self, t: float) -> float:
        return self.box.left + (self.box.right - self.box.left) * min(max(t, 0.0), self.xmax) / self.xmax

    def y(self, v: float) -> float:
        return self.box.bottom - (self.box.bottom - self.box.top) * min(max(v, 0.0), self.ymax) / self.ymax


def _f(x: float) -> str:
    return f"{x:.1f}"


def _esc(s: str) -> str:
    return escape(str(s), quote=True)


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is at least ``raw``."""
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10.0 * mag


def _panel(box: _Box, xmax: float, values: Sequence[float], ticks: int) -> _Scale:
    """The scale of a panel showing ``values`` from 0, topped a little above their maximum at a
    round number, with about ``ticks`` steps."""
    ymax = max(values, default=0.0)
    if ymax <= 0:
        return _Scale(box, xmax, float(ticks), 1.0)
    step = _nice_step(ymax / ticks)
    return _Scale(box, xmax, math.ceil(ymax * 1.02 / step) * step, step)


def _axes(scale: _Scale, title: str, time_labels: bool) -> list:
    """A panel's frame, its title above it, horizontal grid lines with samples/s labels, time
    ticks below (labelled on the lowest panel only)."""
    b = scale.box
    out = [f'<rect x="{_f(b.left)}" y="{_f(b.top)}" width="{_f(b.right - b.left)}" '
           f'height="{_f(b.bottom - b.top)}" fill="#ffffff" stroke="{GRID_COLOR}"/>',
           f'<text x="{_f(b.left)}" y="{_f(b.top - 5)}" fill="{AXIS_COLOR}">{_esc(title)}</text>']
    grid, text = [], []
    n = int(round(scale.ymax / scale.ystep))
    for k in range(n + 1):
        v = k * scale.ystep
        y = _f(scale.y(v))
        if 0 < k:
            grid.append(f'<line x1="{_f(b.left)}" y1="{y}" x2="{_f(b.right)}" y2="{y}"/>')
        text.append(f'<text x="{_f(b.left - 5)}" y="{y}" dy="3.5" text-anchor="end">{format_rate(v)}</text>')
    step = next((s for s in _TIME_STEPS if scale.xmax / s <= 8), _TIME_STEPS[-1])
    k = 0
    while k * step <= scale.xmax + 1e-9:
        x = _f(scale.x(k * step))
        grid.append(f'<line x1="{x}" y1="{_f(b.bottom)}" x2="{x}" y2="{_f(b.bottom + 4)}"/>')
        if time_labels:
            text.append(f'<text x="{x}" y="{_f(b.bottom + 16)}" text-anchor="middle">'
                        f"{format_time(k * step)}</text>")
        k += 1
    out.append(f'<g stroke="{GRID_COLOR}">' + "".join(grid) + "</g>")
    out.append(f'<g fill="{AXIS_COLOR}">' + "".join(text) + "</g>")
    return out


def _line(scale: _Scale, pts: Sequence[Sequence[float]], hold: float, limit: int, color: str, width: str,
          label: str) -> tuple:
    """One series, downsampled to ``limit`` points and broken at gaps longer than ``hold``: one
    path (a dot for a lone point), its label as a tooltip; and the number of points drawn."""
    title = f"<title>{_esc(label)}</title>"
    parts: list = []
    dots: list = []
    n = 0
    for seg in segments(pts, hold):
        seg = downsample(seg, max(1, limit * len(seg) // len(pts)))
        n += len(seg)
        xy = [f"{_f(scale.x(t))},{_f(scale.y(v))}" for t, v in seg]
        if len(xy) == 1:
            dots.append(xy[0])
        else:
            parts.append("M" + " ".join(xy))
    out = []
    if parts:
        out.append(f'<path fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round" '
                   f'd="{"".join(parts)}">{title}</path>')
    for dot in dots:
        x, y = dot.split(",")
        out.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{color}">{title}</circle>')
    return "".join(out), n


def _attempt_lines(box: _Box, scale: _Scale, attempts: Sequence[float]) -> list:
    """A dashed vertical across the panels at the start of each restart, labelled ``restart k``."""
    out = []
    for k, t in enumerate(attempts, start=1):
        x = _f(scale.x(float(t)))
        out.append(f'<line x1="{x}" y1="{_f(box.top)}" x2="{x}" y2="{_f(box.bottom)}" stroke="{AXIS_COLOR}" '
                   f'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x}" y="{_f(box.top + 10)}" dx="3" fill="{AXIS_COLOR}">restart {k}</text>')
    return out


def _mean(pts: Sequence[Sequence[float]]) -> float:
    return sum(p[1] for p in pts) / len(pts)


def _legend_names(names: Sequence[str], data: Mapping[str, Sequence[Sequence[float]]]) -> tuple:
    """The workers the legend names, and a note when it does not name them all."""
    if len(names) <= LEGEND_MAX:
        return list(names), ""
    ranked = sorted(names, key=lambda n: (_mean(data[n]), natural_key(n)))
    slow, fast = ranked[:EXTREMES], ranked[-EXTREMES:][::-1]
    return slow + fast, f"{len(names) - 2 * EXTREMES} other workers in grey"


def _legend(box: _Box, names: Sequence[str], shown: Sequence[str], note: str,
            data: Mapping[str, Sequence[Sequence[float]]], total: Sequence[Sequence[float]],
            labels: Mapping[str, str]) -> list:
    """The legend, right of the plot: swatch, label, mean samples/s."""
    x0, x1 = box.right + 14, box.right + 180
    rows: list = [("head", "mean samples/s", "", "")]
    if total:
        rows.append(("total", "total", TOTAL_COLOR, format_rate(_mean(total))))
    for i, name in enumerate(shown):
        if note and i == 0:
            rows.append(("head", f"{EXTREMES} slowest", "", ""))
        if note and i == EXTREMES:
            rows.append(("head", f"{EXTREMES} fastest", "", ""))
        rows.append(("line", labels.get(name, name), PALETTE[i % len(PALETTE)], format_rate(_mean(data[name]))))
    if note:
        rows.append(("note", note, OTHER_COLOR, ""))
    out = []
    for k, (kind, text, color, value) in enumerate(rows):
        y = box.top + 8 + 14 * k
        if kind == "head":
            out.append(f'<text x="{_f(x0)}" y="{_f(y + 4)}" fill="{AXIS_COLOR}">{_esc(text)}</text>')
            continue
        sw = "2.5" if kind == "total" else "2"
        out.append(f'<line x1="{_f(x0)}" y1="{_f(y)}" x2="{_f(x0 + 16)}" y2="{_f(y)}" stroke="{color}" '
                   f'stroke-width="{sw}"/>')
        out.append(f'<text x="{_f(x0 + 21)}" y="{_f(y + 4)}" fill="#111827">{_esc(text)}</text>')
        if value:
            out.append(f'<text x="{_f(x1)}" y="{_f(y + 4)}" text-anchor="end" fill="#111827">{value}</text>')
    return out
