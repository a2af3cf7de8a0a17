"""ASGI entry point. GatewayMiddleware (in settings.MIDDLEWARE) needs Django on ASGI.

Without the middleware, the same result comes from wrapping the Django app itself:

    from fallback_mw import Gateway
    application = Gateway(get_asgi_application(), config="gateway.toml")
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")

application = get_asgi_application()
