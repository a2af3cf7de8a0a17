"""The canary slice (SPEC §8): deterministic per session, only on eligible routes, named."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.config import RouteConfig
from fallback_mw.plan import candidate_order, is_canary
from tests.helpers import client_for
from tests.test_cli_admin import host_app
from tests.upstreams import status_handler, upstream

SALT = "game-day-salt"


def spec_bucket(session: str, salt: str) -> int:
    # SPEC §8, written out independently of plan.py.
    return int(hashlib.sha256(f"{session}:{salt}".encode()).hexdigest()[:8], 16) % 10000


def route(**fields: Any) -> RouteConfig:
    return RouteConfig(id="chat", prefix="/v1/", plan=("primary", "backup"), retries=1, **fields)


def test_canary_matches_the_spec_formula_and_lands_in_a_sane_band() -> None:
    eligible = route(canary_eligible=True, canary_percent=25.0)
    sessions = [f"session-{i}" for i in range(400)]
    chosen = [s for s in sessions if is_canary(eligible, s, SALT)]
    # Binomial(400, 0.25): mean 100, sd ~8.7; the band is about +-3.5 sd.
    assert 70 <= len(chosen) <= 130, len(chosen)
    assert chosen == [s for s in sessions if spec_bucket(s, SALT) < 2500]
    # Same session, same answer; another salt slices differently.
    assert all(is_canary(eligible, s, SALT) for s in chosen)
    assert [s for s in sessions if is_canary(eligible, s, "other")] != chosen
    assert candidate_order(eligible, canary=True) == ["backup", "primary"]


def test_the_bucket_at_the_percentage_itself_is_not_canary() -> None:
    # SPEC §8: canary when the bucket is *below* canary_percent * 100. A session whose
    # bucket is exactly 100 times a whole percentage (found by search): out of the slice
    # at that percentage, in it at the next bucket up. A mutant reading `<=` passed every
    # test (none met the edge).
    session = next(
        s for s in (f"edge-{i}" for i in range(100_000)) if spec_bucket(s, SALT) % 100 == 0
    )
    bucket = spec_bucket(session, SALT)
    assert not is_canary(route(canary_eligible=True, canary_percent=bucket / 100), session, SALT)
    assert is_canary(route(canary_eligible=True, canary_percent=(bucket + 1) / 100), session, SALT)


def test_a_percentage_maps_to_the_buckets_below_its_float_times_100_as_spec_writes() -> None:
    """SPEC §8 compares with `canary_percent * 100` in floating point, literally (as
    docs/operations.md says): 1.1 * 100 is 110.00000000000001, so bucket 110 is in a
    1.1 % slice (111 buckets of 10,000, one more than 1.1 % names); 0.57 * 100 is
    56.99999999999999, so bucket 57 is out of a 0.57 % slice (57 buckets, as named)."""

    def session_in(bucket: int) -> str:
        return next(s for s in (f"b-{i}" for i in range(200_000)) if spec_bucket(s, SALT) == bucket)

    assert is_canary(route(canary_eligible=True, canary_percent=1.1), session_in(110), SALT)
    assert not is_canary(route(canary_eligible=True, canary_percent=1.1), session_in(111), SALT)
    assert is_canary(route(canary_eligible=True, canary_percent=0.57), session_in(56), SALT)
    assert not is_canary(route(canary_eligible=True, canary_percent=0.57), session_in(57), SALT)


def test_never_canary_when_ineligible_or_without_a_session() -> None:
    ineligible = route(canary_eligible=False, canary_percent=100.0)
    assert not any(is_canary(ineligible, f"s{i}", SALT) for i in range(200))
    eligible = route(canary_eligible=True, canary_percent=100.0)
    assert not is_canary(eligible, None, SALT)
    single = RouteConfig(id="one", prefix="/x/", plan=("primary",), canary_eligible=True)
    assert not is_canary(single.model_copy(update={"canary_percent": 100.0}), "s", SALT)


@pytest.mark.anyio
async def test_canary_through_the_gateway() -> None:
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        config = {
            "gateway": {"canary_salt": SALT},
            "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "canary_eligible": True,
                    "canary_percent": 25.0,
                },
                {
                    "id": "other",
                    "prefix": "/v2/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "canary_percent": 100.0,  # not eligible: never canary
                },
            ],
        }
        gateway = Gateway(host_app, config=config, environ={})
        canary: list[str] = []
        try:
            async with client_for(gateway) as client:
                for i in range(300):
                    session = f"user-{i}"
                    response = await client.get("/v1/chat", headers={"x-session-id": session})
                    flagged = response.headers.get("x-gateway-canary") == "1"
                    assert flagged == (spec_bucket(session, SALT) < 2500)
                    assert response.text == ("backup" if flagged else "primary")
                    if flagged:
                        canary.append(session)
                        again = await client.get("/v1/chat", headers={"x-session-id": session})
                        assert again.headers.get("x-gateway-canary") == "1"
                for i in range(50):
                    response = await client.get("/v2/x", headers={"x-session-id": f"user-{i}"})
                    assert "x-gateway-canary" not in response.headers
                    assert response.text == "primary"
                for _ in range(20):
                    response = await client.get("/v1/chat")  # no session: never canary
                    assert "x-gateway-canary" not in response.headers
        finally:
            await gateway.aclose()
    assert 45 <= len(canary) <= 105, len(canary)  # 300 sessions at 25 %: mean 75
    assert backup.count == 2 * len(canary)


class PinSource:
    """A fault source holding one `pin` (as the store would after a plan change)."""

    def __init__(self, pinned: str) -> None:
        self.pinned = pinned

    async def upstream_fault(self, upstream: str) -> None:
        return None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return self.pinned

    async def aclose(self) -> None:
        return None


@pytest.mark.anyio
async def test_a_pin_outside_the_plan_changes_nothing_not_even_the_canary() -> None:
    """A pin applies only to a candidate of the route's plan (one the plan has since lost
    is ignored); ignored, it must not switch the canary slice off either."""
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        config = {
            "gateway": {"canary_salt": SALT},
            "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "canary_eligible": True,
                    "canary_percent": 100.0,
                }
            ],
        }
        gateway = Gateway(host_app, config=config, environ={}, faults=PinSource("removed"))
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/chat", headers={"x-session-id": "user-1"})
        finally:
            await gateway.aclose()
    assert response.text == "backup"
    assert response.headers.get("x-gateway-canary") == "1"
    assert "x-gateway-fault" not in response.headers


@pytest.mark.anyio
async def test_a_canary_whose_breaker_is_open_is_not_named_canary_when_the_primary_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SPEC §8: a canary session is sent to the second candidate first, named as canary.
    With that candidate's breaker open it is skipped and the primary serves: the request
    never went to the canary, yet it said `x-gateway-canary: 1` (and the span, the log
    line, the metrics counted it as canary traffic). A request that did reach the canary
    and failed over stays named."""
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(503, b"canary down")) as backup,
    ):
        config = {
            "gateway": {
                "canary_salt": SALT,
                "breaker": {"window": 2, "min_calls": 1, "failure_rate": 0.5},
            },
            "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1,
                 "canary_eligible": True, "canary_percent": 100.0}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=config, environ={})
        try:
            async with client_for(gateway) as client:
                session = {"x-session-id": "user-1"}
                tried = await client.get("/v1/chat", headers=session)
                skipped = await client.get("/v1/chat", headers=session)
        finally:
            await gateway.aclose()
    # The first went to the canary (503), then to the primary: canary traffic.
    assert tried.text == "primary"
    assert tried.headers["x-gateway-attempts"] == "2"
    assert tried.headers.get("x-gateway-canary") == "1"
    # The second skipped the canary (its breaker open) and went only to the primary.
    assert skipped.text == "primary"
    assert skipped.headers["x-gateway-attempts"] == "1"
    assert skipped.headers["x-gateway-skipped"] == "backup;reason=breaker_open"
    assert "x-gateway-canary" not in skipped.headers
    logged = [r for r in caplog.records if "gateway request" in r.getMessage()]
    assert [r.canary for r in logged] == [True, False]
