"""FastAPI app with the gateway in front: /v1/* goes to the upstreams, the rest to FastAPI.

    PRIMARY_API_KEY=... BACKUP_API_KEY=... uvicorn app:app --port 8000
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from fallback_mw import Gateway, load_config

app = FastAPI()


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


# Loaded (and checked: every credential variable must be set) when the app is imported.
app.add_middleware(Gateway, config=load_config(Path(__file__).with_name("gateway.toml")))
