"""Waking an idle deliverer when new work is queued.

In the same process a send wakes every deliverer at once (``notify_local``,
called on commit). Across processes PostgreSQL's ``LISTEN/NOTIFY`` does it,
through a connection of its own; elsewhere, and while that connection does
not listen (it cannot be had, or was lost), the deliverer looks for new work
with a cheap indexed query every ``NEW_WORK_POLL_SECONDS``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Iterator
from typing import Any

from django.db import connections

from django_federation_delivery.conf import database_alias
from django_federation_delivery.store import sql
from django_federation_delivery.store.sql import NOTIFY_CHANNEL
from django_federation_delivery.store.wakes import notify_local, register, unregister, wake_all

__all__ = [
    "NOTIFY_CHANNEL",
    "PostgresListener",
    "notify_local",
    "register",
    "unregister",
    "wake_all",
]

logger = logging.getLogger(__name__)

#: How long the listener's connection may take to be made, in seconds,
#: unless the database's OPTIONS set ``connect_timeout``.
CONNECT_TIMEOUT = 10


def _shut(watched: socket.socket) -> None:
    """Shut the connection ``watched`` (a duplicate of its descriptor) down
    both ways: what waits on it returns at once, failed."""
    with contextlib.suppress(OSError):  # closed meanwhile: it answered
        watched.shutdown(socket.SHUT_RDWR)


class PostgresListener:
    """Sets ``event`` whenever PostgreSQL delivers a notification of new work.

    Runs in a daemon thread with a psycopg 3 connection of its own (not
    Django's), and reconnects after a failure. ``available`` says whether it
    could start: without psycopg 3 the deliverer polls instead. It waits on
    the connection's socket and on one of its own, which :meth:`stop` writes
    to: a deliverer stops at once, not at the end of a wait.

    :meth:`pause` has it stop listening (``UNLISTEN``) while the deliverer
    claims from a backlog, which it does without being woken: there every
    send's notification would cost the server a wake of this connection's
    backend for nothing. Listening again, it wakes the deliverer once, for
    what was sent in between.
    """

    #: How long one wait lasts at most; :meth:`stop` ends it sooner.
    WAIT = 5.0
    #: After a wake, how long what comes next is left to gather before it
    #: is read: a stream of sends wakes the deliverer once in that time, not
    #: once a send (each wake a turn of its loop), and the first send after
    #: a quiet spell still wakes it at once.
    GATHER = 0.01
    #: How long :meth:`stop` waits for a listener still connecting.
    STOP_WAIT = 30.0
    #: How long the question asked after a quiet wait may take before the
    #: connection is taken for gone, and replaced.
    PING_TIMEOUT = 3.0

    def __init__(
        self,
        event: threading.Event,
        *,
        listened: threading.Event | None = None,
        using: str | None = None,
    ) -> None:
        #: Set by a notification: something was sent.
        self.event = event
        #: Set when it begins to listen, at first, again after a failure or
        #: a pause: what was sent before may have woken nobody.
        self.listened = listened or event
        self.using = using or database_alias()
        self._stop = threading.Event()
        self._paused = False
        #: Whether the connection listens now: while it does not (connecting,
        #: failing to, or paused), an idle deliverer looks for new work itself.
        self.listening = False
        self._thread: threading.Thread | None = None
        # What stop() writes to, to end a wait at once. A socket pair, not a
        # pipe: select() takes only sockets on Windows.
        self._stop_reader, self._stop_writer = socket.socketpair()
        # What pause() writes to, to have the thread look at once.
        self._turn_reader, self._turn_writer = socket.socketpair()
        # Written to without waiting: the thread reads them only while it is
        # connected, and a byte unread already has it look at what is asked
        # now. Blocking, the loop's 278th change of mind while the thread
        # could not connect would wait on it for good.
        self._stop_writer.setblocking(False)
        self._turn_writer.setblocking(False)

    @staticmethod
    def available(using: str | None = None) -> bool:
        if connections[using or database_alias()].vendor != "postgresql":
            return False
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return False
        return True

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="federation-delivery-listen", daemon=True
        )
        self._thread.start()

    def pause(self, paused: bool) -> None:
        """Stop listening (``paused``) or listen again, soon, in the thread."""
        if paused == self._paused:
            return
        self._paused = paused
        with contextlib.suppress(OSError):  # closed: stopped; full: a byte is unread
            self._turn_writer.send(b"\0")

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # closed: stopped before
            self._stop_writer.send(b"\0")
        if self._thread is not None:
            # At once, unless it is still connecting (which nothing can
            # interrupt): then until the connection is made, and closed.
            self._thread.join(timeout=self.STOP_WAIT)
            if self._thread.is_alive():
                return  # its sockets are left to it
        for end in (self._stop_writer, self._stop_reader, self._turn_writer, self._turn_reader):
            end.close()

    def _connect(self) -> Any:
        import psycopg

        params = connections[self.using].get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        # A server that cannot be reached answers nothing: not waited on for
        # good (a stop would wait STOP_WAIT for it), unless the project says.
        params.setdefault("connect_timeout", CONNECT_TIMEOUT)
        conn = psycopg.connect(**params, autocommit=True)
        try:
            with self._answered(conn):
                sql.listen(conn, True)
        except BaseException:
            conn.close()
            raise
        return conn

    def _run(self) -> None:
        backoff = 0.5
        # Said once when listening fails, once when it listens again: an
        # outage's every try to reconnect is no line of its own (10 s apart
        # at most: 360 an hour, burying the outage's one).
        failing = False
        selector: selectors.BaseSelector | None = None
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._connect()
                self.listening = True
                backoff = 0.5
                # Work queued while this was (re)connecting is not missed.
                self.listened.set()
                logger.debug("Listening for new deliveries")
                # A selector, not select(): a process holding more than 1,024
                # files (many connections kept) has descriptors select()
                # refuses, and it never listened.
                selector = selectors.DefaultSelector()
                selector.register(conn.fileno(), selectors.EVENT_READ, "notified")
                selector.register(self._stop_reader, selectors.EVENT_READ, "stop")
                selector.register(self._turn_reader, selectors.EVENT_READ, "turn")
                while not self._stop.is_set():
                    if self.listening == self._paused:
                        self._turn(conn)
                    readable = {key.data for key, _ in selector.select(self.WAIT)}
                    if failing:
                        # Back once it has waited as a listener does.
                        failing = False
                        logger.info("Listening for new deliveries again")
                    if "stop" in readable:
                        break
                    if "turn" in readable:
                        self._turn_reader.recv(64)
                        continue
                    if not readable:
                        self._ping(conn)
                        continue
                    if readable:
                        # What came: read without waiting (a part of a message
                        # waits for the next turn).
                        woken = False
                        for _ in conn.notifies(timeout=0):
                            woken = True
                        if woken:
                            self.event.set()
                            self._stop.wait(self.GATHER)
            except Exception as exc:  # a database that is away: wait and reconnect
                if self.listening:
                    # Lost: the deliverer is woken to look for new work
                    # itself until this listens again.
                    self.listening = False
                    self.event.set()
                if failing:
                    logger.debug("Listening for new deliveries failed again (%s)", exc)
                else:
                    failing = True
                    logger.warning(
                        "Listening for new deliveries failed (%s); looking for them without "
                        "it, and trying to listen again",
                        exc,
                    )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                self.listening = False
                if selector is not None:
                    selector.close()
                    selector = None
                if conn is not None:
                    conn.close()

    def _ping(self, conn: Any) -> None:
        """After a quiet wait, ask the connection something: one gone
        without a word (a NAT or a firewall that forgot it, an address a
        failover moved) would be listened on for good, and sends from other
        processes wait for the idle poll. A few bytes every WAIT seconds."""
        with self._answered(conn):
            sql.ping(conn)

    @contextlib.contextmanager
    def _answered(self, conn: Any) -> Iterator[None]:
        """What is asked of ``conn`` within: answered in PING_TIMEOUT, or the
        connection is shut down, which fails the question, and the listener
        connects again. A send's notification read with the answer is
        handed to the handlers alone (psycopg): it wakes as any other."""
        watched = socket.socket(fileno=os.dup(conn.fileno()))
        # Shut down, not closed: the descriptor stays the connection's.
        timer = threading.Timer(self.PING_TIMEOUT, _shut, args=(watched,))
        timer.daemon = True

        def notified(notify: Any) -> None:
            self.event.set()

        conn.add_notify_handler(notified)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            watched.close()
            conn.remove_notify_handler(notified)

    def _turn(self, conn: Any) -> None:
        """Listen, or stop, as :meth:`pause` last asked."""
        listen = not self._paused
        with self._answered(conn):
            sql.listen(conn, listen)
        self.listening = listen
        if listen:
            # What was sent while it did not listen is looked for.
            self.listened.set()
