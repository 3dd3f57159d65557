"""Async views that send, as a host project under ASGI writes them."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from django_federation_delivery import InvalidDelivery, asend, asend_portable, asend_webhook
from django_federation_delivery.portable import PortableInbox

from .keys import ALICE


async def post(request: HttpRequest) -> HttpResponse:
    given = json.loads(request.body)
    activity = {"type": "Create", "id": given["id"], "actor": ALICE}
    try:
        if given.get("portable"):
            batch = await asend_portable(
                ALICE, activity, [PortableInbox(name, [url]) for name, url in given["inboxes"]]
            )
        else:
            batch = await asend(ALICE, activity, given["inboxes"], idempotency_key=given["id"])
    except InvalidDelivery as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(
        {
            "batch": batch.pk if batch else None,
            "skipped": [[s.inbox, s.reason] for s in batch.skipped] if batch else [],
        }
    )


async def alert(request: HttpRequest) -> HttpResponse:
    batch = await asend_webhook("ops", "deploy.done", {"n": 1})
    return JsonResponse({"batch": batch.pk if batch else None})


urlpatterns = [path("post", post), path("alert", alert)]
