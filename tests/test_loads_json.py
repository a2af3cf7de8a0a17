"""request/body_json.loads_json is `json.loads` without its Python steps (the request body's
and the answer's JSON, on every routed request): for any bytes, the same value or the same
error, message and position included."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fallback_mw.request.body_json import loads_json

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
WHITESPACE = st.text(alphabet=" \t\n\r\x0b\x0c", max_size=3)


def outcome(data: bytes) -> tuple[str, Any]:
    try:
        return "value", loads_json(data)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


def reference(data: bytes) -> tuple[str, Any]:
    try:
        return "value", json.loads(data)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(), JSON, max_size=5),
    WHITESPACE,
    WHITESPACE,
    st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"]),
)
def test_an_object_reads_as_json_loads_reads_it(
    value: dict[str, Any], before: str, after: str, encoding: str
) -> None:
    data = (before + json.dumps(value, ensure_ascii=False) + after).encode(
        encoding, "surrogatepass"
    )
    assert outcome(data) == reference(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40).map(lambda b: b"{" + b) | st.binary(max_size=40))
@example(b'{"a": 1} x')
@example(b'{"a": 1}\x0c')
@example(b'{"a": NaN}')
@example(b"{\x00")
@example(b'{"a": "\xed\xa0\x80"}')  # a lone surrogate, UTF-8-encoded
@example(b'{"a": "\xff"}')
@example(b"{" * 100_000)
@example(b'{"n": ' + b"9" * 5000 + b"}")
def test_any_bytes_give_json_loads_value_or_error(data: bytes) -> None:
    assert outcome(data) == reference(data)
