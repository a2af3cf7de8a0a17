"""The breaker state machine and the credential pool, without I/O (SPEC §6)."""

from __future__ import annotations

import math

import pytest

from fallback_mw.config import BreakerConfig, UpstreamConfig
from fallback_mw.health.breaker import DEFAULT_PROBE_LEASE, Breaker, upstream_probe_lease
from fallback_mw.health.pool import CredentialMark, CredentialPool, credential_mark

CONFIG = BreakerConfig(
    window=4, min_calls=3, failure_rate=0.5, cooldown_ms=100, max_cooldown_ms=350
)


def test_never_opens_below_min_calls() -> None:
    breaker = Breaker(CONFIG)
    assert breaker.record(failure=True, now=0) is None
    assert breaker.record(failure=True, now=0) is None
    assert breaker.state == "closed"
    assert breaker.record(failure=True, now=0) == "opened"
    assert breaker.state == "open"


def test_failure_rate_over_the_window() -> None:
    breaker = Breaker(CONFIG)
    for failure in (False, False, False, True):
        assert breaker.record(failure=failure, now=0) is None
    # Window of 4 is now [F, F, T, T] after one more failure: 2/4 = 0.5 reaches the rate.
    assert breaker.record(failure=True, now=0) == "opened"


def test_successes_push_failures_out_of_the_window() -> None:
    breaker = Breaker(CONFIG)
    breaker.record(failure=True, now=0)
    for _ in range(4):
        breaker.record(failure=False, now=0)
    assert list(breaker.outcomes) == [False] * 4
    assert breaker.record(failure=True, now=0) is None  # 1/4 < 0.5


def test_open_half_open_one_probe_doubling_and_reset() -> None:
    breaker = Breaker(CONFIG, probe_lease=10)
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.admit(0.099) == (False, None)
    assert breaker.admit(0.1) == (True, "half_open")
    assert breaker.admit(0.1) == (False, None)  # exactly one probe at a time
    assert breaker.record(failure=True, now=0.15) == "reopened"
    assert breaker.cooldown == 0.2
    assert breaker.admit(0.349)[0] is False
    assert breaker.admit(0.35)[0] is True
    assert breaker.record(failure=True, now=0.35) == "reopened"
    assert breaker.cooldown == 0.35  # 0.4 capped at max_cooldown_ms
    assert breaker.admit(0.70)[0] is True
    assert breaker.record(failure=True, now=0.7) == "reopened"
    assert breaker.cooldown == 0.35
    assert breaker.admit(1.05)[0] is True
    assert breaker.record(failure=False, now=1.05) == "closed"
    assert breaker.state == "closed"
    assert breaker.cooldown == 0.1  # reset
    assert breaker.admit(1.05) == (True, None)
    for _ in range(3):
        breaker.record(failure=True, now=2)
    assert breaker.open_until == 2.1  # the next open period starts from the base again


def test_outcomes_while_open_are_ignored() -> None:
    breaker = Breaker(CONFIG)
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.record(failure=False, now=0.01) is None
    assert breaker.state == "open"


def test_a_lost_probe_frees_its_slot_after_the_lease() -> None:
    breaker = Breaker(CONFIG, probe_lease=1.0)
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.admit(0.2)[0] is True
    assert breaker.admit(1.1)[0] is False
    assert breaker.admit(1.2)[0] is True


def test_a_probe_holds_its_slot_for_the_lease_it_was_admitted_with() -> None:
    breaker = Breaker(CONFIG, probe_lease=1.0)
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.admit(0.2, lease=5.0)[0] is True
    assert breaker.admit(1.3)[0] is False  # past the floor, still inside the lease
    assert breaker.admit(5.1)[0] is False
    assert breaker.admit(5.2)[0] is True  # a lost probe still frees its slot
    assert breaker.admit(5.3, lease=0.5)[0] is False  # a shorter lease: the floor holds
    assert breaker.admit(6.2)[0] is True


def test_the_upstream_probe_lease_outlasts_the_longest_attempt() -> None:
    def lease(**timeouts: int) -> float:
        return upstream_probe_lease(UpstreamConfig(url="http://up.example", **timeouts))

    assert lease() == 38.0  # 3 s connect + 30 s first byte + 5 s: the old 30 s was short
    assert lease(first_byte_timeout_ms=90_000) == 98.0
    # The longest walk deadline (600 s) ends any attempt first.
    assert lease(connect_timeout_ms=10_000, first_byte_timeout_ms=900_000) == 605.0
    assert lease(connect_timeout_ms=500, first_byte_timeout_ms=1500) == pytest.approx(7.0)
    assert DEFAULT_PROBE_LEASE == 30.0  # the floor, applied by the breaker


def test_credential_marks() -> None:
    def mark(status: int | None, failure: bool = False, retry_after: float | None = None):
        return credential_mark(
            status=status,
            failure=failure,
            retry_after=retry_after,
            default_cooldown=5,
            max_cooldown=60,
        )

    assert mark(401) == CredentialMark("retire")
    assert mark(403) == CredentialMark("cool_down", 5)
    assert mark(403, retry_after=20) == CredentialMark("cool_down", 20)  # as docs/health.md
    assert mark(403, retry_after=3600) == CredentialMark("cool_down", 60)
    assert mark(429, retry_after=2) == CredentialMark("cool_down", 2)
    assert mark(429, retry_after=3600) == CredentialMark("cool_down", 60)
    assert mark(503, failure=True) == CredentialMark("cool_down", 5)
    assert mark(None, failure=True) == CredentialMark("cool_down", 5)
    assert mark(200) is None
    assert mark(400) is None


def test_pool_rotation_exclusion_retirement_and_affinity() -> None:
    pool = CredentialPool()
    assert [pool.pick(3, exclude=set(), session=None, now=0) for _ in range(4)] == [0, 1, 2, 0]
    assert pool.pick(3, exclude={1, 2}, session=None, now=0) == 0
    assert pool.pick(2, exclude={0, 1}, session=None, now=0) is None
    pool.apply(0, CredentialMark("retire"), now=0)
    assert pool.unusable_until[0] == math.inf
    assert {pool.pick(3, exclude=set(), session=None, now=1e9) for _ in range(6)} == {1, 2}
    bound = pool.pick(3, exclude=set(), session="s", now=0)
    assert all(pool.pick(3, exclude=set(), session="s", now=0) == bound for _ in range(5))
    assert bound is not None
    pool.apply(bound, CredentialMark("cool_down", 10), now=0)
    moved = pool.pick(3, exclude=set(), session="s", now=1)
    assert moved not in (None, 0, bound)
    # The session stays on its new credential while that one is healthy, even after the
    # old one has cooled down.
    assert all(pool.pick(3, exclude=set(), session="s", now=20) == moved for _ in range(5))


def test_a_half_open_breaker_heeds_only_its_probe() -> None:
    """The machine's side of test_health.py's straggler tests: an admission the closed
    breaker made, or a probe whose lease ran out and was replaced, neither decides a
    half-open breaker nor frees the current probe's slot."""
    breaker = Breaker(CONFIG, probe_lease=10)
    assert breaker.admit(0)[0] and breaker.admission() == ""  # a closed breaker's
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.admit(0.1) == (True, "half_open")
    first = breaker.admission()
    assert breaker.record(failure=False, now=0.2, probe="") is None  # the straggler's
    breaker.release("")
    assert breaker.admit(0.2) == (False, None)  # the slot is still the probe's
    assert breaker.admit(10.2) == (True, None)  # its lease ran out: a second probe
    second = breaker.admission()
    assert second != first
    assert breaker.record(failure=True, now=10.3, probe=first) is None  # stale
    assert breaker.state == "half_open"
    assert breaker.record(failure=False, now=10.3, probe=second) == "closed"
