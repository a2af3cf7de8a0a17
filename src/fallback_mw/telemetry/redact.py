"""Redaction by construction: the only ways telemetry turns request facts into strings
(short printable labels, name-shaped model names), and the reader of a caller's trace
context that takes only the propagator's own fields, none oversized, and never lets the
propagators quote a caller's value in a log record."""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Collection, Sequence
from typing import Final

from opentelemetry.propagators.textmap import Getter

from fallback_mw.quoting import printable
from fallback_mw.request.secrets import REDACTED, RequestSecrets, recorded_tenant

MAX_LABEL: Final = 128  # characters
# A model name is echoed from the request body, so only name-shaped values are recorded.
_MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def label(value: object) -> str:
    """A short printable label (route ids, candidate names, tenant), each character a
    terminal would act on or draws as nothing `?`, as the command line shows it."""
    text = str(value)
    if not (text.isascii() and text.isprintable()):  # the usual id: no call past these two
        text = printable(text)
    return text[:MAX_LABEL]


def model_name(value: str | None, secrets: RequestSecrets | None = None) -> str | None:
    """A name-shaped model name that carries none of the request's credentials (a caller
    or an upstream can put a key there: request/secrets.py), else None."""
    if value is None or not _MODEL_NAME.fullmatch(value):
        return None
    if secrets is not None and secrets.carried_by(value):
        return None
    return value


def tenant_label(tenant: str, secrets: RequestSecrets | None) -> str:
    """The tenant as recorded: its label, or `[REDACTED]` when the caller sent one of the
    request's credentials as its tenant id."""
    return label(recorded_tenant(tenant, secrets))


# OpenTelemetry's HTTP conventions: the methods of RFC 9110 and PATCH are known; any other
# token a caller sends is recorded as `_OTHER`, so callers cannot mint values of an attribute
# that span-derived metrics group by.
_KNOWN_METHODS: Final = frozenset(
    ("CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")
)


def http_method(
    method: str, forwarded: Collection[str], secrets: RequestSecrets | None = None
) -> tuple[str, str | None]:
    """`http.request.method` and, for `_OTHER`, `http.request.method_original` (a short
    label; `[REDACTED]` for a token that carries a credential of the request). A method the
    route forwards (`methods = ["PROPFIND"]`) is known: configured."""
    if method in _KNOWN_METHODS or method in forwarded:
        return method, None
    if secrets is not None and secrets.carried_by(method):
        return "_OTHER", REDACTED
    return "_OTHER", label(method)


# A caller's trace-context field longer than this (the W3C baggage limit) is ignored
# whole: OpenTelemetry's propagators log a too-long or malformed field *with its value*,
# which a console exporter setup writes to stderr.
_MAX_PROPAGATION_FIELD: Final = 8192
EXTRACTING: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar(
    "fallback_mw_extracting", default=False
)


class _DropCallerEcho(logging.Filter):
    """Drops the propagators' warnings while they read a caller's headers: those
    warnings quote the caller's field values."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not EXTRACTING.get()


_DROP_CALLER_ECHO: Final = _DropCallerEcho()
_PROPAGATOR_LOGGERS: Final = ("opentelemetry.baggage.propagation", "opentelemetry.propagate")


def quiet_propagators() -> None:
    for name in _PROPAGATOR_LOGGERS:
        target = logging.getLogger(name)
        if _DROP_CALLER_ECHO not in target.filters:
            target.addFilter(_DROP_CALLER_ECHO)


class _HeaderGetter(Getter[Sequence[tuple[bytes, bytes]]]):
    """Reads only the propagator's own fields (traceparent, tracestate, baggage), and
    none longer than _MAX_PROPAGATION_FIELD."""

    def get(self, carrier: Sequence[tuple[bytes, bytes]], key: str) -> list[str] | None:
        wanted = key.lower().encode("latin-1")
        values = [
            v.decode("latin-1")
            for k, v in carrier
            if k.lower() == wanted and len(v) <= _MAX_PROPAGATION_FIELD
        ]
        return values or None

    def keys(self, carrier: Sequence[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1").lower() for k, _ in carrier]


GETTER: Final = _HeaderGetter()
