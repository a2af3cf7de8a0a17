"""A gateway on a host that is having a bad day: out of file descriptors. What the host
lacks is the gateway's own condition, never an upstream's failure (SPEC §5 "local
conditions are not upstream failures"): a burst that exhausts `ulimit -n` must not open
every upstream's breaker for the callers that come after it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
from collections.abc import Iterator
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]


class Descriptors:
    """Every file descriptor this process may open taken (as under `ulimit -n` with a burst
    of connections in flight): the next socket() fails with EMFILE. `take` takes again
    those freed meanwhile (a connection the gateway closed): the upstreams share this
    process, and one freed descriptor would let a connect through to a listener that
    cannot accept it."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def take(self) -> None:
        while True:
            try:
                self.taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                return


@contextlib.contextmanager
def no_file_descriptors_left() -> Iterator[Descriptors]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
    descriptors = Descriptors()
    try:
        descriptors.take()
        yield descriptors
    finally:
        for fd in descriptors.taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def config(primary: str, backup: str, warm: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {
            "primary": {"url": primary},
            "backup": {"url": backup},
            "warm": {"url": warm},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1},
            {"id": "warm", "prefix": "/warm/", "plan": ["warm"]},
        ],
    }


def breaker_marks(gateway: Gateway, name: str) -> list[int]:
    health = gateway.services.health
    assert isinstance(health, MemoryHealth)
    return list(health.breaker(name).outcomes)


@pytest.mark.parametrize("engine", ENGINES)
async def test_running_out_of_file_descriptors_is_the_gateways_503_never_a_breaker_mark(
    engine: str,
) -> None:
    """Under `ulimit -n 64` and a burst of requests, connecting to an upstream failed with
    EMFILE: each was booked as the upstream's transport failure (`could not connect`), both
    upstreams' breakers opened, and for the next cooldown every caller got 503
    route_exhausted from healthy upstreams. It is now the gateway's own 503 `overloaded`
    (nothing sent, no breaker mark), and the gateway serves as soon as descriptors free."""
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        upstream(status_handler(200, b"warm")) as warm,
    ):
        gateway = Gateway(host_app, config=config(primary.url, backup.url, warm.url, engine))
        try:
            async with client_for(gateway) as client:
                # Every module on the path imported; its connection stays pooled (a closed
                # one's descriptor, freed mid-request, would let a connect through).
                assert (await client.get("/warm/x")).status_code == 200
                answers = []
                with no_file_descriptors_left() as descriptors:
                    for _ in range(8):  # more than min_calls: a breaker would have opened
                        descriptors.take()
                        answers.append(await client.get("/v1/x"))
                marks = breaker_marks(gateway, "primary") + breaker_marks(gateway, "backup")
                after = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        error = json.loads(answer.content)["error"]
        assert error["code"] == "overloaded", error
        assert "file descriptors" in error["message"], error
        assert "ulimit -n" in error["message"], error
        assert answer.headers["retry-after"] == "1"  # as max_concurrency's overloaded
    assert 1 not in marks, marks  # no failure booked to either upstream
    assert after.status_code == 200 and after.content == b"primary"
    assert after.headers["x-gateway-attempts"] == "1"
