"""The one home of a URL: its canonical form (parse, IDNA, quote once), its
host and origin, a webhook destination's key among the hosts, and what a
message may show of it.

Inbox URLs come from remote actors' documents, so anyone chooses them. A URL is
taken in one canonical form, or refused with a reason, never quietly mended:
what the signature covers must be, byte for byte, what goes on the wire, and
``requests`` rewrites a URL it finds badly quoted (after it is signed). Every
result is a fixed point of :func:`normalize_inbox` and of
``requests.utils.requote_uri``.

An inbox's query or userinfo may be a credential: what is logged, stored as an
error, sent with a signal or shown in the admin goes through :func:`redact`,
and an inbox's answer is kept with its target's :func:`credentials` replaced.
(A webhook destination's secrets are declared by its kind: see
``channels/``.)

Pure: no Django, no network; :func:`redact` and :func:`credentials` never
raise, as both run on URLs already refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import re
import reprlib
import unicodedata
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote, unquote_plus

import idna

from django_federation_delivery.exceptions import InvalidDelivery

__all__ = [
    "BINARY",
    "MAX_HOST_KEY_LENGTH",
    "MAX_HOST_LENGTH",
    "MAX_LABEL_LENGTH",
    "MAX_URL_LENGTH",
    "Parts",
    "UnusableURL",
    "control_or_space",
    "credentials",
    "delivery_key",
    "escaped",
    "host_of",
    "normalize_inbox",
    "origin",
    "quoted",
    "redact",
    "required_host",
    "scheme_and_host",
    "split",
    "validate_inbox",
]

MAX_URL_LENGTH = 2048
#: A DNS name, without its trailing dot (RFC 1035 with RFC 2181's reading).
MAX_HOST_LENGTH = 253
#: A host key (see :attr:`Parts.host_key`): what a delivery's ``host`` column holds.
MAX_HOST_KEY_LENGTH = 255
MAX_LABEL_LENGTH = 63
DEFAULT_PORTS = {"http": 80, "https": 443}

# RFC 3986: what a path and a query may carry as they are; anything else is percent-encoded.
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PATH_SAFE = "!$&'()*+,;=:@/"
# An apostrophe in a query is percent-encoded, as a WHATWG URL (a browser's,
# Node's) writes it for http(s): a verifier that signs the URL it rebuilds so
# (Fedify on Node) finds the very target signed.
_QUERY_SAFE = _PATH_SAFE.replace("'", "") + "?"
_ESCAPE = re.compile(r"(%[0-9A-Fa-f]{2})")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_PORT = re.compile(r"[0-9]{1,5}")
_ASCII_LABEL = re.compile(r"[a-z0-9_-]+")
# A URL already in canonical form, as nearly every inbox is: a lowercase ASCII
# DNS name, a port that is not the default, a path and a query of characters
# that need no encoding, no fragment. What else split() would change (a dot
# segment, an A-label, an IPv4 address not written as the dotted quad) is
# checked beside it.
_CANONICAL = re.compile(
    r"(https?)://((?:[a-z0-9_-]{1,63}\.)*[a-z0-9_-]{1,63})(?::([1-9][0-9]{0,4}))?"
    r"(/[A-Za-z0-9._~!$&'()*+,;=:@/-]*)(?:\?([A-Za-z0-9._~!$&()*+,;=:@/?-]+))?"
)
_DOT_SEGMENT = re.compile(r"/\.\.?(?:/|$)")
# An IPv4 address as split() writes it: four decimal numbers to 255, no leading zero.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = re.compile(rf"(?:{_OCTET}\.){{3}}{_OCTET}")


class UnusableURL(InvalidDelivery):
    """A URL refused, with what may be shown of it and why."""

    def __init__(self, url: object, reason: str, *, what: str = "URL") -> None:
        #: The URL as a message may show it (see :func:`redact`); "" when not a string.
        self.redacted = redact(url) if isinstance(url, str) else ""
        self.reason = reason
        shown = f" '{self.redacted}'" if isinstance(url, str) else ""
        super().__init__(f"{what}{shown} {reason}")


@dataclasses.dataclass(frozen=True)
class Parts:
    """A URL in canonical form, split."""

    scheme: str
    #: IDNA-encoded and lowercased, no trailing dot; an IPv6 address without brackets.
    host: str
    #: None for the scheme's default port.
    port: int | None
    #: Percent-encoded once, "/" at least.
    path: str
    #: Percent-encoded once, "" when there is none.
    query: str

    @property
    def hostport(self) -> str:
        """The ``Host`` header's value: the host, bracketed if IPv6, and a non-default port."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    @property
    def host_key(self) -> str:
        """The server a delivery to this URL goes to, as breakers, pauses,
        limits and a host's picture know it: the host and the port it is
        reached on, but for 443, HTTPS's, where inboxes are
        (``example.com``, ``example.com:80`` for ``http://example.com/``,
        ``example.com:8443``, ``[::1]:8080``). Another port is another
        server, perhaps a stranger's: an inbox named on a dead port of a
        host counts against that port, never against the host's own server.
        ``http://example.com:443/`` is ``example.com``: the same socket."""
        return host_key(self.host, self.port or DEFAULT_PORTS[self.scheme])

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.hostport}"

    @property
    def target(self) -> str:
        """What the request line carries: the path and the query."""
        return f"{self.path}?{self.query}" if self.query else self.path

    @property
    def url(self) -> str:
        return self.origin + self.target


def normalize_inbox(url: object) -> str:
    """``url`` in its canonical form, or :class:`UnusableURL` (an ``InvalidDelivery``)
    naming it, redacted, and the reason.

    Control characters and whitespace are refused, not stripped; the scheme must be
    http or https; userinfo is refused; the host is IDNA-encoded (UTS #46),
    lowercased, its trailing dot dropped; IP literals are normalised; a default
    port is dropped; path and query are percent-encoded exactly once, with dot
    segments resolved; the fragment is dropped.
    """
    try:
        return split(url).url
    except UnusableURL as exc:
        raise UnusableURL(url, exc.reason, what="inbox") from None


def validate_inbox(url: object) -> None:
    """Raise what :func:`normalize_inbox` would, for an inbox a host project stores."""
    normalize_inbox(url)


#: The port a host key leaves out: HTTPS's.
KEYLESS_PORT = 443


def host_key(host: str, port: int) -> str:
    """The key of ``host`` (canonical, an IPv6 address without brackets)
    reached on ``port``: see :attr:`Parts.host_key`."""
    if port == KEYLESS_PORT:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_prefixes(key: str) -> list[str]:
    """How a canonical URL on the host keyed ``key`` begins, over HTTPS and
    over HTTP: the inverse of :func:`host_key` (``x`` is https on 443,
    ``x:80`` http on 80; an IPv6 address, bare in a key on 443, is
    bracketed in a URL)."""
    address, colon, port = key.rpartition(":")
    if not colon or (":" in address and not address.endswith("]")):
        # No port: a host name holds no colon, a bare IPv6 address's are its own.
        address, port = key, ""
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    if not port:
        return [f"https://{address}/", f"http://{address}:{KEYLESS_PORT}/"]
    if port == "80":
        return [f"http://{address}/", f"https://{address}:80/"]
    return [f"https://{address}:{port}/", f"http://{address}:{port}/"]


def host_of(url: str) -> str:
    """The host key of ``url`` (:attr:`Parts.host_key`: its canonical host,
    and its port but for 443), or "" for a URL that has none."""
    try:
        return split(url, userinfo=True).host_key
    except UnusableURL:
        return ""


def host_named(value: object) -> str:
    """The canonical host key ``value`` names: a host name in any form
    (``Bücher.example.`` is ``xn--bcher-kva.example``), with a port that is
    not the default (``example.com:8443``), or a URL on it; a
    name that has no canonical form (a destination's ``<ops>``) as it is;
    "" for a blank value, a URL on no host, or text no name holds (a
    control character, or more than a host's 253 characters)."""
    canonical, text = _host_named(value)
    kept = text.isprintable() and len(text) <= MAX_HOST_LENGTH
    return canonical or (text if kept else "")


def _host_named(value: object) -> tuple[str, str]:
    """The canonical host ``value`` names ("" if none), and its text if
    it may be a name that has no canonical form ("" for a URL)."""
    text = value.strip() if isinstance(value, str) else ""
    if "://" in text:
        return host_of(text), ""  # a control character in its host is refused there
    if not text:
        return "", text
    name = text
    if ":" in text and not text.startswith("["):
        # An IPv6 address, bare ("2001:DB8::1"), in the brackets a URL needs.
        with contextlib.suppress(ValueError):
            name = f"[{ipaddress.IPv6Address(text)}]"
    return host_of(f"https://{name}/"), text


def required_host(value: object, caller: str) -> str:
    """:func:`host_named`'s canonical host, or a webhook destination's key
    (``<ops>``); else a ``ValueError`` saying that ``caller`` needs one,
    and naming ``value`` as :func:`quoted` shows it: a name no inbox's host
    can have (``example.com:99999``, ``exa mple.com``) names nothing to act on."""
    canonical, text = _host_named(value)
    if canonical:
        return canonical
    if text.startswith("<") and text.endswith(">") and is_destination_name(text[1:-1]):
        return text
    raise ValueError(f"{caller} needs a host name or a URL on one, not {quoted(value)}")


#: What may name a webhook destination: 1 to 64 lowercase letters, digits,
#: "_" or "-", the first a letter or a digit.
_DESTINATION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def is_destination_name(name: object) -> bool:
    """Whether ``name`` can name a webhook destination (see _DESTINATION_NAME)."""
    return isinstance(name, str) and _DESTINATION_NAME.fullmatch(name) is not None


def delivery_key(name: str) -> str:
    """The ``host`` of a delivery to webhook destination ``name``: what
    slots, breakers and pauses go by. The name in angle brackets, ``<ops>``,
    which no inbox's host can be (a DNS name carries neither), so that no
    stranger's inbox shares a destination's breaker. Written, never read
    back: a delivery's ``kind`` and ``destination`` say what it is."""
    return f"<{name}>"


def origin(url: object) -> str:
    """``scheme://host[:port]``, canonical, so that two spellings of one server compare equal.

    Userinfo, path, query and fragment are left out, whatever they are.
    """
    return split(url, userinfo=True).origin


def split(url: object, *, userinfo: bool = False) -> Parts:
    """``url`` parsed into its canonical parts, or :class:`UnusableURL`.

    With ``userinfo``, a user and password are dropped rather than refused.
    """
    if not isinstance(url, str):
        raise UnusableURL(url, f"is not a string but {type(url).__name__}")
    return _split(url, userinfo)


#: URLs split lately, with their parts: an attempt splits its inbox three
#: times (for the URL it sends, for the signature's target, for the transport's
#: check), in any of the worker threads. Parts are immutable, and a URL refused
#: is not kept. At most some 4 MB, with every URL of the longest allowed.
SPLIT_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=SPLIT_CACHE_SIZE)
def _split(url: str, userinfo: bool) -> Parts:
    if not url:
        raise UnusableURL(url, "is empty")
    if len(url) > MAX_URL_LENGTH:
        raise UnusableURL(url, f"is longer than {MAX_URL_LENGTH} characters")
    parts = _already_canonical(url)
    if parts is not None:
        return parts
    # Before parsing: urlsplit and requests strip some of them silently, so that
    # "/in\r\nX: 1" would be queued as another URL.
    char = control_or_space(url)
    if char is not None:
        raise UnusableURL(url, f"has a control or whitespace character (U+{ord(char):04X})")
    scheme_match = _SCHEME.match(url)
    rest = url[scheme_match.end() :] if scheme_match else ""
    if scheme_match is None or not rest.startswith("//"):
        raise UnusableURL(url, "is not an absolute http(s) URL")
    scheme = scheme_match.group(1).lower()
    if scheme not in DEFAULT_PORTS:
        raise UnusableURL(url, f"has scheme {scheme[:20]!r}, not http or https")
    rest = rest[2:]
    end = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter)
        if found != -1:
            end = min(end, found)
    authority, rest = rest[:end], rest[end:]
    if "@" in authority:
        if not userinfo:
            raise UnusableURL(url, "carries a user or password")
        authority = authority.rpartition("@")[2]
    host, port = _host_and_port(url, authority, scheme)
    rest = rest.partition("#")[0]
    path, question, query = rest.partition("?")
    path = _without_dot_segments(encode(path or "/", _PATH_SAFE))
    query = encode(query, _QUERY_SAFE) if question else ""
    parts = Parts(scheme=scheme, host=host, port=port, path=path, query=query)
    if len(parts.url) > MAX_URL_LENGTH:
        raise UnusableURL(url, f"is longer than {MAX_URL_LENGTH} characters once encoded")
    if len(parts.host_key) > MAX_HOST_KEY_LENGTH:
        raise UnusableURL(url, f"has a host and port longer than {MAX_HOST_KEY_LENGTH} characters")
    return parts


def canonical_and_host(url: object) -> tuple[str, str]:
    """``split(url)``'s URL and host key, or the :class:`UnusableURL` it raises: what a
    send keeps of each inbox, read off a URL already canonical without splitting it."""
    if isinstance(url, str) and len(url) <= MAX_URL_LENGTH:
        matched = _canonical_match(url)
        if matched is not None:
            scheme, host, port = matched.group(1, 2, 3)
            return url, host_key(host, int(port) if port else DEFAULT_PORTS[scheme])
    parts = split(url)
    return parts.url, parts.host_key


def _already_canonical(url: str) -> Parts | None:
    """``url``'s parts when it is in canonical form already, which the steps of
    :func:`split` would each leave as it is; None when it may not be.

    A send splits every inbox of a fan-out: this takes a few microseconds, the
    whole way some tens.
    """
    matched = _canonical_match(url)
    if matched is None:
        return None
    scheme, host, port, path, query = matched.groups()
    return Parts(
        scheme=scheme,
        host=host,
        port=None if port is None else int(port),
        path=path,
        query=query or "",
    )


def _canonical_match(url: str) -> re.Match[str] | None:
    matched = _CANONICAL.fullmatch(url)
    if matched is None:
        return None
    scheme, host, port, path, _ = matched.groups()
    if (
        len(host) > MAX_HOST_LENGTH
        or len(host) + 6 > MAX_HOST_KEY_LENGTH  # with a port: the whole way says whether it fits
        # An A-label is checked by IDNA; a last label starting with a digit
        # may make the host an IPv4 address, written another way than the
        # dotted quad.
        or "xn--" in host
        or (host.rpartition(".")[2][0].isdigit() and not _DOTTED_QUAD.fullmatch(host))
        or _DOT_SEGMENT.search(path)
        # Past 65535, or the scheme's own: refused, or left out.
        or (port is not None and (int(port) > 65535 or int(port) == DEFAULT_PORTS[scheme]))
    ):
        return None
    return matched


def encode(text: str, safe: str) -> str:
    """``text`` percent-encoded exactly once: valid escapes kept (uppercase hex, and
    decoded when they stand for an unreserved character, as RFC 3986 section 6.2.2
    and ``requests`` do), a stray "%" encoded, and anything else a URL may not
    carry there encoded as UTF-8."""
    pieces = []
    for piece in _ESCAPE.split(text):
        if _ESCAPE.fullmatch(piece):
            char = chr(int(piece[1:], 16))
            pieces.append(char if char in _UNRESERVED else piece.upper())
        elif piece:
            pieces.append(quote(piece, safe=safe))
    return "".join(pieces)


def encode_path(text: str) -> str:
    return encode(text, _PATH_SAFE)


def encode_query(text: str) -> str:
    return encode(text, _QUERY_SAFE)


def control_or_space(text: str) -> str | None:
    """The first character of ``text`` no URL may hold as it is: C0, DEL,
    C1, a lone surrogate, or any kind of whitespace; None if there is none
    (plain ASCII is read as such at once)."""
    if text.isascii() and text.isprintable() and " " not in text:
        return None
    for char in text:
        if char.isspace() or unicodedata.category(char) in ("Cc", "Cs", "Zs", "Zl", "Zp"):
            return char
    return None


def _host_and_port(url: str, authority: str, scheme: str) -> tuple[str, int | None]:
    if authority.startswith("["):
        literal, bracket, after = authority[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise UnusableURL(url, "has an unterminated or malformed IPv6 address")
        host = _ipv6(url, literal)
    else:
        name, colon, port_text = authority.partition(":")
        host = _name_or_ipv4(url, name)
        after = colon + port_text
    port = _port(url, after[1:]) if after else None
    return host, None if port == DEFAULT_PORTS[scheme] else port


def _port(url: str, text: str) -> int:
    if not _PORT.fullmatch(text):
        raise UnusableURL(url, "has a port that is not a number from 1 to 65535")
    port = int(text)
    if not 1 <= port <= 65535:
        raise UnusableURL(url, f"has port {port}, not from 1 to 65535")
    return port


def _ipv6(url: str, literal: str) -> str:
    # No zone ("%25eth0"): it names an interface of this machine, not a destination.
    if "%" in literal:
        raise UnusableURL(url, "has an IPv6 address with a zone")
    try:
        address = ipaddress.IPv6Address(literal)
    except ValueError:
        raise UnusableURL(url, "has an invalid IPv6 address") from None
    if address.ipv4_mapped is not None:
        # In hexadecimal groups, as a WHATWG URL writes it (a verifier that
        # rebuilds the URL so, Fedify on Node, signs that target), spelt here
        # rather than by the interpreter: Python 3.13 writes RFC 5952's mixed
        # notation and older ones do not, and the canonical form must not
        # depend on which Python queued it.
        mapped = int(address.ipv4_mapped)
        return f"::ffff:{mapped >> 16:x}:{mapped & 0xFFFF:x}"
    return address.compressed


def _name_or_ipv4(url: str, text: str) -> str:
    if not text:
        raise UnusableURL(url, "has no host")
    if "%" in text:
        raise UnusableURL(url, "has a percent-encoded host")
    if not text.isascii():
        try:
            text = idna.uts46_remap(text, std3_rules=False, transitional=False)
        except (idna.IDNAError, UnicodeError, ValueError):
            raise UnusableURL(url, "has a host that is not a valid IDNA name") from None
    text = text.lower()
    if text.endswith("."):
        text = text[:-1]
    labels = text.split(".")
    # As browsers read it, a host ending in a number is an IPv4 address, which
    # resolvers also take in forms such as "127.1" or "0x7f.1": only the dotted
    # quad is accepted, so that one address has one spelling.
    if re.fullmatch(r"[0-9]+|0x[0-9a-f]*", labels[-1]):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise UnusableURL(
                url, "has a host ending in a number that is not a dotted-quad IPv4 address"
            ) from None
    return _dns_name(url, labels)


def _dns_name(url: str, labels: list[str]) -> str:
    encoded = []
    for label in labels:
        if not label:
            raise UnusableURL(url, "has a host with an empty label")
        if label.isascii() and not label.startswith("xn--"):
            if not _ASCII_LABEL.fullmatch(label):
                raise UnusableURL(url, "has a host with a character a DNS name cannot carry")
        else:
            try:
                label = idna.alabel(label).decode("ascii")
            except (idna.IDNAError, UnicodeError, ValueError):
                raise UnusableURL(url, "has a host that is not a valid IDNA name") from None
        if len(label) > MAX_LABEL_LENGTH:
            raise UnusableURL(
                url, f"has a host with a label longer than {MAX_LABEL_LENGTH} characters"
            )
        encoded.append(label)
    host = ".".join(encoded)
    if len(host) > MAX_HOST_LENGTH:
        raise UnusableURL(url, f"has a host longer than {MAX_HOST_LENGTH} characters")
    return host


def _without_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, as urllib3 applies it before sending: "/a/../b" is "/b"."""
    if "." not in path:
        return path
    segments = path.split("/")[1:]
    kept: list[str] = []
    for position, segment in enumerate(segments):
        last = position == len(segments) - 1
        if segment == "..":
            if kept:
                kept.pop()
            if last:
                kept.append("")
        elif segment == ".":
            if last:
                kept.append("")
        else:
            kept.append(segment)
    return "/" + "/".join(kept)


# What a message may show of a URL, and what of it no message may hold.

#: What a URL's userinfo comes after: what a pasted link may begin with
#: (spaces, "<", a quote), its scheme, and its slashes: any number of them,
#: backslashes too, as a WHATWG parser (a browser's, Node's) reads an http(s)
#: URL, where "https:/user:pass@host/" has the userinfo "user:pass".
_BEFORE_USERINFO = re.compile(r"[\s<\"'(\[]*(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):)?[/\\]*")


def _userinfo(text: str) -> tuple[int, int] | None:
    """Where the userinfo of the URL ``text`` is, its "@" included: up to the
    last "@" before the path; or, where what comes before the first "/" is
    no host and port (a password holding an unencoded "/" makes "user:pass"
    of it), up to the last "@" of the segment of the first "@" after it.
    None when it has none. A portable inbox (``ap://``), whose authority is a
    DID, colons and all, is never read the second way. Read in one pass,
    whatever the text: a URL a stranger chose may be built to make a pattern
    try every way to split it."""
    before = _BEFORE_USERINFO.match(text)
    start = before.end() if before else 0
    slash = text.find("/", start)
    authority_end = len(text) if slash == -1 else slash
    at = text.rfind("@", start, authority_end)
    if at != -1:
        return start, at + 1
    if slash == -1 or text.startswith("[", start):
        return None
    if before is not None and (before.group("scheme") or "").lower() == "ap":
        return None
    # What comes before a query or a fragment ("host:8443?next=/@a",
    # "host?token=a:b/@c"): a password may hold a "?", a host never does.
    head = re.split(r"[?#]", text[start:slash], maxsplit=1)[0]
    _, colon, port = head.partition(":")
    if not colon or not port or (port.isascii() and port.isdigit()):
        return None  # a host, and its port if any
    at = text.find("@", slash)
    if at == -1:
        return None
    path = text.find("/", at)
    return start, text.rfind("@", at, len(text) if path == -1 else path) + 1


def _without_userinfo(text: str, instead: str = "") -> str:
    """``text`` with its userinfo (and its "@") taken out, or put ``instead``."""
    found = _userinfo(text)
    if found is None:
        return text
    start, end = found
    return f"{text[:start]}{instead}{text[end:]}"


_ORIGIN_ONLY = re.compile(
    r"^(?P<scheme>(?:[A-Za-z][A-Za-z0-9+.-]*:)?(?://|[/\\]+)?)(?P<authority>[^/\\?#]*)"
)
#: A URL with its scheme, however many slashes follow it ("https:/a@b/",
#: "https:\\\\a@b/"): read as one by a browser, its userinfo and all.
_SCHEME_AND_SLASH = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[/\\]")
#: The schemes a browser reads as a URL's whatever follows their colon
#: ("https:host/x" is https://host/x).
_SPECIAL_SCHEMES = frozenset({"http", "https", "ws", "wss", "ftp", "file"})


def _url_like(value: str) -> bool:
    """Whether a message should take ``value`` for a URL: with "://", a
    scheme and a slash, a scheme a browser reads as a URL's whatever
    follows, or, in one word, any scheme before a user and a password
    ("telegram:bot:TOKEN@chat", not "order:created@v1"); pasted after what
    a link may begin with (spaces, "<", a quote, a bracket), as
    ``_BEFORE_USERINFO`` reads it."""
    # A line's end copied with it (from a .env file) is no space within.
    text = _PASTED_BEFORE.sub("", value, count=1).rstrip()
    if "://" in text or _SCHEME_AND_SLASH.match(text):
        return True
    scheme = _SCHEME.match(text)
    if scheme is None:
        return False
    if scheme[1].lower() in _SPECIAL_SCHEMES:
        return True
    if _SPACE.search(text):
        return False
    found = _userinfo(text)
    if found is None:
        # A host and a path, its slashes lost ("ntfy:ntfy/TOPIC",
        # "ntfy+http:localhost:8080/TOPIC": the path is the secret).
        authority = re.split(r"[/\\?#]", text[scheme.end() :], maxsplit=1)[0]
        return text[scheme.end() + len(authority) :][:1] in ("/", "\\") and _is_host(authority)
    # A user and a password; or a user alone (a token) before a host with a
    # dot or a port, or any host before a path ("ntfy:tk_TOKEN@ntfy.sh",
    # "ntfy:tk_TOKEN@localhost:8080", "ntfy:tk_TOKEN@localhost/alerts"; not
    # "order:created@v1", nor "order:created@v1.2", which is no host).
    if ":" in text[found[0] : found[1]]:
        return True
    rest = text[found[1] :]
    authority = re.split(r"[/\\?#]", rest, maxsplit=1)[0]
    path = rest[len(authority) : len(authority) + 1] in ("/", "\\")
    return ("." in authority or ":" in authority or path) and _is_host(authority)


def scheme_and_host(url: str) -> str:
    """A secret's URL (a webhook's) as its ``repr`` shows it: its scheme and
    its host as written (``'slack://hooks.slack.com/…'``), however many
    slashes follow the scheme, without userinfo; its scheme alone when what
    comes where the host goes is no host and port (a bot's token,
    ``telegram://123:TOKEN``); "…" with no scheme."""
    scheme = _SCHEME.match(url)
    if scheme is None:
        return "…"
    rest = url[scheme.end() :].lstrip("/\\")
    authority = re.split(r"[/\\?#]", rest, maxsplit=1)[0].rpartition("@")[2]
    host = authority if authority and _is_host(authority) else ""
    return f"{scheme[1]}://{host}/…" if host else f"{scheme[1]}:…"


def _is_host(authority: str) -> bool:
    """Whether ``authority``, what a URL has between its scheme and its path
    (its userinfo taken out), is a host and a port, the port perhaps out of
    range (shown, to be seen wrong): not a bot's token."""
    host, colon, port = authority.rpartition(":")
    if colon and port.isdigit() and not host.endswith(":"):
        authority = host
    return bool(host_of(f"https://{authority}/"))


#: A scheme, then a bot's token (digits, "bot" before them or not, a colon,
#: 16 or more of a token's characters: "telegram:123:TOKEN"), as no name,
#: event type, time or IPv6 address is.
_TOKEN_AFTER_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(?:bot)?[0-9]+:[A-Za-z0-9_-]{16}")
#: A bot's token alone, at the start.
_BOT_TOKEN = re.compile(r"(?:bot)?[0-9]+:[A-Za-z0-9_-]{16}")
#: A token: 16 or more of a token's characters, no dot.
_TOKEN = r"[A-Za-z0-9_-]{16,}"
#: A token before a host (a name, an IPv4 or a bracketed IPv6 address, a
#: port), with no path: "syt_…@matrix.example".
_TOKEN_BEFORE_HOST = re.compile(
    r"(?P<token>" + _TOKEN + r")@(?P<host>(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]+)?)"
)
#: What a pasted link may end with: a line's end, a closing quote or bracket.
_PASTED_AFTER = " \t\r\n\"'>)"


def quoted_name(value: object) -> str:
    """A webhook destination's name someone gave, quoted as :func:`quoted`
    quotes a value, but for what a service's credential pasted in its place
    looks like and no name does: a bot's token (alone or before its chat),
    a token before its host (its host alone shown), a token alone (digits
    among 16 or more of a token's characters, and no name), a hook's path."""
    if isinstance(value, str):
        pasted = _PASTED_BEFORE.sub("", value, count=1).rstrip(_PASTED_AFTER)
        if pasted.endswith("]") and "@[" not in pasted:
            pasted = pasted[:-1]
        if _BOT_TOKEN.match(pasted) or (_looks_like_a_token(pasted)):
            return repr("…")
        if (found := _TOKEN_BEFORE_HOST.fullmatch(pasted)) is not None and _looks_like_a_token(
            found["token"]
        ):
            return repr(f"{found['host']}/…")
        head, slash, _ = pasted.partition("/")
        if slash and not re.search(r"[.:@]", head):
            # A hook's path alone ("T0…/B0…/token", "<id>/<token>"): no name
            # has a slash, and no host or scheme comes before it.
            return repr("…")
    return quoted(value)


def _looks_like_a_token(text: str) -> bool:
    """Whether ``text`` is a run of a token's characters, a digit or an
    underscore among them, that no name is, whatever its case: each word
    of "Prod_Alerts_EU_1" is cased as a word, a token's letters at random."""
    if not re.fullmatch(_TOKEN, text) or not re.search(r"[0-9_]", text):
        return False
    # A name typed in capitals is named.
    return not (
        is_destination_name(text.lower())
        and all(
            word.islower() or word.isupper() or word.istitle() or word.isdigit()
            for word in re.split(r"[_-]", text)
            if word
        )
    )


#: What a pasted link may begin with, as ``_BEFORE_USERINFO`` skips it.
_PASTED_BEFORE = re.compile(r"^[\s<\"'(\[]*")
_SPACE = re.compile(r"\s")


_MESSAGE_URL_LENGTH = 200
# A part of a query or userinfo shorter than this ("a=1") is not worth hiding on its own.
_PART_LENGTH = 4


def redact(url: str, *, whole_path: bool = False, longest: int = _MESSAGE_URL_LENGTH) -> str:
    """The URL as a message may show it: no userinfo, query or fragment, one printable
    line, at most ``longest`` characters. With ``whole_path``, only
    ``scheme://host[:port]`` (for a URL whose path is itself the credential).
    Never raises."""
    text = str(url)
    # Up to the last "@" before the path, "//" or not ("http:user:pw@host"), even when
    # a "?" comes first: a password may hold one.
    text = _without_userinfo(text)
    if whole_path:
        matched = _ORIGIN_ONLY.match(text)
        text = matched.group(0) if matched else ""
    else:
        text = re.split(r"[?#]", text, maxsplit=1)[0]
    text = text[: longest + 1]
    # Escaped as repr() escapes: one line, and nothing that prints as something else.
    text = repr(text)[1:-1]
    if len(text) > longest:
        text = text[: longest - 3] + "..."
    return text


def escaped(value: object) -> str:
    """``value`` as text safe to print, log or show on a page: any character
    that is not printable (an escape sequence, a bell, a line break, a bidi
    override) written as its escape (``\\x1b``), never acted on by a
    terminal nor read as something else."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


#: The most of a name an error repeats.
MOST_SHOWN = 80

#: Binary data, which iterates as its bytes' numbers: given where a list of
#: URLs or of names goes, it is one of them taken for the list, and refused.
BINARY = bytes | bytearray | memoryview


def quoted(value: object, *, path: bool = False) -> str:
    """A value someone gave, quoted as an error repeats it, escaped and cut.
    A URL (a webhook's, pasted where its name goes, whose path or query may
    be the credential) as its scheme and host only, or its host only when
    pasted without its scheme; with ``path``, for a URL public by nature
    (an actor's, an ``ap://`` inbox), its path too, without userinfo, query
    or fragment, and so is each URL of a row of them (a tuple or list, a
    dict, bytes: what a query gives where URLs were meant). A value that is
    not text as its short repr (one that raises is named by its type and
    address, as reprlib does), or as its type's name alone when that holds
    a URL."""
    if not isinstance(value, str):
        public = _public(value, _SHORT.maxlevel) if path else _NOT_PUBLIC
        if public is not _NOT_PUBLIC:
            return _SHORT.repr(public)
        text = _SHORT.repr(value)
        return f"<{type(value).__name__}>" if "://" in text else text
    shown = value
    url = _url_like(value)
    if url and path:
        shown = _with_path(value)
    elif url:
        matched = _ORIGIN_ONLY.match(_without_userinfo(_PASTED_BEFORE.sub("", value, count=1)))
        kept = matched.group(0) if matched else ""
        if matched and matched["authority"] and not _is_host(matched["authority"]):
            # What comes where the host goes is no host and port (a bot's
            # token, "telegram://123:TOKEN"): the scheme alone.
            kept = matched["scheme"]
        if kept != value:
            shown = f"{kept}…" if kept.endswith("/") else f"{kept}/…"
    elif not path and _TOKEN_AFTER_SCHEME.match(pasted := _PASTED_BEFORE.sub("", value, count=1)):
        # A bot's token after its scheme, no chat nor slashes ("telegram:123:TOKEN").
        shown = f"{pasted.partition(':')[0]}:…"
    elif not path:
        host, slash, _ = value.partition("/")
        if slash and ("." in host or ("@" in host and _is_host(host.rpartition("@")[2]))):
            # "hooks.slack.com/services/…", "tk_TOKEN@localhost:8080/alerts":
            # no name or host has a dotted part, nor a user, before a slash
            # but a URL without its scheme; its userinfo out.
            shown = f"{_without_userinfo(host)}/…"
    # repr() escapes what a terminal would act on, as escaped() does.
    return repr(shown if len(shown) <= MOST_SHOWN else f"{shown[:MOST_SHOWN]}…")


def _with_path(url: str, cut: str = "…") -> str:
    """A public URL as a message shows it: without userinfo, query or
    fragment, each marked ``cut`` where it was."""
    # A password taken out is marked where it was; a query or fragment cut.
    shown = _without_userinfo(url, f"{cut}@")
    kept = re.split(r"[?#]", shown, maxsplit=1)[0]
    return kept if kept == shown else f"{kept}{cut}"


#: What :func:`_public` makes of a value it cannot tell holds public URLs only.
_NOT_PUBLIC = object()


def _public(value: object, level: int) -> object:
    """``value``, a row of public URLs, with each URL as :func:`_with_path`
    shows it, to the depth the short repr shows (``level``), and only the
    items it shows: a tuple or list, a dict, text and bytes, numbers and
    None. :data:`_NOT_PUBLIC` when it holds anything else, which may hold a
    URL where no one can tell it is public."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return _with_path(value) if "://" in value else value
    if isinstance(value, bytes):
        # Bytes hold no "…"; latin-1 gives every byte back as it was.
        text = value.decode("latin-1")
        return _with_path(text, "...").encode("latin-1") if "://" in text else value
    if isinstance(value, tuple | list | dict) and level <= 0:
        return value  # shown as "(...)", its items not at all
    if isinstance(value, tuple | list):
        items = [_public(item, level - 1) for item in value[: _SHORT.maxlist + 1]]
        if any(item is _NOT_PUBLIC for item in items):
            return _NOT_PUBLIC
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        pairs = [
            (_public(key, level - 1), _public(item, level - 1))
            for key, item in itertools.islice(value.items(), _SHORT.maxdict + 1)
        ]
        if any(key is _NOT_PUBLIC or item is _NOT_PUBLIC for key, item in pairs):
            return _NOT_PUBLIC
        return dict(pairs)
    return _NOT_PUBLIC


#: How a value that is not text is shown: a few items, each short.
class _Short(reprlib.Repr):
    """reprlib's short repr, which writes out an int of more digits than
    Python will (sys.int_info) as its size instead of raising."""

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:
            return f"<int of {x.bit_length()} bits>"


_SHORT = _Short()
_SHORT.maxlevel = 2
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 4
_SHORT.maxstring = _SHORT.maxother = MOST_SHOWN


#: The shortest start of a secret taken out of the end of a text.
_PARTIAL_LENGTH = 4


def replace_secrets(text: str, secrets: Sequence[str], marker: str = "[redacted]") -> str:
    """``text`` with each of ``secrets`` (longest first) replaced by ``marker``,
    and the start of one that ends it too: a text cut short (an answer read to
    ``MAX_ANSWER_BYTES``) may end in half a secret, no longer whole to find."""
    for secret in secrets:
        text = text.replace(secret, marker)
    for secret in secrets:
        for length in range(min(len(secret) - 1, len(text)), _PARTIAL_LENGTH - 1, -1):
            if text.endswith(secret[:length]):
                return text[:-length] + marker
    return text


def credentials(url: str) -> list[str]:
    """What of ``url`` no message may hold: its userinfo and query, whole and in parts
    (user, password, each parameter and its value), as written and decoded; longest
    first, so that replacing them in turn leaves no piece of a longer one."""
    text = str(url)
    found: set[str] = set()
    place = _userinfo(text)
    if place:
        start, end = place
        userinfo = text[start : end - 1]
        found.add(userinfo)
        found.update(piece for piece in userinfo.split(":") if len(piece) >= _PART_LENGTH)
        text = text[end:]
    query = text.partition("#")[0].partition("?")[2]
    if query:
        found.add(query)
        for parameter in re.split(r"[&;]", query):
            value = parameter.partition("=")[2]
            found.update(part for part in (parameter, value) if len(part) >= _PART_LENGTH)
    return secret_forms(found)


def secret_forms(secrets: Iterable[str]) -> list[str]:
    """Each of ``secrets`` as a text may hold it (none empty): as written,
    decoded (``+`` read as a space too, as a form's parser reads it),
    percent-encoded whole, and with its ``/`` escaped as JSON may write it;
    longest first, so that replacing them in turn leaves no piece of a
    longer one (a whole path goes before the token in it). A server that
    repeats a URL it was sent repeats it in any of these."""
    found = {
        form
        for secret in secrets
        for text in (secret, unquote(secret), unquote_plus(secret))
        for form in (text, quote(text, safe=""), text.replace("/", "\\/"))
        if form
    }
    return sorted(found, key=lambda secret: (-len(secret), secret))
