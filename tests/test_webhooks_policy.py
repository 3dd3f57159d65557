"""The webhook policy: its defaults, and settings checked by name."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.checks import check_webhooks
from django_federation_delivery.webhooks.policy import WebhookPolicy


def test_the_defaults_are_nine_tries_across_about_a_day_ten_seconds_a_request() -> None:
    webhook = WebhookPolicy.from_settings()
    policy = webhook.policy
    assert webhook.retry.max_attempts == 9
    assert 20 * 3600 < sum(policy.schedule) < 26 * 3600
    assert list(policy.schedule) == sorted(policy.schedule)
    assert [webhook.retry.delay(made) for made in (1, 2, 8, 9)] == [30, 120, 43200, None]
    assert (policy.timeout, policy.retry_after_max, webhook.body_length) == (10, 3600, 300)


def test_a_short_schedule_from_the_settings_is_used(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "WEBHOOK_RETRY": [0.1, 0.2]}
    policy = WebhookPolicy.from_settings()
    assert [policy.retry.delay(made) for made in (1, 2, 3)] == [0.1, 0.2, None]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WEBHOOK_RETRY", []),
        ("WEBHOOK_RETRY", "30,120"),
        ("WEBHOOK_RETRY", [30, -1]),
        ("WEBHOOK_RETRY", [True]),
        ("WEBHOOK_TIMEOUT", 0),
        ("WEBHOOK_RETRY_AFTER_MAX", "3600"),
    ],
)
def test_a_bad_webhook_setting_is_a_check_error_naming_it(
    settings: Any, name: str, value: Any
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: value}
    errors = check_webhooks()
    assert [error.id for error in errors] == ["federation_delivery.E032"]
    assert name in errors[0].msg
    with pytest.raises(ImproperlyConfigured, match=name):
        WebhookPolicy.from_settings()
