"""Which addresses a delivery may connect to: public unicast ones, and named networks."""

from __future__ import annotations

import ipaddress

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: The well-known NAT64 prefix (RFC 6052): DNS64 answers with the IPv4 address inside it.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: The local-use NAT64 prefix (RFC 8215): a network's own translators, never a public host.
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
#: Blocks no host of anyone else's is in, which some Pythons' ``is_global``
#: still calls global (the special-purpose registries they were released
#: with): IETF protocol assignments (192.0.0.0/24; global from 3.11 to 3.12
#: but for its first addresses, and 2001::/23, whose anycast and AS112
#: blocks newer ones call global and older ones do not), 6to4 (2002::/16,
#: global to Pythons before 3.13 and before the fixes of CVE-2024-4032, a
#: relay's address carrying any IPv4 one) and IPv6 documentation
#: (3fff::/20, RFC 9637). Never public, so that an address is judged alike
#: on every Python.
_NEVER_PUBLIC: tuple[IPNetwork, ...] = (
    ipaddress.IPv4Network("192.0.0.0/24"),
    ipaddress.IPv6Network("2001::/23"),
    ipaddress.IPv6Network("2002::/16"),
    ipaddress.IPv6Network("3fff::/20"),
)


def network(value: object) -> IPNetwork:
    """``value``, a network opened as ``ALLOWED_NETWORKS`` and a kind's
    ``Policy`` take one: text (``"127.0.0.0/8"``, host bits allowed) or a
    network already made. TypeError naming its type for anything else:
    ``ip_network()`` takes an int (True among them) or packed bytes as an
    address, and would open 0.0.0.1/32 for ``[True]`` or ``[1]``;
    ValueError for text that is no network."""
    if not isinstance(value, str | ipaddress.IPv4Network | ipaddress.IPv6Network):
        raise TypeError(type(value).__name__)
    return ipaddress.ip_network(value, strict=False)


def parse_ip(address: str) -> IPAddress | None:
    try:
        # getaddrinfo and getpeername may add an IPv6 zone ("fe80::1%eth0").
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one leads to, where the prefix says it does."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _is_public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip in _NAT64_LOCAL:
        return False
    embedded = _embedded_ipv4(ip)
    if embedded is not None and not _is_public(embedded):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        # ::ffff:0:0/96 is "private" as a block, but only says "this IPv4 address".
        return embedded is not None
    if ip in _NAT64:
        # Inside ::/8, "reserved"; but on an IPv6-only server it is how every IPv4-only
        # host is reached, so it is judged by the IPv4 address it carries, as above.
        return embedded is not None
    if any(ip in block for block in _NEVER_PUBLIC):
        return False
    return ip.is_global and not (
        ip.is_multicast
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_unspecified
        or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local)
    )


def is_public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public unicast address.

    Loopback, RFC 1918, link-local, CGNAT, unique-local, unspecified,
    multicast, reserved and documentation addresses are not; nor is an IPv6
    address that embeds one of those (IPv4-mapped, 6to4, Teredo, NAT64). A
    NAT64 address (``64:ff9b::/96``) is judged by the IPv4 address it embeds;
    the local-use NAT64 prefix ``64:ff9b:1::/48`` is never public. A string
    that is not an IP address is not.
    """
    ip = parse_ip(address)
    return ip is not None and _is_public(ip)


#: Where a server's own services listen: loopback, link-local, private
#: (RFC 1918), shared (CGNAT: a tailnet's, a cloud's own) and unique local
#: space, and the unspecified addresses, which reach this machine's own
#: listeners on Linux.
LOCAL_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(network)
    for network in (
        "0.0.0.0/8",
        "::/128",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "::1/128",
        "fe80::/10",
        "fc00::/7",
    )
)


#: The IPv6 blocks whose addresses carry an IPv4 one, which :func:`allowed` judges
#: too: IPv4-mapped, 6to4, Teredo and NAT64.
_CARRIERS: tuple[ipaddress.IPv6Network, ...] = (
    ipaddress.IPv6Network("::ffff:0:0/96"),
    ipaddress.IPv6Network("2002::/16"),
    ipaddress.IPv6Network("2001::/32"),
    _NAT64,
)


def _carried(network: IPNetwork) -> list[ipaddress.IPv4Network]:
    """The IPv4 addresses that the addresses of ``network`` carry, as networks."""
    if not isinstance(network, ipaddress.IPv6Network):
        return []
    found: list[ipaddress.IPv4Network] = []
    for block in _CARRIERS:
        if not network.overlaps(block):
            continue
        part = network if network.subnet_of(block) else block
        # Within one block the addresses carried are one range, from what its first
        # address carries to what its last one does (the other way round for Teredo,
        # which inverts them).
        first = _embedded_ipv4(part.network_address)
        last = _embedded_ipv4(part.broadcast_address)
        assert first is not None and last is not None, "both ends are in the block"
        found.extend(ipaddress.summarize_address_range(min(first, last), max(first, last)))
    return found


def opens_local(network: IPNetwork) -> bool:
    """Whether allowing ``network`` opens any of :data:`LOCAL_NETWORKS`.

    Directly, or through the IPv4 addresses its IPv6 addresses carry:
    :func:`allowed` lets through an address in ``network`` whatever it carries,
    so ``::ffff:127.0.0.0/104`` opens loopback as ``127.0.0.0/8`` does.
    """
    return any(
        opened.version == local.version and opened.overlaps(local)
        for opened in (network, *_carried(network))
        for local in LOCAL_NETWORKS
    )


def allowed(ip: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    if _is_public(ip):
        return True
    embedded = _embedded_ipv4(ip)
    return any(ip in net or (embedded is not None and embedded in net) for net in networks)
