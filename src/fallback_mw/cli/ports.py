"""A free loopback port for a server this process is about to start (the evaluation's own
gateway; the tests' servers)."""

from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


FIRST_EPHEMERAL = _ephemeral_low()


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound and released), drawn below the ephemeral
    range. A port the kernel hands out for `bind(0)` is one it also gives outgoing
    connections as their local port: between this check and the server's own bind, any
    connection (this process's, another's) could take it, and the server then fails to
    start ("address already in use"). Below that range only a listener can."""
    for _ in range(200):
        port = random.randrange(10_000, FIRST_EPHEMERAL)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free 127.0.0.1 port below the ephemeral range")
