"""Minimal Django settings with the gateway as the first middleware.

    cd examples/django_app
    PRIMARY_API_KEY=... BACKUP_API_KEY=... DJANGO_SETTINGS_MODULE=settings uvicorn asgi:application
"""

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = "example-only-change-me"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "urls"
INSTALLED_APPS: list[str] = []

MIDDLEWARE = [
    # First, so routed requests skip the rest of the stack (like whitenoise).
    "fallback_mw.django.GatewayMiddleware",
    "django.middleware.common.CommonMiddleware",
]

FALLBACK_MW = {"config": str(BASE_DIR / "gateway.toml")}
