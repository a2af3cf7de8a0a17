"""Minimal Django settings with the gateway as the first middleware.

python examples/django_app/run.py          # mocks + this project, offline (README.md)
cd examples/django_app
PRIMARY_API_KEY=... BACKUP_API_KEY=... uvicorn asgi:application --no-access-log
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = "example-only-change-me"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "urls"
INSTALLED_APPS: list[str] = []

MIDDLEWARE = [
    # First, so routed requests skip the rest of the stack (like whitenoise).
    "fallback_mw.django.GatewayMiddleware",
    "django.middleware.common.CommonMiddleware",
]

# run.py sets GATEWAY_CONFIG to a copy of gateway.toml pointed at its mock upstreams.
FALLBACK_MW = {"config": os.environ.get("GATEWAY_CONFIG") or str(BASE_DIR / "gateway.toml")}
