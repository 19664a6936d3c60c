"""Charts as inline SVG, drawn in Python: no plotting library, nothing fetched when a page is viewed.

Every chart has a title and both axis labels (units in parentheses). A mark that shows a number of a report
carries where it comes from: ``data-path`` (a JSON pointer into the report) and ``data-value`` (the number as
JSON, exactly as ``--json`` prints it), so the page can be read back and compared with the report; ``data-tip``
is the text hovering shows (``prep/inspect/assets/report.js``). The geometry is the only thing computed here.
Imports nothing of the project (``prep/inspect/html.py`` lays the charts out).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 560, 300
TOP, BOTTOM, RIGHT = 40, 50, 18  # room for the title, the x ticks and label, the last x tick
LEFT = 72  # the y ticks and label of a numeric y axis
CHAR_PX = 6.6  # width of a 11 px character, to make room for category names
BAND_MAX = 54  # pixels of a bar chart's row at most: one or two rows stay bars, not blocks
ALL_COLOUR = "#1f2430"  # the overall series ("all"), darker than any category
NEUTRAL = "#5b6b84"  # bars that stand for no category (reasons, measures)
GRID = "#e6e9ee"


# ------------------------------------------------------------------------------------------ markup
def attrs(**values) -> str:
    """`` name="value"`` pairs, escaped; ``None`` is left out, ``data_path`` is written ``data-path``."""
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{escape(str(v), quote=True)}"'
                   for k, v in values.items() if v is not None)


def as_json(value) -> str:
    """A report value as ``--json`` writes it (floats round-trip exactly)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Source:
    """Where a mark's number comes from: a JSON pointer into report ``report`` and the value there (no
    ``path``: a value of the page's own, e.g. the step index of an axis)."""

    path: str | None
    value: object
    report: int | None = None

    def attrs(self) -> dict:
        return {"data_report": self.report, "data_path": self.path, "data_value": as_json(self.value)}


# ------------------------------------------------------------------------------------------- scales
@dataclass(frozen=True)
class Scale:
    """Data → pixels along one axis, linear or log10; ``lo`` lands on pixel ``start``, ``hi`` on ``end``."""

    lo: float
    hi: float
    start: float
    end: float
    log: bool = False

    def __call__(self, v: float) -> float:
        if self.log:
            a, b, v = math.log10(self.lo), math.log10(self.hi), math.log10(max(v, self.lo))
        else:
            a, b = self.lo, self.hi
        t = (v - a) / (b - a) if b != a else 0.5
        return round(self.start + t * (self.end - self.start), 1)


def nice_step(raw: float) -> float:
    """The round step (1, 2, 2.5 or 5 × 10^k) at least ``raw``."""
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def nice_range(lo: float, hi: float, zero: bool = False, count: int = 5, least: float = 0.0) -> tuple[float, float]:
    """``[lo, hi]`` widened to round steps of at least ``least`` (and to 0 with ``zero``); an empty range gets a
    width."""
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = (lo, lo + pad) if zero and lo == 0 else (lo - pad, hi + pad)
    step = nice_step(max((hi - lo) / count, least))
    return math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step


def linear_ticks(lo: float, hi: float, count: int = 5, least: float = 0.0) -> list[float]:
    """About ``count`` round ticks in ``[lo, hi]``, at least ``least`` apart (1 on an axis of counts)."""
    step = nice_step(max((hi - lo) / count, least))
    first = math.ceil(lo / step - 1e-9) * step
    n = int(math.floor((hi - first) / step + 1e-9))
    return [round(first + k * step, 12) for k in range(n + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten in ``[lo, hi]``, and 2× and 5× them when the range spans less than three decades."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    steps = (1, 2, 5) if hi / lo < 1000 else (1,)
    return [m * 10.0 ** d for d in decades for m in steps if lo <= m * 10.0 ** d <= hi]


Format = Callable[[float, float], str]  # (value, step between an axis's ticks, 0 for a lone value) → label


def decimals(step: float) -> int:
    """The fewest decimals that write every multiple of ``step`` exactly: 5 → 0, 0.5 → 1, 0.01 → 2, 0.025 → 3."""
    for d in range(16):
        scaled = abs(step) * 10 ** d
        if abs(scaled - round(scaled)) <= 1e-6 * scaled:
            return d
    return 15


def short(v: float, step: float = 0.0) -> str:
    """A number in a few characters: 1.5k, 20M, 0.25, 3e-4. Given ``step``, the distance between an axis's
    ticks, it has the decimals the step needs, so that the ticks read apart and alike: 11.80 11.81 11.82 (not
    11.8 three times), 0 500 1.0k 1.5k; alone, three significant digits."""
    if v == 0:
        return "0"
    a = abs(v)
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= size:
            return f"{v / size:.{decimals(step / size)}f}{suffix}" if step else f"{v / size:.3g}{suffix}"
    if a >= 0.01 or (step and decimals(step) <= 4):
        return f"{v:.{decimals(step)}f}" if step else f"{v:.3g}"
    if not step:
        mantissa, exponent = f"{v:.1e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    mantissa, exponent = f"{v:.{decimals(step / 10 ** math.floor(math.log10(a)))}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def percent(v: float, step: float = 0.0) -> str:
    """A fraction as a percentage: 25%, 70.02% (to the precision of ``step``, as ``short``)."""
    return f"{100 * v:.{decimals(100 * step)}f}%" if step else f"{100 * v:.3g}%"


def times(v: float, step: float = 0.0) -> str:
    """A factor: 2.44×."""
    return f"{short(v, step)}×"


def labelled(ticks: Sequence[float], fmt: Format = short) -> list[tuple[float, str]]:
    """Evenly spaced ticks with their labels, each written to the precision of the step between them."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 0.0
    return [(t, fmt(t, step)) for t in ticks]


# -------------------------------------------------------------------------------------------- frame
@dataclass
class Frame:
    """The plot area of one chart: its scales, ticks and labels; ``marks`` are drawn inside it."""

    title: str
    x_label: str
    y_label: str
    x: Scale
    y: Scale
    x_ticks: Sequence[tuple[float, str]]
    y_ticks: Sequence[tuple[float, str]]
    left: float = LEFT
    marks: list[str] = field(default_factory=list)

    def svg(self, kind: str, extra: dict | None = None) -> str:
        """The whole chart: grid, axes, ticks, labels, title, then the marks and a hover guide."""
        bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
        parts = [f'<text class="chart-title" x="12" y="22">{escape(self.title)}</text>']
        for v, label in self.y_ticks:
            y = self.y(v)
            parts.append(f'<line class="grid" x1="{self.left}" x2="{right}" y1="{y}" y2="{y}"/>'
                         f'<text class="tick y" x="{self.left - 6}" y="{y + 4}">{escape(label)}</text>')
        for v, label in self.x_ticks:
            x = self.x(v)
            parts.append(f'<line class="tick-mark" x1="{x}" x2="{x}" y1="{bottom}" y2="{bottom + 4}"/>'
                         f'<text class="tick x" x="{x}" y="{bottom + 16}">{escape(label)}</text>')
        parts.append(f'<line class="axis" x1="{self.left}" x2="{right}" y1="{bottom}" y2="{bottom}"/>'
                     f'<line class="axis" x1="{self.left}" x2="{self.left}" y1="{TOP}" y2="{bottom}"/>')
        parts.append(f'<text class="axis-label x" x="{(self.left + right) / 2}" y="{HEIGHT - 10}">'
                     f'{escape(self.x_label)}</text>'
                     f'<text class="axis-label y" transform="translate(14 {(TOP + bottom) / 2}) rotate(-90)">'
                     f'{escape(self.y_label)}</text>')
        parts += self.marks
        parts.append(f'<line class="guide" x1="0" x2="0" y1="{TOP}" y2="{bottom}" visibility="hidden"/>')
        geometry = {"data_x_lo": self.x.lo, "data_x_hi": self.x.hi, "data_x_log": int(self.x.log),
                    "data_left": self.x.start, "data_right": self.x.end} if kind == "line" else {}
        head = attrs(class_="chart", viewBox=f"0 0 {WIDTH} {HEIGHT}", role="img", aria_label=self.title,
                     data_kind=kind, **geometry, **(extra or {}))
        return f'<svg xmlns="http://www.w3.org/2000/svg"{head}>{"".join(parts)}</svg>'


def y_value_axis(values: Sequence[float], fmt: Format = short, zero: bool = True,
                 log: bool = False, counts: bool = False) -> tuple[Scale, list[tuple[float, str]]]:
    """A numeric y axis over ``values`` (from 0 unless ``zero`` is off; log10 when asked and all > 0; whole
    ticks only for ``counts``)."""
    finite = [v for v in values if v is not None and math.isfinite(v)] or [0.0]
    if log and min(finite) > 0:
        lo, hi = 10 ** math.floor(math.log10(min(finite))), 10 ** math.ceil(math.log10(max(finite)))
        hi = hi * 10 if hi == lo else hi
        return Scale(lo, hi, HEIGHT - BOTTOM, TOP, log=True), [(t, fmt(t, 0.0)) for t in log_ticks(lo, hi)]
    least = 1.0 if counts else 0.0
    lo, hi = nice_range(min(finite), max(finite), zero=zero, least=least)
    return Scale(lo, hi, HEIGHT - BOTTOM, TOP), labelled(linear_ticks(lo, hi, least=least), fmt)


# ------------------------------------------------------------------------------------------ legend
@dataclass(frozen=True)
class Key:
    """One entry of a legend; clicking it shows or hides the marks of its ``series`` (or ``run``)."""

    label: str
    colour: str = ALL_COLOUR
    series: str | None = None
    run: int | None = None
    dash: str = ""
    opacity: float = 1.0
    category: str | None = None


def legend(keys: Sequence[Key]) -> str:
    if not keys:
        return ""
    items = []
    for k in keys:
        swatch = (f'<svg class="swatch" viewBox="0 0 22 8" aria-hidden="true"><line x1="1" x2="21" y1="4" y2="4"'
                  f'{attrs(stroke=k.colour, stroke_dasharray=k.dash or None, stroke_opacity=k.opacity)}/></svg>')
        tags = attrs(data_series=k.series, data_run=k.run, data_category=k.category,
                     data_colour=k.colour if k.category else None)
        items.append(f'<button type="button" class="key"{tags} aria-pressed="true">{swatch}{escape(k.label)}</button>')
    return f'<div class="legend">{"".join(items)}</div>'


def figure(svg: str, keys: Sequence[Key] = (), note: str | None = None) -> str:
    """A chart with its legend and an optional note under it."""
    caption = f'<figcaption>{escape(note)}</figcaption>' if note else ""
    return f'<figure class="figure">{svg}{legend(keys)}{caption}</figure>'


# ------------------------------------------------------------------------------------- histograms
@dataclass(frozen=True)
class Marker:
    """A labelled vertical line at ``x`` (a percentile, a checkpoint), with its source."""

    x: float
    label: str
    tip: str
    source: Source | None = None
    run: int | None = None
    emphasis: bool = False


def histogram(title: str, x_label: str, y_label: str, rows: Sequence[dict], path: str, *,
              span: Callable[[dict], tuple[float, float]], tip: Callable[[dict], str], log_x: bool = False,
              x_fmt: Format = short, colour: str = NEUTRAL,
              markers: Sequence[Marker] = (), trim: bool = False) -> str:
    """Bars of ``rows`` (``count`` each, at ``span(row)`` on x) with vertical ``markers``; each bar's count
    comes from ``{path}/{i}/count``. ``trim`` leaves out the empty rows at either end."""
    shown = [(i, r) for i, r in enumerate(rows)]
    if trim:
        full = [k for k, r in enumerate(rows) if r["count"]] or [0]
        shown = shown[full[0]:full[-1] + 1]
    spans = [span(r) for _, r in shown]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if log_x:
        x = Scale(lo, hi, LEFT, WIDTH - RIGHT, log=True)
        x_ticks = [(t, x_fmt(t, 0.0)) for t in log_ticks(lo, hi)]
    else:
        x = Scale(lo, hi, LEFT, WIDTH - RIGHT)
        x_ticks = labelled(linear_ticks(lo, hi, 6), x_fmt)
    y, y_ticks = y_value_axis([r["count"] for _, r in shown], counts=True)
    frame = Frame(title, x_label, y_label, x, y, x_ticks, y_ticks)
    base = y(0)
    for (i, r), (a, b) in zip(shown, spans, strict=True):
        x0, x1, top = x(a), x(b), y(r["count"])
        bar = attrs(x=x0 + 0.5, y=top, width=round(max(x1 - x0 - 1, 0.8), 1), height=round(base - top, 1),
                    fill=colour, data_tip=tip(r), **Source(f"{path}/{i}/count", r["count"]).attrs())
        frame.marks.append(f'<rect class="bar"{bar}/>')
    frame.marks += vertical_markers(frame, markers)
    return frame.svg("histogram")


def vertical_markers(frame: Frame, markers: Sequence[Marker]) -> list[str]:
    """Dashed vertical lines, labels staggered over two rows where they would overlap."""
    out, last, row = [], (-1e9, None), 0
    for m in sorted(markers, key=lambda m: m.x):
        if not frame.x.lo <= m.x <= frame.x.hi:
            continue
        x = frame.x(m.x)
        repeated = (x, m.label) == last  # the same checkpoint step of another run: one label is enough
        row = row if repeated else 1 - row if x - last[0] < 44 else 0
        last = (x, m.label)
        m = m if not repeated else Marker(m.x, "", m.tip, m.source, m.run, m.emphasis)
        source = m.source.attrs() if m.source else {}
        near_end = x > WIDTH - RIGHT - 40  # the label goes left of its line, inside the chart
        label = attrs(x=x - 3 if near_end else x + 3, y=TOP + 10 + 11 * row, text_anchor="end" if near_end else None)
        out.append(f'<g class="marker{" emphasis" if m.emphasis else ""}"{attrs(data_run=m.run, data_tip=m.tip)}>'
                   f'<line x1="{x}" x2="{x}" y1="{TOP + 4}" y2="{HEIGHT - BOTTOM}"{attrs(**source)}/>'
                   f'<text{label}>{escape(m.label)}</text></g>')
    return out


# ------------------------------------------------------------------------------------------- bars
@dataclass(frozen=True)
class Bar:
    """One horizontal bar: its value's source, colour and hover text."""

    source: Source
    colour: str
    tip: str
    opacity: float = 1.0
    category: str | None = None
    series: str | None = None


def bar_chart(title: str, value_label: str, row_label: str, rows: Sequence[tuple[str, Sequence[Bar]]],
              fmt: Format = short, stacked: bool = False, counts: bool = False) -> str:
    """Horizontal bars, one band per row (a category, a reason, a source); inside a band the bars stand side
    by side, or end to end when ``stacked``; ``counts`` (tokens, records) get whole ticks only."""
    names = [name for name, _ in rows]
    left = min(max(LEFT, 34 + CHAR_PX * max(map(len, names), default=0)), 200)  # names clear of the axis label
    extent = [sum(b.source.value for b in bars) if stacked else max((b.source.value for b in bars), default=0)
              for _, bars in rows]
    least = 1.0 if counts else 0.0
    lo, hi = nice_range(0.0, max(extent, default=0.0), zero=True, least=least)
    x = Scale(lo, hi, left, WIDTH - RIGHT)
    band = min((HEIGHT - BOTTOM - TOP) / max(len(rows), 1), BAND_MAX)
    frame = Frame(title, value_label, row_label, x, Scale(0, 1, HEIGHT - BOTTOM, TOP),
                  labelled(linear_ticks(lo, hi, least=least), fmt), [], left=left)
    for k, (name, bars) in enumerate(rows):
        top = TOP + k * band + band * 0.15
        room = int((left - 34) / CHAR_PX)
        shown = name if len(name) <= room else name[:room - 1] + "…"
        label = attrs(x=left - 6, y=round(top + band * 0.35 + 4, 1), data_tip=name if shown != name else None)
        frame.marks.append(f'<text class="tick y"{label}>{escape(shown)}</text>')
        frame.marks += _band(x, bars, top, band * 0.7, stacked)
    return frame.svg("bars")


def _band(x: Scale, bars: Sequence[Bar], top: float, height: float, stacked: bool) -> list[str]:
    out, start = [], 0.0
    each = height if stacked else height / max(len(bars), 1)
    for j, b in enumerate(bars):
        v = b.source.value
        x0, x1 = (x(start), x(start + v)) if stacked else (x(0), x(v))
        y0 = top if stacked else top + j * each
        bar = attrs(x=x0, y=round(y0, 1), width=round(max(x1 - x0, 0.0), 1), height=round(max(each - 1, 1.0), 1),
                    fill=b.colour, fill_opacity=b.opacity if b.opacity < 1 else None, data_tip=b.tip,
                    data_category=b.category, data_colour=b.colour if b.category else None, data_series=b.series,
                    **b.source.attrs())
        out.append(f'<rect class="bar"{bar}/>')
        start += v
    return out


# ------------------------------------------------------------------------------------------ lines
@dataclass(frozen=True)
class Series:
    """A line over steps: ``xs`` from ``x_source``, ``ys`` (``None`` = no point there) from ``source``."""

    label: str
    source: Source
    x_source: Source
    colour: str = ALL_COLOUR
    dash: str = ""
    series: str | None = None
    run: int | None = None
    dots: bool = False
    category: str | None = None

    def points(self) -> list[tuple[float, float]]:
        return [(x, y) for x, y in zip(self.x_source.value, self.source.value, strict=True)
                if y is not None and math.isfinite(y)]


def line_chart(title: str, x_label: str, y_label: str, series: Sequence[Series], *,
               y_fmt: Format = short, markers: Sequence[Marker] = (), zero: bool = False,
               log_y: bool = False) -> str:
    """Lines over a shared x axis of steps (whole ticks); hovering shows every visible series' value at the
    nearest x."""
    xs = [x for s in series for x, _ in s.points()] + [m.x for m in markers]
    ys = [y for s in series for _, y in s.points()]
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0, 1)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    x = Scale(x_lo, x_hi, LEFT, WIDTH - RIGHT)
    y, y_ticks = y_value_axis(ys, y_fmt, zero=zero, log=log_y)
    frame = Frame(title, x_label, y_label, x, y, labelled(linear_ticks(x_lo, x_hi, 6, least=1.0)), y_ticks)
    frame.marks += vertical_markers(frame, markers)
    frame.marks += [_line(x, y, s) for s in series]
    return frame.svg("line")


def _line(x: Scale, y: Scale, s: Series) -> str:
    """The path, its dots, and the data hovering reads. A step without a value (no target of that category in
    the step's batch) is passed over, the line joining its neighbours; a series of one or two points, or with
    ``dots``, shows its points."""
    points = s.points()
    d = "".join(f'{"L" if k else "M"}{x(xv)} {y(yv)}' for k, (xv, yv) in enumerate(points))
    show = s.dots or len(points) <= 2
    dots = "".join(f'<circle cx="{x(xv)}" cy="{y(yv)}" r="2.6"/>' for xv, yv in points) if show else ""
    group = attrs(class_="series", data_series=s.series, data_run=s.run, data_label=s.label,
                  data_category=s.category, data_colour=s.colour if s.category else None)
    path = attrs(d=d or "M0 0", stroke=s.colour, stroke_dasharray=s.dash or None,
                 data_x=as_json(s.x_source.value), data_x_path=s.x_source.path, **s.source.attrs())
    return f'<g{group} fill="{s.colour}"><path fill="none"{path}/>{dots}</g>'
