"""The credentials one request's records must never carry (SPEC §9): the caller's own (the
credential headers and query keys the gateway strips) and every provider key the gateway
could inject. Telemetry records a few values a caller chooses — the tenant, the body's
`model`, an unknown method token, the W3C `tracestate` its spans inherit — and an upstream
chooses one (the model it says answered). A caller that puts a credential there (its own
bearer token as its tenant id, a provider key it learnt as the model name) must not get it
written into spans, log lines, usage records or error bodies: `recordable` says whether
such a value may be recorded.

Nothing is computed for a request that records no such value: the caller's credential
values are read from its headers on the first question only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import unquote_to_bytes

from fallback_mw.config.views import AnyUpstream
from fallback_mw.security.fields import CREDENTIAL_HEADERS, name_forms
from fallback_mw.security.queries import canonical_query_key
from fallback_mw.security.values import EQUALS, SP

# A credential shorter than this is not searched for: it would match ordinary text (a test
# key such as "k1"); real keys are far longer.
MIN_SECRET: Final = 8
# A recorded value at least this long that is a piece of a credential is caught too (a key
# sent as the model and cut to the 200 characters a request keeps of it). Shorter pieces
# are ordinary words: a tenant "acme-prod" beside a token "acme-prod-7f3a...".
MIN_PIECE: Final = 32
# What a redacted tenant is recorded as (OpenTelemetry's instrumentations use this word).
REDACTED: Final = "[REDACTED]"
# The most characters of a value a caller or an upstream chooses that any record holds (a
# tenant label, a model name, a W3C `tracestate` key or value, a method or header name in
# an error): only they are searched, so a check costs in proportion to the request's
# credentials, never to their number times the value's length (a cookie of thousands of
# values beside a 32 KB tenant cost some 100 ms a request, a square of the head's size).
MAX_RECORDED: Final = 256


def secret_forms(value: bytes) -> list[bytes]:
    """The secrets a caller's credential field value holds, lowercased (of the value
    lowered first: lowering changes no space, `=` or `;`): the whole value (stripped) and,
    for `Scheme token`, the token; for `name=value` pairs (a cookie list), each value;
    those too short to search for left out. `credential_forms` is the same for text
    (two functions, not one over `AnyStr`, which mypyc refuses: scripts/compile.py)."""
    value = value.lower().strip()
    forms = [value]
    if SP in value:
        forms.append(value.rsplit(b" ", 1)[1])
    if EQUALS in value:
        forms.extend(pair.split(b"=", 1)[-1].strip() for pair in value.split(b";"))
    return [form for form in forms if len(form) >= MIN_SECRET]


def credential_forms(key: str) -> list[str]:
    """The secrets one provider credential value holds (as `secret_forms` reads a
    caller's, each stripped by text's rule), case kept, each once. A variable may hold a
    whole header value (`Bearer sk-...` under `auth_scheme = ""`): an upstream quoting
    only the token quotes the key all the same."""
    value = key.strip()
    forms = [value]
    if " " in value:
        forms.append(value.rsplit(" ", 1)[1])
    if "=" in value:
        forms.extend(pair.split("=", 1)[-1].strip() for pair in value.split(";"))
    return list(dict.fromkeys(form for form in forms if len(form) >= MIN_SECRET))


class RequestSecrets:
    """One request's credentials, read lazily from its headers and query string (the
    caller's), plus the provider keys of the route table it was resolved on."""

    __slots__ = ("_checked", "_headers", "_names", "_provider", "_query", "_query_keys", "_values")

    def __init__(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        query: bytes,
        # Positional too: the resolver makes one per request, and a class called with
        # keywords builds a dictionary of them on every call.
        names: frozenset[bytes] = CREDENTIAL_HEADERS,
        query_keys: frozenset[bytes] = frozenset(),
        provider: tuple[bytes, ...] = (),
    ) -> None:
        self._headers = headers
        self._query = query
        # The credential header names (canonical): CREDENTIAL_HEADERS and the table's own.
        self._names = names
        self._query_keys = query_keys  # canonical strip_query_keys
        self._provider = provider
        self._values: tuple[bytes, ...] | None = None
        self._checked: dict[str, bool] = {}  # texts asked about (a tenant is asked thrice)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied and pickled as it was made (a host's layer that deep-copies the scope,
        # the request's context in it): compiled, a native class is not made again without
        # its arguments (`__init__() missing required argument`). The caches refill.
        made = (self._headers, self._query, self._names, self._query_keys, self._provider)
        return (RequestSecrets, made)

    @property
    def query_keys(self) -> frozenset[bytes]:
        """The query parameters the gateway strips (`strip_query_keys`, canonical)."""
        return self._query_keys

    def values(self) -> tuple[bytes, ...]:
        values = self._values
        if values is None:
            found = list(self._provider)
            names = self._names
            for name, value in self._headers:
                # `canonical_name`, remembered per name (`name_forms`).
                if name_forms(name)[1] in names:
                    found.extend(secret_forms(value))
            if self._query and self._query_keys:
                for part in self._query.replace(b";", b"&").split(b"&"):
                    key, _, value = part.partition(b"=")
                    if canonical_query_key(key) in self._query_keys:
                        found.extend(secret_forms(value))
                        found.extend(secret_forms(unquote_to_bytes(value.replace(b"+", b" "))))
            # A comprehension, not `dict.fromkeys`: compiled, a class method called on
            # `dict` is a method look-up on the type (some 2,000 instructions).
            values = self._values = tuple({value: None for value in found})
        return values

    def carried_by(self, text: str) -> bool:
        """Whether the part of `text` a record may hold (its first MAX_RECORDED
        characters) holds one of these credentials, or a part of one that begins there,
        or is a piece of one."""
        values = self.values()
        if not values:
            return False
        checked = self._checked.get(text)
        if checked is None:
            checked = self._checked[text] = _carries(text, values)
        return checked


# Up to this many credentials, `_carries` searches for each without its filter.
_FEW: Final = 16


def _carries(text: str, values: tuple[bytes, ...]) -> bool:
    recorded = text[:MAX_RECORDED].encode("utf-8", "replace").lower()
    end = len(recorded)
    # A credential that begins in the recorded part, followed as far as it goes.
    lowered = recorded
    if len(text) > MAX_RECORDED:
        longest = max(len(secret) for secret in values)
        lowered = text[: MAX_RECORDED + longest].encode("utf-8", "replace").lower()
    piece = end >= MIN_PIECE
    # Where a credential can begin: its first MIN_SECRET bytes at one of `end` places. A
    # filter only (the `find` alone decides), made for many credentials (a cookie of
    # thousands of values): for a few, their `find`s cost less than its `end` slices.
    starts = {lowered[i : i + MIN_SECRET] for i in range(end)} if len(values) > _FEW else None
    for secret in values:
        if (starts is None or secret[:MIN_SECRET] in starts) and lowered.find(
            secret, 0, end + len(secret) - 1
        ) >= 0:
            return True
        if piece and len(secret) >= end and secret.find(recorded) >= 0:
            return True
    return False


def provider_secrets(
    credentials: Mapping[str, Sequence[tuple[str, str] | None]],
    upstreams: Mapping[str, AnyUpstream],
) -> tuple[bytes, ...]:
    """The provider keys behind a credential table's injected values (`scheme key`, or the
    raw key), lowercased; the ones too short to search for left out."""
    found: list[bytes] = []
    for name, values in credentials.items():
        upstream = upstreams.get(name)
        scheme = upstream.auth_scheme if upstream is not None else ""
        for credential in values:
            if credential is None:
                continue
            value = credential[1]
            if scheme and value.startswith(scheme + " "):
                value = value[len(scheme) + 1 :]
            found.extend(
                form.encode("utf-8", "replace").lower() for form in credential_forms(value)
            )
    return tuple(dict.fromkeys(found))


def recorded_tenant(tenant: str, secrets: RequestSecrets | None) -> str:
    """The tenant as recorded: `[REDACTED]` when the caller sent one of the request's
    credentials as its tenant id. The default tenant (no header) costs nothing."""
    if secrets is not None and tenant != "default" and secrets.carried_by(tenant):
        return REDACTED
    return tenant


def recordable(secrets: RequestSecrets | None, text: str | None) -> str | None:
    """The part of `text` that may be recorded (its first MAX_RECORDED characters), None
    when it carries one of the request's credentials (or is None)."""
    if text is None or (secrets is not None and secrets.carried_by(text)):
        return None
    return text[:MAX_RECORDED]
