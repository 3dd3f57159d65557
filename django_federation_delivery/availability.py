"""Hosts gone for good stop costing: marked unavailable, skipped by sends,
probed once a day, and cleared when seen again.

An inbox's host with no success for ``HOST_UNAVAILABLE_AFTER`` (7 days by
default, as Mastodon's) is marked unavailable on its ``Host`` row by a
running deliverer (at its start, then every hour): its ``failing_since``
(health.py) is that old. From then on, ``send()`` leaves its inboxes out,
listed in the batch's ``skipped`` with the reason. What was already queued
to it goes on as its retries say; a retraction of any of it is queued there
all the same, to supersede or follow it (see retractions.py).

The mark clears when the host is seen again:

- the deliverer probes each unavailable host once a day, a ``GET`` of its
  ``/.well-known/nodeinfo`` through the guarded transport, in a thread of its
  own; any answer but a 5xx or a 429 is a host that is up. Each hourly round
  takes its share of them all (:func:`probes_a_round`), those never probed
  first;
- an operator clears it in the admin (the hosts' "Mark as seen" action);
- the host project calls :func:`mark_host_seen` when it hears from the host
  (an activity it just received from it, say);
- a delivery there is accepted (one queued before the mark, retrying):
  the deliverer sees it up as :func:`mark_host_seen` does (health.py).

Each process keeps the set of unavailable hosts for ``KNOWN_FOR`` seconds,
so that a send costs no query for it: a host marked or cleared elsewhere is
known here within a minute; one cleared here, at once.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

from django.db import transaction
from django.db.models import F, Max, Q, Value
from django.utils import timezone

from django_federation_delivery import addresses, signals
from django_federation_delivery.conf import database_alias
from django_federation_delivery.dialect import aware, orm_datetime
from django_federation_delivery.exceptions import TransportError
from django_federation_delivery.models import Delivery, Host, Kind
from django_federation_delivery.store.claims import stored_gateways
from django_federation_delivery.store.locks import in_name_order, write_first
from django_federation_delivery.store.queueing import CHUNK
from django_federation_delivery.transport import Transport, TransportSettings

__all__ = [
    "mark_host_seen",
    "mark_unavailable",
    "probe",
    "probe_due",
    "probes_a_round",
    "seen",
    "unavailable_hosts",
]

logger = logging.getLogger("django_federation_delivery.deliverer")

#: How long a process trusts its set of unavailable hosts.
KNOWN_FOR = 60.0
#: How often an unavailable host is probed.
PROBE_EVERY = dt.timedelta(days=1)
#: How often a running deliverer takes the hosts due a probe: a round
#: (upkeep.HOSTS_EVERY, an hour).
PROBE_ROUND = dt.timedelta(hours=1)
#: The fewest and the most hosts one deliverer probes in a round
#: (:func:`probes_a_round`). The fewest, so that a few hosts marked at once
#: are probed at once. The most, as a deliverer probes one host at a time,
#: each within ATTEMPT_TIMEOUT, and takes none while it still probes the
#: last round's: 500 fit in the hour at 7 s each. So each is probed daily up
#: to 11,500 unavailable hosts a deliverer (500 in each of 23 rounds);
#: past that, or slower to answer, less often, each in its turn.
PROBES_LEAST = 20
PROBES_MOST = 500
#: What a probe asks for: every fediverse server answers it.
PROBE_PATH = "/.well-known/nodeinfo"

#: An inbox's host, not a webhook destination's key (``<ops>``): only inboxes'
#: hosts are marked unavailable and probed. A destination failing for good
#: is disabled instead (webhooks/life.py); probed at ``https://<ops>/…``, it
#: could never be seen again.
INBOX_HOSTS = ~Q(name__startswith="<")

#: A host marked unavailable, or failing: one with a mark to clear.
MARKED = Q(unavailable_since__isnull=False) | Q(failing_since__isnull=False)

_known: dict[str, tuple[float, frozenset[str]]] = {}
_known_lock = threading.Lock()
#: How many times the set was forgotten: a read begun before the last time
#: is not kept (a mark cleared since would be kept for ``KNOWN_FOR``).
_forgotten = [0]


def unavailable_hosts(*, using: str | None = None) -> frozenset[str]:
    """The hosts marked unavailable, as this process last read them (at most
    ``KNOWN_FOR`` seconds ago): one small query a minute, not one a send."""
    alias = using or database_alias()
    own = _marks_cleared_uncommitted(alias)
    known = _known.get(alias)
    if not own and known is not None and time.monotonic() - known[0] < KNOWN_FOR:
        return known[1]
    forgotten = _forgotten[0]
    # Read in the send's transaction, if the caller holds one open.
    write_first(alias)
    names = frozenset(
        Host.objects.using(alias)
        .filter(unavailable_since__isnull=False)
        .values_list("name", flat=True)
    )
    if not own:
        with _known_lock:
            # Not if a mark was cleared here while it read (another thread's
            # commit): what it read may be older than that.
            if _forgotten[0] == forgotten:
                _known[alias] = (time.monotonic(), names)
    return names


def _marks_cleared_uncommitted(alias: str) -> bool:
    """Whether the caller's open transaction on ``alias`` has cleared a
    host's mark (:func:`seen`), not committed yet: what it reads of the
    marks is its own, kept for no other send (rolled back, the host would be
    sent to for ``KNOWN_FOR`` seconds while still marked). Told by the
    clearing's own callback, still waiting for the commit: a rollback, of
    the transaction or of the savepoint that cleared it, drops it."""
    connection = transaction.get_connection(alias)
    return connection.in_atomic_block and any(
        getattr(hook[1], "func", None) is _seen_again for hook in connection.run_on_commit
    )


def forget_known() -> None:
    """Read the unavailable hosts again at the next send."""
    with _known_lock:
        _known.clear()
        _forgotten[0] += 1


def mark_unavailable(
    after: float | None, *, now: dt.datetime | None = None, using: str | None = None
) -> list[str]:
    """Mark unavailable the hosts failing for at least ``after`` seconds (none
    when it is None). Returns their names, each marked once, however many
    deliverers look."""
    if after is None:
        return []
    alias = using or database_alias()
    # As the ORM takes it: naive with USE_TZ off, however it was given.
    now = orm_datetime(now or timezone.now(), alias)
    due = Q(failing_since__lte=now - dt.timedelta(seconds=after), unavailable_since__isnull=True)
    # Nor one delivered to since, by any deliverer (last_delivered_at,
    # hoststats.py): a deliverer reads the failing hosts only every so often
    # (health.py), so its success there may not have cleared it yet.
    due &= Q(last_delivered_at__isnull=True) | Q(last_delivered_at__lte=F("failing_since"))
    due &= INBOX_HOSTS
    hosts = Host.objects.using(alias)
    marked = []
    for name, since in hosts.filter(due).values_list("name", "failing_since"):
        # Each host by a conditional update of its own: the one that sets it, logs it.
        if hosts.filter(due, name=name).update(unavailable_since=now, updated_at=now):
            marked.append(name)
            logger.warning(
                "Host %s marked unavailable: no success since %s; sends skip it until it is seen",
                name,
                aware(since).isoformat(timespec="seconds") if since else "?",
            )
    if marked:
        forget_known()
    return marked


def mark_host_seen(host: str, *, using: str | None = None) -> bool:
    """Tell the app that ``host`` is up (the host project just received an
    activity from it, say): its unavailable mark, and its failing since, are
    cleared, and ``host_recovered`` is sent if it was told failing. Returns
    whether it was marked unavailable or failing.

    ``host`` is a host name (``Bücher.example``, ``bücher.example.``) or a
    URL on it, read as a delivery's inbox is: in its canonical form
    (``xn--bcher-kva.example``); a name that has none (a webhook
    destination's ``<ops>``) as it is. ``ValueError`` naming it if it is
    blank, a URL on no host, or a name no host has (``example.com:99999``)."""
    named = addresses.required_host(host, "mark_host_seen")
    return any(seen(named, using=database_alias(using)))


def mark_seen(host: str, *, using: str | None = None) -> bool:
    """:func:`mark_host_seen` for a host named exactly as its ``Host`` row
    names it (the admin's action, a probe's answer): read as it is, whatever
    it holds. Returns whether it was marked unavailable (what the admin
    counts)."""
    return seen(host, using=using or database_alias())[0]


def seen(
    host: str, *, now: dt.datetime | None = None, using: str, marked: Q = MARKED
) -> tuple[bool, bool]:
    """Clear the marks of ``host``, seen up at ``now`` (the time now if not
    given): unavailable, and failing since; ``host_recovered`` is sent on
    commit if it was told failing. Whether it was marked unavailable, and
    failing. Only while its row matches ``marked``, as it is once locked: a
    deliverer clearing what it read (``health.py``) clears nothing another
    has written since.

    Whatever saw it up (:func:`mark_host_seen`, the admin, a probe, or a
    delivery it accepted: ``health.py``), both marks go together: a host up
    is never left skipped by sends until its next probe, a day on."""
    now = aware(now or timezone.now())  # the loop's is aware, USE_TZ or not
    at = orm_datetime(now, using)
    hosts = Host.objects.using(using).filter(name=host)
    # Read first, unlocked: a host with no mark (most of those a host project
    # hears from) is not written, so that the caller's transaction, a view's
    # that may last seconds, holds no lock on its row (on SQLite, none on the
    # database) that the deliverer's write of the hosts would wait for.
    if not hosts.filter(marked).exists():
        return False, False
    with transaction.atomic(using=using):
        # A write first: the row is locked (and on SQLite, the database)
        # before it is read again, so that no other write comes in between.
        if not hosts.update(updated_at=at):
            return False, False
        found = (
            hosts.filter(marked)
            .values_list("unavailable_since", "failing_since", "failing_told_at")
            .first()
        )
        if found is None:
            return False, False
        unavailable, since, told = found
        if unavailable is None and since is None:
            return False, False
        hosts.update(
            unavailable_since=None,
            failing_since=None,
            failing_told_at=None,
            probed_at=None,
            updated_at=at,
        )
        if told is not None and since is not None:
            # A signal's times are aware, whatever USE_TZ says.
            recovered = signals.HostRecovered(
                host=host, failing_since=aware(since), recovered_at=now
            )
            transaction.on_commit(lambda: _tell_recovered(recovered), using=using)
    if unavailable is not None:
        # Sends here skip it no longer, at once: once committed, when a
        # caller's transaction holds it (read before, the mark is read again).
        transaction.on_commit(partial(_seen_again, [host]), using=using)
    return unavailable is not None, since is not None


class Seen(NamedTuple):
    """What :func:`seen_all` cleared: how many hosts had a mark (failing,
    unavailable or both), and how many of them were marked unavailable."""

    marked: int
    unavailable: int


def seen_all(names: Sequence[str], *, using: str) -> Seen:
    """:func:`mark_seen` of each of ``names`` (the admin's "select all",
    which may name tens of thousands of hosts): a :data:`CHUNK` of names
    at a time, in a few statements, within the caller's transaction if it
    has one. Only the hosts with a mark are written, and told as
    :func:`seen` tells them."""
    now = aware(timezone.now())
    at = orm_datetime(now, using)
    # In name order over all the chunks, as every writer of many hosts
    # locks them: the caller's transaction may hold them all (the admin's).
    unique = sorted(set(names))
    gone: list[str] = []
    cleared = 0
    for start in range(0, len(unique), CHUNK):
        chunk = unique[start : start + CHUNK]
        with transaction.atomic(using=using):
            write_first(using)  # on SQLite, the write lock before the read
            marked = Host.objects.using(using).filter(MARKED, name__in=chunk)
            rows = list(
                # In name order, as every writer of many hosts locks them.
                marked.select_for_update()
                .order_by(in_name_order(using))
                .values_list("name", "unavailable_since", "failing_since", "failing_told_at")
            )
            cleared += len(rows)
            Host.objects.using(using).filter(name__in=[row[0] for row in rows]).update(
                unavailable_since=None,
                failing_since=None,
                failing_told_at=None,
                probed_at=None,
                updated_at=at,
            )
            for name, unavailable, since, told in rows:
                if unavailable is not None:
                    gone.append(name)
                if told is not None and since is not None:
                    recovered = signals.HostRecovered(
                        host=name, failing_since=aware(since), recovered_at=now
                    )
                    transaction.on_commit(partial(_tell_recovered, recovered), using=using)
    if gone:
        transaction.on_commit(partial(_seen_again, gone), using=using)
    return Seen(cleared, len(gone))


def _seen_again(names: list[str]) -> None:
    """Once their marks' clearing is committed: sends read the unavailable
    hosts again, and the log says which are seen."""
    forget_known()
    if len(names) == 1:
        logger.warning("Host %s seen again: no longer unavailable", addresses.escaped(names[0]))
        return
    shown = ", ".join(addresses.escaped(name) for name in names[:10])
    logger.warning(
        "%d host(s) seen again, no longer unavailable: %s%s",
        len(names),
        shown,
        ", …" if len(names) > 10 else "",
    )


def _tell_recovered(recovered: signals.HostRecovered) -> None:
    logger.warning(
        "Host %s up again after failing since %s",
        addresses.escaped(recovered.host),
        recovered.failing_since.isoformat(timespec="seconds"),
    )
    signals.send_safely(signals.host_recovered, recovered=recovered)


def probes_a_round(*, using: str | None = None) -> int:
    """How many hosts a round probes: enough that each unavailable host is
    probed within a day, however many there are. A host probed is due
    again a day (a day's rounds) later, so a round that takes its share of
    them all, in a day's rounds but one (a round may come a little late),
    leaves none waiting longer; at least ``PROBES_LEAST``, at most
    ``PROBES_MOST``. One count of a partial index, a round."""
    unavailable = (
        Host.objects.using(using or database_alias())
        .filter(INBOX_HOSTS, unavailable_since__isnull=False)
        .count()
    )
    rounds = PROBE_EVERY // PROBE_ROUND - 1
    return min(PROBES_MOST, max(PROBES_LEAST, -(-unavailable // rounds)))


def probe_due(
    *, now: dt.datetime | None = None, most: int | None = None, using: str | None = None
) -> list[tuple[str, str]]:
    """Take the unavailable hosts not probed for a day, at most ``most``
    (:func:`probes_a_round`, if not given), each for one deliverer alone;
    with the URL each is probed at (its origin, as its latest delivery's
    inbox has it). Those never probed first, then the longest unprobed."""
    alias = using or database_alias()
    now = orm_datetime(now or timezone.now(), alias)
    due = (
        Q(unavailable_since__isnull=False)
        & (Q(probed_at__isnull=True) | Q(probed_at__lte=now - PROBE_EVERY))
        & INBOX_HOSTS  # a destination's key left marked from before: never probed
    )
    if most is None:
        most = probes_a_round(using=alias)
    hosts = Host.objects.using(alias)
    taken = []
    for name in (
        hosts.filter(due)
        # Never probed first on both databases: PostgreSQL puts NULLs last in
        # an ascending order, and a host newly marked waited behind every
        # host due again, for ever once they were as many as a day's rounds.
        .order_by(F("probed_at").asc(nulls_first=True), "name")
        .values_list("name", flat=True)[:most]
    ):
        if hosts.filter(due, name=name).update(probed_at=now):
            taken.append((name, _probe_url(name, alias)))
    return taken


def _probe_url(host: str, alias: str) -> str:
    """Where ``host`` is probed: the origin of its latest delivery's inbox,
    or, a portable inbox's (an ``ap://`` name), of the gateway that stands
    for the host, its first (a plain http one on a port of its own is
    probed there, not guessed https); guessed when neither is kept."""
    rows = Delivery.objects.using(alias)
    # Its highest id read through the index on (host, status), a host's own
    # rows: as "the first by id, descending", the primary key was walked back
    # past every row sent since the host went away (0.12 s a probe at
    # 200,000 of them, in the loop's thread). "+ 0" keeps the planner off it.
    last = (
        rows.filter(host=host, kind=Kind.ACTIVITYPUB)
        .aggregate(last=Max(F("id") + Value(0)))
        .get("last")
    )
    latest = rows.filter(id=last).values_list("inbox", "via").first() if last else None
    if latest is not None:
        inbox, via = latest
        gateways = stored_gateways(via) or ()
        for url in (gateways[0], inbox) if gateways else (inbox,):
            try:
                return addresses.origin(url) + PROBE_PATH
            except addresses.UnusableURL:
                continue
    return _guessed_origin(host) + PROBE_PATH


def _guessed_origin(key: str) -> str:
    """The origin of the host keyed ``key`` (``addresses.host_key``), with no
    inbox of it kept to say: http on port 80, https on any other."""
    try:
        ipaddress.IPv6Address(key)
    except ValueError:
        pass
    else:
        return f"https://[{key}]"  # an IPv6 address on 443, keyed without brackets
    if key.endswith(":80"):
        return f"http://{key.removesuffix(':80')}"
    return f"https://{key}"  # on 443, or on the port it is keyed with


def probe(url: str, settings: TransportSettings) -> bool:
    """Whether the host at ``url`` answers as a host that is up: anything
    but a 5xx or a 429, a refusal included. Never raises for the network."""
    with Transport(settings) as transport:
        try:
            answer = transport.post(url, b"", {"Accept": "application/json"}, method="GET")
        except TransportError:
            return False
    return answer.status < 500 and answer.status != 429
