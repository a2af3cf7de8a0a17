"""The dataclasses made on every request with their `__init__` written out (a dataclass's
generated `__init__` is interpreted Python under mypyc too, called through `tp_init`;
written out, it is compiled, for about a third of the instructions): each takes what the
dataclass's generated one took. Every field, in the fields' order, positionally and by
keyword; each field not given at its default (a new list, tuple or time where the
dataclass had a factory); `dataclasses.replace`, `==` and `repr` as before. In both builds
(compiled, `__init__` has no signature to read: these call it)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from fallback_mw.budget.ledger import AttemptOutcome, UsageRecord
from fallback_mw.request.context import AttemptRecord, RequestBody, SkipRecord, Usage
from fallback_mw.telemetry.spans import Untraced
from fallback_mw.upstream.base import Timeouts, UpstreamRequest

TIMEOUTS = Timeouts(connect=1.0, first_byte=2.0, idle=3.0)


async def _chunks() -> Any:
    yield b"x"


STREAM = _chunks()

# Per class: a value of its type for every field (none of them the default), the fields
# the caller must give, and each other field's default (`NOW`: a factory's time, `NEW`: a
# factory's new empty container).
NOW, NEW = object(), object()
CASES: dict[type, tuple[dict[str, Any], tuple[str, ...], dict[str, Any]]] = {
    AttemptRecord: (
        {
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
        },
        ("candidate", "number", "server_address"),
        {"started": NOW, "could_not_connect": False, "queued_only": False, "hedge": False},
    ),
    AttemptOutcome: (
        {"candidate": "a", "status": 502, "failure": "status", "skipped": "x", "fault": "f"},
        ("candidate",),
        {},
    ),
    UsageRecord: (
        {
            "request_id": "r1",
            "route": "chat",
            "tenant": "acme",
            "at": datetime(2026, 1, 2, tzinfo=UTC),
            "budget_id": "b",
            "candidates": ("a", "b"),
            "attempts": (AttemptOutcome("a", 503),),
            "chosen": "b",
            "outcome": "served",
            "status": 200,
            "model": "m",
            "input_tokens": 3,
            "output_tokens": 4,
            "cost": Decimal("0.5"),
            "charged": Decimal("0.25"),
            "duration_ms": 12.0,
            "rule": "served",
        },
        ("request_id", "route", "tenant"),
        {"at": NOW, "candidates": (), "attempts": ()},
    ),
    RequestBody: (
        {
            "buffered": b"{}",
            "stream": STREAM,
            "length": 2,
            "declared": 2,
            "too_large": True,
            "timed_out": True,
            "client_gone": True,
            "misframed": True,
            "host_refusal": ValueError("refused"),
            "finished": True,
            "waiter": None,  # an asyncio.Event is made in a loop: left at its default
            "json": {"a": 1},
            "json_inspected": True,
        },
        (),
        {
            "too_large": False,
            "timed_out": False,
            "client_gone": False,
            "misframed": False,
            "finished": False,
            "json_inspected": False,
        },
    ),
    Usage: (
        {"input_tokens": 1, "output_tokens": 2, "model": "m", "done": True},
        (),
        {"done": False},
    ),
    Untraced: ({"attempts": [AttemptRecord("a", 1, "h")]}, (), {"attempts": NEW}),
    UpstreamRequest: (
        {
            "method": "POST",
            "url": "http://127.0.0.1:9/x",
            "headers": [("a", "b")],
            "body": b"{}",
            "timeouts": TIMEOUTS,
            "allow_hosts": ("127.0.0.1",),
            "max_connections": 4,
            "pool_key": "primary",
            "ca_file": "/ca.pem",
            "proxy": "http://proxy:3128",
            "slot_taken": True,
            "replayable": True,
        },
        ("method", "url", "headers", "body", "timeouts"),
        {"allow_hosts": (), "max_connections": 0, "pool_key": "", "replayable": False},
    ),
}
IDS = [cls.__name__ for cls in CASES]


@pytest.mark.parametrize("cls", CASES, ids=IDS)
def test_every_field_is_taken_in_order_and_by_keyword(cls: type) -> None:
    given, _, _ = CASES[cls]
    names = [f.name for f in dataclasses.fields(cls)]
    assert sorted(given) == sorted(names)  # the case names every field
    values = [given[name] for name in names]
    by_position = cls(*values)
    by_keyword = cls(**given)
    assert [getattr(by_position, name) for name in names] == values
    assert by_keyword == by_position  # the dataclass's __eq__
    assert repr(by_keyword) == repr(by_position)


@pytest.mark.parametrize("cls", CASES, ids=IDS)
def test_each_field_not_given_has_its_default(cls: type) -> None:
    given, required, defaults = CASES[cls]
    before = time.monotonic(), datetime.now(UTC)
    made = cls(*(given[name] for name in required))
    after = time.monotonic(), datetime.now(UTC)
    again = cls(*(given[name] for name in required))
    for field in dataclasses.fields(cls):
        value = getattr(made, field.name)  # unset: AttributeError
        if field.name in required:
            assert value == given[field.name]
            continue
        default = defaults.get(field.name)
        if default is NOW:
            clock = 0 if isinstance(value, float) else 1
            assert before[clock] <= value <= after[clock], field.name
        elif default is NEW:
            assert value == [] and value is not getattr(again, field.name), field.name
        else:
            assert value == default, field.name


@pytest.mark.parametrize("cls", CASES, ids=IDS)
def test_replace_copies_every_field(cls: type) -> None:
    given, _, _ = CASES[cls]
    made = cls(**given)
    copy = dataclasses.replace(made)
    assert copy == made and copy is not made


def test_a_request_body_waits_for_its_end_and_a_skip_record_is_where_it_was() -> None:
    async def main() -> None:
        body = RequestBody()
        waiting = asyncio.ensure_future(body.wait_finished())
        await asyncio.sleep(0)
        body.finish()
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())
    skip = SkipRecord("primary", "breaker_open")
    assert (skip.after_attempts, skip.fault) == (0, None)
    assert repr(RequestBody(buffered=b"abc")) == "<RequestBody 3 bytes>"
