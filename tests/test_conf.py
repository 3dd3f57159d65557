from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_federation_delivery.conf import DEFAULTS, AppSettings, Typed, app_settings
from django_federation_delivery.retry import RetryPolicy
from django_federation_delivery.signatures import Scheme


def test_every_typed_accessor_reads_a_setting_of_its_name_in_capitals() -> None:
    typed = {name for name, value in vars(AppSettings).items() if isinstance(value, Typed)}
    assert typed
    assert {name.upper() for name in typed} <= set(DEFAULTS)


def test_a_typed_accessor_converts_what_is_written(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {
        **settings.FEDERATION_DELIVERY,
        "CONCURRENCY": "3",
        "LEASE_SECONDS": 60,
        "FIRST_SCHEME": "rfc9421",
        "PERMANENT_IF_SENDER_GONE": [401, "410"],
        "WEBHOOK_RETRY": [1, 2],
    }
    assert app_settings.concurrency == 3
    assert isinstance(app_settings.lease_seconds, float)
    assert app_settings.first_scheme is Scheme.RFC9421
    assert app_settings.permanent_if_sender_gone == frozenset({401, 410})
    assert app_settings.webhook_retry == (1.0, 2.0)


def test_a_typed_accessor_reads_the_defaults_merged_with_what_is_written(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "RETRY": {"ATTEMPTS": 3}}
    assert app_settings.retry == RetryPolicy(base=30.0, cap=3600.0, attempts=3, jitter=0.25)


def test_a_typed_accessor_follows_override_settings(settings: Any) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PER_HOST": 5}
    assert app_settings.per_host == 5
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, "PER_HOST": 7}
    assert app_settings.per_host == 7


@pytest.mark.parametrize(
    ("name", "bad", "named"),
    [
        ("CONCURRENCY", "many", "'many'"),
        ("ATTEMPT_TIMEOUT", None, "None"),
        ("FIRST_SCHEME", "hmac", "'hmac'"),
        ("RETRY", {"BASE": "soon"}, "'BASE': 'soon'"),
    ],
)
def test_a_value_a_typed_accessor_cannot_use_is_an_error_naming_it(
    settings: Any, name: str, bad: Any, named: str
) -> None:
    settings.FEDERATION_DELIVERY = {**settings.FEDERATION_DELIVERY, name: bad}
    with pytest.raises(ImproperlyConfigured) as caught:
        getattr(app_settings, name.lower())
    assert f"[{name!r}]" in str(caught.value)
    assert named in str(caught.value)


def test_a_typed_accessor_for_no_such_setting_cannot_be_declared() -> None:
    # Python 3.11 wraps what __set_name__ raises in a RuntimeError; 3.12 does not.
    with pytest.raises((TypeError, RuntimeError)) as caught:

        class Wrong(AppSettings):
            no_such = Typed(int)

    assert "'NO_SUCH'" in str(caught.value.__cause__ or caught.value)
