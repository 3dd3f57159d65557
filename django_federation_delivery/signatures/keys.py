"""The sender's private key, wrapped so it can be passed around without leaking."""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.exceptions import InternalError, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey

from django_federation_delivery.exceptions import SigningError

__all__ = ["SenderKey", "shown"]

# The errors cryptography raises for a key or input it cannot work with.
_CRYPTO_ERRORS = (ValueError, TypeError, UnsupportedAlgorithm, InternalError)


#: What a PEM holds, and no key id does: a key id holding it is a key.
_PEM_MARK = "-----BEGIN"


def shown(key_id: object) -> str:
    """``key_id`` as an error names it: quoted, unless it is a PEM (a key
    given where its id goes, the arguments swapped), which is never shown."""
    text = key_id
    if isinstance(key_id, bytes | bytearray | memoryview):
        text = bytes(key_id).decode("latin-1")  # every byte as it was
    if isinstance(text, str) and _PEM_MARK in text:
        return "a key id that is a PEM key (are the arguments swapped?)"
    return repr(key_id)


@dataclass(frozen=True, repr=False)
class SenderKey:
    """An actor's signing key and the id remote servers fetch its public half by.

    ``repr`` shows only the key id and algorithm, so a key that ends up in a log
    line, a traceback or a debug page never discloses the private material.
    """

    key_id: str
    private_key: RSAPrivateKey | Ed25519PrivateKey

    def __post_init__(self) -> None:
        # Checked here too, not only in from_pem, so a hand-built key fails early.
        if not isinstance(self.private_key, RSAPrivateKey | Ed25519PrivateKey):
            raise SigningError(
                f"key {shown(self.key_id)} is a {type(self.private_key).__name__}; "
                "only RSA and Ed25519 private keys can sign deliveries"
            )

    @classmethod
    def from_pem(
        cls, key_id: str, pem: str | bytes, password: str | bytes | None = None
    ) -> SenderKey:
        """Load a PEM private key (PKCS#1 or PKCS#8, optionally encrypted with
        ``password``: bytes, or text as the environment gives it, in UTF-8).

        Errors name the key id but never echo the PEM, which may be a real key
        (nor a key id that is one: the two arguments swapped).
        """
        named = shown(key_id)
        if not isinstance(pem, str | bytes | bytearray | memoryview):
            # None from an actor whose key column is empty, say.
            raise SigningError(
                f"could not load the private key for {named}: the PEM must be text or "
                f"bytes, not {type(pem).__name__}"
            )
        # Text as the environment gives it: bytes that are no UTF-8 come back
        # as they were, and are then no PEM.
        data = pem.encode("utf-8", "surrogateescape") if isinstance(pem, str) else bytes(pem)
        if password is not None and not isinstance(password, str | bytes):
            raise SigningError(
                f"could not load the private key for {named}: its password must be "
                f"text or bytes, not {type(password).__name__}"
            )
        try:
            # Text as the environment gives it: bytes that are no UTF-8
            # come back as they were (surrogateescape, as os.fsencode does).
            secret = (
                password.encode("utf-8", "surrogateescape")
                if isinstance(password, str)
                else password
            )
        except UnicodeEncodeError:
            raise SigningError(
                f"could not load the private key for {named}: its password is text "
                "that cannot be written as bytes"
            ) from None
        try:
            loaded = serialization.load_pem_private_key(data, password=secret)
        except _CRYPTO_ERRORS as exc:
            # Said by the PEM itself (its header: "ENCRYPTED PRIVATE KEY", or
            # PKCS#1's "Proc-Type: 4,ENCRYPTED"), not by cryptography's error,
            # which is a TypeError for a password given to a key not
            # encrypted and for an empty one alike.
            encrypted = b"ENCRYPTED" in data
            if not encrypted and secret:
                hint = "a password was given, but the key is not encrypted"
            elif encrypted and not secret:
                hint = "it is encrypted, and no password was given"
            elif encrypted:
                hint = "is the password right?"
            else:
                hint = "is it encrypted?"
            raise SigningError(
                f"could not load the private key for {named}: not a usable PEM private key ({hint})"
            ) from exc
        if not isinstance(loaded, RSAPrivateKey | Ed25519PrivateKey):
            raise SigningError(
                f"key {named} is a {type(loaded).__name__}; "
                "only RSA and Ed25519 private keys can sign deliveries"
            )
        return cls(key_id=key_id, private_key=loaded)

    @property
    def algorithm(self) -> str:
        """``"rsa"`` or ``"ed25519"``: what each scheme needs to pick its ``alg``."""
        return "rsa" if isinstance(self.private_key, RSAPrivateKey) else "ed25519"

    def __repr__(self) -> str:
        return f"SenderKey(key_id={shown(self.key_id)}, algorithm={self.algorithm!r})"

    def public_key_pem(self) -> str:
        """The SubjectPublicKeyInfo PEM an actor document publishes as ``publicKeyPem``."""
        return (
            self.private_key.public_key()
            .public_bytes(
                encoding=serialization.Encoding.PEM,
                format=serialization.PublicFormat.SubjectPublicKeyInfo,
            )
            .decode("ascii")
        )

    def sign(self, message: bytes) -> bytes:
        """Sign ``message``: RSASSA-PKCS1-v1_5 with SHA-256, or plain Ed25519.

        Both signature schemes use exactly these primitives, so they live here
        once; any failure comes out as ``SigningError`` naming only the key id.
        """
        try:
            if isinstance(self.private_key, RSAPrivateKey):
                return self.private_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
            return self.private_key.sign(message)
        except _CRYPTO_ERRORS as exc:
            raise SigningError(
                f"key {shown(self.key_id)} could not sign the request ({type(exc).__name__})"
            ) from exc
