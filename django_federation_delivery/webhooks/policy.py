"""How webhook deliveries are retried and judged: the nine-try schedule across a day.

Webhooks get their own defaults, whatever the ActivityPub ones are: a chat
service's bad night is ridden out, and an alert is not delivered on Thursday
about Monday.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext as _

from django_federation_delivery.addresses import quoted
from django_federation_delivery.channels import Policy
from django_federation_delivery.channels.base import MESSAGE_ROOM
from django_federation_delivery.channels.policy import is_wait
from django_federation_delivery.decide import Outcome, Ruling
from django_federation_delivery.retry import DAY_SCHEDULE, LONGEST_WAIT, RetryPolicy

if TYPE_CHECKING:
    from django_federation_delivery.attempt import AttemptResult
    from django_federation_delivery.batches import BatchInfo
    from django_federation_delivery.settling import Settler, Summary
    from django_federation_delivery.store.claims import Claimed

__all__ = ["WebhookPolicy", "settings_policy", "settings_problems"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WebhookPolicy:
    """How a kind's webhook deliveries are settled and told: its
    :class:`~django_federation_delivery.channels.Policy`, and how much of a
    refusal's body is kept."""

    policy: Policy = dataclasses.field(default_factory=Policy)
    #: How much of a refusal's body is kept.
    body_length: int = 300

    @property
    def retry(self) -> RetryPolicy:
        return self.policy.retry

    @property
    def message_length(self) -> int:
        return self.body_length + MESSAGE_ROOM

    def settler(
        self,
        summary: Summary,
        watch: Callable[[Claimed, AttemptResult, dt.datetime], bool] | None = None,
    ) -> Settler:
        """The settler of webhook deliveries: retried and judged by this
        policy, each attempt told to ``watch``."""
        from django_federation_delivery.settling import Settler

        longest, length = self.policy.retry_after_max, self.message_length
        return Settler(
            self.retry,
            summary,
            retry_after_max=longest,
            error_length=length,
            holds_spend_tries=False,
            watch=watch,
            tell=self.tell,
        )

    def tell(
        self, row: Claimed, batch: BatchInfo, ruling: Ruling, attempts: int, now: dt.datetime
    ) -> None:
        """One WARNING line for an operator per retry, refusal and give-up:
        which event, where (the destination's name, never its URL), which
        try, and what next."""
        what = _event(row, batch.event_type)
        error = ruling.error[: self.message_length]
        if ruling.outcome is Outcome.RETRYING and ruling.due_at is not None:
            most = self.retry.max_attempts
            logger.warning(
                "%s failed, attempt %d of %d: %s; tried again in %.1f s, at %s",
                what,
                attempts,
                min(batch.max_attempts or most, most),
                error,
                (ruling.due_at - now).total_seconds(),
                ruling.due_at.isoformat(timespec="seconds"),
            )
        elif ruling.outcome is Outcome.REFUSED:
            logger.warning("%s refused for good: %s", what, error)
        elif ruling.outcome is Outcome.FAILED:
            self.given_up(row, batch.event_type, ruling.error)

    def given_up(self, row: Claimed, event_type: str, error: str) -> None:
        """The WARNING line of an event given up, sent or not."""
        logger.warning("%s given up: %s", _event(row, event_type), error[: self.message_length])

    @classmethod
    def of(cls, policy: Policy) -> WebhookPolicy:
        """For a kind whose :meth:`~Channel.policy` is ``policy``; a refusal's
        body kept as ``ERROR_LENGTH`` says."""
        from django_federation_delivery.conf import app_settings

        return cls(policy, body_length=app_settings.error_length)

    @classmethod
    def from_settings(cls) -> WebhookPolicy:
        """As the ``WEBHOOK_*`` settings say: ``ImproperlyConfigured`` naming
        the first that is wrong."""
        return cls.of(settings_policy())


def _event(row: Claimed, event_type: str) -> str:
    return f"Webhook event {event_type} (delivery {row.id}) to {row.destination!r}"


def settings_policy() -> Policy:
    """The policy the ``WEBHOOK_*`` settings make, every built-in kind's and
    what a kind of the project's starts from: ``ImproperlyConfigured``
    naming the first setting that is wrong, the package's own message,
    which never holds a destination's URL."""
    from django_federation_delivery.conf import SETTING

    problems = settings_problems()
    if problems:
        raise ImproperlyConfigured(
            _("%(setting)s: %(problem)s.") % {"setting": SETTING, "problem": problems[0]}
        )
    return Policy.for_webhooks()


def settings_problems() -> list[str]:
    """What is wrong with the webhook settings, each naming the setting."""
    from django_federation_delivery.conf import app_settings

    problems = []
    schedule: Any = app_settings.get("WEBHOOK_RETRY")
    if not _waits(schedule):
        problems.append(
            _(
                "WEBHOOK_RETRY must be a non-empty list of waits in seconds, such as "
                "%(example)s, not %(value)s"
            )
            % {"example": list(map(int, DAY_SCHEDULE)), "value": quoted(schedule)}
        )
    for name in ("WEBHOOK_RETRY_AFTER_MAX", "WEBHOOK_TIMEOUT"):
        value = app_settings.get(name)
        if not is_wait(value):
            problems.append(
                _(
                    "%(name)s must be a number of seconds above 0 "
                    "and at most %(longest)g, not %(value)s"
                )
                % {"name": name, "longest": LONGEST_WAIT, "value": quoted(value)}
            )
    return problems


def _waits(schedule: Any) -> bool:
    return (
        isinstance(schedule, Sequence)
        and not isinstance(schedule, str)
        and bool(schedule)
        and all(is_wait(wait) for wait in schedule)
    )
