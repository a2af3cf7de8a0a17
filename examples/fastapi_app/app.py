"""FastAPI app with the gateway in front: /v1/* goes to the upstreams, the rest to FastAPI.

python examples/fastapi_app/run.py          # mocks + this app, offline (see README.md)
PRIMARY_API_KEY=... BACKUP_API_KEY=... uvicorn app:app --port 8000 --no-access-log  # real ones
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI

from fallback_mw import ConfigError, Gateway, load_config

CONFIG = os.environ.get("GATEWAY_CONFIG") or Path(__file__).with_name("gateway.toml")

app = FastAPI()


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


# Loaded (and checked: every credential variable must be set) when the app is imported; a
# refusal exits with its one line instead of a traceback.
try:
    config = load_config(CONFIG)
except ConfigError as exc:
    raise SystemExit(f"gateway config: {exc}") from None
app.add_middleware(Gateway, config=config)
