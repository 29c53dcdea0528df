"""Charts drawn as SVG on the server: nothing to fetch, nothing to build, and made of
numbers alone, so no request's text can reach them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup

WIDTH, HEIGHT = 560, 140
PAD_LEFT, PAD_BOTTOM = 48, 18
COLOURS = ("#2f6fd6", "#d65a2f")


@dataclass(frozen=True)
class Series:
    label: str
    values: Sequence[float | None]  # one a minute, oldest first; None: nothing that minute


def chart(title: str, unit: str, series: Sequence[Series]) -> Markup:
    """A line chart of the last hour, one line a series, with its highest value on the axis."""
    top = max((v for s in series for v in s.values if v is not None), default=0.0) or 1.0
    plot_w, plot_h = WIDTH - PAD_LEFT - 4, HEIGHT - PAD_BOTTOM - 4
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_text(title)}">',
             f'<line x1="{PAD_LEFT}" y1="4" x2="{PAD_LEFT}" y2="{4 + plot_h}" stroke="#999"/>',
             f'<line x1="{PAD_LEFT}" y1="{4 + plot_h}" x2="{WIDTH - 4}" y2="{4 + plot_h}" stroke="#999"/>',
             f'<text x="{PAD_LEFT - 4}" y="12" text-anchor="end" font-size="10">{_number(top)}</text>',
             f'<text x="{PAD_LEFT - 4}" y="{4 + plot_h}" text-anchor="end" font-size="10">0</text>',
             f'<text x="{PAD_LEFT}" y="{HEIGHT - 4}" font-size="10">-60 min</text>',
             f'<text x="{WIDTH - 4}" y="{HEIGHT - 4}" text-anchor="end" font-size="10">now ({_text(unit)})</text>']
    for index, one in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        points = _points(one.values, top, PAD_LEFT, 4, plot_w, plot_h)
        if points:
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        if None in one.values:  # a series with gaps: each minute it has is a dot, so a lone one shows
            parts += [f'<circle cx="{xy.split(",")[0]}" cy="{xy.split(",")[1]}" r="2" fill="{colour}"/>'
                      for xy in points.split()]
        parts.append(f'<text x="{PAD_LEFT + 6 + 90 * index}" y="14" font-size="11" fill="{colour}">'
                     f'{_text(one.label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def sparkline(values: Sequence[float]) -> Markup:
    """A worker's tokens per second over the last hour, small."""
    top = max(values, default=0.0) or 1.0
    points = _points(values, top, 0, 1, 120, 20)
    return Markup(f'<svg class="spark" viewBox="0 0 120 22" role="img" aria-label="tok/s, last hour">'
                  f'<polyline fill="none" stroke="{COLOURS[0]}" stroke-width="1" points="{points}"/></svg>')


def _points(values: Sequence[float | None], top: float, left: float, upper: float, width: float,
            height: float) -> str:
    step = width / max(1, len(values) - 1)
    return " ".join(f"{left + i * step:.1f},{upper + height - (v / top) * height:.1f}"
                    for i, v in enumerate(values) if v is not None)


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _text(value: str) -> str:
    return str(Markup.escape(value))
