"""Incoming webhooks whose URL path is the credential (Slack, Discord,
Mattermost): ``kind://host/path`` POSTs JSON to ``https://host/path``, and
``kind+http://`` to ``http://``."""

from __future__ import annotations

from typing import ClassVar

from django.utils.translation import gettext as _

from django_federation_delivery.channels.base import Channel, Parsed, UnusableURL

__all__ = ["HookChannel"]


class HookChannel(Channel):
    """A hook: the path (and any query) is secret, and so is every segment of
    it but the words the service puts in every hook's path."""

    #: Path segments that are the same in every hook of the service ("services"
    #: in Slack's), and so no secret.
    public_segments: ClassVar[frozenset[str]] = frozenset()

    def parse(self, url: str, scheme: str) -> Parsed:
        target = self.over(url, scheme)
        parts = self.split(target)
        path = parts.path
        if path.strip("/") == "":
            raise UnusableURL(
                _("a %(kind)s URL needs the hook's path, as the service gave it")
                % {"kind": _(self.label)}
            )
        segments = [s for s in path.split("/") if s and s not in self.public_segments]
        # The query whole, and each parameter and its value by themselves: a
        # receiver that repeats it may write its "&" otherwise (JSON's \u0026).
        pairs = [
            piece
            for pair in parts.query.split("&")
            for piece in (pair, pair.partition("=")[2])
            if piece
        ]
        return Parsed(url=target, secrets=(path, parts.query, *segments, *pairs))
