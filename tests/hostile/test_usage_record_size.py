"""The caller's text a usage record keeps (the requested model from the body, the tenant
from a header) is bounded: a record is kept for every routed request (the newest 10,000 in
memory, every one in a store), so an unbounded field let each request store up to its
whole body."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.cli import main
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


async def test_a_megabyte_model_name_or_a_huge_tenant_is_not_stored_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    model = "gpt-test-" + "x" * 1_000_000  # within replay_buffer: buffered and parsed
    tenant = "t" * 8_000  # within max_header_bytes (and the test upstream's 8 KiB field limit)
    async with upstream(status_handler(200)) as primary:
        conf = gateway_config({"primary": primary.url}, store=store, budget=None)
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                for _ in range(3):
                    response = await client.post(
                        "/v1/chat",
                        content=json.dumps({"model": model}).encode(),
                        headers={"x-tenant-id": tenant},
                    )
                    assert response.status_code == 200
        finally:
            await gateway.aclose()
    assert len(primary.received[0].body) > 1_000_000  # forwarded whole, as it came
    capsys.readouterr()
    status = await anyio.to_thread.run_sync(main, ["usage", "--store", store, "--json"])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line in lines:
        record = json.loads(line)
        assert record["model"].startswith("gpt-test-xxx")
        assert record["tenant"].startswith("ttt")
        assert len(line) < 4096  # was 1,060,000 bytes a record
