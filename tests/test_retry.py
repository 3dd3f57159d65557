from __future__ import annotations

import pytest

from django_federation_delivery.retry import (
    DAY_SCHEDULE,
    LONGEST_WAIT,
    RetryPolicy,
    jitter,
    wait_before_retry,
)


def test_the_default_doubles_from_30_seconds_to_an_hour_over_12_attempts() -> None:
    policy = RetryPolicy()
    waits = [policy.delay(made, rand=lambda: 0.0) for made in range(1, 13)]
    assert waits[:8] == [30, 60, 120, 240, 480, 960, 1920, 3600]
    assert waits[8:11] == [3600, 3600, 3600]
    assert waits[11] is None, "twelve attempts in all"


def test_each_wait_is_up_to_a_quarter_shorter_at_random() -> None:
    policy = RetryPolicy()
    assert policy.delay(1, rand=lambda: 1.0) == pytest.approx(22.5)
    for _ in range(200):
        assert 22.5 <= (policy.delay(1) or 0) <= 30
        assert 0.75 * 300 <= jitter(300) <= 300


def test_a_fixed_schedule_gives_nine_tries_across_about_a_day() -> None:
    policy = RetryPolicy(schedule=DAY_SCHEDULE, jitter=0.0)
    waits = [policy.delay(made) for made in range(1, 10)]
    assert waits[:8] == list(DAY_SCHEDULE)
    assert waits[8] is None
    assert 20 * 3600 < sum(DAY_SCHEDULE) < 26 * 3600


def test_retry_after_is_waited_at_least_as_asked_but_never_past_the_cap() -> None:
    assert wait_before_retry(30, 120, wait_as_asked=True, longest=3600) == 120
    assert wait_before_retry(30, 5, wait_as_asked=True, longest=3600) == 30
    assert wait_before_retry(30, 86_400, wait_as_asked=True, longest=3600) == 3600
    assert wait_before_retry(30, 120, wait_as_asked=False, longest=3600) == 30
    assert wait_before_retry(30, None, wait_as_asked=True, longest=3600) == 30


def test_the_setting_builds_the_policy() -> None:
    policy = RetryPolicy.from_setting(
        {"BASE": 1, "CAP": 4, "ATTEMPTS": 3, "JITTER": 0, "SCHEDULE": None}
    )
    assert [policy.delay(n) for n in (1, 2, 3)] == [1, 2, None]
    scheduled = RetryPolicy.from_setting(
        {"BASE": 1, "CAP": 4, "ATTEMPTS": 3, "JITTER": 0, "SCHEDULE": [5, 7]}
    )
    assert [scheduled.delay(n) for n in (1, 2, 3)] == [5, 7, None]


@pytest.mark.parametrize(
    ("policy_wait", "retry_after", "longest"),
    [
        (30, 999_999_999_999, float("inf")),
        (30, float("inf"), float("inf")),
        (float("inf"), None, 3600),
        (float("nan"), None, 3600),
        (30, 999_999_999_999, float("nan")),
    ],
)
def test_no_wait_is_past_the_longest_whatever_the_server_or_the_settings_say(
    policy_wait: float, retry_after: float | None, longest: float
) -> None:
    wait = wait_before_retry(policy_wait, retry_after, wait_as_asked=True, longest=longest)
    assert 0 <= wait <= LONGEST_WAIT


def test_a_nan_retry_after_is_not_waited_for() -> None:
    assert wait_before_retry(30, float("nan"), wait_as_asked=True, longest=3600) == 30


def test_the_backoff_reaches_its_cap_without_overflowing_after_many_attempts() -> None:
    policy = RetryPolicy(attempts=10_000, jitter=0)
    assert policy.delay(1025) == policy.delay(9_999) == 3600
