"""The demo actors' signing keys: the ``SENDER_KEYS`` provider, and no model.

Each actor's RSA key is a PEM file under ``example_project/var/keys/``,
made (mode 0600) the first time it is asked for. A real project would keep
its actors' keys in its own models instead.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.conf import settings

from django_federation_delivery.signatures import SenderKey

ORIGIN = "http://example.test"
ACTORS = ("alice", "bob")
ALICE = f"{ORIGIN}/users/alice"
BOB = f"{ORIGIN}/users/bob"

_lock = threading.Lock()
_keys: dict[str, SenderKey] = {}


def key_dir() -> Path:
    return Path(settings.BASE_DIR) / "var" / "keys"


def sender_key(sender: str) -> SenderKey | None:
    """The key ``sender`` signs with, or None when it is not a demo actor."""
    slug = sender.removeprefix(f"{ORIGIN}/users/")
    if slug == sender or slug not in ACTORS:
        return None
    with _lock:
        key = _keys.get(slug)
        if key is None:
            key = SenderKey.from_pem(f"{sender}#main-key", _load_or_make_pem(slug))
            _keys[slug] = key
    return key


def public_key_pem(key_id: str) -> str | None:
    """The public key a remote server would fetch for ``key_id``, or None."""
    actor, _, _ = key_id.partition("#")
    key = sender_key(actor)
    if key is None or key.key_id != key_id:
        return None
    return key.public_key_pem()


def _load_or_make_pem(slug: str) -> bytes:
    path = key_dir() / f"{slug}.pem"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Written aside (mkstemp makes it 0600), then linked into place: another
    # process that made the key first wins, and its key is the one used.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{slug}-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(pem)
        os.link(tmp, path)
    except FileExistsError:
        return path.read_bytes()
    finally:
        os.unlink(tmp)
    return pem
