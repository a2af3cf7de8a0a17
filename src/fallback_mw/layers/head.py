"""The resolver's reading of the request head: the identity headers, the caller's deadline
and the method-override fields in one pass (`identity_headers`), and the spellings of the
fields a route's answers vary by (`as_spelled`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from fallback_mw.request.types import Scope
from fallback_mw.security.fields import CANONICAL, METHOD_OVERRIDE_FIELDS, canonical_name
from fallback_mw.security.values import UNDERSCORE

# More digits than this is longer than any deadline (600000 ms): it can shorten nothing.
_DEADLINE_DIGITS: Final = 7
_OWS: Final = " \t"  # optional whitespace around a field value (RFC 9110 §5.6.3)


def requested_deadline_ms(text: str | None) -> int | None:
    """The caller's `x-gateway-deadline-ms`, strictly: 1..7 ASCII digits, > 0. Anything
    else (other Unicode digits such as `²`, signs, decimals, a 5,000-digit number) is
    ignored: the route deadline applies. The header can only shorten a deadline, so a
    value it cannot read asks for nothing."""
    if text is None:
        return None
    text = text.strip()
    if not 0 < len(text) <= _DEADLINE_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value > 0 else None


def identity_headers(
    headers: Iterable[tuple[bytes | bytearray, bytes]],
    names: tuple[bytes, ...],
    wanted: frozenset[bytes],
) -> tuple[list[str | None], bytes | None, list[bytes] | None]:
    """The first value of each named header (stripped, None when absent or empty; the
    deadline's None when sent twice), in one pass over the request's headers; the first
    of `names[:2]` (the identity headers) sent twice with different values (in two
    fields, or in one joined by commas), or None; and the values of the method-override
    fields (METHOD_OVERRIDE_FIELDS, for `named_methods`), in order, read in the same pass
    (`wanted`: `names` and those fields), or None when a name could not be looked up so
    (unhashable: a `bytearray`, where ASGI sends bytes): `override_methods` reads them.
    A `bytearray` name is in the annotation so compiled code takes it too (it checks each
    item against the annotation: `tuple[bytes, bytes] object expected`)."""
    found: list[str | None] = [None] * len(names)
    seen = [False] * len(names)
    twice: bytes | None = None
    overrides: list[bytes] | None = []
    for key, value in headers:
        # `x_tenant_id` is `x-tenant-id` to a WSGI-style upstream (HTTP_X_TENANT_ID): one
        # field, so a caller's underscore spelling beside a proxy's field is two.
        # (`canonical_name`, written out: a call per header is most of the pass's cost.)
        lower = key.translate(CANONICAL)
        try:
            hit = lower in wanted
        except TypeError:  # unhashable: compared as before, the overrides read apart
            hit, overrides = lower in names, None
        if not hit:
            continue
        if overrides is not None and lower in METHOD_OVERRIDE_FIELDS:
            overrides.append(value)
        for index, name in enumerate(names):
            if name == lower:
                try:  # UTF-8, as the engines forward it and as the config names it
                    text = value.decode()
                except UnicodeDecodeError:  # refused with a 400 before any upstream
                    text = value.decode("latin-1")
                # Only SP and HTAB surround a field value (RFC 9110 §5.5), as the
                # upstream reads it: "acme\u00a0" is not tenant "acme".
                text = text.strip(_OWS)
                if index < 2 and "," in text:
                    # Two fields of one name may reach us joined by a comma (RFC 9110
                    # §5.3; Node's http does so): "caller, proxy" is the field twice.
                    members = {m.strip(_OWS) for m in text.split(",")} - {""}
                    if len(members) > 1:
                        twice = twice or name
                    text = members.pop() if members else ""
                if not seen[index]:
                    seen[index] = True
                    found[index] = text or None
                elif index >= 2:
                    # The deadline sent twice is one field "50, 5000" (RFC 9110 §5.3),
                    # not 1-7 digits: ignored however the fields reach us (SPEC §12).
                    found[index] = None
                elif twice is None and (text or None) != found[index]:
                    twice = name
    return found, twice, overrides


def as_spelled(scope: Scope, fields: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """`fields` (the identity headers a route's answers vary by) and each spelling of them
    the request came with that a cache reads as another field: `x_tenant_id` is the tenant
    header to the resolver (`canonical_name`), not to a shared cache, which stored the
    answer it chose under "no tenant header" and served it to every caller sending none.
    Only a route whose answers vary pays for this pass."""
    read_as = {canonical_name(field) for field in fields}
    # Another spelling differs by an `_` (a name of ours without one: only a sent name
    # with one can be another spelling of it).
    any_name = any(UNDERSCORE in field for field in fields)
    spelled: list[bytes] = []
    for key, _ in scope.get("headers", ()):
        if not any_name and UNDERSCORE not in key:
            continue
        lower = key.lower()
        if canonical_name(lower) in read_as and lower not in fields and lower not in spelled:
            spelled.append(lower)
    return (*fields, *spelled) if spelled else fields
