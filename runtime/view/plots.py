"""The steps page's plots as numbers for an SVG template (no script): axes with labelled ticks, lines with a spread
band, stacked bars; each point carries the ``<title>`` text a browser shows on hover. Nothing here is HTML.

Any number may come (±1e308, the infinities, NaN): the frame is drawn over the finite ones, every coordinate is
computed halved so that no difference overflows, and a point that cannot be drawn is named in ``unplotted``
(its value as text) instead."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

W, H = 560, 220  # the plot area's frame
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 14, 34
COLOURS = ["#0969da", "#cf222e", "#1a7f37", "#bf8700", "#8250df", "#57606a", "#bc4c00", "#0550ae"]


@dataclass
class Point:
    x: float
    y: float
    title: str


@dataclass
class Line:
    label: str
    colour: str
    points: list[Point]
    band: str = ""  # an SVG polygon's points: the spread around the line

    @property
    def path(self) -> str:
        return " ".join(f"{p.x:.1f},{p.y:.1f}" for p in self.points)


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    colour: str
    title: str


@dataclass
class Tick:
    at: float
    label: str


@dataclass
class Chart:
    id: str
    title: str
    xlabel: str
    ylabel: str
    xticks: list[Tick] = field(default_factory=list)
    yticks: list[Tick] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)  # (label, colour)
    unplotted: list[str] = field(default_factory=list)  # the points with no place on the plot (a value not finite)
    width: int = W
    height: int = H
    left: int = LEFT
    top: int = TOP
    bottom: int = H - BOTTOM
    right: int = W - RIGHT


def _nice(lo: float, hi: float) -> tuple[float, float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0, 1.0
    if hi - lo < 1e-12:
        return lo - 0.5, hi + 0.5
    return lo, hi


def round_ticks(lo: float, hi: float, most: int = 6, *, whole: bool = False) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten apart; ``whole``: at least 1, for counts) from at or below
    ``lo`` to at or above ``hi``, at most ``most`` of them: an axis labelled 0, 0.1, 0.2, not 0.0947, 0.119."""
    raw = (hi - lo) / (most - 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    if whole:
        step = max(1.0, float(math.ceil(step)))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) + 0.0 for k in range(first, last + 1)]  # (+ 0.0: no "-0")


def _fmt(v: float) -> str:
    return "not a number" if math.isnan(v) else f"{v:.3g}"


class Frame:
    """Maps data to the plot area."""

    def __init__(self, xs: list[int], lo: float, hi: float, *, whole: bool = False) -> None:
        self.xs = xs
        self.lo, self.hi = _nice(lo, hi)
        if math.isfinite(self.hi - self.lo):  # the y axis spans its round ticks
            values = round_ticks(self.lo, self.hi, whole=whole)
            self.lo, self.hi = values[0], values[-1]
            self.labels = [(v, f"{v:g}") for v in values]
        else:  # a span beyond a float (-1e308 to 1e308): five ticks, each as it is
            at = [self.lo * (1 - k / 4) + self.hi * (k / 4) for k in range(5)]
            self.labels = [(v, _fmt(v)) for v in at]
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0, 1)

    def x(self, v: float) -> float:
        span = (self.x1 - self.x0) or 1
        return LEFT + (v - self.x0) / span * (W - LEFT - RIGHT) if self.x1 != self.x0 else (LEFT + W - RIGHT) / 2

    def y(self, v: float) -> float:
        if not math.isfinite(v):  # a band's edge beyond a float (1e308 + 1e308): at the frame's edge
            v = self.hi if v > 0 else self.lo
        # halved: from -1e308 to 1e308 is beyond a float, half of it is not
        return (H - BOTTOM) - (v / 2 - self.lo / 2) / (self.hi / 2 - self.lo / 2) * (H - BOTTOM - TOP)

    def ticks(self, chart: Chart) -> None:
        step = max(1, math.ceil(len(self.xs) / 10))
        chart.xticks = [Tick(self.x(v), str(v)) for v in self.xs[::step]]
        chart.yticks = [Tick(self.y(v), label) for v, label in self.labels]


def lines(
    id: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: list[tuple[str, list[tuple[int, float, float]]]],
    *,
    unit: str = "",
    floor: float | None = None,
) -> Chart:
    """Lines over steps, each point ``(step, value, spread)``: a band of ± spread drawn where it is above 0, never
    below ``floor`` (the least value there can be: a reward's, a length's 0)."""
    chart = Chart(id, title, xlabel, ylabel)
    xs = sorted({x for _, pts in series for x, _, _ in pts})

    def low(v: float, s: float) -> float:
        return v - s if floor is None else max(floor, v - s)

    drawn = [[(x, v, s if math.isfinite(s) else 0.0) for x, v, s in pts if math.isfinite(v)] for _, pts in series]
    values = [b for pts in drawn for _, v, s in pts for b in (v + s, low(v, s)) if math.isfinite(b)]
    values += [v for pts in drawn for _, v, _ in pts]
    frame = Frame(xs, min(values, default=0.0), max(values, default=1.0))
    frame.ticks(chart)
    for k, ((label, every), pts) in enumerate(zip(series, drawn, strict=True)):
        colour = COLOURS[k % len(COLOURS)]
        chart.unplotted += [f"{label}, {xlabel} {x}: {_fmt(v)}{unit}" for x, v, _ in every if not math.isfinite(v)]
        spreads = {x: s for x, _, s in every}
        points = [
            Point(frame.x(x), frame.y(v), f"{label}, {xlabel} {x}: {_fmt(v)}{unit} (± {_fmt(spreads[x])})")
            for x, v, _ in pts
        ]
        band = ""
        if any(s > 0 for _, _, s in pts):
            upper = [f"{frame.x(x):.1f},{frame.y(v + s):.1f}" for x, v, s in pts]
            lower = [f"{frame.x(x):.1f},{frame.y(low(v, s)):.1f}" for x, v, s in reversed(pts)]
            band = " ".join(upper + lower)
        chart.lines.append(Line(label, colour, points, band))
        chart.legend.append((label, colour))
    return chart


def stacked(id: str, title: str, xlabel: str, ylabel: str, counts: dict[int, dict[str, int]]) -> Chart:
    """Bars per step, stacked by kind (``counts[step][kind]``)."""
    chart = Chart(id, title, xlabel, ylabel)
    xs = sorted(counts)
    kinds = sorted({k for c in counts.values() for k in c})
    top = max((sum(c.values()) for c in counts.values()), default=0)
    frame = Frame(xs, 0.0, float(max(top, 1)), whole=True)
    frame.ticks(chart)
    colours = {k: COLOURS[(n + 1) % len(COLOURS)] for n, k in enumerate(kinds)}
    width = max(2.0, min(24.0, (W - LEFT - RIGHT) / max(1, len(xs)) * 0.7))
    for x in xs:
        base = 0
        for kind in kinds:
            n = counts[x].get(kind, 0)
            if not n:
                continue
            y0, y1 = frame.y(base), frame.y(base + n)
            chart.bars.append(
                Bar(frame.x(x) - width / 2, y1, width, y0 - y1, colours[kind], f"{xlabel} {x}: {n} {kind}")
            )
            base += n
    chart.legend = [(k, colours[k]) for k in kinds]
    return chart
