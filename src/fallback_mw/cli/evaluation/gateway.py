"""The gateway under evaluation: `fallback-mw serve` as its own process on a loopback port,
with a configuration written for one arm (so each arm starts with fresh breakers)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fallback_mw.cli.ports import free_port


class GatewayDidNotStart(RuntimeError):
    pass


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the plain values used here
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")


def to_toml(config: Mapping[str, Any]) -> str:
    """The small subset of TOML the evaluation's configurations need."""
    lines: list[str] = []
    gateway = config.get("gateway", {})
    if gateway:
        lines.append("[gateway]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in gateway.items() if not isinstance(v, dict)]
        for key, table in gateway.items():
            if isinstance(table, dict):
                lines.append(f"\n[gateway.{key}]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    for name, upstream in config.get("upstreams", {}).items():
        lines.append(f"\n[upstreams.{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in upstream.items()]
    for route in config.get("routes", []):
        lines.append("\n[[routes]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in route.items()]
    return "\n".join(lines) + "\n"


async def _wait_listening(process: asyncio.subprocess.Process, port: int, log: Path) -> None:
    """Until our gateway listens on `port`: it has said "serving on" (it bound the port)
    and the port accepts. A connection alone could reach another program already on the
    port (`eval --port P` with P taken): its arms would measure that program."""
    deadline = time.monotonic() + 30
    bound = f"serving on http://127.0.0.1:{port} "
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(log.read_text, errors="replace")
        if process.returncode is not None:
            # Its own one-line error, without its prefix (ours is added once, by eval).
            tail = text[-2000:].strip().removeprefix("fallback-mw: error: ")
            raise GatewayDidNotStart(f"the gateway exited ({process.returncode}): {tail}")
        if bound not in text:
            await asyncio.sleep(0.05)
            continue
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise GatewayDidNotStart("the gateway did not listen within 30 s")


@asynccontextmanager
async def served_gateway(
    config: Mapping[str, Any], workdir: Path, name: str, port: int = 0
) -> AsyncIterator[str]:
    """Runs `fallback-mw serve` with `config` on `port` (0: a free one); yields its base
    URL; stops it (SIGINT, then kill after 10 s) at the end. Its log goes to
    `workdir/<name>.log`."""
    path = workdir / f"{name}.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    log = workdir / f"{name}.log"
    port = port or free_port()
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(path)),
            *("--host", "127.0.0.1", "--port", str(port)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            await _wait_listening(process, port, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()
