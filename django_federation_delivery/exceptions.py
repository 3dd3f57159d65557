"""The exceptions this app raises, in one tree.

Nothing here imports Django, so that ``signatures`` and ``transport`` can use
them and stay free of it.
"""

from __future__ import annotations

import os
import traceback


class FederationDeliveryError(Exception):
    """The root of every error this app raises."""


class InvalidDelivery(FederationDeliveryError, ValueError):
    """A ``send*()`` call was given something it cannot queue.

    Raised before anything is written: a bad call queues nothing at all.
    """


class SigningError(FederationDeliveryError):
    """A request could not be signed: no key, or a key the scheme cannot use.

    Trying again will not help, so a delivery that meets one is refused.
    """


class TransportError(FederationDeliveryError):
    """An attempt got no usable answer from the inbox."""

    #: Whether trying again cannot help (a bad or refused address).
    permanent: bool = False
    #: Whether a request may have reached the server: not when the URL or
    #: the address was refused before any was made, which says nothing of
    #: the server.
    sent: bool = True


class InvalidURL(TransportError):
    """The target is not an absolute http(s) URL with a host."""

    permanent = True
    sent = False


class RefusedAddress(TransportError):
    """The target resolved to an address deliveries may not go to.

    Loopback, private, link-local and other non-public addresses are refused
    unless ``ALLOWED_NETWORKS`` names them; the check is made on the address
    actually connected to, after DNS, before any byte of a request is sent.
    """

    permanent = True
    sent = False


class AttemptTimeout(TransportError):
    """Connecting, or the whole attempt, took longer than allowed."""


class ConnectionFailed(TransportError):
    """The connection could not be made, or broke before an answer came."""


def raised_at(error: BaseException) -> str:
    """Where ``error`` was raised, as `` at file.py:LINE`` (empty when it is
    not known): what a log line says of an error besides its type, when its
    message may quote a webhook's URL or an inbox's query."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
