"""The example project's own tests, written as a host project writes them
with ``django_federation_delivery.testing``: run them with
``python manage.py test federation_demo`` (or pytest, with its fixtures).

Nothing reaches the network: sends are listed in the outbox, and
``deliver_all`` runs the real deliverer against a fake receiver that
verifies each signature with the sender's key, as a real server would.
"""

from __future__ import annotations

from django.test import TransactionTestCase

from django_federation_delivery import send
from django_federation_delivery.testing import DeliveryTestMixin
from federation_demo.keys import ALICE
from federation_demo.models import RemoteServer

NOTE = {"type": "Create", "id": f"{ALICE}/notes/1/activity", "actor": ALICE}
INBOX = "https://remote.example/users/carol/inbox"


# TransactionTestCase: the deliverer commits as it goes, as it does in production.
class FederationTests(DeliveryTestMixin, TransactionTestCase):
    def test_posting_sends_a_signed_create_that_a_real_server_would_accept(self) -> None:
        send(ALICE, NOTE, [INBOX])
        assert [(out.inbox, out.activity["type"]) for out in self.delivery_outbox] == [
            (INBOX, "Create")
        ]
        self.deliver_all()
        assert [request.verified for request in self.fake_inbox.received] == [True]
        assert RemoteServer.objects.get(host="remote.example").delivered == 1

    def test_a_server_that_answers_410_is_marked_gone(self) -> None:
        self.fake_inbox.answer(410)
        send(ALICE, NOTE, [INBOX])
        self.deliver_all()
        server = RemoteServer.objects.get(host="remote.example")
        assert (server.gone, server.last_failure_status) == (True, 410)
