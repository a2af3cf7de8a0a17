"""`[[routes]]`: one route's match (prefix, tenant, methods), its plan and failover settings,
its budget, canary and shadow."""

from __future__ import annotations

import difflib
from typing import Literal
from urllib.parse import unquote

from pydantic import (
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from fallback_mw.config.strict import (
    MAX_DEADLINE_MS,
    MAX_PLAN_LENGTH,
    MAX_TIMER_MS,
    Strict,
    budget_id,
)
from fallback_mw.rules import ConfigError as ConfigError  # re-exported: its public home
from fallback_mw.security.values import is_field_name

# A route that lists no `methods` forwards these; any other method on its paths (TRACE,
# CONNECT, a custom one) is a local 405 `method_not_allowed` (SPEC §12).
DEFAULT_METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")


# HTTP's own methods (RFC 9110 §9, PATCH: RFC 5789).
HTTP_METHODS = (*DEFAULT_METHODS, "TRACE", "CONNECT")


def _decoded_prefix_hint(prefix: str) -> str:
    """For a prefix written percent-encoded (`/v1/caf%C3%A9/`, as a browser shows a URL),
    the prefix to write instead: requests are matched on the decoded path, so the encoded
    one could never match, and "without percent-encoding" left the user to decode it."""
    if "%" not in prefix:
        return ""
    try:
        decoded = unquote(prefix, errors="strict")
    except UnicodeDecodeError:
        return ""
    if decoded.count("/") != prefix.count("/") or "%" in decoded or not decoded.isprintable():
        return ""  # an escaped separator, a double escape, a control character: no hint
    if any(seg.split(";", 1)[0] in (".", "..") for seg in decoded.split("/")):
        return ""
    if "//" in decoded or any(char.isspace() or char in "?#\\*" for char in decoded):
        return ""  # refused as written too (`_prefix`)
    return f": write the characters themselves, {decoded!r} (requests match decoded paths)"


class RouteConfig(Strict):
    id: str = Field(min_length=1, max_length=200)
    prefix: str
    tenant: str | None = None
    methods: tuple[str, ...] | None = None  # None: DEFAULT_METHODS
    plan: tuple[str, ...] = Field(min_length=1, max_length=MAX_PLAN_LENGTH)
    strategy: Literal["sequential", "random"] = "sequential"
    retries: int = Field(default=0, ge=0, le=32)
    backoff_ms: int = Field(default=25, ge=0, le=60_000)
    deadline_ms: int | None = Field(default=None, ge=1, le=MAX_DEADLINE_MS)
    replayable_methods: tuple[str, ...] = ("GET", "HEAD", "OPTIONS")
    # A POST carrying an Idempotency-Key header (IETF HTTPAPI draft) is replayable too: the
    # upstream deduplicates on the key, so a second attempt cannot act twice.
    replay_with_idempotency_key: bool = False
    failover_status: tuple[StrictInt, ...] = (502, 503, 504)  # ["503"] refused, as retries = "1"
    on_exhausted: Literal["error", "last_response"] = "error"
    budget: str | None = None
    hedge_after_ms: int = Field(default=0, ge=0, le=MAX_TIMER_MS)
    # Hedge a POST that carries an Idempotency-Key too (two concurrent requests, one key).
    hedge_idempotent_posts: bool = False
    canary_percent: float = Field(default=0.0, ge=0.0, le=100.0)
    canary_eligible: bool = False
    shadow: str | None = None  # an upstream that gets copies of the slice, answer discarded
    shadow_percent: float = Field(default=0.0, ge=0.0, le=100.0)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        # `..;x` and `.;x` too: the request path is read as servlet containers read it, a
        # dot segment with a parameter (routing.normalise_path), so such a prefix loaded
        # and no request could ever match it.
        if any(seg.split(";", 1)[0] in (".", "..") for seg in value.split("/")) or "%" in value:
            raise ValueError(
                "must be a plain path without dot segments or percent-encoding"
                + _decoded_prefix_hint(value)
            )
        # Requests are matched on the normalised path (no empty segments, `\\` read as `/`,
        # no query or fragment): a prefix holding one of these could never match.
        if "//" in value or any(char in value for char in "?#\\*"):
            raise ValueError(
                "must be a plain path: no '//', '?', '#', '\\' or '*' (a prefix is literal "
                "and matches every path below it: '/v1/' takes /v1/chat/completions)"
            )
        # A space is a quoting slip far more often than a path (such a route serves only
        # `%20` spellings); a control character would also split `routes list` lines.
        if any(char.isspace() or char < " " or "\x7f" <= char <= "\x9f" for char in value):
            raise ValueError(
                "must be a plain path: no spaces or control characters (route a parent "
                "path, e.g. '/files/', to serve paths that contain them)"
            )
        return value

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        # Matched against the tenant header's value, stripped and never empty (empty is
        # tenant "default"), which no control character can be part of: such a tenant could
        # never match, and a line break would split `routes list` / `check` lines.
        if value is None:
            return None
        control = any(c < " " or "\x7f" <= c <= "\x9f" for c in value)
        # A comma separates the values of a field sent twice (RFC 9110 §5.3): refused.
        if not value or value != value.strip() or control or "," in value:
            raise ValueError(
                "must be a tenant header value: not empty, no surrounding spaces, no control "
                "characters, no comma (omit tenant for a route that serves every tenant)"
            )
        return value

    @field_validator("budget")
    @classmethod
    def _budget(cls, value: str | None) -> str | None:
        return None if value is None else budget_id(value)

    @field_validator("methods", "replayable_methods")
    @classmethod
    def _upper(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        for method in value:
            # A method is a token, as a field name is (RFC 9110 §9.1): "GET,HEAD" or
            # "GET POST" would match no request, silently.
            if not is_field_name(method):
                raise ValueError(
                    f"{method!r} is not an HTTP method: list one method per string, e.g. "
                    '["GET", "HEAD"]'
                )
        return tuple(m.upper() for m in value)

    @field_validator("methods")
    @classmethod
    def _some_methods(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError(
                "a route of no methods serves no request: list its methods, or omit the key "
                f"for {', '.join(DEFAULT_METHODS)}"
            )
        return value

    @field_validator("replayable_methods")
    @classmethod
    def _replayable_known(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # `replayable_methods = ["PSOT"]` loaded, and POST silently never failed over. A
        # method is listed here only to be forwarded: one of HTTP's own, or one the route's
        # `methods` names (a custom method such as PROPFIND).
        routed = info.data.get("methods") or DEFAULT_METHODS
        known = (*routed, *(m for m in HTTP_METHODS if m not in routed))
        for method in value:
            if method not in known:
                close = difflib.get_close_matches(method, known, n=1)
                hint = f": did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{method!r} is neither an HTTP method nor one this route's methods "
                    f"list ({', '.join(routed)}){hint}"
                )
        return value

    @field_validator("failover_status")
    @classmethod
    def _statuses(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status")
            if status < 300:  # a 2xx would fail over (and mark the breaker) on every success
                raise ValueError(
                    f"{status} is not a failure: list the statuses that should move the walk "
                    "on, e.g. 429, 500, 502, 503, 504, 529 (a 1xx as the final answer always does)"
                )
        return value

    @property
    def attempt_ceiling(self) -> int:
        return 1 + self.retries

    @property
    def accepted_methods(self) -> tuple[str, ...]:
        return DEFAULT_METHODS if self.methods is None else self.methods
