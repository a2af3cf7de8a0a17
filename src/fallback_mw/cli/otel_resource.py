"""serve's OpenTelemetry `Resource`, its hash computed once (imported with the SDK only).

The OTLP span encoder groups every exported span by its `Resource` (a dict keyed by it),
and the SDK's `Resource.__hash__` is a sorted `json.dumps` of the attributes, computed
again for each span: about 3 µs of the batch span thread's work per span, two spans a
request. A Resource never changes once made (its attributes are immutable), so its hash
can be kept. Everything else is the SDK's own: the same attributes, schema URL, equality
and encoding, so what a collector receives is unchanged.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource


class HashedResource(Resource):
    """A `Resource` whose hash is computed once, when it is made."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


__all__ = ["HashedResource"]
