"""The OpenTelemetry exporters' own log lines without what a URL may carry as a secret.

An OTLP endpoint can hold a collector key in its query (`...?api-key=KEY`) or its userinfo;
the SDK's retry line ("Transient error ... url: /otlp?api-key=KEY/v1/traces") quoted it in
the gateway's log on every failed export. `hide_url_secrets()` adds a filter to the
exporters' loggers (and those of the HTTP client under them) that replaces a query string
with `?[query hidden]` and userinfo with `[userinfo hidden]@`; the line is kept.

The same lines quote what a collector wrote: a refused export's reason phrase ("Failed to
export spans batch code: 400, reason: ..."). Its escape sequences reached the log as they
were (a terminal tailing it cleared, retitled), a carriage return drew the collector's
text over the gateway's line, and a reason of any length was written whole at each export:
each message is shown printable (`?` for what a terminal would act on) and cut at
`MESSAGE_CHARACTERS`."""

from __future__ import annotations

import logging
import re

from fallback_mw.quoting import printable

# The loggers whose records may quote the endpoint: the SDK's and its exporters', and the
# HTTP client libraries the OTLP/HTTP exporter runs on.
_PREFIXES = ("opentelemetry", "urllib3", "requests")

# `?` and what follows up to a space, a quote or a closing bracket: a URL's query.
_QUERY = re.compile(r"\?[^\s'\"()<>\[\]{}]+")
# `//user:password@` in a URL.
_USERINFO = re.compile(r"(?<=//)[^\s/'\"@]+@")


# A message's length in the log, past which it is cut (a traceback's lines are not).
MESSAGE_CHARACTERS = 1000


def shown(message: str) -> str:
    """`message` as one log line: printable, at most MESSAGE_CHARACTERS long."""
    text = printable(message)
    if len(text) <= MESSAGE_CHARACTERS:
        return text
    return f"{text[:MESSAGE_CHARACTERS]}...({len(text)} characters)"


def hidden(text: str) -> str:
    """`text` with every URL query and userinfo replaced."""
    if "?" not in text and "@" not in text:
        return text
    return _USERINFO.sub("[userinfo hidden]@", _QUERY.sub("?[query hidden]", text))


class UrlSecretsFilter(logging.Filter):
    """Rewrites a record's message (and the traceback it carries) through `hidden`, and
    `shown` (each traceback line printable)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: left to the handler
            return True
        cleaned = shown(hidden(message))
        if record.exc_info:
            # A traceback's exception text quotes the URL as often as the message does.
            text = logging.Formatter().formatException(record.exc_info)
            lines = (printable(line) for line in hidden(text).split("\n"))
            cleaned = f"{cleaned}\n" + "\n".join(lines)
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
