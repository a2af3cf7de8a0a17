"""Whether a connection to a host lands on a socket serve listens on: what `serve` asks of
an upstream (`own_address.py`) and of an OTLP endpoint (`otel_env.py`) before it starts.
One answer for both: a name resolved with a bound, an IPv4-mapped IPv6 address taken as
the IPv4 address it connects to, this host's own addresses asked of the kernel."""

from __future__ import annotations

import ipaddress
import socket
import threading

from fallback_mw.cli.serve_options import listen_family
from fallback_mw.security.addresses import IPAddress, parse_ip

# How long a start waits for a host name's addresses (`resolved`).
RESOLVE_WITHIN = 2.0


def connects_to(text: str) -> IPAddress | None:
    """An IP literal as the address a connection goes to, in any spelling the resolver reads
    (`127.1`, `2130706433`: `parse_ip`); an IPv4-mapped IPv6 one is the IPv4 address (the
    kernel connects to it as such). None for a name."""
    address = parse_ip(text.strip("[]"))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def resolved(host: str, family: int = socket.AF_UNSPEC) -> list[IPAddress]:
    """The addresses `host` connects to (an IP literal: itself), through `getaddrinfo` (the
    resolver the exporters and the engines' guard call), waited for `RESOLVE_WITHIN` seconds
    at most; none when it does not resolve, or not in time (a collector's or an upstream's
    name may come up after the gateway does; the connect-time guard still checks it)."""
    literal = connects_to(host)
    if literal is not None:
        return [literal]
    found: list[IPAddress] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            infos = []
        for info in infos:
            address = connects_to(str(info[4][0]).split("%", 1)[0])
            if address is not None and address not in found:
                found.append(address)
        done.set()

    # A daemon thread: a resolver that never answers holds the start RESOLVE_WITHIN, and
    # not the exit.
    threading.Thread(target=lookup, name="fmw-resolve", daemon=True).start()
    if not done.wait(RESOLVE_WITHIN):
        return []
    return list(found)


def is_this_hosts(address: IPAddress) -> bool:
    """Whether `address` is one of this host's own (loopback, the wildcard, any interface's
    address): the kernel, asked for a route to it (a UDP connect: nothing is sent), leaves
    from that very address only when it is local; to any other it names the interface
    address the route leaves from. Not `bind` (a host with `ip_nonlocal_bind` binds any
    address), nor psutil (no dependency), nor the interfaces' ioctls (per platform)."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(address), 9))
            source = str(probe.getsockname()[0]).split("%", 1)[0]
    except OSError:  # no route to it at all: not this host's
        return False
    return source == str(address)


def dual_stack() -> bool:
    """Whether an IPv6 socket serve binds (it sets no IPV6_V6ONLY) takes IPv4 connections
    too: the system's default for a new one, asked of one (Linux: net.ipv6.bindv6only, 0
    unless set; Windows: IPv6 only). False without IPv6."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            return probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:
        return False


def reaches(targets: list[IPAddress], bind_host: str) -> bool:
    """Whether a connection to any of `targets` lands on a socket serve bound to `bind_host`
    (an IP literal, a wildcard, empty for every interface, or a name such as `localhost`,
    bound in the family serve binds it in: `listen_family`). A wildcard `::` takes IPv4
    connections too where the system dual-stacks it (`dual_stack`); `0.0.0.0` IPv4 ones
    only."""
    host = bind_host.strip("[]")
    bound: list[IPAddress]
    if not host:  # every interface, both families (as asyncio binds an empty host)
        six = four = True
        bound = [ipaddress.IPv6Address("::")]
    else:
        six = listen_family(host) == socket.AF_INET6
        four = not six or dual_stack()
        bound = resolved(host, socket.AF_INET6 if six else socket.AF_INET)
    for target in targets:
        for address in bound:
            if address.is_unspecified:
                wanted = four if target.version == 4 else six
                if wanted and is_this_hosts(target):
                    return True
            elif target == address:
                return True
    return False
