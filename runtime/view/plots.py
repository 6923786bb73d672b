"""The steps page's plots as numbers for an SVG template (no script): axes with labelled ticks, lines with a spread
band, stacked bars; each point carries the ``<title>`` text a browser shows on hover. Nothing here is HTML."""

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
    return f"{v:.3g}"


class Frame:
    """Maps data to the plot area."""

    def __init__(self, xs: list[int], lo: float, hi: float, *, whole: bool = False) -> None:
        self.xs = xs
        self.values = round_ticks(*_nice(lo, hi), whole=whole)  # the y axis spans its round ticks
        self.lo, self.hi = self.values[0], self.values[-1]
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0, 1)

    def x(self, v: float) -> float:
        span = (self.x1 - self.x0) or 1
        return LEFT + (v - self.x0) / span * (W - LEFT - RIGHT) if self.x1 != self.x0 else (LEFT + W - RIGHT) / 2

    def y(self, v: float) -> float:
        return (H - BOTTOM) - (v - self.lo) / (self.hi - self.lo) * (H - BOTTOM - TOP)

    def ticks(self, chart: Chart) -> None:
        step = max(1, math.ceil(len(self.xs) / 10))
        chart.xticks = [Tick(self.x(v), str(v)) for v in self.xs[::step]]
        chart.yticks = [Tick(self.y(v), f"{v:g}") for v in self.values]


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

    values = [v + s for _, pts in series for _, v, s in pts] + [low(v, s) for _, pts in series for _, v, s in pts]
    frame = Frame(xs, min(values, default=0.0), max(values, default=1.0))
    frame.ticks(chart)
    for k, (label, pts) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        points = [
            Point(frame.x(x), frame.y(v), f"{label}, {xlabel} {x}: {_fmt(v)}{unit} (± {_fmt(s)})") for x, v, s in pts
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
