"""The history's charts: SVG drawn from buckets, pure."""

from __future__ import annotations

import datetime as dt
import re
import xml.etree.ElementTree as ET

import pytest

from django_federation_delivery import charts
from django_federation_delivery.charts import SERIES, Bucket

SVG = "{http://www.w3.org/2000/svg}"
START = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def minutes(*rows: dict[str, int]) -> list[Bucket]:
    return [Bucket(START + dt.timedelta(minutes=n), **row) for n, row in enumerate(rows)]


def draw(buckets: list[Bucket], **options: object) -> ET.Element:
    arguments: dict[str, object] = {
        "title": "Last hour, by minute",
        "id": "chart",
        "unit": "minute",
        "time_format": "%H:%M",
        "label_every": 2,
        **options,
    }
    markup = charts.chart(buckets, **arguments)  # type: ignore[arg-type]
    return ET.fromstring(markup)  # well-formed, or this raises


def points(svg: ET.Element, series: str) -> list[tuple[float, float]]:
    group = svg.find(f"{SVG}g[@data-series='{series}']")
    assert group is not None, series
    line = group.find(f"{SVG}polyline")
    assert line is not None
    return [
        (float(x), float(y)) for x, y in (pair.split(",") for pair in line.attrib["points"].split())
    ]


@pytest.mark.parametrize(
    ("highest", "top", "step"),
    [(0, 1, 1), (1, 1, 1), (4, 4, 1), (5, 5, 1), (9, 10, 2), (23, 25, 5), (177, 200, 50)],
)
def test_the_count_axis_is_whole_numbers_in_round_steps_up_to_the_highest(
    highest: int, top: int, step: int
) -> None:
    assert charts.scale(highest) == (top, step)


def test_each_series_is_a_line_with_a_point_a_bucket_at_its_height() -> None:
    buckets = minutes(
        {"delivered": 10, "retried": 2},
        {"delivered": 5, "failed": 1},
        {"delivered": 0, "refused": 10},
    )
    svg = draw(buckets)
    bottom = charts.HEIGHT - charts.BOTTOM
    height = charts.HEIGHT - charts.TOP - charts.BOTTOM
    for series in SERIES:
        line = points(svg, series.name)
        assert len(line) == 3
        xs = [x for x, _ in line]
        assert xs == sorted(xs) and xs[0] == charts.LEFT and xs[-1] == charts.WIDTH - charts.RIGHT
        # The axis goes to 10: a count's height is its share of that.
        for (_, y), bucket in zip(line, buckets, strict=True):
            assert y == pytest.approx(bottom - height * getattr(bucket, series.name) / 10, abs=0.1)
    labels = [text.text for text in svg.iter(f"{SVG}text")]
    assert {"0", "2", "4", "6", "8", "10"} <= set(labels)
    assert "12:00" in labels and "12:02" in labels, "time labels every other bucket, and the last"
    assert "12:01" not in labels


def test_the_series_differ_by_dash_pattern_and_marker_and_the_legend_shows_both() -> None:
    svg = draw(minutes({"delivered": 1}, {"delivered": 2}))
    assert len({series.dashes for series in SERIES}) == len(SERIES)
    assert len({series.marker for series in SERIES}) == len(SERIES)
    legend = svg.find(f"{SVG}g[@class='fd-legend']")
    assert legend is not None
    for series in SERIES:
        item = legend.find(f"{SVG}g[@data-series='{series.name}']")
        assert item is not None
        sample = item.find(f"{SVG}line")
        assert sample is not None
        assert sample.attrib.get("stroke-dasharray", "") == series.dashes
        assert item.find(f"{SVG}path") is not None, "its marker"
        text = item.find(f"{SVG}text")
        assert text is not None and text.text == series.label
        line = svg.find(f"{SVG}g[@class='fd-series'][@data-series='{series.name}']")
        assert line is not None
        polyline = line.find(f"{SVG}polyline")
        assert polyline is not None
        assert polyline.attrib.get("stroke-dasharray", "") == series.dashes
        assert len(line.findall(f"{SVG}path")) == 2, "a marker at each point"


def test_the_chart_is_an_image_whose_title_sums_it_up() -> None:
    svg = draw(
        minutes(
            {"delivered": 3, "breakers_opened": 1},
            {"delivered": 4, "retried": 2, "failed": 1, "breakers_opened": 1},
        )
    )
    assert svg.attrib["role"] == "img"
    assert svg.attrib["aria-labelledby"] == "chart-title"
    title = svg.find(f"{SVG}title")
    assert title is not None and title.attrib["id"] == "chart-title"
    assert title.text == (
        "Last hour, by minute: 7 delivered, 2 retried, 0 refused, 1 failed; "
        "2 breakers opened, from 2026-03-01 12:00 UTC."
    )


def test_nothing_at_all_is_a_flat_chart_on_an_axis_of_zero_to_one() -> None:
    buckets = [Bucket(START + dt.timedelta(minutes=n)) for n in range(60)]
    svg = draw(buckets, label_every=10)
    bottom = charts.HEIGHT - charts.BOTTOM
    for series in SERIES:
        assert {y for _, y in points(svg, series.name)} == {bottom}
    labels = [text.text for text in svg.iter(f"{SVG}text")]
    assert labels.count("0") == 1 and labels.count("1") == 1
    assert svg.find(f".//{SVG}g[@class='fd-breaker-mark']") is None
    title = svg.find(f"{SVG}title")
    assert title is not None and "0 delivered" in (title.text or "")


def test_no_bucket_at_all_still_draws() -> None:
    svg = draw([])
    assert all(points(svg, series.name) == [] for series in SERIES)


def test_breakers_opened_are_marked_under_their_bucket_with_how_many() -> None:
    buckets = minutes({}, {"breakers_opened": 2}, {}, {"breakers_opened": 1})
    svg = draw(buckets)
    marks = svg.findall(f"{SVG}g[@class='fd-breaker-mark']")
    assert [mark.findtext(f"{SVG}title") for mark in marks] == [
        "2 breakers opened at 2026-03-01 12:01 UTC",
        "1 breaker opened at 2026-03-01 12:03 UTC",
    ]
    xs = [float(re.match(r"M([\d.]+) ", mark[1].attrib["d"])[1]) for mark in marks]  # type: ignore[index]
    delivered = [x for x, _ in points(svg, "delivered")]
    assert xs == [delivered[1], delivered[3]], "each under its bucket's point"


def test_what_it_is_given_to_write_is_escaped() -> None:
    markup = charts.chart(
        minutes({"delivered": 1}),
        title='<script>alert("x")</script> & co',
        id='a"b',
        unit="<minute>",
        time_format="%H:%M <b>",
        label_every=1,
    )
    assert "<script>" not in markup and "<b>" not in markup and "<minute>" not in markup
    svg = ET.fromstring(markup)
    assert svg.attrib["id"] == 'a"b'
    heading = [text.text for text in svg.iter(f"{SVG}text")]
    assert '<script>alert("x")</script> & co' in heading
    assert "12:00 <b>" in heading


def test_buckets_add_up_from_the_earlier_start() -> None:
    later = Bucket(START + dt.timedelta(minutes=5), delivered=1, breakers_opened=1)
    earlier = Bucket(START, delivered=2, retried=3, refused=4, failed=5)
    assert later + earlier == Bucket(START, 3, 3, 4, 5, 1)
