"""Hosts: the scheme each last accepted, shared by every process through the Host table."""

from __future__ import annotations

from typing import Any

import pytest

from django_federation_delivery.hosts import (
    KnownSchemes,
    host_schemes,
    pause_host,
    pause_hosts,
    paused_hosts,
    remember_schemes,
    resume_host,
    resume_hosts,
)
from django_federation_delivery.models import Delivery, Host, Status
from django_federation_delivery.signatures import Scheme
from django_federation_delivery.store.queueing import CHUNK

from .operators import queue


def run(function: Any, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def known(first: Scheme = Scheme.CAVAGE, db: Any = run) -> KnownSchemes:
    return KnownSchemes(first, db, using="default")


@pytest.mark.django_db
def test_a_host_never_heard_of_is_knocked_on_in_the_first_scheme() -> None:
    schemes = known(Scheme.RFC9421)
    schemes.read({"new.example"})
    assert schemes.scheme_for("new.example") is Scheme.RFC9421


@pytest.mark.django_db
def test_what_one_deliverer_learns_another_reads() -> None:
    one, other = known(), known()
    one.learn("strict.example", Scheme.RFC9421)
    assert one.scheme_for("strict.example") is Scheme.RFC9421
    one.write()

    other.read({"strict.example", "plain.example"})

    assert other.scheme_for("strict.example") is Scheme.RFC9421
    assert other.scheme_for("plain.example") is Scheme.CAVAGE
    assert host_schemes(["strict.example", "plain.example"]) == {"strict.example": "rfc9421"}


@pytest.mark.django_db
def test_a_host_back_on_the_first_scheme_has_none_learned() -> None:
    # It was written "draft-cavage", the first scheme, and shown learned for
    # ever where a host that always took the first shows none.
    one, other = known(), known()
    one.learn("switch.example", Scheme.RFC9421)
    one.write()
    one.learn("switch.example", Scheme.CAVAGE)
    one.write()
    assert host_schemes(["switch.example"]) == {}
    assert Host.objects.get(name="switch.example").scheme == ""
    other.read({"switch.example"})
    assert other.scheme_for("switch.example") is Scheme.CAVAGE


@pytest.mark.django_db
def test_the_scheme_a_host_is_known_to_accept_is_not_written_again() -> None:
    schemes = known()
    schemes.learn("plain.example", Scheme.CAVAGE)
    schemes.learn("plain.example", None)  # it answered, in no scheme
    schemes.write()
    assert not Host.objects.exists()


@pytest.mark.django_db
def test_a_scheme_that_could_not_be_written_is_written_next_time() -> None:
    away = [True]

    def db(function: Any, *args: Any, **kwargs: Any) -> Any:
        return None if away[0] else function(*args, **kwargs)

    schemes = known(db=db)
    schemes.learn("strict.example", Scheme.RFC9421)
    schemes.write()
    assert not Host.objects.exists()

    away[0] = False
    schemes.learn("other.example", Scheme.RFC9421)
    schemes.write()
    assert host_schemes(["strict.example", "other.example"]) == {
        "strict.example": "rfc9421",
        "other.example": "rfc9421",
    }


@pytest.mark.django_db
def test_remembering_a_scheme_keeps_a_paused_host_paused() -> None:
    pause_host("paused.example")
    remember_schemes({"paused.example": "rfc9421"})

    host = Host.objects.get(name="paused.example")
    assert host.scheme == "rfc9421"
    assert host.paused_at is not None


@pytest.mark.django_db
def test_the_paused_hosts_are_those_paused_and_not_resumed_among_those_asked_about() -> None:
    for name in ("a.example", "b.example", "c.example"):
        pause_host(name)
    resume_host("b.example")
    remember_schemes({"d.example": "rfc9421"})

    assert paused_hosts() == {"a.example", "c.example"}
    assert paused_hosts(["c.example", "b.example", "d.example", "e.example"]) == {"c.example"}
    assert paused_hosts([]) == set()


@pytest.mark.django_db
def test_many_hosts_are_paused_and_resumed_a_chunk_at_a_time() -> None:
    # As the admin's "select all" names them: more than a statement takes,
    # a name given twice, and a destination disabled (its reason goes).
    names = [f"h{n}.example" for n in range(CHUNK * 2 + 1)]
    queue(hosts=names[:2])
    Host.objects.create(name=names[-1], disabled_reason="the receiver answered 410 Gone")

    assert pause_hosts([*names, names[0]]) == 4
    assert paused_hosts(names) == set(names)
    assert not Host.objects.exclude(disabled_reason="").exists()
    assert Delivery.objects.filter(due_at__isnull=True).count() == 4

    assert resume_hosts(names) == 4
    assert paused_hosts() == set()
    assert Delivery.objects.filter(status=Status.PENDING, due_at__isnull=True).count() == 0
