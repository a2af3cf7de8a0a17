"""OpenTelemetry GenAI semantic conventions (v1.37.0, where `gen_ai.provider.name`
replaced `gen_ai.system`) for the request and attempt spans.

`gen_ai.provider.name` is what an upstream declares (`provider = "openai"`): the gateway
does not guess it from a URL. `gen_ai.operation.name` is read from the request path of
the well-known APIs, and left out for any other path."""

from __future__ import annotations

from typing import Final

from opentelemetry.util.types import AttributeValue

from fallback_mw.request.context import RequestContext

# Path endings of the major providers' APIs -> gen_ai.operation.name (well-known values).
_OPERATIONS: Final[tuple[tuple[str, str], ...]] = (
    ("/chat/completions", "chat"),  # OpenAI and the many APIs shaped like it
    ("/responses", "chat"),  # OpenAI Responses
    ("/messages", "chat"),  # Anthropic Messages
    ("/converse", "chat"),  # AWS Bedrock Converse
    ("/converse-stream", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
    ("/embed", "embeddings"),  # Cohere
    (":generatecontent", "generate_content"),  # Gemini / Vertex AI
    (":streamgeneratecontent", "generate_content"),
    (":embedcontent", "embeddings"),
)


def operation_name(path: str) -> str | None:
    """The GenAI operation of a request path, or None when it is not one we know."""
    tail = path.rstrip("/").lower()
    for ending, operation in _OPERATIONS:
        if tail.endswith(ending):
            return operation
    return None


def genai_attributes(
    attributes: dict[str, AttributeValue], context: RequestContext, candidate: str | None
) -> dict[str, AttributeValue]:
    """GenAI semantic-convention attributes, added to `attributes`: the operation read
    from the path, the provider the candidate declares."""
    operation = operation_name(context.path)
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    upstream = context.upstreams.get(candidate) if candidate is not None else None
    if upstream is not None and upstream.provider is not None:
        attributes["gen_ai.provider.name"] = upstream.provider
    return attributes
