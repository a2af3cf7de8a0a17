"""The OpenTelemetry exporters' own log lines without what a URL may carry as a secret.

An OTLP endpoint can hold a collector key in its query (`...?api-key=KEY`) or its userinfo;
the SDK's retry line ("Transient error ... url: /otlp?api-key=KEY/v1/traces") quoted it in
the gateway's log on every failed export. `hide_url_secrets()` adds a filter to the
exporters' loggers (and those of the HTTP client under them) that replaces a query string
with `?[query hidden]` and userinfo with `[userinfo hidden]@`; the line is kept."""

from __future__ import annotations

import logging
import re

# The loggers whose records may quote the endpoint: the SDK's and its exporters', and the
# HTTP client libraries the OTLP/HTTP exporter runs on.
_PREFIXES = ("opentelemetry", "urllib3", "requests")

# `?` and what follows up to a space, a quote or a closing bracket: a URL's query.
_QUERY = re.compile(r"\?[^\s'\"()<>\[\]{}]+")
# `//user:password@` in a URL.
_USERINFO = re.compile(r"(?<=//)[^\s/'\"@]+@")


def hidden(text: str) -> str:
    """`text` with every URL query and userinfo replaced."""
    if "?" not in text and "@" not in text:
        return text
    return _USERINFO.sub("[userinfo hidden]@", _QUERY.sub("?[query hidden]", text))


class UrlSecretsFilter(logging.Filter):
    """Rewrites a record's message (and the traceback it carries) through `hidden`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: left to the handler
            return True
        cleaned = hidden(message)
        if record.exc_info:
            # A traceback's exception text quotes the URL as often as the message does.
            text = logging.Formatter().formatException(record.exc_info)
            cleaned = f"{cleaned}\n{hidden(text)}"
            record.exc_info = None
            record.exc_text = None
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = UrlSecretsFilter()


def hide_url_secrets() -> None:
    """Adds the filter to every logger under `_PREFIXES` made so far (the exporters make
    theirs as they are imported: call this after), once each."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (
            isinstance(logger, logging.Logger)
            and name.split(".", 1)[0] in _PREFIXES
            and _FILTER not in logger.filters
        ):
            logger.addFilter(_FILTER)
