"""The memory states answer the walk at the call (health.events.ImmediateHealth,
capacity.model.ImmediateCapacity): the attempt lifecycle and the cursor ask their
synchronous methods, which their coroutines also are, so no coroutine is spent on a call
that never waits (docs/performance.md). A subclass may override the coroutines (a test's
double, a host's own state): it is asked through them, as any other state is."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.capacity.memory import MemoryCapacity
from fallback_mw.config import BreakerConfig
from fallback_mw.failover import attempt
from fallback_mw.failover.attempt import AttemptLifecycle
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.helpers import COMPILED, client_for
from tests.test_budget_guard import gateway_config, json_handler, status_of
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

WALKED = ("admit", "record", "release", "pick_credential", "credential_result")
ANSWER = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
asked: list[str] = []


@pytest.fixture(autouse=True)
def nothing_asked_yet() -> None:
    asked.clear()


def spy(name: str) -> Any:
    """A coroutine the state must not be asked through: it says so."""

    async def coroutine(*args: Any, **kwargs: Any) -> None:
        asked.append(name)
        raise AssertionError(f"{name} awaited")

    return coroutine


async def three_gets(gateway: Gateway) -> list[Any]:
    """Three GETs of the chat route through `gateway`, which is closed after them."""
    try:
        async with client_for(gateway) as client:
            return [await client.get("/v1/x") for _ in range(3)]
    finally:
        await gateway.aclose()


def conf(primary: str, backup: str, **primary_settings: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "breaker": {"window": 4, "min_calls": 2}},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY", **primary_settings},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


@pytest.mark.skipif(
    COMPILED,
    reason="patches the lifecycle's methods and the memory states' coroutines, which compiled "
    "callers do not read through (nor may a compiled class's method be replaced): what it "
    "checks is the shape of the sources, the same in both builds",
)
async def test_the_memory_states_are_asked_without_their_coroutines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PRIMARY_KEY", "p-key")
    monkeypatch.setenv("BACKUP_KEY", "b-key")
    health = MemoryHealth(BreakerConfig(window=4, min_calls=2))
    for name in WALKED:  # on the instance: its type is still the memory state's
        setattr(health, name, spy(name))
    # Nor a coroutine of the lifecycle's for an attempt's marks (a fault's outcome aside).
    monkeypatch.setattr(AttemptLifecycle, "mark_health", spy("mark_health"))

    def unread(response: object) -> None:  # a single credential keeps no health of its own
        asked.append("credential_retry_after")

    monkeypatch.setattr(attempt, "credential_retry_after", unread)
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"ok")) as backup,
    ):
        gateway = Gateway(host_app, config=conf(primary.url, backup.url, rpm=100), health=health)
        capacity = gateway.services.capacity
        assert type(capacity) is MemoryCapacity
        capacity.reserve = spy("reserve")  # type: ignore[method-assign]
        answers = await three_gets(gateway)
    assert [(a.status_code, a.text) for a in answers] == [(200, "ok")] * 3
    assert asked == []
    # The same answers as the coroutines give: two 503s opened the primary's breaker (the
    # third request skipped it) and its rpm counted the two attempts that reached it.
    assert health.breaker("primary").state == "open"
    assert [a.headers["x-gateway-attempts"] for a in answers] == ["2", "2", "1"]
    counted = capacity._capacity["primary"].totals[0]
    assert counted == 2


class Overridden(MemoryHealth):
    """A host's state built on the memory one, overriding its coroutines."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def admit(self, upstream: str, **kwargs: Any) -> bool:
        self.asked.append("admit")
        return await super().admit(upstream, **kwargs)

    async def record(self, upstream: str, **kwargs: Any) -> None:
        self.asked.append("record")
        await super().record(upstream, **kwargs)

    async def pick_credential(self, upstream: str, pool_size: int, **kwargs: Any) -> int | None:
        self.asked.append("pick_credential")
        return await super().pick_credential(upstream, pool_size, **kwargs)


async def test_a_subclass_of_a_memory_state_is_asked_through_its_coroutines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PRIMARY_KEY", "p-key")
    monkeypatch.setenv("BACKUP_KEY", "b-key")
    health = Overridden()
    async with (
        upstream(status_handler(200, b"ok")) as primary,
        upstream(status_handler(200, b"ok")) as backup,
    ):
        gateway = Gateway(host_app, config=conf(primary.url, backup.url), health=health)
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert (response.status_code, response.text) == (200, "ok")
    assert health.asked == ["pick_credential", "admit", "record"]


@pytest.mark.parametrize("budget", [None, "acme"])
async def test_the_memory_ledger_settles_and_records_without_its_coroutines(
    budget: str | None,
) -> None:
    ledger = MemoryLedger()
    for name in ("settle", "release", "record_usage"):
        setattr(ledger, name, spy(name))
    async with upstream(json_handler(ANSWER)) as primary:
        settings = gateway_config({"primary": primary.url}, store=None, budget=budget)
        gateway = Gateway(host_app, config=settings, ledger=ledger)
        try:
            async with client_for(gateway) as client:
                body = {"model": "gpt-test", "max_tokens": 5, "messages": []}
                response = await client.post("/v1/chat", json=body)
            spent, held = await status_of(gateway)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert asked == []
    # The same books as the coroutines keep: the usage record, and a budgeted request's
    # hold settled at its reported usage's cost (3 x 1000 + 5 x 2000 per million tokens).
    (record,) = await ledger.usage()
    assert (record.route, record.input_tokens, record.output_tokens) == ("chat", 3, 5)
    assert (record.cost, record.charged) == (Decimal("0.013"), Decimal("0.013") if budget else None)
    assert (spent, held) == (Decimal("0.013") if budget else 0, 0)


async def test_the_memory_states_per_attempt_calls_are_made_without_its_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For a state of exactly the memory class the attempt lifecycle makes the breaker's
    per-attempt calls itself (health/memory_calls.py, compiled), not through the state's
    interpreted methods; what they do is the same: two 503s open the primary's breaker."""
    monkeypatch.setenv("PRIMARY_KEY", "p-key")
    monkeypatch.setenv("BACKUP_KEY", "b-key")
    health = MemoryHealth(BreakerConfig(window=4, min_calls=2))
    methods = ("admit_now", "record_now", "pooled")
    for name in methods:  # on the instance: its type is still the memory state's
        original = getattr(health, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            asked.append(_name)
            return _original(*args)

        setattr(health, name, counted)
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"ok")) as backup,
    ):
        gateway = Gateway(host_app, config=conf(primary.url, backup.url), health=health)
        answers = await three_gets(gateway)
    assert [(a.status_code, a.text) for a in answers] == [(200, "ok")] * 3
    assert [name for name in asked if name in methods] == []
    assert health.breaker("primary").state == "open"
    assert [a.headers["x-gateway-attempts"] for a in answers] == ["2", "2", "1"]
