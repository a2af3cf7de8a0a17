"""`AttemptRecord`'s written-out `__init__` (request/records.py: a dataclass's generated one
is interpreted under mypyc) takes what the dataclass's would: every field, in the fields'
order, each with its default, and `dataclasses.replace` still makes a copy."""

from __future__ import annotations

import dataclasses
import inspect
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


def test_the_init_takes_every_field_in_order() -> None:
    parameters = list(inspect.signature(AttemptRecord.__init__).parameters)[1:]
    assert parameters == [f.name for f in dataclasses.fields(AttemptRecord)]


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
    given = {name: f"v-{name}" for name in DEFAULTS} | {"started": 12.5}
    record = AttemptRecord("backup", 2, "h", **given)  # type: ignore[arg-type]
    for name, value in given.items():
        assert getattr(record, name) == value, name
    copy = dataclasses.replace(record, status=503)
    assert copy.status == 503 and copy.started == 12.5 and copy.candidate == "backup"
    assert dataclasses.replace(copy, status="v-status") == record  # the dataclass's __eq__
    assert "AttemptRecord(candidate='backup'" in repr(record)  # and its __repr__


def test_a_skip_record_is_where_it_was() -> None:
    skip = SkipRecord("primary", "breaker_open")
    assert (skip.after_attempts, skip.fault) == (0, None)
