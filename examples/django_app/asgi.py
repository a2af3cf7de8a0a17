"""ASGI entry point. GatewayMiddleware (in settings.MIDDLEWARE) needs Django on ASGI.

Without the middleware, the same result comes from wrapping the Django app itself:

    from fallback_mw import Gateway
    application = Gateway(get_asgi_application(), config="gateway.toml")
"""

import os

from django.core.asgi import get_asgi_application
from django.core.exceptions import ImproperlyConfigured

from fallback_mw.django import with_lifespan

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")

try:
    # with_lifespan: the server's startup and shutdown reach the gateway (Django itself
    # has no ASGI lifespan), which closes its upstream connections at shutdown.
    application = with_lifespan(get_asgi_application())
except ImproperlyConfigured as exc:
    # e.g. "fallback_mw configuration error: upstream 'primary': environment variable
    # PRIMARY_API_KEY is not set":
    # one line instead of a traceback.
    raise SystemExit(str(exc)) from None
