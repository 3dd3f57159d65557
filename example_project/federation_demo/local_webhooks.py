"""Print ``export WEBHOOK_<NAME>=…`` lines for two local webhook destinations.

    eval "$(python example_project/federation_demo/local_webhooks.py)"

``WEBHOOK_OPS``: a Slack incoming webhook (``slack+http://``) on 127.0.0.8,
``WEBHOOK_AUDIT``: signed JSON (``http://…?secret=whsec_…``) on 127.0.0.9,
each on a port free now, with a fresh hook path and a fresh key. ``manage.py
demo`` starts a stand-in receiver where each points. Where only 127.0.0.1 can
be bound (macOS by default), both use it. Run as a script: it needs neither
Django nor the package.
"""

from __future__ import annotations

import base64
import secrets
import shlex
import socket
import sys


def free_address(host: str) -> str:
    """``host:port`` with a port nothing listens on now, on ``host`` or, if it
    cannot be bound, on 127.0.0.1."""
    for candidate in (host, "127.0.0.1"):
        try:
            with socket.socket() as probe:
                probe.bind((candidate, 0))
                return f"{candidate}:{probe.getsockname()[1]}"
        except OSError:
            continue
    raise SystemExit(f"cannot bind {host} or 127.0.0.1")


def destinations() -> dict[str, str]:
    hook = f"T0DEMO/B0DEMO/{secrets.token_urlsafe(18)}"
    key = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    # The key percent-encoded: base64 has "+" and "/", which a URL could misread.
    encoded = key.replace("+", "%2B").replace("/", "%2F").replace("=", "%3D")
    return {
        "WEBHOOK_OPS": f"slack+http://{free_address('127.0.0.8')}/services/{hook}",
        "WEBHOOK_AUDIT": f"http://{free_address('127.0.0.9')}/hooks/audit?secret={encoded}",
    }


def main() -> int:
    for variable, url in destinations().items():
        print(f"export {variable}={shlex.quote(url)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
