"""What the app's admin pages apply to text their rows keep as it came."""

from __future__ import annotations

from django import template

from django_federation_delivery.addresses import escaped

register = template.Library()

# What would read as something else, or as nothing (a bidi override, an
# escape, a line break), written as its escape.
register.filter("printable", escaped)
