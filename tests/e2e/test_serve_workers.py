"""`fallback-mw serve --workers 2`: two worker processes on one port (SO_REUSEPORT), their
breakers shared through the real Redis; refused with the in-memory state; a replacement
that cannot start during a store outage is retried while the other worker serves."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from fallback_mw.cli.workers import START_UP_SECONDS
from tests.helpers import (
    SIGHUP_AT_ITS_DEFAULT,
    alive,
    free_port,
    log_text,
    serve_process,
    wait_listening,
)
from tests.tcp_proxy import tcp_proxy
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

# serve's request log line in a worker: `fallback_mw.request[PID] gateway request ...`
LINE = re.compile(r"fallback_mw\.request\[(\d+)\] gateway request route=chat .*? attempts=(\d)")


def write_config(path: Path, state: str, primary: str, backup: str) -> Path:
    path.write_text(
        f"""
[gateway]
{state}

[gateway.breaker]
window = 1
min_calls = 1
failure_rate = 0.5
cooldown_ms = 120000

[upstreams.primary]
url = "{primary}"

[upstreams.backup]
url = "{backup}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
backoff_ms = 0
"""
    )
    return path


def idle_config(tmp_path: Path, redis_url: str) -> Path:
    """The workers' config on Redis state with upstreams nothing listens at (a test of
    the supervisor, not of a request)."""
    return write_config(
        tmp_path / "gateway.toml",
        f'state = "{redis_url}"',
        "http://127.0.0.1:9",
        "http://localhost:10",
    )


def command(config: Path, port: int, workers: int) -> list[str]:
    return [
        *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)),
    ]


@contextmanager
def supervisor(
    config: Path, port: int, log: Path, *, workers: int = 2, prefix: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*prefix, *command(config, port, workers)], stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def lines(log: Path) -> list[tuple[int, int]]:
    """(pid, attempts) of each request log line so far."""
    return [(int(pid), int(n)) for pid, n in LINE.findall(log_text(log))]


async def logged(log: Path, count: int) -> list[tuple[int, int]]:
    """The request log lines once there are `count` (written just after the response)."""
    deadline = time.monotonic() + 10
    while len(found := lines(log)) < count:
        assert time.monotonic() < deadline, log_text(log)
        await anyio.sleep(0.02)
    return found


async def both_serving(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until the supervisor listens and both its workers have started."""
    await wait_listening(process, port, log)
    deadline = time.monotonic() + 30
    while log_text(log).count("Application startup complete") < 2:
        assert process.poll() is None, log_text(log)
        assert time.monotonic() < deadline, log_text(log)
        await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_a_breaker_opened_through_one_worker_is_open_in_the_other(
    redis_url: str, tmp_path: Path
) -> None:
    async with upstream(status_handler(503)) as primary, upstream(status_handler(200)) as backup:
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log = free_port(), tmp_path / "serve.log"
        with supervisor(config, port, log) as process:
            await both_serving(process, port, log)
            url = f"http://127.0.0.1:{port}/v1/chat"
            # One failure opens the breaker (window 1): through whichever worker took it.
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(url)
            assert response.status_code == 200
            assert response.headers["x-gateway-attempts"] == "2"
            assert primary.count == 1
            ((opener, attempts),) = await logged(log, 1)
            assert attempts == 2
            # New connections until the other worker has served some (the kernel spreads
            # connections across the two sockets); every one skips the open breaker.
            others: list[int] = []
            for sent in range(2, 300):
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(url)
                assert response.status_code == 200
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers["x-gateway-attempts"] == "1"
                others = [pid for pid, _ in await logged(log, sent) if pid != opener]
                if len(others) >= 3:
                    break
            assert len(others) >= 3, log_text(log)
            assert all(n == 1 for pid, n in lines(log)[1:]), log_text(log)
            assert primary.count == 1  # no worker tried it again
            workers = {opener, *others}
            assert len(workers) == 2 and process.pid not in workers
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0, log_text(log)
        assert not any(alive(pid) for pid in workers)
    if len(os.sched_getaffinity(0)) >= 2:
        assert "per CPU" not in log_text(log)  # two workers on two CPUs: nothing to say


@pytest.mark.anyio
async def test_more_workers_than_cpus_is_said_once_and_serves(
    redis_url: str, tmp_path: Path
) -> None:
    """`--workers 2` on one CPU (taskset, a container's cpuset) started two event loops
    taking turns on one core: twice the memory, no more throughput, and nothing said it."""
    cpu = min(os.sched_getaffinity(0))
    config = idle_config(tmp_path, redis_url)
    port, log = free_port(), tmp_path / "serve.log"
    with supervisor(config, port, log, prefix=("taskset", "-c", str(cpu))) as process:
        await both_serving(process, port, log)
        text = log_text(log)
        warning = "--workers 2 on 1 CPU (those this process may run on): a worker past one"
        assert text.count(warning) == 1, text
        assert text.index(warning) < text.index("serving on"), text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log_text(log)


def test_the_cpu_bound_is_one_worker_per_cpu() -> None:
    from fallback_mw.cli.worker_checks import more_than_cpus

    assert more_than_cpus(2, 2) is None and more_than_cpus(1, 1) is None
    assert more_than_cpus(3, 2) == (
        "--workers 3 on 2 CPUs (those this process may run on): a worker past one per CPU "
        "adds memory and context switches, not throughput; --workers 2 serves as much"
    )


def test_more_than_one_worker_with_memory_state_is_refused_in_one_line(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "gateway.toml", "", "http://127.0.0.1:9", "http://localhost:10"
    )
    port = free_port()
    result = subprocess.run(
        command(config, port, 2), capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "--workers 2 needs a shared state" in result.stderr
    assert 'state = "redis://' in result.stderr


def test_a_store_that_cannot_be_loaded_at_start_is_one_line_not_one_per_worker(
    tmp_path: Path,
) -> None:
    # `serve --workers 4` with the store unreachable at start: each worker loaded the
    # store's routes after the fork and printed the same error, four lines for one
    # problem. The supervisor loads them once before forking: one line, exit 2, as `serve`.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens here
    config = write_config(
        tmp_path / "gateway.toml",
        'state = "redis://127.0.0.1:6379/0"\n'
        f'store = "postgresql://nobody@127.0.0.1:{closed}/gateway"',
        "http://127.0.0.1:9",
        "http://localhost:10",
    )
    result = subprocess.run(
        command(config, free_port(), 4), capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "cannot load routes from the store: cannot reach the store" in result.stderr


@pytest.mark.anyio
async def test_a_second_serve_with_workers_on_a_serving_address_is_refused_in_one_line(
    redis_url: str, tmp_path: Path
) -> None:
    """A second `serve --workers 2` on the address a first one serves (a deploy that
    starts the new instance before stopping the old, two operators): every socket of
    both bound with SO_REUSEPORT, so Linux let the second in, and it silently took a
    share of the first one's connections with its own configuration. It is refused now
    as a busy port is: one line, exit 1, nothing started."""
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log = free_port(), tmp_path / "serve.log"
        with supervisor(config, port, log) as process:
            await both_serving(process, port, log)
            with anyio.fail_after(30):
                second = await anyio.run_process(command(config, port, 2), check=False)
            assert second.returncode == 1, second.stderr
            assert second.stdout == b""
            assert second.stderr.decode() == (
                f"fallback-mw: error: cannot listen on 127.0.0.1:{port}: address already in use\n"
            )
            assert process.poll() is None, log_text(log)


def ignores_sighup(pid: int) -> bool:
    """Whether the process ignores SIGHUP (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)  # type: ignore[union-attr]
    return bool(mask & (1 << (signal.SIGHUP - 1)))


@pytest.mark.anyio
@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_under_nohup_keeps_ignoring_a_hangup(
    redis_url: str, tmp_path: Path, workers: int
) -> None:
    """`nohup fallback-mw serve ...` asks for SIGHUP to be ignored: the gateway must outlive
    the terminal that started it. The supervisor of `serve --workers` (and `serve`, which
    stops on a hangup otherwise) replaced the ignored disposition with a stop."""
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log = free_port(), tmp_path / "serve.log"
        with supervisor(config, port, log, workers=workers, prefix=("nohup",)) as process:
            if workers == 1:
                await wait_listening(process, port, log)
                deadline = time.monotonic() + 30
                while "Application startup complete" not in log_text(log):
                    assert process.poll() is None and time.monotonic() < deadline, log_text(log)
                    await anyio.sleep(0.05)
            else:
                await both_serving(process, port, log)
            assert ignores_sighup(process.pid), log_text(log)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0, log_text(log)


def test_a_worker_killed_while_starting_is_named_by_the_supervisor(
    redis_url: str, tmp_path: Path
) -> None:
    """A worker killed by a signal before it served (the OOM killer, SIGKILL) stops the
    instance, as any start-up failure does: the supervisor exited 1 with nothing after
    "serving on ...", since a killed worker prints no line of its own. It names it now."""
    config = idle_config(tmp_path, redis_url)
    port, log = free_port(), tmp_path / "serve.log"
    with supervisor(config, port, log) as process:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + 30
        while not (forked := children.read_text().split()):
            assert process.poll() is None and time.monotonic() < deadline, log_text(log)
        victim = int(forked[0])
        os.kill(victim, signal.SIGKILL)  # a moment after its fork: it has not served
        assert process.wait(timeout=60) == 1, log_text(log)
        text = log_text(log)
        assert "all 2 workers serving" not in text, text
        assert (
            f"fallback-mw: error: worker {victim} was killed by SIGKILL before it served; "
            "stopping the others"
        ) in text, text


STARTED = re.compile(r"Started server process \[(\d+)\]")


@pytest.mark.anyio
async def test_a_worker_that_dies_is_replaced(redis_url: str, tmp_path: Path) -> None:
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log = free_port(), tmp_path / "serve.log"
        with supervisor(config, port, log) as process:
            await wait_listening(process, port, log)
            deadline = time.monotonic() + 30
            while len(started := STARTED.findall(log_text(log))) < 2:
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            # Past the start-up window: a death now is a crash, not a start-up failure.
            await anyio.sleep(START_UP_SECONDS + 0.5)
            victim = int(started[0])
            os.kill(victim, signal.SIGKILL)
            while len(STARTED.findall(log_text(log))) < 3:
                assert process.poll() is None, log_text(log)
                assert time.monotonic() < deadline + 30, log_text(log)
                await anyio.sleep(0.05)
            assert f"worker {victim} was killed by SIGKILL; starting another" in log_text(log)
            workers = {int(pid) for pid in STARTED.findall(log_text(log))} - {victim}
            assert len(workers) == 2 and all(alive(pid) for pid in workers)
            for _ in range(10):  # new connections: whichever worker takes them answers
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0, log_text(log)
        assert not any(alive(pid) for pid in workers)


@pytest.mark.anyio
async def test_a_replacement_that_cannot_reach_the_store_is_retried_while_the_other_serves(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    """The store is reachable at start, then not; a worker killed then cannot start again
    (it cannot load the store's routes). The surviving worker keeps serving the route
    without a budget, the supervisor retries the replacement with a backoff instead of
    stopping the instance, and the replacement starts once the store is back."""
    pg = urlsplit(pg_url)
    assert pg.hostname is not None and pg.port is not None
    async with (
        tcp_proxy(pg.hostname, pg.port) as proxy,
        upstream(status_handler(200)) as primary,
        upstream(status_handler(200)) as backup,
    ):
        store = pg_url.replace(f"@{pg.hostname}:{pg.port}/", f"@127.0.0.1:{proxy.port}/")
        config = write_config(
            tmp_path / "gateway.toml",
            f'state = "{redis_url}"\nstore = "{store}"',
            primary.url,
            backup.url,
        )
        port, log = free_port(), tmp_path / "serve.log"
        with supervisor(config, port, log) as process:
            await both_serving(process, port, log)
            started = STARTED.findall(log_text(log))
            assert len(started) == 2, log_text(log)
            # Past the start-up window, as an instance that has run a while.
            await anyio.sleep(START_UP_SECONDS + 0.5)
            await proxy.cut()  # the store is unreachable from now on
            victim, survivor = int(started[0]), int(started[1])
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while "failed to start" not in log_text(log):
                assert process.poll() is None, log_text(log)
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            text = log_text(log)
            assert "all 2 workers serving" in text
            assert f"worker {victim} was killed by SIGKILL; starting another" in text
            assert "cannot load routes from the store: cannot reach the store" in text
            assert re.search(r"failed to start \(\d+\); starting another in \d+ s", text)
            assert pg.password is None or pg.password not in text
            for _ in range(10):  # new connections: the survivor answers every one
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200
            assert process.poll() is None and alive(survivor), log_text(log)
            await proxy.open()  # the store is back: the next retry starts a worker
            deadline = time.monotonic() + 40
            while len(STARTED.findall(log_text(log))) < 3:
                assert process.poll() is None, log_text(log)
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            workers = {int(pid) for pid in STARTED.findall(log_text(log))} - {victim}
            assert len(workers) == 2
            process.send_signal(signal.SIGINT)
            # Waited for without blocking: the workers close their store connections
            # through the proxy, which runs on this event loop.
            deadline = time.monotonic() + 30
            while process.poll() is None:
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            assert process.returncode == 0, log_text(log)
        assert not any(alive(pid) for pid in workers)


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux's /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found.update(int(child) for child in text.split())
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
async def test_no_worker_serves_on_once_the_supervisor_is_gone(
    redis_url: str, tmp_path: Path, how: signal.Signals
) -> None:
    """A supervisor killed (SIGKILL), or hung up on (SIGHUP: the terminal closed, left to
    its default), left its two workers serving on the port with nobody to replace or stop
    them. Now SIGHUP stops the workers as SIGTERM does, and a worker dies with its
    supervisor however that one dies."""
    config = idle_config(tmp_path, redis_url)
    port, log = free_port(), tmp_path / "serve.log"
    with supervisor(config, port, log, prefix=SIGHUP_AT_ITS_DEFAULT) as process:
        await both_serving(process, port, log)
        workers = children(process.pid)
        assert len(workers) == 2, log_text(log)
        try:
            process.send_signal(how)
            process.wait(timeout=30)
            deadline = time.monotonic() + 20
            while any(alive(pid) for pid in workers):
                assert time.monotonic() < deadline, f"workers serve on: {log_text(log)}"
                await anyio.sleep(0.05)
        finally:
            for pid in workers:  # a failing run leaves no orphan serving
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


METRICS_ON = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
REQUESTS = re.compile(r'^gateway_requests_total\{[^}]*gateway_route_id="chat"[^}]*\} (\S+)$', re.M)


def two_free_ports() -> int:
    """A port P with P + 1 free too (worker i serves /metrics on P + i)."""
    for _ in range(50):
        port = free_port()
        if port < 65535:
            with contextlib.suppress(OSError), socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
                return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.anyio
async def test_each_worker_serves_its_own_metrics_port_and_a_replacement_takes_it_over(
    redis_url: str, tmp_path: Path
) -> None:
    # An SRE with Debian's Prometheus (it scrapes; no OTLP receiver) runs `serve --workers 2`
    # with OTEL_METRICS_EXPORTER=prometheus: it was refused ("use --workers 1"), so the
    # instance could not be scraped. Now worker i serves /metrics on PORT + i; the two
    # targets' counts add up to every request, and a replacement serves its slot's port.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log, metrics = free_port(), tmp_path / "serve.log", two_free_ports()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics),
        }
        with serve_process(config, port, log, env=env, options=("--workers", "2")) as process:
            await both_serving(process, port, log)
            assert sorted(map(int, METRICS_ON.findall(log_text(log)))) == [metrics, metrics + 1]
            sent = 40
            for _ in range(sent):  # a connection each: the kernel spreads them
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200

            async def scrape() -> list[float]:
                counts = []
                async with httpx.AsyncClient(timeout=5) as client:
                    for target in (metrics, metrics + 1):
                        page = await client.get(f"http://127.0.0.1:{target}/metrics")
                        assert page.status_code == 200
                        counts.append(sum(float(v) for v in REQUESTS.findall(page.text)))
                return counts

            counts = await scrape()
            assert sum(counts) == sent, counts

            # A worker dies past its start-up window: its replacement serves the same port.
            await anyio.sleep(START_UP_SECONDS + 0.5)
            victim = int(STARTED.findall(log_text(log))[0])
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while len(METRICS_ON.findall(log_text(log))) < 3:
                assert process.poll() is None, log_text(log)
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            ports = list(map(int, METRICS_ON.findall(log_text(log))))
            assert ports[2] in (metrics, metrics + 1) and sorted(ports[:2]) == [
                metrics,
                metrics + 1,
            ]
            while log_text(log).count("Application startup complete") < 3:
                assert time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            counts = await scrape()  # both answer again; the dead worker's counts are gone
            assert len(counts) == 2 and sum(counts) < sent


@pytest.mark.anyio
async def test_workers_export_otlp_counts_apart_under_one_given_instance_id(
    redis_url: str, tmp_path: Path
) -> None:
    # A platform team runs `serve --workers 2` in a pod whose OTEL_RESOURCE_ATTRIBUTES name
    # the pod as `service.instance.id` (as Kubernetes operators set it), exporting OTLP to
    # a collector. Both workers exported `gateway.requests` under one identical resource,
    # so the collector saw one series whose value jumped between the two workers' counts
    # (15, 25, 15, ...), never their sum. Each worker's id now ends in `-worker-SLOT`.
    latest: dict[str, float] = {}

    async def collector(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/metrics":
            exported = ExportMetricsServiceRequest.FromString(await request.read())
            for resource in exported.resource_metrics:
                attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name == "gateway.requests":
                            served = sum(
                                p.as_int
                                for p in metric.sum.data_points
                                if any(a.value.string_value == "served" for a in p.attributes)
                            )
                            latest[attributes["service.instance.id"]] = served
        return web.Response(status=200, body=b"", content_type="application/x-protobuf")

    async with (
        upstream(status_handler(200)) as primary,
        upstream(status_handler(200)) as backup,
        upstream(collector) as otlp,
    ):
        config = write_config(
            tmp_path / "gateway.toml", f'state = "{redis_url}"', primary.url, backup.url
        )
        port, log = free_port(), tmp_path / "serve.log"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url,
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=shop.gw-7f9c.gateway",
        }
        with serve_process(config, port, log, env=env, options=("--workers", "2")) as process:
            await both_serving(process, port, log)
            sent = 40
            for _ in range(sent):  # a connection each: the kernel spreads them
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200
            deadline = time.monotonic() + 10
            while sum(latest.values()) != sent:
                assert time.monotonic() < deadline, (latest, log_text(log))
                await anyio.sleep(0.1)
    assert sorted(latest) == [
        "shop.gw-7f9c.gateway-worker-0",
        "shop.gw-7f9c.gateway-worker-1",
    ], latest


# A whole request line of a worker: its time, level, logger[pid], ... its duration, once.
WHOLE_LINE = re.compile(
    r"\d{4}-\d\d-\d\d [\d:,]+ (?:INFO|WARNING) fallback_mw\.request\[\d+\] gateway request "
    r"route=\S+ (?:(?!fallback_mw\.request\[).)* duration_ms=[\d.]+"
)


@contextmanager
def piped(
    config: Path, port: int, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`serve --workers 2`, its stdout and stderr one pipe, as under a log collector."""
    process = subprocess.Popen(
        command(config, port, 2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stdout is not None
        if not process.stdout.closed:
            process.stdout.close()


@pytest.mark.anyio
async def test_request_lines_of_two_workers_on_one_pipe_are_never_torn(
    redis_url: str, tmp_path: Path
) -> None:
    """Under systemd, Docker or Kubernetes the workers' output is one pipe (or socket) a log
    collector reads. Each worker wrote its batch of request lines (up to 0.1 s of them) in
    one write; a write to a pipe over PIPE_BUF (4 KiB) is not atomic, so when the collector
    lagged and the pipe was full, the two workers' batches were spliced mid-line: a line
    of one worker ran into a line of the other, both unparseable. Now every write holds
    whole lines, at most PIPE_BUF bytes (a longer line alone)."""
    names = [f"u{i}-" + "x" * 120 for i in range(8)]  # long lines: big batches
    sent = 600
    output = bytearray()
    async with upstream(status_handler(200)) as up:
        text = f'[gateway]\nstate = "{redis_url}"\n'
        for i, name in enumerate(names):
            text += f'[upstreams.{name}]\nurl = "{up.url}/p{i}"\n'
        plan = ", ".join(f'"{name}"' for name in names)
        text += f'[[routes]]\nid = "chat"\nprefix = "/v1/"\nretries = 7\nplan = [{plan}]\n'
        (config := tmp_path / "gateway.toml").write_text(text)
        port = free_port()
        with piped(config, port) as process:
            assert process.stdout is not None
            out = process.stdout.fileno()
            deadline = time.monotonic() + 30
            while b"all 2 workers serving" not in output:
                assert process.poll() is None and time.monotonic() < deadline, output.decode()
                output += os.read(out, 65536)

            answered = threading.Event()

            def read_slowly() -> None:
                # A collector that lags while the requests are served (small reads, a pause
                # each: the pipe stays full, both workers' writes wait on it), then catches
                # up. Lagging to the end, under load (20 on two cores) it had not read the
                # last lines when the workers' exit flush gave up on them (EXIT_STALL_SECONDS,
                # by design the longest a stop waits for its log): 541 of 600, none torn.
                while chunk := os.read(out, 65536 if answered.is_set() else 512):
                    output.extend(chunk)
                    if not answered.is_set():
                        time.sleep(0.003)

            async def one(client: httpx.AsyncClient, limit: anyio.Semaphore) -> None:
                async with limit:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                    assert response.status_code == 200

            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, read_slowly)
                async with (
                    httpx.AsyncClient(timeout=60) as client,
                    anyio.create_task_group() as load,
                ):
                    limit = anyio.Semaphore(32)
                    for _ in range(sent):
                        load.start_soon(one, client, limit)
                answered.set()
                await anyio.sleep(0.5)  # the last lines written; then stop and read to EOF
                process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0
    logged = [line for line in output.decode().splitlines() if "fallback_mw.request[" in line]
    torn = [line for line in logged if not WHOLE_LINE.fullmatch(line)]
    assert not torn, f"{len(torn)} torn of {len(logged)}: {torn[0][:300]!r}"
    assert len(logged) == sent


@pytest.mark.parametrize("workers", [1, 2])
def test_a_metrics_port_that_is_the_gateway_port_is_refused_in_one_line(
    redis_url: str, tmp_path: Path, workers: int
) -> None:
    """`serve --workers 2 --port P` with OTEL_EXPORTER_PROMETHEUS_PORT=P-1: worker 1's
    `/metrics` is on P + 1 - 1 = P, the gateway's own port. Its server bound it while the
    workers' sockets were bound but not yet listening, and then took every connection to
    the gateway: each API call was answered 200 with the metrics text. One process
    (`--workers 1`, the metrics port = the gateway port) failed with "address already in
    use", as if another program held it. Both are refused up front, naming the clash."""
    config = idle_config(tmp_path, redis_url)
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port - workers + 1),  # the last worker's: port
    }
    try:
        result = subprocess.run(
            command(config, port, workers),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:  # it served, on a port /metrics had taken
        raise AssertionError(f"serve started: {exc.stdout!r} {exc.stderr!r}") from None
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" in result.stderr
    assert f"port {port}, the gateway's own" in result.stderr


@pytest.mark.anyio
async def test_a_worker_dying_after_the_log_reader_left_is_still_replaced(
    redis_url: str, tmp_path: Path
) -> None:
    """`serve --workers 2 2>&1 | logger` (or a job left on a terminal that closed): once
    the reader of its output was gone, the next worker death made the supervisor's line
    about it fail (BrokenPipeError). The supervisor died of it: it left the other worker
    serving unsupervised for its 30 s grace without a SIGTERM, then SIGKILLed it mid-request;
    the whole gateway was down. (A replacement's own `metrics on` line failed its start the
    same way.) Now the supervisor's and a worker's lines are best effort: the dead worker is
    replaced, the gateway serves on, and a stop is still clean."""
    config = idle_config(tmp_path, redis_url)
    port, metrics = free_port(), two_free_ports()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics),
    }
    first: set[int] = set()
    workers: set[int] = set()
    with piped(config, port, env) as process:
        try:
            assert process.stdout is not None
            output = b""
            deadline = time.monotonic() + 30
            while b"all 2 workers serving" not in output:
                assert process.poll() is None and time.monotonic() < deadline, output.decode()
                output += os.read(process.stdout.fileno(), 65536)
            process.stdout.close()  # the reader is gone
            first = children(process.pid)
            assert len(first) == 2
            os.kill(min(first), signal.SIGKILL)
            deadline = time.monotonic() + 20
            while len(workers := children(process.pid) - {min(first)}) < 2:
                assert process.poll() is None, "the supervisor died"
                assert time.monotonic() < deadline, f"not replaced: {workers}"
                await anyio.sleep(0.1)
            async with httpx.AsyncClient(timeout=10) as client:
                for slot in (0, 1):  # the replacement serves its slot's /metrics once started
                    while True:
                        with contextlib.suppress(httpx.ConnectError):
                            scrape = await client.get(f"http://127.0.0.1:{metrics + slot}/metrics")
                            assert scrape.status_code == 200
                            break
                        assert process.poll() is None and time.monotonic() < deadline
                        await anyio.sleep(0.1)
                for _ in range(10):  # new connections: both workers answer
                    response = await client.get(f"http://127.0.0.1:{port}/nothing")
                    assert response.status_code == 404
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            assert not any(alive(pid) for pid in workers)
        finally:
            for pid in first | workers:  # a failing run leaves no orphan serving
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# A supervisor of real forked workers (cli/workers.py's Supervisor, serve's own listen
# socket), each worker `WORKER` below; `PRELUDE` runs first.
SUPERVISED = """
import os, signal, sys, time
from fallback_mw.cli.app import Console
from fallback_mw.cli.serve import listen_socket
from fallback_mw.cli.workers import Supervisor
{prelude}
def worker(sock, ready, slot):
{worker}

console = Console(sys.stdout, sys.stderr)
supervisor = Supervisor(
    {count}, "127.0.0.1", 0, worker, bind=listen_socket, console=console, stop_grace={grace}
)
sys.exit(supervisor.run())
"""


@contextmanager
def supervised(
    tmp_path: Path, worker: str, *, count: int = 2, grace: float = 30.0, prelude: str = ""
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The supervisor script running (its process and its output's file); killed at the
    end if it still runs."""
    script = tmp_path / "supervised.py"
    script.write_text(SUPERVISED.format(worker=worker, count=count, grace=grace, prelude=prelude))
    log = tmp_path / "supervised.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=out)
    try:
        yield process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_worker_that_outlives_the_stop_grace_is_killed(tmp_path: Path) -> None:
    """A stop waits `stop_grace` for the workers, then SIGKILLs them (serve: the graceful
    shutdown's timeout and a margin). The supervisor's loop waited for its workers without
    a bound: a worker stuck in its shutdown (or one that never saw its SIGTERM) kept the
    supervisor, and the instance's port, forever."""
    worker = (
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck: the stop never ends it\n"
        "    ready()\n"
        "    time.sleep(120)\n"
        "    return 0"
    )
    with supervised(tmp_path, worker, grace=1.0) as (process, log):
        deadline = time.monotonic() + 60
        while "all 2 workers serving" not in log_text(log):
            assert process.poll() is None and time.monotonic() < deadline, log_text(log)
            time.sleep(0.05)
        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)
        took = time.monotonic() - stopped
        assert process.poll() == 0, f"still running {took:.1f} s after SIGTERM: {log_text(log)}"


def test_a_stop_that_reaches_a_worker_as_it_forks_is_the_workers(tmp_path: Path) -> None:
    """A SIGTERM that reached a worker between its fork and its own handlers ran the
    supervisor's handler (inherited) in the worker: the worker noted a "stop", told the
    supervisor's copy of the other workers to stop, and served on (CI: a worker killed
    while starting, and the supervisor still there a minute later). Signals are held across
    the fork now: the worker takes them once its own handlers are in place, and ends."""
    prelude = (
        "_fork = os.fork\n"
        "def fork():\n"
        "    pid = _fork()\n"
        "    if pid == 0:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # a stop, at once after the fork\n"
        "    return pid\n"
        "os.fork = fork\n"
    )
    worker = "    ready()\n    time.sleep(120)\n    return 0"
    with supervised(tmp_path, worker, count=1, prelude=prelude) as (process, log):
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        text = log_text(log)
        # The worker ended on its stop before it served; the supervisor, a start-up
        # failure, ended with it.
        assert process.poll() == 1, text
        assert "before it served; stopping the others" in text, text
        assert "all 1 workers serving" not in text, text


def test_a_stop_that_reaches_a_worker_as_it_writes_its_last_lines_ends_it(
    tmp_path: Path,
) -> None:
    """On a terminal Ctrl-C reaches every worker, and the supervisor passes a second stop on
    to each: one that arrived while a worker wrote its last log lines (after its stop, just
    before `os._exit`) raised out of that `finally`, and the worker went on running the
    supervisor's loop in itself ('fallback-mw: error: OSError: Bad file descriptor', the
    SDK's exit hooks run twice). A worker that has begun to end takes no further stop."""
    prelude = (
        "import fallback_mw.cli.workers as supervision\n"
        "_flush = supervision.flush_request_lines\n"
        "def flush_request_lines():\n"
        "    print(f'worker {os.getpid()} writes its last lines', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # a further stop, just then\n"
        "    for _ in range(100):  # the handler runs between two bytecodes\n"
        "        time.sleep(0.001)\n"
        "    _flush()\n"
        "supervision.flush_request_lines = flush_request_lines\n"
    )
    worker = "    ready()\n    time.sleep(120)\n    return 0"
    with supervised(tmp_path, worker, count=2, prelude=prelude) as (process, log):
        deadline = time.monotonic() + 60
        while "all 2 workers serving" not in log_text(log):
            assert process.poll() is None and time.monotonic() < deadline, log_text(log)
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        text = log_text(log)
        assert process.poll() == 0, text
    assert text.count("writes its last lines") == 2, text
    assert "error" not in text and "Traceback" not in text, text
