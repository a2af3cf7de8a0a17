"""What `serve`'s options accept (argparse types): a port, an address to listen on (never
empty), a worker count, and seconds within bounds. `demo` and `eval` take a port too."""

from __future__ import annotations

import argparse
import contextlib
import socket
from collections.abc import Callable

# How long a stop waits for requests in flight (`--timeout-graceful-shutdown`): under a
# Kubernetes pod's default 30 s termination grace, so the cut streams still settle.
DEFAULT_GRACEFUL_SECONDS = 25.0
# uvicorn's own default: an idle kept-alive connection is closed after this long.
DEFAULT_KEEP_ALIVE_SECONDS = 5.0


def port_number(value: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not between 0 and 65535")
    return port


def bind_host(value: str) -> str:
    """argparse type: the address to listen on, never empty. The socket API reads an empty
    host as every interface: `--host "$GATEWAY_HOST"` with the variable unset put the
    gateway, and the credentials it injects, on every network the machine is on. An IPv6
    address in the brackets a URL writes it in (`[::1]`, as serve prints its own) is that
    address: the socket API read it as a name ("Name or service not known")."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            "empty (an unset variable?): give the address to listen on, "
            "127.0.0.1 for this machine only, or 0.0.0.0 for every interface"
        )
    if value.startswith("[") and value.endswith("]") and ":" in value:
        return value[1:-1]
    return value


def listen_family(host: str) -> socket.AddressFamily:
    """The address family serve binds `host` in: IPv6 for an IPv6 address; for a name, IPv4
    when it has an IPv4 address (as uvicorn binds one), else IPv6: a name with only an IPv6
    address (an IPv6-only host's own) was bound as IPv4, "Address family for hostname not
    supported", exit 1."""
    if ":" in host:
        return socket.AF_INET6
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        with contextlib.suppress(OSError, UnicodeError):
            socket.getaddrinfo(host, None, socket.AF_INET6, socket.SOCK_STREAM)
            return socket.AF_INET6
    return socket.AF_INET


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL writes it: an IPv6 address in brackets (`[::1]:8000`; `::1:8000`
    reads as one address with no port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_count(value: str) -> int:
    """argparse type: how many worker processes, 1 to 256."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid worker count {value!r}") from None
    if not 1 <= count <= 256:
        raise argparse.ArgumentTypeError(f"--workers {count} is not between 1 and 256")
    return count


def seconds_between(low: float, high: float) -> Callable[[str], float]:
    """argparse type: a number of seconds from `low` to `high`."""

    def seconds(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of seconds {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{value} is not between {low:g} and {high:g} seconds")
        return number

    return seconds


# How long a stop waits for requests in flight; how long an idle kept-alive connection is kept;
# how long a worker's event loop may go without running before the worker is taken for hung.
graceful_seconds = seconds_between(0, 3600)
keep_alive_seconds = seconds_between(1, 3600)
hang_seconds = seconds_between(0, 3600)
# gunicorn's worker timeout: far above any stall a healthy event loop has (a GC pass, a
# burst on a loaded host), far below "forever".
DEFAULT_WORKER_TIMEOUT_SECONDS = 30.0


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """serve's `--workers N` and `--worker-timeout SECONDS`."""
    parser.add_argument(
        "--workers",
        type=worker_count,
        default=1,
        metavar="N",
        help="gateway processes on this address (default 1); N > 1 needs a shared "
        "gateway.state (Redis) and, with budgets, a gateway.store",
    )
    parser.add_argument(
        "--worker-timeout",
        type=hang_seconds,
        default=DEFAULT_WORKER_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="with --workers N > 1: a worker whose event loop has not run for this long is "
        f"killed and replaced (0: never; default {DEFAULT_WORKER_TIMEOUT_SECONDS:g})",
    )
