"""The test project's senders and their keys, made once per test run."""

from __future__ import annotations

from functools import cache

from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from django_federation_delivery.signatures import SenderKey

ALICE = "https://social.example/users/alice"
EDNA = "https://social.example/users/edna"  # signs with Ed25519
BROKEN = "https://social.example/users/broken"  # whose key store raises

calls: list[str] = []


@cache
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@cache
def ed25519_key() -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.generate()


def sender_key(sender: str) -> SenderKey | None:
    calls.append(sender)
    if sender == BROKEN:
        raise ConnectionError("the key store is away")
    if sender == EDNA:
        return SenderKey(f"{EDNA}#ed25519-key", ed25519_key())
    if sender.startswith("https://social.example/users/"):
        return SenderKey(f"{sender}#main-key", rsa_key())
    return None
