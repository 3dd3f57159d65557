"""Circuit breakers: holding back deliveries to a destination that keeps failing.

After ``threshold`` failures in a row a destination's breaker opens, and its
deliveries are held — retried as failures, without a request — until
``cool_off`` has passed. Then one delivery at a time goes through as a probe
while the others are held; the probe's success closes the breaker, its
failure opens it for another cool-off, and a probe that never reports back
stops being one after the cool-off.

The decisions here are plain functions of a breaker's state and the time;
:class:`BreakerView` keeps what the database holds in memory, refreshed about
once a second, so that admitting a delivery to a healthy destination costs no
query. The rows live in the database, so that every process counts failures
together and only one probe goes through among them all.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import math
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import F, Q
from django.utils.translation import gettext as _

from django_federation_delivery import addresses
from django_federation_delivery.conf import SETTING, app_settings, database_alias
from django_federation_delivery.dialect import aware, aware_now, orm_datetime
from django_federation_delivery.models import Breaker, Delivery, Status
from django_federation_delivery.store import wakes
from django_federation_delivery.store.breakers import count_failures
from django_federation_delivery.store.locks import in_name_order
from django_federation_delivery.store.queueing import CHUNK

#: The longest key a breaker's row holds.
KEY_LENGTH = Breaker._meta.get_field("key").max_length or 2048


class Scope(enum.StrEnum):
    #: One breaker per host: a server that is down fails every inbox on it.
    HOST = "host"
    #: One per inbox, as Mastodon keeps them.
    INBOX = "inbox"


@dataclasses.dataclass(frozen=True)
class BreakerSettings:
    threshold: int = 10
    cool_off: float = 60.0
    scope: Scope = Scope.HOST

    def key(self, host: str, inbox: str) -> str:
        """The breaker of ``inbox`` on ``host``: the host's, or the inbox's
        without its userinfo and query, which may be credentials (the key is
        shown, and in the admin's URLs). A webhook destination's is its host
        (``<ops>``) either way: it is one inbox, named as its host is."""
        if self.scope is Scope.HOST or host.startswith("<"):
            return host
        return inbox_key(inbox)

    @classmethod
    def from_settings(cls) -> BreakerSettings | None:
        """``BREAKER``; None when breakers are turned off (set to None or {})."""
        if not app_settings.written("BREAKER"):
            return None
        breaker = app_settings.get("BREAKER")
        try:
            if not isinstance(breaker, Mapping):
                raise TypeError("a dict is needed")
            found = cls(
                threshold=int(breaker["THRESHOLD"]),
                cool_off=float(breaker["COOL_OFF"]),
                scope=Scope(breaker["SCOPE"]),
            )
            # An endless cool-off would overflow the datetime it opens a breaker until.
            if found.threshold < 1 or not 0 < found.cool_off < math.inf:
                raise ValueError("THRESHOLD must be 1 or more and COOL_OFF finite, above 0")
            return found
        except (KeyError, TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                _(
                    "%(setting)s['BREAKER'] = %(value).200r cannot be used: %(error)r. "
                    "Run manage.py check for what to write instead."
                )
                % {"setting": SETTING, "value": breaker, "error": exc}
            ) from exc


@dataclasses.dataclass(frozen=True)
class State:
    """A destination's breaker as last read: no row means closed and healthy."""

    failures: int
    open_until: dt.datetime | None
    probe_until: dt.datetime | None


class Decision(enum.Enum):
    PASS = "pass"
    #: Cool-off over and no probe under way: this delivery may try to take the probe.
    PROBE = "probe"
    HOLD = "hold"


def admit(state: State | None, now: dt.datetime) -> tuple[Decision, float]:
    """Whether a delivery may be sent now, and if held, for about how long."""
    if state is None or state.open_until is None:
        return Decision.PASS, 0.0
    if now < state.open_until:
        return Decision.HOLD, (state.open_until - now).total_seconds()
    if state.probe_until is not None and now < state.probe_until:
        return Decision.HOLD, (state.probe_until - now).total_seconds()
    return Decision.PROBE, 0.0


class BreakerView:
    """The breakers the database holds, as of the last refresh."""

    def __init__(self) -> None:
        self._states: dict[str, State] = {}

    def refresh(self, breakers: Iterable[Breaker]) -> None:
        # Aware, as every time the loop compares them with (USE_TZ off, the
        # ORM reads them naive).
        self._states = {
            breaker.key: State(
                breaker.failures,
                None if breaker.open_until is None else aware(breaker.open_until),
                None if breaker.probe_until is None else aware(breaker.probe_until),
            )
            for breaker in breakers
        }

    def get(self, key: str) -> State | None:
        return self._states.get(key)

    def holding(self, now: dt.datetime) -> list[str]:
        """The keys whose breaker holds every delivery at ``now``."""
        return [key for key, state in self._states.items() if admit(state, now)[0] is Decision.HOLD]

    def set(self, key: str, state: State | None) -> None:
        if state is None:
            self._states.pop(key, None)
        else:
            self._states[key] = state

    def __len__(self) -> int:
        return len(self._states)


# The rows, shared by every process.


def breaker_rows(*, forget_after: float, using: str | None = None) -> list[Breaker]:
    """Every breaker row, after forgetting closed ones nothing has touched for
    ``forget_after`` seconds. The table holds what is failing now: small."""
    alias = using or database_alias()
    manager = Breaker.objects.using(alias)
    stale = aware_now() - dt.timedelta(seconds=forget_after)
    rows = list(manager.all())
    # Read first, deleted only when something is stale: a delete is a write,
    # and on SQLite every write waits its turn for the lock behind the web
    # processes' sends, once a second for nothing when no host is failing.
    if not any(_forgettable(row, stale) for row in rows):
        return rows
    stale_in_orm = orm_datetime(stale, alias)
    manager.filter(open_until__isnull=True, updated_at__lt=stale_in_orm).delete()
    # A probe that never reported back (its deliverer killed, stopped, or
    # its attempt no request) is one no more once its time is past.
    no_probe = Q(probe_until__isnull=True) | Q(probe_until__lt=stale_in_orm)
    manager.filter(no_probe, open_until__lt=stale_in_orm, updated_at__lt=stale_in_orm).delete()
    return list(manager.all())


def _forgettable(row: Breaker, stale: dt.datetime) -> bool:
    """What ``breaker_rows`` deletes: closed and untouched, or open long ago
    with no probe under way (none, or one whose time lapsed long ago), and
    untouched."""
    if aware(row.updated_at) >= stale:
        return False
    if row.open_until is None:
        return True
    return aware(row.open_until) < stale and (
        row.probe_until is None or aware(row.probe_until) < stale
    )


def record_successes(keys: Iterable[str], *, using: str | None = None) -> None:
    """A success while closed starts the count again; one sent before the
    breaker opened does not close it, as only a probe does."""
    keys = list(keys)
    if not keys:
        return
    alias = using or database_alias()
    closed = Breaker.objects.using(alias).filter(key__in=keys, open_until__isnull=True)
    with transaction.atomic(using=alias):
        if connections[alias].vendor == "postgresql":
            # Locked in key order first, as count_failures upserts them: a
            # DELETE alone locks them in the order its plan reads them, and
            # two deliverers' flushes crossed (a deadlock, one ended).
            list(closed.select_for_update().order_by(in_name_order(alias, "key")).values("key"))
        closed.delete()


def take_probe(key: str, *, cool_off: float, using: str | None = None) -> str | None:
    """Take the probe of a half-open breaker, in one atomic statement: the
    token when this caller has it, None when it is not to be had."""
    alias = using or database_alias()
    # Aware, so that a cool-off across a clock change is as long as it says.
    now = aware_now()
    at = orm_datetime(now, alias)
    taken = (
        Breaker.objects.using(alias)
        .filter(key=key, open_until__lte=at)
        .filter(Q(probe_until__isnull=True) | Q(probe_until__lte=at))
        .update(
            probe_token=(token := uuid.uuid4().hex),
            probe_until=orm_datetime(now + dt.timedelta(seconds=cool_off), alias),
            # The count goes on: a failed probe is one more failure in a row.
            updated_at=at,
        )
    )
    return token if taken else None


#: What a delivery held back by its breaker is written with (``triage.py``).
HELD_BY_BREAKER = "held: the circuit breaker for {key} is open"


def record_probe(
    key: str, token: str, *, failed: bool | None, cool_off: float, using: str | None = None
) -> None:
    """A probe's outcome: success closes the breaker, failure opens it for
    another cool-off; ``None``, no answer of its host's (no request made),
    gives the probe back for another delivery to take. A probe that lost
    its turn changes nothing.

    A success also makes due now what the breaker held back while the
    probe was under way (held until the probe's time was up, a cool-off):
    a host's backlog follows its probe, not a minute later. (Of a breaker
    kept per inbox, whose key names no host, a held delivery waits its
    time.)"""
    alias = using or database_alias()
    manager = Breaker.objects.using(alias).filter(key=key, probe_token=token)
    if failed is None:
        manager.update(probe_token="", probe_until=None)
        return
    if not failed:
        # Together: the row gone and what it held left held, a write that
        # failed between them had the probe's success, flushed again, find
        # no row and release nothing.
        with transaction.atomic(using=alias):
            if manager.delete()[0]:
                _release_held([key], alias)
        return
    now = aware_now()
    manager.update(
        failures=F("failures") + 1,
        open_until=orm_datetime(now + dt.timedelta(seconds=cool_off), alias),
        probe_token="",
        probe_until=None,
        updated_at=orm_datetime(now, alias),
    )


def _release_held(keys: Sequence[str], alias: str) -> None:
    """Make due now what the breakers ``keys``, closed, held back while
    they were open (a host's: of a breaker kept per inbox, whose key names
    no host, a held delivery waits its time). Not what a deliverer has in
    hand: it is written as it was sent, or held again. Those released are
    woken for, as a send wakes the deliverers: an idle one listening would
    otherwise wait for its idle poll."""
    now = orm_datetime(aware_now(), alias)
    # As the row keeps it: cut at ERROR_LENGTH, as every error is.
    longest = app_settings.error_length
    released = (
        Delivery.objects.using(alias)
        .filter(
            host__in=keys,
            status=Status.PENDING,
            settled_at__isnull=True,
            lease_token__isnull=True,
            due_at__gt=now,
            last_error__in=[HELD_BY_BREAKER.format(key=key)[:longest] for key in keys],
        )
        .update(due_at=now)
    )
    if released:
        transaction.on_commit(lambda: wakes.wake_all(alias), using=alias)


def _release_closed(keys: Sequence[str], alias: str) -> None:
    """:func:`_release_held` of those of the breakers ``keys`` (a host's)
    that no longer are: closed since they held what was just written."""
    for start in range(0, len(keys), CHUNK // 2):
        chunk = keys[start : start + CHUNK // 2]
        # Open, or half-open: one closed that counts failures again holds nothing.
        standing = set(
            Breaker.objects.using(alias)
            .filter(key__in=chunk, open_until__isnull=False)
            .values_list("key", flat=True)
        )
        closed = [key for key in chunk if key not in standing]
        if closed:
            _release_held(closed, alias)


def inbox_key(inbox: str) -> str:
    """The key of a breaker kept per inbox: the canonical inbox without its
    userinfo and query, which may be credentials (the key is shown), and
    whole as the key's column holds it. Cut short as a message shows it,
    a portable inbox's RSA ``did:key`` (about 400 characters) named no
    delivery to find its gateways by, and two such inboxes shared one breaker."""
    return addresses.redact(inbox, longest=KEY_LENGTH)


def reset_breaker(key: str, *, using: str | None = None) -> int:
    return reset_breakers([key], using=using)


def reset_breakers(keys: Iterable[str], *, using: str | None = None) -> int:
    """Forget the breakers ``keys`` (closed, their count at nought), and
    make due now what they held back, as a probe's success does: a
    :data:`CHUNK` of keys a statement, in one transaction: the admin's
    "select all" may name tens of thousands. Returns how many were."""
    alias = using or database_alias()
    keys = list(keys)
    manager = Breaker.objects.using(alias)
    forgotten = 0
    with transaction.atomic(using=alias):
        for start in range(0, len(keys), CHUNK):
            forgotten += int(manager.filter(key__in=keys[start : start + CHUNK]).delete()[0])
        # Two lists of keys a statement: half a chunk each.
        for start in range(0, len(keys), CHUNK // 2):
            _release_held(keys[start : start + CHUNK // 2], alias)
    return forgotten


class Breakers:
    """The coordinator's breakers: admission answered from memory, outcomes
    written to the database a batch at a time.

    The database is the truth every process shares; this view of it is
    refreshed about once a second, and updated at once with what this process
    learns, so that it holds back a failing destination without waiting.
    """

    def __init__(self, settings: BreakerSettings, *, using: str | None = None) -> None:
        self.settings = settings
        self.using = using
        self.view = BreakerView()
        self._failures: Counter[str] = Counter()
        self._successes: set[str] = set()
        self._probes: list[tuple[str, str, bool]] = []
        #: The hosts whose breaker held a delivery since the last flush.
        self._held: set[str] = set()
        #: How long a probe taken is its own, at the least: as long as its
        #: attempt may take (the deliverer says, for an inbox's host and for
        #: a webhook destination, ``<name>``), else another would be taken
        #: beside it, one a cool-off, while it waits on a silent host.
        self.probe_time = 0.0
        self.webhook_probe_time = 0.0

    @classmethod
    def from_settings(cls, *, using: str | None = None) -> Breakers | None:
        """As ``BREAKER`` says; None when breakers are turned off."""
        settings = BreakerSettings.from_settings()
        return None if settings is None else cls(settings, using=using)

    def refresh(self) -> None:
        forget = max(2 * self.settings.cool_off, 600.0)
        self.view.refresh(breaker_rows(forget_after=forget, using=self.using))

    def holding_hosts(self, now: dt.datetime) -> list[str]:
        """The hosts whose breaker holds every delivery at ``now`` (open, or
        its probe under way), as last read; none when breakers are by inbox."""
        return self.view.holding(now) if self.settings.scope is Scope.HOST else []

    def admit(self, key: str, now: dt.datetime) -> tuple[Decision, str, float]:
        """(decision, probe token, seconds to hold). Taking the probe is one
        atomic statement in the database: one probe among all processes."""
        decision, held = admit(self.view.get(key), now)
        if decision is not Decision.PROBE:
            return decision, "", held
        cool_off = self.settings.cool_off
        reserved = max(
            cool_off, self.webhook_probe_time if key.startswith("<") else self.probe_time
        )
        token = take_probe(key, cool_off=reserved, using=self.using)
        state = self.view.get(key)
        until = now + dt.timedelta(seconds=reserved)
        self.view.set(
            key, State(state.failures if state else 0, state.open_until if state else now, until)
        )
        if token is None:
            return Decision.HOLD, "", cool_off
        return Decision.PROBE, token, 0.0

    def record(self, key: str, *, failed: bool, probe: str, now: dt.datetime) -> None:
        """Note how a delivery that was let through went."""
        state = self.view.get(key)
        if probe:
            self._probes.append((key, probe, failed))
            if not failed:
                # As a success closed: failures noted before it, not written
                # yet (the outage's attempts in flight), go with the count
                # it ends; written after its probe (flush), they reopened it.
                self._failures.pop(key, None)
            failures = (state.failures if state else 0) + 1
            reopened = State(failures, now + dt.timedelta(seconds=self.settings.cool_off), None)
            self.view.set(key, reopened if failed else None)
        elif failed:
            self._failures[key] += 1
            failures = (state.failures if state else 0) + 1
            open_until = state.open_until if state else None
            if open_until is None and failures >= self.settings.threshold:
                open_until = now + dt.timedelta(seconds=self.settings.cool_off)
            self.view.set(key, State(failures, open_until, state.probe_until if state else None))
        elif (state is None and key in self._failures) or (
            state is not None and state.open_until is None
        ):
            # The healthy path writes only when there was a count to forget.
            # Failures noted before it, not written yet, are forgotten with
            # it; those after it are counted anew once it is written (flush).
            del self._failures[key]
            self._successes.add(key)
            self.view.set(key, None)

    def unwritten(self) -> bool:
        """Whether outcomes or held rows wait to be written or looked at."""
        return bool(self._failures or self._successes or self._probes or self._held)

    def note_held(self, key: str) -> None:
        """A delivery was held back by the breaker ``key``, to be written
        held: looked at again once written (:meth:`flush`)."""
        # A webhook destination's (``<ops>``) names its host in either scope.
        if self.settings.scope is Scope.HOST or key.startswith("<"):
            self._held.add(key)

    def give_back(self, key: str, probe: str) -> None:
        """The probe ``probe`` taught nothing of its host: no request was
        made (a key id that cannot be signed, say). Given
        back, the next delivery there probes at once, rather than after
        another cool-off with the breaker held open for nothing. Written at
        once, as the probe was taken: a delivery admitted before the next
        flush would find it still taken."""
        cool_off = self.settings.cool_off
        record_probe(key, probe, failed=None, cool_off=cool_off, using=self.using)
        state = self.view.get(key)
        if state is not None:
            self.view.set(key, State(state.failures, state.open_until, None))

    def flush(self) -> int:
        """Write what was noted; kept for the next flush if this one fails.
        Called once what came of the attempts is written: what this process
        wrote held for a breaker another closed meanwhile (its probe's
        success, an operator's reset, as this one read it open) is made due
        now, as the closing would have made it had it been written then."""
        written = self._write()
        if self._held:
            # After the failures: a breaker this process has just opened
            # has its row by now, and is not taken for closed.
            held, self._held = self._held, set()
            try:
                _release_closed(sorted(held), self.using or database_alias())
            except BaseException:
                self._held |= held
                raise
        return written

    def _write(self) -> int:
        """:meth:`flush`'s writes of the outcomes noted."""
        written = len(self._failures) + len(self._successes) + len(self._probes)
        if not written:
            return 0
        settings = self.settings
        # The successes first: a failure noted after one (the only kind
        # still noted with it) counts from nought, not on top of the count
        # it ended; written after, it could open the breaker, which the
        # success would then leave open.
        record_successes(self._successes, using=self.using)
        self._successes = set()
        # The probes' outcomes before the failures: a failure noted after a
        # probe's success (the breaker closed, and one sent) counts from
        # nought; written before, it was counted on the open row, which the
        # success then deleted, and the view it gave back had the closed
        # breaker half-open, holding its host for a cool-off.
        while self._probes:
            key, token, failed = self._probes[0]
            record_probe(key, token, failed=failed, cool_off=settings.cool_off, using=self.using)
            self._probes.pop(0)
        standing = count_failures(
            self._failures,
            threshold=settings.threshold,
            cool_off=settings.cool_off,
            using=self.using,
        )
        self._failures = Counter()
        # What every process counted together, so that this one holds back as
        # soon as the breaker opens, not at its next refresh.
        for key, (failures, open_until) in standing.items():
            state = self.view.get(key)
            probe_until = state.probe_until if state else None
            self.view.set(key, State(failures, open_until, probe_until))
        return written
