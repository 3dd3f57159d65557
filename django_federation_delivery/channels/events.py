"""An event: what ``send_webhook`` queues and every kind renders.

Stored as its JSON (:meth:`Event.as_json`) once, in its batch, and read back
(:meth:`Event.read`) byte for byte at each attempt, so that every retry sends
the same body and a receiver de-duplicates by the id.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django_federation_delivery.addresses import quoted
from django_federation_delivery.exceptions import InvalidDelivery

__all__ = [
    "MAX_DEPTH",
    "Event",
    "colliding_key",
    "compact_json",
    "nested_deeper",
    "not_json",
]

# An event type names a template, so it is a plain dotted name: "alert.raised".
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_]+(?:[.-][A-Za-z0-9_]+)*")
_EVENT_TYPE_LENGTH = 100
# The id travels in a header and in the signed content.
_EVENT_ID = re.compile(r"[\x21-\x7e]{1,200}")
#: How many arrays and objects an event's data may hold one inside another.
#: Fixed, and far below the interpreter's recursion limit: the encoder and
#: the decoder recurse once a level, and the loop reads a stored event back
#: one level deeper than it was written (in its document), from deep in its
#: own stack. Bounded by that limit alone, data a send could write was data
#: the loop could not read, at every start.
MAX_DEPTH = 100


@dataclass(frozen=True)
class Event:
    """One event for a destination. Built with :meth:`of`, which checks it."""

    type: str
    id: str
    timestamp: datetime.datetime
    data: Any

    @classmethod
    def of(
        cls, event_type: str, event_id: str | uuid.UUID, timestamp: datetime.datetime, data: Any
    ) -> Event:
        """The event, or ``InvalidDelivery`` naming what is wrong with it."""
        if not isinstance(event_type, str) or not event_type:
            raise InvalidDelivery(
                f"An event type must be a non-empty string, not {quoted(event_type)}."
            )
        if len(event_type) > _EVENT_TYPE_LENGTH or not _EVENT_TYPE.fullmatch(event_type):
            raise InvalidDelivery(
                f"The event type {quoted(event_type)} is not a simple name: letters, digits and "
                f"'_', parts joined by '.' or '-' (e.g. 'alert.raised'), at most "
                f"{_EVENT_TYPE_LENGTH} characters."
            )
        if isinstance(event_id, uuid.UUID):
            event_id = str(event_id)
        if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
            raise InvalidDelivery(
                f"An event id must be 1 to 200 printable ASCII characters without spaces, "
                f"not {quoted(event_id)}."
            )
        if not isinstance(timestamp, datetime.datetime) or timestamp.utcoffset() is None:
            raise InvalidDelivery(
                f"An event's timestamp must be an aware datetime, not {quoted(timestamp)}."
            )
        try:
            in_utc = timestamp.astimezone(datetime.UTC)
        except OverflowError:
            # The year 1 at +01:00, or 9999-12-31 at -01:00.
            raise InvalidDelivery(
                f"An event's timestamp must be one UTC can hold, not {timestamp.isoformat()}."
            ) from None
        try:
            compact_json(data)
        except RecursionError:
            raise _too_deep(event_type) from None
        # ValueError: NaN or infinity, a circular reference, a lone surrogate.
        except (TypeError, ValueError) as exc:
            raise InvalidDelivery(
                f"The data of event {event_type!r} cannot be written as JSON: {not_json(data, exc)}"
            ) from None
        # Once written, so that what is walked is neither circular nor endless.
        if nested_deeper(data, MAX_DEPTH):
            raise _too_deep(event_type)
        collision = colliding_key(data)
        if collision is not None:
            key, path = collision
            raise InvalidDelivery(
                f"The data of event {event_type!r} has two keys that are both {quoted(key)} "
                f"in JSON at {path}."
            )
        return cls(event_type, event_id, in_utc, data)

    @classmethod
    def read(cls, body: str | bytes) -> Event:
        """The event :meth:`as_json` wrote, exactly: sent again, and signed
        again, it gives the same bytes. ``InvalidDelivery`` if it is not one."""
        try:
            document = json.loads(body)
            timestamp = datetime.datetime.fromisoformat(document["timestamp"])
            return cls.of(document["type"], document["id"], timestamp, document["data"])
        # RecursionError: nested past what the decoder reads from here, which
        # no send wrote (MAX_DEPTH), but a body changed by hand may be.
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            if isinstance(exc, InvalidDelivery):
                raise
            raise InvalidDelivery(f"not a stored event: {type(exc).__name__}") from None

    def as_json(self) -> bytes:
        """The body of a signed JSON delivery, in the shape Standard Webhooks suggests."""
        document = {
            "type": self.type,
            "id": self.id,
            "timestamp": self.timestamp.isoformat().replace("+00:00", "Z"),
            "data": self.data,
        }
        return compact_json(document)


def _too_deep(event_type: str) -> InvalidDelivery:
    return InvalidDelivery(
        f"The data of event {event_type!r} is nested more than {MAX_DEPTH} levels deep "
        f"(arrays and objects one inside another)."
    )


def compact_json(value: Any) -> bytes:
    """``value`` as compact JSON in UTF-8, refusing NaN and infinity."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


#: What holds nothing to look into: the types JSON writes as they are.
_LEAVES = frozenset((str, int, float, bool, type(None)))
#: What JSON writes as an array. A tuple, not ``list | tuple``: isinstance()
#: is quicker given one, and it is asked of every array of every send.
_ARRAYS = (list, tuple)
#: How much of where two keys collide a message shows.
_PATH_SHOWN = 120


def colliding_key(value: Any) -> tuple[str, str] | None:
    """The key that two keys of one object in ``value`` both become once
    written as JSON, and where that object is (``$.object.tag[0]``); None
    when there is none. JSON writes each key as text: ``1`` and ``"1"``, or
    ``None`` and ``"null"``, are the same key to every receiver, which keeps
    one of the two, or refuses the body.

    Asked of what the encoder has just written, so that ``value`` holds
    nothing circular, nothing it cannot write, and is walked without
    recursion however deep it is. It is on the way of every send: in most
    activities every key is text, and each object's keys are only looked at
    for that."""
    todo = [value]
    pop = todo.pop
    append = todo.append
    leaves = _LEAVES
    while todo:
        item = pop()
        if isinstance(item, dict):
            for key in item:
                if type(key) is not str:
                    # Only a key that is not text can be another once written.
                    if _duplicated(item) is not None:
                        return _where(value, item)
                    break
            for member in item.values():
                if type(member) not in leaves:
                    append(member)
        elif isinstance(item, _ARRAYS):
            for member in item:
                if type(member) not in leaves:
                    append(member)
    return None


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` holds arrays and objects more than ``limit`` deep,
    one inside another (``[[0]]`` is 2 deep, ``0`` 0). Walked without
    recursion, as :func:`colliding_key` walks, so that it answers however
    deep ``value`` is; asked of what the encoder has just written, so that
    nothing in it is circular."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    pop = todo.pop
    append = todo.append
    leaves = _LEAVES
    while todo:
        item, depth = pop()
        if isinstance(item, dict):
            members: Any = item.values()
        elif isinstance(item, _ARRAYS):
            members = item
        else:
            continue
        if depth > limit:
            return True
        for member in members:
            if type(member) not in leaves:
                append((member, depth + 1))
    return False


def not_json(value: Any, error: Exception) -> str:
    """Why the encoder refused ``value``, as ``error`` says; for a value or a
    key JSON cannot write (a NaN or an infinity, which JSON has no number
    for; an integer longer than the interpreter writes), which one and where
    it is (``nan at $.object.score``, ``nan (a key) at $.tag``): the encoder
    says neither."""
    if isinstance(error, UnicodeEncodeError):
        # Text with a lone surrogate (a file name decoded with
        # surrogateescape): the codec names a place in the document only.
        for item, path in _paths(value):
            if isinstance(item, str) and not _encodes(item):
                return f"a lone surrogate at {_shown(path)}, which UTF-8 cannot write"
            if isinstance(item, dict):
                for key in item:
                    if isinstance(key, str) and not _encodes(key):
                        return (
                            f"a lone surrogate (a key) at {_shown(path)}, which UTF-8 cannot write"
                        )
    if isinstance(error, ValueError):
        for item, path in _paths(value):
            if (why := _unwritable(item)) is not None:
                return f"{why[0]} at {_shown(path)}, {why[1]}"
            if isinstance(item, dict):
                for key in item:
                    if (why := _unwritable(key)) is not None:
                        return f"{why[0]} (a key) at {_shown(path)}, {why[1]}"
    if isinstance(error, TypeError):
        # A value of a type JSON has none for: a datetime, a Decimal, a lazy
        # translation (whose type calls itself __proxy__), a model instance.
        for item, path in _paths(value):
            if not isinstance(item, _WRITTEN):
                return f"{_kind(item)} at {_shown(path)}, which JSON cannot write"
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, _KEYS):
                        return f"{_kind(key)} (a key) at {_shown(path)}, which JSON cannot write"
    return str(error)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


#: What the encoder writes as a value, and as a key.
_WRITTEN = (dict, list, tuple, str, int, float, type(None))
_KEYS = (str, int, float, type(None))


def _kind(item: Any) -> str:
    """What ``item`` is, by its type: never its value, which may be long."""
    from django.utils.functional import Promise

    if isinstance(item, Promise):
        return "a lazy translation (str() it first)"
    name = type(item).__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _unwritable(item: Any) -> tuple[str, str] | None:
    """The number ``item`` and why the encoder refuses it, if it does."""
    if isinstance(item, float) and not math.isfinite(item):
        return float.__repr__(item), "which JSON has no number for"
    if isinstance(item, int) and not isinstance(item, bool):
        try:
            int.__repr__(item)
        except ValueError:
            most = sys.get_int_max_str_digits()
            return "an integer", f"longer than the {most} digits Python writes"
    return None


def _json_key(key: Any) -> str:
    """``key`` as the encoder writes a key (``json`` ``encoder.py``): the
    text of a float or an integer, true, false or null; for a key it cannot
    write (an integer too long, a tuple), what it is."""
    if isinstance(key, str):
        return str.__str__(key)  # its text, whatever a subclass makes of str()
    if isinstance(key, float):
        return float.__repr__(key)
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        try:
            return int.__repr__(key)
        except ValueError:
            return "<an integer too long to write>"
    return f"<a {type(key).__name__}>"


def _duplicated(item: dict[Any, Any]) -> str | None:
    """The first key of ``item`` another of its keys is also, as JSON."""
    seen: set[str] = set()
    for key in item:
        written = _json_key(key)
        if written in seen:
            return written
        seen.add(written)
    return None


def _where(value: Any, found: dict[Any, Any]) -> tuple[str, str]:
    """The key ``found`` (an object in ``value``) has twice as JSON, and its
    path from ``value``: looked for again, this time with the paths, as it
    is only asked once a send is refused."""
    for item, path in _paths(value):
        if item is found:
            return _duplicated(found) or "", _shown(path)
    raise AssertionError("the object whose keys collide is in the value it was found in")


def _paths(value: Any) -> Iterator[tuple[Any, str]]:
    """Each member of ``value``, ``value`` first, with its path from it
    (``$.object.tag[0]``), in the order JSON writes them; walked without
    recursion, each array and object once (a value the encoder refused may
    be circular). Only asked once a send is refused: it builds every path."""
    todo: list[tuple[Any, str]] = [(value, "$")]
    seen: set[int] = set()
    while todo:
        item, path = todo.pop()
        yield item, path
        if not isinstance(item, dict | list | tuple) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            todo += [(member, path + _step(key)) for key, member in reversed(item.items())]
        else:
            todo += [(member, f"{path}[{n}]") for n, member in reversed(list(enumerate(item)))]


def _shown(path: str) -> str:
    return path if len(path) <= _PATH_SHOWN else f"{path[:_PATH_SHOWN]}…"


def _step(key: Any) -> str:
    """One step of a path, to the member ``key`` names: ``.name``, or
    ``["@context"]`` when the name is not an identifier."""
    written = _json_key(key)
    if written.isidentifier() and written.isascii():
        return f".{written}"
    return f"[{json.dumps(written)}]"
