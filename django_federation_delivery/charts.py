"""The queues page's charts: the queue's history as inline SVG, drawn on the server.

Pure: buckets in, markup out, nothing read or written. Each series is told
apart without colour, by its dash pattern and its point markers, which the
legend shows beside its name; a bucket in which breakers opened has a
marker under the time axis whose tooltip says how many.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

from django.utils.dates import WEEKDAYS_ABBR
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

__all__ = ["SERIES", "Bucket", "Series", "chart", "scale"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What came of deliveries from ``start`` for a minute, or an hour."""

    start: dt.datetime
    delivered: int = 0
    retried: int = 0
    refused: int = 0
    failed: int = 0
    breakers_opened: int = 0

    def __add__(self, other: Bucket) -> Bucket:
        """The two together, from the earlier start."""
        return Bucket(
            start=min(self.start, other.start),
            delivered=self.delivered + other.delivered,
            retried=self.retried + other.retried,
            refused=self.refused + other.refused,
            failed=self.failed + other.failed,
            breakers_opened=self.breakers_opened + other.breakers_opened,
        )


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    label: StrOrPromise
    colour: str
    #: stroke-dasharray: "" for a solid line.
    dashes: str
    #: The point marker: "circle", "square", "triangle" or "cross".
    marker: str


#: The four lines, each with its own dash pattern and marker (and a colour
#: from a palette that colour-blind readers tell apart, as a help only).
SERIES = (
    Series("delivered", _("delivered"), "#1b7837", "", "circle"),
    Series("retried", _("retried"), "#b35806", "7 4", "triangle"),
    Series("refused", _("refused"), "#542788", "2 3", "square"),
    Series("failed", _("failed"), "#c51b7d", "10 3 2 3", "cross"),
)
#: The time axis's title, by ``unit``.
AXIS_TITLES = {
    "minute": _("time (UTC), one point a minute"),
    "hour": _("time (UTC), one point an hour"),
}
BREAKER_COLOUR = "#ba2121"

WIDTH = 760
HEIGHT = 260
LEFT, RIGHT, TOP, BOTTOM = 48, 36, 34, 52
#: Steps up the count axis, at most.
STEPS = 5


def scale(highest: int) -> tuple[int, int]:
    """The count axis for a highest value: (top, step), whole numbers, the
    step 1, 2 or 5 times a power of ten, with at most ``STEPS`` steps to the top.
    Nothing at all still has an axis: 0 to 1."""
    if highest <= 0:
        return 1, 1
    rough = highest / STEPS
    power = 10 ** max(0, math.floor(math.log10(rough))) if rough >= 1 else 1
    step = next(f * power for f in (1, 2, 5, 10) if f * power >= rough)
    return step * math.ceil(highest / step), step


def _number(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def time_label(moment: dt.datetime, time_format: str) -> str:
    """``moment`` as ``time_format`` says, with ``%a`` the weekday in the active
    language: strftime's would be the C locale's English, whatever the language."""
    weekday = str(WEEKDAYS_ABBR[moment.weekday()]).replace("%", "%%")
    return moment.strftime(time_format.replace("%a", weekday))


def _marker(kind: str, x: float, y: float, size: float = 3.0) -> str:
    """One point's marker, as a path (hollow shapes read better where lines cross)."""
    s = size
    if kind == "circle":
        path = (
            f"M{_number(x - s)} {_number(y)}a{_number(s)} {_number(s)} 0 1 0 {_number(2 * s)} 0"
            f"a{_number(s)} {_number(s)} 0 1 0 {_number(-2 * s)} 0z"
        )
    elif kind == "square":
        side = _number(2 * s)
        path = f"M{_number(x - s)} {_number(y - s)}h{side}v{side}h-{side}z"
    elif kind == "triangle":
        path = (
            f"M{_number(x)} {_number(y - s - 0.5)}l{_number(s + 0.5)} {_number(2 * s)}"
            f"h{_number(-2 * s - 1)}z"
        )
    else:
        path = (
            f"M{_number(x - s)} {_number(y - s)}l{_number(2 * s)} {_number(2 * s)}"
            f"M{_number(x - s)} {_number(y + s)}l{_number(2 * s)} {_number(-2 * s)}"
        )
    return f'<path d="{path}"/>'


def chart(
    buckets: Sequence[Bucket],
    *,
    title: str,
    id: str,
    unit: str,
    time_format: str,
    label_every: int,
) -> str:
    """An SVG line chart of ``buckets`` (oldest first, one a ``unit``, "minute" or "hour"):
    the four series, a count axis, a time axis labelled every
    ``label_every`` buckets with ``time_format`` (times as given: UTC),
    and a mark where breakers opened. ``title`` and ``id`` are escaped."""
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    bottom = TOP + plot_h
    highest = max((getattr(b, s.name) for b in buckets for s in SERIES), default=0)
    top, tick = scale(highest)
    slots = max(len(buckets) - 1, 1)

    def x(index: int) -> float:
        return LEFT + plot_w * index / slots

    def y(value: int) -> float:
        return bottom - plot_h * value / top

    totals = {s.name: sum(getattr(b, s.name) for b in buckets) for s in SERIES}
    opened = sum(b.breakers_opened for b in buckets)
    counts = ", ".join(
        gettext("%(count)d %(series)s") % {"count": totals[s.name], "series": s.label}
        for s in SERIES
    )
    breakers = ngettext("%(count)d breaker opened", "%(count)d breakers opened", opened) % {
        "count": opened
    }
    since = (
        gettext(", from %(time)s UTC") % {"time": f"{buckets[0].start:%Y-%m-%d %H:%M}"}
        if buckets
        else ""
    )
    summary = f"{title}: {counts}; {breakers}{since}."
    ident = escape(id)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" class="fd-chart" id="{ident}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'aria-labelledby="{ident}-title" font-family="sans-serif" font-size="11">',
        f'<title id="{ident}-title">{escape(summary)}</title>',
        f'<text x="{LEFT}" y="13" font-weight="bold" fill="currentColor">{escape(title)}</text>',
    ]
    # The legend: each series' pattern and marker, with its name; then the breaker mark.
    legend_x = LEFT + 160
    parts.append('<g class="fd-legend">')
    for s in SERIES:
        dash = f' stroke-dasharray="{s.dashes}"' if s.dashes else ""
        label = escape(str(s.label))
        parts.append(
            f'<g class="fd-legend-item" data-series="{s.name}" stroke="{s.colour}" '
            f'fill="none" stroke-width="1.5">'
            f'<line x1="{legend_x}" y1="9" x2="{legend_x + 30}" y2="9"{dash}/>'
            f"{_marker(s.marker, legend_x + 15, 9)}"
            f'<text x="{legend_x + 35}" y="13" stroke="none" fill="currentColor">{label}</text>'
            "</g>"
        )
        legend_x += 35 + round(6.5 * len(label)) + 14
    parts.append(
        f'<g class="fd-legend-item" data-series="breakers_opened">'
        f'<path d="M{legend_x + 4} 4l5 9h-10z" fill="{BREAKER_COLOUR}"/>'
        f'<text x="{legend_x + 13}" y="13" fill="currentColor">'
        f"{escape(gettext('breaker opened'))}</text></g>"
    )
    parts.append("</g>")
    # The count axis and its grid.
    parts.append('<g class="fd-axis" fill="currentColor" stroke="none">')
    for value in range(0, top + 1, tick):
        at = _number(y(value))
        parts.append(
            f'<line x1="{LEFT}" y1="{at}" x2="{LEFT + plot_w}" y2="{at}" '
            f'stroke="currentColor" stroke-opacity="0.15"/>'
            f'<text x="{LEFT - 6}" y="{_number(y(value) + 4)}" text-anchor="end">{value}</text>'
        )
    # The time axis, its labels, and its title.
    parts.append(
        f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + plot_w}" y2="{bottom}" '
        f'stroke="currentColor" stroke-opacity="0.6"/>'
    )
    for index, bucket in enumerate(buckets):
        if index % label_every and index != len(buckets) - 1:
            continue
        at = _number(x(index))
        parts.append(
            f'<line x1="{at}" y1="{bottom}" x2="{at}" y2="{bottom + 4}" stroke="currentColor"/>'
            f'<text x="{at}" y="{bottom + 16}" text-anchor="middle">'
            f"{escape(time_label(bucket.start, time_format))}</text>"
        )
    parts.append(
        f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">'
        f"{escape(str(AXIS_TITLES.get(unit, unit)))}</text>"
    )
    parts.append("</g>")
    # The lines, each with a marker at every point.
    for s in SERIES:
        points = " ".join(
            f"{_number(x(i))},{_number(y(getattr(b, s.name)))}" for i, b in enumerate(buckets)
        )
        dash = f' stroke-dasharray="{s.dashes}"' if s.dashes else ""
        parts.append(
            f'<g class="fd-series" data-series="{s.name}" stroke="{s.colour}" fill="none" '
            f'stroke-width="1.5"><title>{escape(str(s.label))}: {totals[s.name]}</title>'
            f'<polyline points="{points}"{dash}/>'
            + "".join(
                _marker(s.marker, x(i), y(getattr(b, s.name)), 2.2) for i, b in enumerate(buckets)
            )
            + "</g>"
        )
    # Where breakers opened: a mark under the time axis, its count in its tooltip.
    for index, bucket in enumerate(buckets):
        if bucket.breakers_opened:
            parts.append(
                f'<g class="fd-breaker-mark" fill="{BREAKER_COLOUR}">'
                "<title>"
                + escape(
                    ngettext(
                        "%(count)d breaker opened at %(time)s UTC",
                        "%(count)d breakers opened at %(time)s UTC",
                        bucket.breakers_opened,
                    )
                    % {"count": bucket.breakers_opened, "time": f"{bucket.start:%Y-%m-%d %H:%M}"}
                )
                + "</title>"
                f'<path d="M{_number(x(index))} {bottom + 19}l5 9h-10z"/></g>'
            )
    parts.append("</svg>")
    return "".join(parts)
