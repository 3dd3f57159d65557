"""Waking an idle deliverer: PostgreSQL's LISTEN/NOTIFY, through a connection of its own."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from django.db import OperationalError, connection

from django_federation_delivery import controls, send, store, wakeup
from django_federation_delivery.dialect import aware_now
from django_federation_delivery.models import Delivery, Status
from django_federation_delivery.store import settlements
from django_federation_delivery.store.settlements import Settlement
from django_federation_delivery.wakeup import NOTIFY_CHANNEL

from .conftest import wait_until
from .keys import ALICE
from .operators import NOTE

pytestmark = pytest.mark.django_db(transaction=True)


#: A listener's wait in these tests: a stop that waited for its end would
#: take about this long, far past what "at once" allows on a busy machine.
LONG_WAIT = 60.0
#: What "at once" allows, with every run of the suite sharing two cores.
AT_ONCE = 5.0


@pytest.fixture
def listener(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> wakeup.PostgresListener:
    if not wakeup.PostgresListener.available():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)")
    monkeypatch.setattr(wakeup.PostgresListener, "WAIT", LONG_WAIT)
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    woken = threading.Event()
    listener = wakeup.PostgresListener(woken)
    listener.start()
    wait_until(lambda: "Listening for new deliveries" in caplog.messages, timeout=10)
    assert woken.is_set(), "what was queued while it connected is looked for"
    woken.clear()
    return listener


def test_a_notification_from_another_connection_wakes_the_listener(
    listener: wakeup.PostgresListener,
) -> None:
    try:
        time.sleep(0.2)
        assert not listener.event.is_set()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        assert listener.event.wait(5), "not woken by the notification"
        listener.event.clear()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        assert listener.event.wait(5), "not woken by a second one"
    finally:
        listener.stop()


def test_a_waiting_listener_stops_at_once(listener: wakeup.PostgresListener) -> None:
    started = time.monotonic()
    listener.stop()
    took = time.monotonic() - started
    assert took < AT_ONCE, f"stopped after {took:.2f} s: not at once"
    assert listener._thread is not None and not listener._thread.is_alive()


def test_a_stream_of_notifications_wakes_the_listener_once_a_gathering(
    listener: wakeup.PostgresListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A web process sending steadily: its every NOTIFY would be a turn of
    # the deliverer's loop. After a wake, what comes is gathered for GATHER.
    monkeypatch.setattr(wakeup.PostgresListener, "GATHER", 0.3)

    class Counted(threading.Event):
        sets = 0

        def set(self) -> None:
            self.sets += 1
            super().set()

    listener.event = woken = Counted()
    try:
        started = time.monotonic()
        with connection.cursor() as cursor:
            for _ in range(100):  # each its own transaction: none folded into another
                cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        sending = time.monotonic() - started
        time.sleep(1.0)
        # One wake at the first, then one a gathering while they kept coming.
        assert 1 <= woken.sets <= 2 + sending / 0.3, (woken.sets, sending)
    finally:
        listener.stop()


def test_a_paused_listener_is_not_woken_and_listening_again_wakes_once(
    listener: wakeup.PostgresListener,
) -> None:
    # Paused while the deliverer claims from a backlog: a send's notification
    # is not even delivered to its connection.
    try:
        listener.pause(True)
        wait_until(lambda: not listener.listening, timeout=AT_ONCE)
        listener.event.clear()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        assert not listener.event.wait(0.5), "woken while paused"
        # Listening again wakes it, for what was sent meanwhile.
        listener.pause(False)
        assert listener.event.wait(AT_ONCE), "not woken on listening again"
        wait_until(lambda: listener.listening, timeout=AT_ONCE)
        listener.event.clear()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        assert listener.event.wait(AT_ONCE), "not woken by a notification once listening"
    finally:
        listener.stop()


def test_a_listener_that_loses_its_connection_wakes_the_deliverer_to_look_itself(
    listener: wakeup.PostgresListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lost, and not to be had again for a while: the idle deliverer, which
    # counts on it for sends from other processes, slept on to its idle poll.
    def cannot(self: wakeup.PostgresListener) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(wakeup.PostgresListener, "_connect", cannot)
    try:
        assert listener.listening
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query ILIKE 'LISTEN%%'"
            )
            assert cursor.fetchall() == [(True,)], "its connection found"
        assert listener.event.wait(AT_ONCE), "not woken when it stopped listening"
        assert not listener.listening
    finally:
        listener.stop()


def test_a_requeue_a_resume_and_a_hand_back_wake_other_processes(
    listener: wakeup.PostgresListener,
) -> None:
    # Each makes deliveries due now outside a send: a deliverer of another
    # process, idle on its listener, is woken as by a send, not 30 s on.
    def woken_by(act: Callable[[], object]) -> bool:
        listener.event.clear()
        act()
        found = listener.event.wait(AT_ONCE)
        listener.event.clear()
        return found

    try:
        batch = send(ALICE, NOTE, ["https://a.example/inbox"])
        assert listener.event.wait(AT_ONCE), "a send's own notification, come and gone"
        controls.give_up(Delivery.objects.filter(batch=batch))
        assert woken_by(lambda: controls.requeue(Delivery.objects.filter(batch=batch)))

        controls.pause_host("a.example")
        assert woken_by(lambda: controls.resume_host("a.example"))

        (claimed,) = store.claim(10, 300)
        back = Settlement(claimed=claimed, status=Status.PENDING, attempts=0, due_at=aware_now())
        assert woken_by(lambda: settlements.settle([back]))
        # A retry, due later, wakes nobody.
        (claimed,) = store.claim(10, 300)
        later = aware_now() + dt.timedelta(minutes=5)
        retry = Settlement(claimed=claimed, status=Status.PENDING, attempts=1, due_at=later)
        assert not woken_by(lambda: settlements.settle([retry]))
    finally:
        listener.stop()


def test_a_listener_that_cannot_connect_says_so_once_and_once_when_it_listens_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its every try to reconnect was a WARNING: an hour's outage, 360 lines
    # burying the outage's one.
    if not wakeup.PostgresListener.available():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)")
    real = wakeup.PostgresListener._connect
    tries: list[int] = []

    def away(self: wakeup.PostgresListener) -> object:
        tries.append(1)
        if len(tries) <= 3:
            raise OperationalError("connection failed: the server is away")
        return real(self)

    monkeypatch.setattr(wakeup.PostgresListener, "_connect", away)
    caplog.set_level(logging.DEBUG, logger="django_federation_delivery")
    listener = wakeup.PostgresListener(threading.Event())
    listener.start()
    try:
        wait_until(lambda: "Listening for new deliveries again" in caplog.messages, timeout=20)
    finally:
        listener.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "Listening" in r.getMessage()]
    warned = [message for level, message in said if level == "WARNING"]
    assert len(tries) == 4 and len(warned) == 1, said
    assert warned[0].startswith("Listening for new deliveries failed (connection failed:")
    assert ("INFO", "Listening for new deliveries again") in said


def test_a_listener_in_a_process_holding_over_a_thousand_files_still_wakes() -> None:
    # select() refuses a descriptor past 1,023: a deliverer holding many
    # connections (or in a task worker's process) never listened, and
    # warned at each try, for ever.
    import resource
    import socket

    if not wakeup.PostgresListener.available():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files at most")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [socket.socket() for _ in range(1100)]
    woken = threading.Event()
    listener = wakeup.PostgresListener(woken)
    try:
        listener.start()
        wait_until(lambda: listener.listening, timeout=10)
        wait_until(woken.is_set, timeout=5)  # what was queued as it connected
        woken.clear()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
        assert woken.wait(5), "not woken by the notification"
    finally:
        listener.stop()
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Blackhole:
    """A TCP proxy to the database that, once ``cut`` is set, forwards
    nothing more either way and closes nothing: a connection gone without
    a word, as a NAT or a firewall forgets an idle one, or a failover moves
    its address."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                return
            upstream.settimeout(None)
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                if not self.cut.is_set():
                    sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for each in self.sockets:
            with contextlib.suppress(OSError):
                each.close()


def listening_after_quiet_waits_of(
    wait: float, monkeypatch: pytest.MonkeyPatch
) -> wakeup.PostgresListener:
    """A listener started whose waits last ``wait`` seconds, once it listens."""
    monkeypatch.setattr(wakeup.PostgresListener, "WAIT", wait)
    listener = wakeup.PostgresListener(threading.Event())
    listener.start()
    wait_until(lambda: listener.listening, timeout=10)
    return listener


@dataclass
class Silenced:
    """What the listener connects through, and when each connection was made."""

    proxy: Blackhole
    connected: list[float]


@pytest.fixture
def silenced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Silenced]:
    """The listener connecting through a :class:`Blackhole`, its questions
    given a second."""
    import psycopg
    from django.db import connections

    from django_federation_delivery.store import sql

    if not wakeup.PostgresListener.available():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)")
    params = connections["default"].get_connection_params()
    proxy = Blackhole(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    through = Silenced(proxy, [])

    def through_the_proxy(self: wakeup.PostgresListener) -> object:
        given = connections[self.using].get_connection_params()
        given.pop("cursor_factory", None)
        given.pop("context", None)
        given.update(host="127.0.0.1", port=proxy.port, connect_timeout=2)
        conn = psycopg.connect(**given, autocommit=True)
        sql.listen(conn, True)
        through.connected.append(time.monotonic())
        return conn

    monkeypatch.setattr(wakeup.PostgresListener, "_connect", through_the_proxy)
    monkeypatch.setattr(wakeup.PostgresListener, "PING_TIMEOUT", 1.0)
    try:
        yield through
    finally:
        proxy.cut.clear()
        proxy.close()
        # The server's end of a silent connection, which heard nothing.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )


@pytest.mark.slow
def test_a_listener_whose_connection_went_silent_connects_again(
    silenced: Silenced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener's connection is gone without a word (no reset: a NAT
    that forgot it). Waiting on its socket, the listener would listen on it
    for good, and an idle deliverer count on it for the sends of other
    processes, which then waited for its idle poll. After a quiet wait it
    asks the connection something; unanswered, it stops counting itself as
    listening (the deliverer woken to look itself) and connects again."""
    listener = listening_after_quiet_waits_of(0.5, monkeypatch)
    woken = listener.event
    try:
        time.sleep(1.2)  # quiet waits, each asked after: it answers
        assert listener.listening and len(silenced.connected) == 1
        woken.clear()
        silenced.proxy.cut.set()
        assert woken.wait(AT_ONCE), "still counted as listening on a silent connection"
        assert not listener.listening
        silenced.proxy.cut.clear()
        wait_until(lambda: listener.listening, timeout=10)
        assert len(silenced.connected) == 2
    finally:
        listener.stop()


def test_a_notification_that_comes_while_the_connection_is_asked_after_wakes_all_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a quiet wait the listener asks its connection something; a
    send's notification that arrives meanwhile is read with the answer, and
    wakes the deliverer as any other does."""
    from django_federation_delivery.store import sql

    if not wakeup.PostgresListener.available():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's (with psycopg 3)")
    asked = threading.Event()

    def slow_ping(conn: object) -> None:
        if not asked.is_set():
            asked.set()
            # A send commits while the question is on its way.
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
            connection.close()  # the listener's thread's
            conn.execute("SELECT pg_sleep(0.3)")  # type: ignore[attr-defined]

    monkeypatch.setattr(sql, "ping", slow_ping)
    listener = listening_after_quiet_waits_of(0.2, monkeypatch)
    woken = listener.event
    try:
        woken.clear()
        assert asked.wait(AT_ONCE)
        assert woken.wait(AT_ONCE), "the notification read with the answer woke nobody"
    finally:
        listener.stop()


@pytest.mark.slow
def test_a_listener_told_to_pause_on_a_silent_connection_is_not_stuck_listening(
    silenced: Silenced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener's connection is gone without a word (a NAT forgot it)
    and the deliverer, claiming a full batch, pauses it, then lets it
    listen again. The UNLISTEN asked of the silent connection is given no
    more time than a ping: the listener stops counting itself as listening
    (the deliverer woken to look itself) and connects again, where it
    waited for an answer for good, and a stop waited STOP_WAIT."""
    monkeypatch.setattr(wakeup.PostgresListener, "STOP_WAIT", 3.0)
    listener = listening_after_quiet_waits_of(0.5, monkeypatch)
    woken = listener.event
    try:
        woken.clear()
        silenced.proxy.cut.set()
        listener.pause(True)  # a full claim: UNLISTEN on the silent connection
        time.sleep(0.3)
        listener.pause(False)  # caught up: listen again
        # A quiet wait (0.5 s) and an unanswered question (1 s) at most.
        assert woken.wait(AT_ONCE), "still counted as listening on a silent connection"
        assert not listener.listening
        silenced.proxy.cut.clear()
        wait_until(lambda: len(silenced.connected) == 2 and listener.listening, timeout=10)
    finally:
        listener.stop()
