"""The ledger's row encodings, written the cheap way, are what the plain way wrote: the
SQLite time text (`isoformat`, once `strftime`). Rows written before and after the change
must read and compare alike (`usage --since` compares the time text)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from fallback_mw.store.ledgers.schema import encode_sqlite_time


def _strftime_text(moment: datetime) -> str:
    """How the SQLite ledger wrote its times until now."""
    moment = moment.astimezone(UTC)
    return f"{moment.year:04d}" + moment.strftime("-%m-%dT%H:%M:%S.%fZ")


offsets = st.integers(min_value=-23 * 60, max_value=23 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
moments = st.datetimes(
    min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=offsets
)


@given(moments)
def test_a_time_is_written_as_strftime_wrote_it(moment: datetime) -> None:
    assert encode_sqlite_time(moment) == _strftime_text(moment)


def test_a_time_keeps_its_zero_microseconds_and_four_digit_year() -> None:
    assert encode_sqlite_time(datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC)) == (
        "0999-01-02T03:04:05.000000Z"
    )
    naive = datetime(2026, 12, 6, 7, 8, 9, 10)  # local time, as astimezone reads it
    assert encode_sqlite_time(naive) == _strftime_text(naive)
