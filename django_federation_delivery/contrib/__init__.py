"""Integrations with other packages, each optional: they sit on top of the
app and call the same API a host project would."""
