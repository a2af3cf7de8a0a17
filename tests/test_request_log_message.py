"""The request log line's text written for serve's writer (`request_log._message`, an
f-string) is the text of the record's `_MESSAGE % arguments`, for every value
`_arguments` gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fallback_mw.telemetry.request_log import _MESSAGE, _message

TEXT = st.text(max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    route=TEXT,
    outcome=TEXT,
    status=st.one_of(st.integers(100, 599), st.just("-")),
    chosen=TEXT,
    attempts=st.integers(0, 50),
    candidates=TEXT,
    duration=st.floats(min_value=0, max_value=1e9, allow_nan=False),
    why=TEXT,
)
def test_the_direct_line_is_the_records_message(
    route: str,
    outcome: str,
    status: int | str,
    chosen: str,
    attempts: int,
    candidates: str,
    duration: float,
    why: str,
) -> None:
    arguments = (route, outcome, status, chosen, attempts, candidates, round(duration, 1), why)
    assert _message(*arguments) == _MESSAGE % arguments


def test_a_rounded_duration_keeps_one_decimal() -> None:
    arguments = ("chat", "served", 200, "a", 1, "a,b", 12.0, " rule=x")
    expected = (
        "gateway request route=chat outcome=served status=200 chosen=a attempts=1 "
        "candidates=a,b duration_ms=12.0 rule=x"
    )
    assert _message(*arguments) == _MESSAGE % arguments == expected
