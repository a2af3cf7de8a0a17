"""`AttemptRecord`'s written-out `__init__` (request/records.py: a dataclass's generated one
is interpreted under mypyc) takes what the dataclass's would: every field, in the fields'
order, each with its default, and `dataclasses.replace` still makes a copy."""

from __future__ import annotations

import dataclasses
import time

from fallback_mw.request.context import AttemptRecord, SkipRecord

DEFAULTS = {
    "server_port": None,
    "duration": None,
    "status": None,
    "failure_kind": None,
    "could_not_connect": False,
    "failure_detail": None,
    "timer": None,
    "fault": None,
    "queued_only": False,
    "hedge": False,
    "credential_index": None,
    "responsible": None,
    "decision": None,
    "reason": None,
    "coding": None,
    "unmaskable": None,
}


# A value of its type for every field, none of them its default.
GIVEN: dict[str, object] = {
    "candidate": "primary",
    "number": 3,
    "server_address": "10.0.0.1",
    "server_port": 8443,
    "started": 12.5,
    "duration": 0.25,
    "status": 503,
    "failure_kind": "status",
    "could_not_connect": True,
    "failure_detail": "detail",
    "timer": "first_byte_timeout_ms",
    "fault": "fail",
    "queued_only": True,
    "hedge": True,
    "credential_index": 1,
    "responsible": "upstream",
    "decision": "next_candidate",
    "reason": "a reason",
    "coding": (b"application/json", None),
    "unmaskable": "why",
}


def test_the_init_takes_every_field_in_order() -> None:
    # Called positionally, in the fields' order (compiled, `__init__` has no signature to
    # read): each value lands in its field.
    values = [GIVEN[f.name] for f in dataclasses.fields(AttemptRecord)]
    record = AttemptRecord(*values)  # type: ignore[arg-type]
    assert [getattr(record, f.name) for f in dataclasses.fields(AttemptRecord)] == values


def test_each_field_not_given_has_its_default_and_started_is_now() -> None:
    before = time.monotonic()
    record = AttemptRecord("primary", 1, "127.0.0.1")
    after = time.monotonic()
    assert (record.candidate, record.number, record.server_address) == ("primary", 1, "127.0.0.1")
    assert before <= record.started <= after
    for name, default in DEFAULTS.items():
        assert getattr(record, name) == default, name
    assert set(DEFAULTS) | {"candidate", "number", "server_address", "started"} == {
        f.name for f in dataclasses.fields(AttemptRecord)
    }


def test_each_field_given_is_kept_and_replace_copies_them() -> None:
    given = {k: v for k, v in GIVEN.items() if k not in ("candidate", "number", "server_address")}
    record = AttemptRecord("backup", 2, "h", **given)  # type: ignore[arg-type]
    for name, value in given.items():
        assert getattr(record, name) == value, name
    copy = dataclasses.replace(record, status=200)
    assert copy.status == 200 and copy.started == 12.5 and copy.candidate == "backup"
    assert dataclasses.replace(copy, status=503) == record  # the dataclass's __eq__
    assert "AttemptRecord(candidate='backup'" in repr(record)  # and its __repr__


def test_a_skip_record_is_where_it_was() -> None:
    skip = SkipRecord("primary", "breaker_open")
    assert (skip.after_attempts, skip.fault) == (0, None)
