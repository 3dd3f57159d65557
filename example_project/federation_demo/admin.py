"""The project's own pages beside the package's: remote servers, and actors
with their public keys (the private key is never shown)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from federation_demo.models import Actor, RemoteServer


@admin.register(RemoteServer)
class RemoteServerAdmin(admin.ModelAdmin):
    list_display = [
        "host",
        "gone",
        "gone_at",
        "failures",
        "last_failure_status",
        "last_failure_at",
        "delivered",
    ]
    list_filter = ["gone"]
    search_fields = ["host"]
    # Filled by the signal receivers, not by hand.
    readonly_fields = list_display
    actions = ["mark_back"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(permissions=["change"], description="Mark as back (no longer gone)")
    def mark_back(self, request: HttpRequest, queryset: QuerySet[RemoteServer]) -> None:
        count = queryset.filter(gone=True).update(gone=False, gone_at=None)
        self.message_user(request, f"{count} server(s) marked as back.")


@admin.register(Actor)
class ActorAdmin(admin.ModelAdmin):
    list_display = ["username", "uri", "created_at"]
    search_fields = ["username", "uri"]
    # The private key is not editable, so no form holds it; nor does this list.
    fields = ["username", "uri", "key_id", "public_key_pem", "created_at"]
    readonly_fields = ["key_id", "public_key_pem", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # An actor is made with its key by Actor.objects.get_or_make.
        return False

    @admin.display(description="key id")
    def key_id(self, actor: Actor) -> str:
        return actor.key_id
