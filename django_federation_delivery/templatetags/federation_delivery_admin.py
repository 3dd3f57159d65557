"""What the app's admin pages apply to text their rows keep as it came."""

from __future__ import annotations

from django import template

from django_federation_delivery.addresses import escaped, redact

register = template.Library()

# What would read as something else, or as nothing (a bidi override, an
# escape, a line break), written as its escape.
register.filter("printable", escaped)
# A breaker's key as every list shows it: a portable inbox's (the whole
# inbox, up to 2,048 characters) cut as a message cuts a URL; escaped too.
register.filter("shown_key", redact)
