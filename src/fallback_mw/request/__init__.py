"""What every layer knows of one request, below all four: the per-request context, the
body reader and request-JSON helper, the local-error writer and the ASGI types."""
