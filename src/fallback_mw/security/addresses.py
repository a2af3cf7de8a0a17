"""The upstream address checks: the allowlist, and the link-local / metadata addresses refused
whatever it says (SPEC §3), at load and again at connect time."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_legacy_ipv4(host: str) -> bool:
    """An IPv4 address in a spelling other than four dotted decimals (octal `0177.0.0.1`,
    hex `0x7f.1`, integer `2130706433`, short `127.1`): resolvers read them as addresses,
    readers as names, so a configuration may not use them."""
    written = host.strip().lower()
    text = written.rstrip(".")
    if parse_ip(text) is None:
        return False
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return ":" not in text  # an IPv6 literal is fine
    # Four decimals and a trailing dot (`127.0.0.1.`): the address to URL parsers (WHATWG,
    # curl), a name to getaddrinfo, and aiohttp refuses the URL.
    return written != text


# The one list of addresses refused whatever the allowlist (load, store, proxies, and the
# engines' connect-time guard all come through `is_always_refused`). Cloud metadata and
# credential endpoints, as each vendor documents them:
_ALWAYS_REFUSED: Final = (
    # IPv4 link-local: the metadata service of AWS, Azure (IMDS), GCP, Oracle, DigitalOcean,
    # OpenStack, Hetzner, Akamai/Linode at 169.254.169.254, Tencent's 169.254.0.23, ECS task
    # credentials 169.254.170.2, EKS Pod Identity 169.254.170.23, Scaleway's 169.254.42.42.
    ipaddress.ip_network("169.254.0.0/16"),
    # IPv6 link-local: OpenStack's metadata over IPv6 is fe80::a9fe:a9fe.
    ipaddress.ip_network("fe80::/10"),
    # AWS IMDS over IPv6:
    # docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
    ipaddress.ip_network("fd00:ec2::254/128"),
    # AWS EKS Pod Identity Agent over IPv6 (hands out IAM credentials):
    # docs.aws.amazon.com/eks/latest/userguide/pod-id-agent-setup.html
    ipaddress.ip_network("fd00:ec2::23/128"),
    # GCP metadata server on IPv6-only VMs:
    # cloud.google.com/compute/docs/metadata/querying-metadata
    ipaddress.ip_network("fd20:ce::254/128"),
    # Azure WireServer (VM agent, extension settings and certificates; a public address
    # Microsoft owns): learn.microsoft.com/azure/virtual-network/what-is-ip-address-168-63-129-16
    ipaddress.ip_network("168.63.129.16/32"),
    # Alibaba Cloud metadata: alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata;
    # over IPv6 fd00:100::100:200 (cloud-init's AliYun datasource, canonical/cloud-init#6893).
    ipaddress.ip_network("100.100.100.200/32"),
    ipaddress.ip_network("fd00:100::100:200/128"),
    # Oracle Cloud: IMDS over IPv6 (IPv4: docs.oracle.com/iaas/Content/Compute/Tasks/
    # gettingmetadata.htm; IPv6: the OCI SDK's DEFAULT_METADATA_URL_BASE_IPV6, github.com/
    # oracle/oci-python-sdk, src/oci/auth/signers/instance_principals_security_token_signer.py),
    # and the metadata address of Oracle Cloud Classic / Cloud@Customer (docs.oracle.com/en/
    # cloud/cloud-at-customer/occ-get-started/retrieve-predefined-instance-metadata.html):
    ipaddress.ip_network("fd00:c1::a9fe:a9fe/128"),
    ipaddress.ip_network("192.0.0.192/32"),
    # Scaleway metadata over IPv6: docs.cloud-init.io/en/latest/reference/datasources/scaleway.html
    ipaddress.ip_network("fd00:42::42/128"),
    # Akamai / Linode metadata over IPv6 (IPv4 169.254.169.254):
    # docs.cloud-init.io/en/latest/reference/datasources/akamai.html
    ipaddress.ip_network("fd00:a9fe:a9fe::1/128"),
    ipaddress.ip_network("0.0.0.0/8"),  # "this network": connects to local services
    ipaddress.ip_network("::/128"),
    # Translation ranges whose IPv4 destination cannot be read off the address: local-use
    # NAT64 (RFC 8215, the prefix and its embedding are the operator's) and Teredo (the
    # client address is obfuscated). The well-known NAT64 prefix 64:ff9b::/96, 6to4 and
    # IPv4-mapped addresses are judged by the IPv4 address they carry (`_embedded_ipv4`).
    ipaddress.ip_network("64:ff9b:1::/48"),
    ipaddress.ip_network("2001::/32"),
)


class UnsafeUpstream(ValueError):
    """An upstream host or address the gateway refuses to contact."""


def parse_ip(host: str) -> IPAddress | None:
    """Parse an IP literal, including the legacy IPv4 forms a resolver accepts
    (decimal `2852039166`, hex `0xa9fea9fe`, octal and short dotted forms) and an IPv4
    literal with a trailing dot (`169.254.169.254.`, the address to URL parsers)."""
    text = host.strip().strip("[]")
    if text.endswith(".") and ":" not in text:
        text = text[:-1]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    lowered = text.lower()
    if lowered and all(c in "0123456789abcdefx." for c in lowered) and lowered[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(lowered))
        except OSError:
            return None
    return None


_EMBEDDING_PREFIXES: Final = frozenset(
    bytes.fromhex(prefix)
    for prefix in (
        "000000000000000000000000",  # ::a.b.c.d (IPv4-compatible)
        "0000000000000000ffff0000",  # ::ffff:0:a.b.c.d (IPv4-translated)
        "0064ff9b0000000000000000",  # 64:ff9b::a.b.c.d (NAT64)
        "0064ff9b0001000000000000",  # 64:ff9b:1::a.b.c.d (local-use NAT64)
    )
)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        # IPv4-compatible (::a.b.c.d), IPv4-translated (::ffff:0:a.b.c.d, RFC 2765) and
        # NAT64 (64:ff9b::/96, and 64:ff9b:1::/96 of the local-use 64:ff9b:1::/48, RFC
        # 8215) embed the address in the low bits. `::1` (loopback) and `::` are not
        # IPv4-compatible addresses (RFC 4291 §2.5.5.1): read as 0.0.0.1 / 0.0.0.0 they
        # would be refused as "this network".
        if address.is_loopback or address.is_unspecified:
            return None
        packed = address.packed
        if packed[:12] in _EMBEDDING_PREFIXES:
            return ipaddress.IPv4Address(packed[12:])
    return None


def carried_ipv4_network(
    network: ipaddress.IPv4Network | ipaddress.IPv6Network,
) -> ipaddress.IPv4Network | None:
    """The IPv4 network an IPv6 `allow_hosts` entry spells, when every address in it
    carries an IPv4 one (IPv4-mapped `::ffff:127.0.0.1`, NAT64 `64:ff9b::/96`, 6to4
    `2002:a00::/24`...): the allowlist judges such an address by the IPv4 address alone
    (`Allowlist.allows_address`), so the entry as written matches nothing. None for any
    other entry."""
    first = network.network_address
    carried = _embedded_ipv4(first)
    if not isinstance(first, ipaddress.IPv6Address) or carried is None:
        return None
    embedding = 16 if first.sixtofour is not None else 96
    if network.prefixlen < embedding:
        return None
    length = min(32, network.prefixlen - embedding)
    return ipaddress.IPv4Network((carried, length), strict=False)


def is_always_refused(address: IPAddress) -> bool:
    """Link-local and metadata addresses, in every spelling, whatever the allowlist says."""
    candidates: list[IPAddress] = [address]
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        candidates.append(embedded)
    for candidate in candidates:
        for network in _ALWAYS_REFUSED:
            if candidate.version == network.version and candidate in network:
                return True
        if candidate.is_link_local:
            return True
    return False


class Allowlist:
    """`allow_hosts`: exact host names and IP addresses / CIDR networks."""

    def __init__(self, entries: Sequence[str]) -> None:
        names: set[str] = set()
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            text = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            except ValueError:
                names.add(text.rstrip("."))
        self.names = frozenset(names)
        self.networks = tuple(networks)

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IPAddress, *, via_name: str | None = None) -> bool:
        """An address is allowed when an IP/CIDR entry covers it, or when it was reached
        through an allowlisted name and is a public address (a listed public name must
        not be turned into a door to loopback or private services by its DNS);
        `localhost` may reach loopback."""
        if is_always_refused(address):
            return False
        # An address that carries an IPv4 one (IPv4-mapped, NAT64 64:ff9b::/96, 6to4) is
        # judged by that IPv4 address alone: `::/0` must not open 127.0.0.1 or 10.0.0.0/8
        # through ::ffff:127.0.0.1 or 64:ff9b::a00:5.
        target: IPAddress = _embedded_ipv4(address) or address
        for network in self.networks:
            if target.version == network.version and target in network:
                return True
        if via_name is not None and self.allows_name(via_name):
            if via_name.lower().rstrip(".") == "localhost":
                return target.is_loopback
            return target.is_global
        return False


@lru_cache(maxsize=64)
def _allowlist(entries: tuple[str, ...]) -> Allowlist:
    return Allowlist(entries)


def _not_listed(host: str) -> UnsafeUpstream:
    return UnsafeUpstream(f"host {host!r} is not in allow_hosts: add it to [gateway] allow_hosts")


def check_upstream_host(host: str, allow_hosts: Sequence[str], *, resolve: bool = True) -> None:
    """Load-time / store-write check of an upstream host. Raises UnsafeUpstream."""
    allow = _allowlist(tuple(allow_hosts))
    literal = parse_ip(host)
    if literal is not None:
        if is_always_refused(literal):
            raise UnsafeUpstream(f"host {host!r} is a link-local / metadata address")
        if not allow.allows_address(literal) and not allow.allows_name(host):
            raise _not_listed(host)
        return
    if not allow.allows_name(host) and not allow.networks:
        raise _not_listed(host)
    if not resolve:
        if not allow.allows_name(host):
            raise _not_listed(host)
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        if allow.allows_name(host):
            return  # unresolvable now; the connect-time check still applies
        raise _not_listed(host) from None
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    for address in addresses:
        if is_always_refused(address):
            raise UnsafeUpstream(f"host {host!r} resolves to a link-local / metadata address")
    if not any(allow.allows_address(a, via_name=host) for a in addresses):
        if allow.allows_name(host):
            # Listed, but a listed name admits public addresses only: say so, and what
            # to add, rather than "not in allow_hosts" about a host that is. The addresses
            # are not named: a refusal also answers callers (503 config_error).
            raise UnsafeUpstream(
                f"host {host!r} is in allow_hosts, but resolves only to non-public "
                "(loopback, private or reserved) addresses, which a listed name does not "
                "admit; add the address or its network (CIDR) to allow_hosts"
            )
        raise _not_listed(host)


def check_connect_addresses(
    host: str, addresses: Sequence[str], allow_hosts: Sequence[str]
) -> list[str]:
    """Connect-time check: of the resolved addresses keep the allowed ones, in order.
    Raises UnsafeUpstream when none is left. With no allowlist at all (a client the Python
    API made without one, `make_client(engine)`; the config loader refuses an empty
    `allow_hosts`) every address is kept but the always-refused ones: the metadata guard
    holds whatever the allowlist, none included."""
    if not allow_hosts:
        kept = [
            text
            for text in addresses
            if not is_always_refused(ipaddress.ip_address(text.split("%", 1)[0]))
        ]
        if not kept:
            raise UnsafeUpstream(f"host {host!r} resolved only to link-local / metadata addresses")
        return kept
    allow = _allowlist(tuple(allow_hosts))
    kept = []
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if allow.allows_address(address, via_name=host) or (
            parse_ip(host) == address and allow.allows_name(host) and not is_always_refused(address)
        ):
            kept.append(text)
    if not kept:
        raise UnsafeUpstream(f"host {host!r} resolved only to addresses outside allow_hosts")
    return kept
