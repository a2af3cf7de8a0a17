"""The ledger's row encodings, written the cheap way, are what the plain way wrote: the
SQLite time text (`isoformat`, once `strftime`) and the usage record's JSON columns (kept
by their values, once `json.dumps` on every record). Rows written before and after the
change must read and compare alike (`usage --since` compares the time text)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from fallback_mw.budget.ledger import AttemptOutcome
from fallback_mw.store.ledgers.schema import attempts_json, candidates_json, encode_sqlite_time
from tests.helpers import COMPILED


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


names = st.text(max_size=8) | st.sampled_from(["primary", "backup", "ü", '"', "\\"])
attempts = st.builds(
    AttemptOutcome,
    names,
    st.none() | st.integers(min_value=-1, max_value=999) | st.booleans(),
    st.none() | names,
    st.none() | names,
    st.none() | names,
)


@given(st.lists(st.tuples(st.lists(names, max_size=4), st.lists(attempts, max_size=3))))
def test_the_json_columns_are_what_json_dumps_writes(
    records: list[tuple[list[str], list[AttemptOutcome]]],
) -> None:
    """Each record's text is its own, however the ones before it were (a status True
    after a status 1 is `true`, as `json.dumps` writes it)."""
    for candidates, tried in records:
        assert candidates_json(tuple(candidates)) == json.dumps(candidates)
        expected = json.dumps([attempt.as_dict() for attempt in tried])
        assert attempts_json(tuple(tried)) == expected


def test_a_status_true_after_a_status_1_is_written_true() -> None:
    one = (AttemptOutcome("primary", 1),)
    assert attempts_json(one) == '[{"candidate": "primary", "status": 1}]'
    true = (AttemptOutcome("primary", True),)
    assert attempts_json(true) == json.dumps([a.as_dict() for a in true])
    # Compiled, `as_dict` reads the status as the int its type says: True is written 1.
    written = "1" if COMPILED else "true"
    assert attempts_json(true) == f'[{{"candidate": "primary", "status": {written}}}]'
