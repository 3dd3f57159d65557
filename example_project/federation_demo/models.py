"""What a host project keeps itself: its actors' keys, and what it has learnt
of the remote servers it delivers to (filled by the receivers in
``remote_servers.py``)."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.db import IntegrityError, models, transaction

#: Where the demo's actors live: ``{ORIGIN}/users/<username>``.
ORIGIN = "http://example.test"


class ActorManager(models.Manager["Actor"]):
    def get_or_make(self, username: str) -> Actor:
        """The local actor ``username``, made with a fresh RSA key the first
        time it is asked for. Two processes asking at once get the same key."""
        actor = self.filter(username=username).first()
        if actor is not None:
            return actor
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        try:
            # A savepoint: the caller's transaction goes on if another made it first.
            with transaction.atomic():
                return self.create(
                    username=username,
                    uri=f"{ORIGIN}/users/{username}",
                    private_key_pem=private.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    ).decode("ascii"),
                    public_key_pem=private.public_key()
                    .public_bytes(
                        serialization.Encoding.PEM,
                        serialization.PublicFormat.SubjectPublicKeyInfo,
                    )
                    .decode("ascii"),
                )
        except IntegrityError:
            return self.get(username=username)


class Actor(models.Model):
    """A local actor and its key pair.

    The private key is kept in the row: this is the project's own database,
    as it is for its users' passwords. It is not editable (so no admin form
    shows it) and no ``str`` or ``repr`` of the row holds it.
    """

    username = models.SlugField(max_length=100, unique=True)
    uri = models.URLField(unique=True)
    private_key_pem = models.TextField(editable=False)
    public_key_pem = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ActorManager()

    class Meta:
        ordering = ["username"]

    def __str__(self) -> str:
        return self.uri

    @property
    def key_id(self) -> str:
        """What remote servers fetch the public key by (``publicKey.id``)."""
        return f"{self.uri}#main-key"


class RemoteServer(models.Model):
    """A remote server, as the deliveries to it went: one row a host.

    Counted by signal receivers, which run again for a delivery whose process
    stopped before the row left the queue: the counts are close, not exact.
    """

    #: The host, as the package names it (``Delivery.host``): no port.
    host = models.CharField(max_length=255, unique=True)
    #: It answered 410 Gone: it will take nothing again.
    gone = models.BooleanField(default=False)
    gone_at = models.DateTimeField(null=True, blank=True)
    #: Deliveries to it that ended without being delivered.
    failures = models.PositiveIntegerField(default=0)
    #: The status of the last failure, if the server answered at all.
    last_failure_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    delivered = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["host"]

    def __str__(self) -> str:
        return self.host
