"""The HTTP session `serve`'s OTLP/HTTP exporters send through: what a collector answers an
export with is read up to `ANSWER_LIMIT` bytes, the rest never.

`requests` reads a whole answer into memory before the exporter looks at its status, and
the exporter never uses its body (an OTLP answer is a few bytes of partial-success counts):
a collector, or whatever answers at its address, that sent a gigabyte took a gigabyte of
the gateway's memory twice over, and one whose answer never ended grew it without bound,
about 100 MiB a second, the export thread never coming back. Here the answer's first
`ANSWER_LIMIT` bytes, those that came within the export's timeout, are kept as its
content; past either the connection is closed, not reused. Redirects are not followed
(the exporter asks for none either: an endpoint's OTLP headers, its key, must not go where
a 3xx points); the exporter counts a 3xx answer as delivered, so the first one is said in
one WARNING line (its Location not shown). A credential provider's session (the SDK's
`OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER`), of its own class, is loaded here and
its answers are read the same way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import requests

from fallback_mw.cli.otel_env import TelemetrySetupError
from fallback_mw.cli.serve_logging import heard

_log = logging.getLogger("fallback_mw.telemetry")
# Whether a redirect was said, by either exporter (once per process).
_redirect_said: list[bool] = []
_said_lock = threading.Lock()

# What an OTLP answer may hold: its partial-success message, or a proxy's error page.
ANSWER_LIMIT = 64 * 1024
_CHUNK = 8192
# An answer's time, when the exporter gives no timeout (it always gives one: 10 s unless set).
_ANSWER_SECONDS = 10.0


class BoundedAnswerSession(requests.Session):
    """A `requests.Session` whose answers are read up to `ANSWER_LIMIT` bytes."""

    def request(
        self, method: str, url: str | bytes, *args: Any, **kwargs: Any
    ) -> requests.Response:
        return _bounded(super().request, method, url, *args, **kwargs)


def bound_answers(session: requests.Session) -> requests.Session:
    """`session` (a credential provider's, of its own class) with its answers read as
    BoundedAnswerSession's are, its own `request` (which signs) still making each."""
    send = session.request

    def request(method: str, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        return _bounded(send, method, url, *args, **kwargs)

    session.request = request  # type: ignore[method-assign]  # this session's, not its class's
    return session


def _bounded(
    send: Callable[..., requests.Response], method: str, url: str | bytes, *args: Any, **kwargs: Any
) -> requests.Response:
    kwargs["stream"] = True
    kwargs["allow_redirects"] = False
    until = time.monotonic() + _seconds(kwargs.get("timeout"))
    response = send(method, url, *args, **kwargs)
    if not response._content_consumed:  # read already: a provider sent again through this
        _read_bounded(response, until)
    if 300 <= response.status_code < 400 and _first_redirect():
        _log.warning(
            "the OTLP endpoint answered an export with a redirect (HTTP %d), which is "
            "not followed: what was sent there is not delivered, though the exporter "
            "counts it so (said once); set OTEL_EXPORTER_OTLP_ENDPOINT to the "
            "collector itself (where it points is not shown)",
            response.status_code,
        )
    return response


def _seconds(timeout: Any) -> float:
    """The export's timeout (requests': a number, or (connect, read)) as the whole answer's
    time: each read's timeout alone let a trickled answer, a byte a second, go on for hours."""
    if isinstance(timeout, tuple):
        timeout = timeout[-1]
    return float(timeout) if isinstance(timeout, int | float) else _ANSWER_SECONDS


def _first_redirect() -> bool:
    """Whether this redirect is the one to say: the first while the log has a handler
    (`heard`: an export before serve's log handler is installed, a slow start beside a short
    export interval, said it to a NullHandler only, then never again)."""
    with _said_lock:
        if _redirect_said or not heard(_log):
            return False
        _redirect_said.append(True)
        return True


def _read_bounded(response: requests.Response, until: float) -> None:
    """`response`'s content: its body's first ANSWER_LIMIT bytes (as sent, not decoded:
    a compressed answer is not inflated), what came by `until` (monotonic). Past either
    the connection is closed."""
    body = bytearray()
    complete = False
    # One read of the connection at a time where urllib3 has it (2.x): `read` waits for
    # _CHUNK bytes, minutes of a trickle, before `until` is looked at again.
    read = getattr(response.raw, "read1", None) or response.raw.read
    try:
        while len(body) <= ANSWER_LIMIT and time.monotonic() < until:
            chunk = read(_CHUNK, decode_content=False)
            if not chunk:
                complete = True
                break
            body += chunk
    except Exception:  # a reset or a timeout part-way: what came is the content
        pass
    if not complete:
        response.raw.close()  # the rest unread: the connection is not reused
    response._content = bytes(body[:ANSWER_LIMIT])
    response._content_consumed = True
    response.close()  # a connection read to its end goes back to the pool


# The SDK's variables naming a credential provider, the general one first, as the SDK reads
# them; the provider is an entry point of this group, a factory of a `requests.Session`.
_PROVIDER_GENERAL = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER"
PROVIDER_GROUP = "opentelemetry_otlp_credential_provider"


def provider_variable(environ: Mapping[str, str], signal: str) -> str | None:
    """The variable naming the credential provider of `signal`'s exporter, if one does."""
    own = f"OTEL_PYTHON_EXPORTER_OTLP_HTTP_{signal.upper()}_CREDENTIAL_PROVIDER"
    return next((name for name in (_PROVIDER_GENERAL, own) if environ.get(name)), None)


def provider_session(variable: str, name: str) -> requests.Session:
    """The session of the credential provider `name`, which `variable` names (the SDK
    raised a RuntimeError, or the provider's own error, and serve said "unexpected internal
    error"). Raises TelemetrySetupError naming the variable, never the provider's own
    words (they may quote a credential or its path)."""
    found = entry_points(group=PROVIDER_GROUP, name=name)
    if not found:
        raise TelemetrySetupError(
            f"{variable}: no credential provider {name!r} is installed (an entry point of "
            f"the {PROVIDER_GROUP} group): install the package that provides it, or unset "
            f"{variable}"
        )
    try:
        session = next(iter(found)).load()()
    except Exception as exc:
        raise TelemetrySetupError(
            f"{variable}: the credential provider {name!r} failed making its session "
            f"({type(exc).__name__}); check the credentials it reads, or unset {variable}"
        ) from None
    if not isinstance(session, requests.Session):
        raise TelemetrySetupError(
            f"{variable}: the credential provider {name!r} gave a {type(session).__name__}, "
            f"not a requests.Session; use a provider made for OTLP/HTTP, or unset {variable}"
        )
    return bound_answers(session)


__all__ = [
    "ANSWER_LIMIT",
    "PROVIDER_GROUP",
    "BoundedAnswerSession",
    "bound_answers",
    "provider_session",
    "provider_variable",
]
