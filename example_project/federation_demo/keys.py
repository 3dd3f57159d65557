"""The ``SENDER_KEYS`` provider: each local actor's key, read from its
:class:`~federation_demo.models.Actor` row.

The demo's two actors, alice and bob, are made (with a fresh RSA key) the
first time they are asked for; any other sender with no row has no key. The
package keeps what this returns for ``KEY_CACHE_SECONDS``, so a key costs a
query now and then, not one a delivery.
"""

from __future__ import annotations

from django_federation_delivery.signatures import SenderKey
from federation_demo.models import ORIGIN, Actor

ACTORS = ("alice", "bob")
ALICE = f"{ORIGIN}/users/alice"
BOB = f"{ORIGIN}/users/bob"


def sender_key(sender: str) -> SenderKey | None:
    """The key ``sender`` signs with, or None when it is no local actor."""
    actor = Actor.objects.filter(uri=sender).first()
    if actor is None:
        username = sender.removeprefix(f"{ORIGIN}/users/")
        if username == sender or username not in ACTORS:
            return None
        actor = Actor.objects.get_or_make(username)
    return SenderKey.from_pem(actor.key_id, actor.private_key_pem)


def public_keys() -> dict[str, str]:
    """Every local actor's public key by its key id, as a remote server would
    fetch it from the actor's document: the demo's inboxes check with these."""
    for username in ACTORS:
        Actor.objects.get_or_make(username)
    return dict(
        (actor.key_id, actor.public_key_pem)
        for actor in Actor.objects.only("uri", "public_key_pem")
    )
